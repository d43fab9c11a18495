// The operators of torch.ops.tgis (cpu_decode.cpp, cpu_products.cpp) as AOTInductor's C shims, so that
// PT2_COMPILE's package (exported_step.py) calls them directly. Without a shim, the package calls a
// custom operator through its proxy executor: each call's arguments are boxed into a stack from the
// operator's serialized schema and sent through the dispatcher, the result unboxed again. A decode step
// of GPT-2-small makes 61 such calls (48 int4 products, 12 attention layers, the LM head), all on the
// calling thread while the other waits.
//
// Each shim's name is the one the package calls (aoti_torch_<device>_<operator>) and its arguments the
// ones inductor passes: tensors as handles, an optional tensor as a pointer to one (null: None), ints as
// int64_t, floats as double, the result through the last pointer. `aoti_shims` hands the declarations to
// exported_step.py, which declares them to inductor; the build's module is made global before a package
// is loaded (cpu_kernel.py), so that the package's references resolve to these functions.
#include <torch/csrc/inductor/aoti_torch/utils.h>

namespace {

const torch::Tensor& tensor_at(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}

std::optional<torch::Tensor> optional_at(AtenTensorHandle* handle) {
  return handle == nullptr ? std::nullopt : std::optional<torch::Tensor>(tensor_at(*handle));
}

AtenTensorHandle handed_out(torch::Tensor&& result) {
  return torch::aot_inductor::new_tensor_handle(std::move(result));
}

}  // namespace

#define TGIS_SHIM extern "C" __attribute__((visibility("default"))) AOTITorchError

TGIS_SHIM aoti_torch_cpu_decode_layer(AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
                                      AtenTensorHandle key_cache, AtenTensorHandle value_cache,
                                      AtenTensorHandle slot_mapping, AtenTensorHandle block_tables,
                                      AtenTensorHandle seq_lens, double scale, int64_t sliding_window,
                                      AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = handed_out(decode_layer(tensor_at(query), tensor_at(key), tensor_at(value), tensor_at(key_cache),
                                    tensor_at(value_cache), tensor_at(slot_mapping), tensor_at(block_tables),
                                    tensor_at(seq_lens), scale, sliding_window));
  });
}

TGIS_SHIM aoti_torch_cpu_packed_linear(AtenTensorHandle input, AtenTensorHandle packed_weight, AtenTensorHandle* bias,
                                       AtenTensorHandle* dense_weight, int64_t few_rows, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = handed_out(
        packed_linear(tensor_at(input), tensor_at(packed_weight), optional_at(bias), optional_at(dense_weight), few_rows));
  });
}

TGIS_SHIM aoti_torch_cpu_few_rows_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                         AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret0 = handed_out(few_rows_linear(tensor_at(x), tensor_at(weight), optional_at(bias))); });
}

TGIS_SHIM aoti_torch_cpu_int8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale,
                                     AtenTensorHandle weight_sums, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = handed_out(
        int8_linear(tensor_at(x), tensor_at(weight), tensor_at(scale), tensor_at(weight_sums), optional_at(bias)));
  });
}

TGIS_SHIM aoti_torch_cpu_int4_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle scale,
                                     AtenTensorHandle scaled_zero, int64_t group, AtenTensorHandle* bias,
                                     AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = handed_out(int4_linear(tensor_at(x), tensor_at(packed), tensor_at(scale), tensor_at(scaled_zero), group,
                                   optional_at(bias)));
  });
}

// Each operator of torch.ops.tgis and its shim's declaration, as the package's C++ wrapper declares it.
std::vector<std::pair<std::string, std::string>> aoti_shims() {
  return {
      {"decode_layer",
       "AOTITorchError aoti_torch_cpu_decode_layer(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
       "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, double, int64_t, "
       "AtenTensorHandle*)"},
      {"packed_linear",
       "AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, "
       "AtenTensorHandle*, int64_t, AtenTensorHandle*)"},
      {"few_rows_linear",
       "AOTITorchError aoti_torch_cpu_few_rows_linear(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, "
       "AtenTensorHandle*)"},
      {"int8_linear",
       "AOTITorchError aoti_torch_cpu_int8_linear(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
       "AtenTensorHandle, AtenTensorHandle*, AtenTensorHandle*)"},
      {"int4_linear",
       "AOTITorchError aoti_torch_cpu_int4_linear(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
       "AtenTensorHandle, int64_t, AtenTensorHandle*, AtenTensorHandle*)"},
  };
}
