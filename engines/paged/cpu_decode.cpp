// Decode attention over paged KV blocks on the CPU: one query token per sequence attends that
// sequence's cached positions, read in place from its blocks (no gather copy).
//
// key_cache / value_cache: [num_blocks, block_size, kv_heads, head_dim] (float, bfloat16 or half)
// query: [sequences, heads, head_dim]; block_tables: [sequences, max_blocks] int64;
// seq_lens: [sequences] int64 (positions attended, the new token included); positions before `skip`
// are left out (another pass attends them, see attention.py's shared-prefix split).
// Returns the attention output and each (sequence, head)'s log-sum-exp of its scores [sequences,
// heads] float32, so that partial results over disjoint positions can be merged.
// Work is split over (sequence, kv head); the query heads sharing a kv head (GQA) reuse each key
// and value row while it is in cache. Scores, softmax and the weighted sum run in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Written so that the compiler vectorises them: fixed-width lanes of independent accumulators.
constexpr int64_t LANES = 16;

inline void load_row(const float* __restrict src, float* __restrict dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void load_row(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);  // built with -fno-strict-aliasing
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}
inline void load_row(const c10::Half* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[LANES] = {};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    for (int64_t l = 0; l < LANES; ++l) lanes[l] += a[d + l] * b[d + l];
  }
  float total = 0.0f;
  for (int64_t l = 0; l < LANES; ++l) total += lanes[l];
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

inline void axpy(float weight, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += weight * x[d];
}

template <typename T>
void decode_kernel(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                   int64_t sliding_window, int64_t skip, torch::Tensor& out, torch::Tensor& lse) {
  const int64_t sequences = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t row_stride = kv_heads * dim, block_stride = block_size * row_stride;
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  float* lse_ptr = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // A task is one sequence and a slice of its kv heads. A position's keys (or values) of all its kv
  // heads are one contiguous row, so a task reads its blocks front to back; with fewer sequences
  // than threads, the heads are split up to keep every thread busy.
  const int64_t splits = sequences >= at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_task = kv_heads / splits;

  at::parallel_for(0, sequences * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, row(heads_per_task * dim), acc, scores, totals;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / splits, h0 = (task % splits) * heads_per_task;
      const int64_t q_heads = heads_per_task * group;  // query heads h0*group .. + q_heads
      const int64_t length = lens[n];
      const int64_t window = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window) : 0;
      const int64_t first = std::max(window, skip);
      const int64_t span = length - first;
      if (span <= 0) {  // nothing left to attend here: a zero output that weighs nothing when merged
        for (int64_t qh = 0; qh < q_heads; ++qh) {
          T* o = o_ptr + (n * heads + h0 * group + qh) * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(0.0f);
          lse_ptr[n * heads + h0 * group + qh] = -std::numeric_limits<float>::infinity();
        }
        continue;
      }
      q.resize(q_heads * dim);
      load_row(q_ptr + (n * heads + h0 * group) * dim, q.data(), q_heads * dim);
      scores.assign(q_heads * span, 0.0f);
      const int64_t* table = tables + n * max_blocks;
      // Positions first..length-1, block by block; `visit(i, row)` gets this task's kv heads of
      // position first + i as float32.
      auto for_each_row = [&](const T* cache, auto&& visit) {
        for (int64_t block = first / block_size; block * block_size < length; ++block) {
          const int64_t start = std::max(block * block_size, first);
          const int64_t stop = std::min((block + 1) * block_size, length);
          const T* base = cache + table[block] * block_stride + h0 * dim;
          for (int64_t p = start; p < stop; ++p) {
            load_row(base + (p - block * block_size) * row_stride, row.data(), heads_per_task * dim);
            visit(p - first);
          }
        }
      };
      for_each_row(k_ptr, [&](int64_t i) {
        for (int64_t qh = 0; qh < q_heads; ++qh) {
          scores[qh * span + i] = dot(q.data() + qh * dim, row.data() + (qh / group) * dim, dim) * fscale;
        }
      });
      totals.assign(q_heads, 0.0f);
      for (int64_t qh = 0; qh < q_heads; ++qh) {
        float* s = scores.data() + qh * span;
        const float peak = *std::max_element(s, s + span);
        float total = 0.0f;
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - peak);
          total += s[i];
        }
        totals[qh] = total;
        lse_ptr[n * heads + h0 * group + qh] = peak + std::log(total);
      }
      acc.assign(q_heads * dim, 0.0f);
      for_each_row(v_ptr, [&](int64_t i) {
        for (int64_t qh = 0; qh < q_heads; ++qh) {
          axpy(scores[qh * span + i], row.data() + (qh / group) * dim, acc.data() + qh * dim, dim);
        }
      });
      for (int64_t qh = 0; qh < q_heads; ++qh) {
        T* o = o_ptr + (n * heads + h0 * group + qh) * dim;
        const float inverse = 1.0f / totals[qh];
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[qh * dim + d] * inverse);
      }
    }
  });
}

}  // namespace

std::vector<torch::Tensor> decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                           torch::Tensor value_cache, torch::Tensor block_tables,
                                           torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                           int64_t skip) {
  TORCH_CHECK(query.device().is_cpu(), "the CPU paged decode kernel needs CPU tensors");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.to(torch::kLong).contiguous();
  seq_lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(query);
  auto lse = torch::empty({query.size(0), query.size(1)}, query.options().dtype(torch::kFloat));
  switch (query.scalar_type()) {
    case torch::kFloat:
      decode_kernel<float>(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, skip, out,
                           lse);
      break;
    case torch::kBFloat16:
      decode_kernel<c10::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                   skip, out, lse);
      break;
    case torch::kHalf:
      decode_kernel<c10::Half>(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, skip,
                               out, lse);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype for the CPU paged decode kernel");
  }
  return {out, lse};
}
