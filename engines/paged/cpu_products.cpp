// Linear products for steps of a few rows on the CPU, where a step is bound by reading each weight once:
// decode at low concurrency, drafts, a tied LM head. Built into the same extension as cpu_decode.cpp and
// after it, in one translation unit (cpu_kernel.py joins the sources): it uses that file's helpers
// (Vec, float_row, copy_as_float, sum_of, dispatch_dtype).
//
// - few_rows_linear: x times a dense weight, as F.linear computes it. float32 and half weights are read
//   as float32 (half widened per row); bfloat16 weights, on a CPU with AVX512_BF16, are multiplied as
//   they are by its bfloat16 dot product (two products summed into each float32 lane), else widened.
//   Aligned bfloat16 weights (AVX512_BF16) and aligned float32 ones against one or two rows of x
//   (AVX-512) are read row after row by non-temporal loads, so a step's weights do not settle in the caches.
// - int8_linear: a quantized layer (engines/quantized.py) in one call: each row of x quantized to int8
//   (symmetric, its own scale), the int32 sums with the int8 weight, rescaled, the bias added. Up to
//   INT8_MAX_ROWS rows on a CPU with AVX-512 VNNI the sums come from this file's kernel (each weight
//   read once), else from torch._int_mm; both give the same integers, so a row's result depends on that
//   row alone, whatever the step's width.
// - int4_linear: an int4 layer (engines/quantized.py) in one call, on a CPU with AVX-512 VNNI or AVX2:
//   each row of x quantized to int8 as int8_linear does, the weight's 4-bit values (two a byte)
//   multiplied with it in exact int32 sums a group at a time, then each group's scale and zero point
//   applied. One kernel at every row count, so a row's result depends on that row alone: the row
//   kernel, or on a CPU with AMX-INT8 the tiles' kernel, with the weight laid out for the tiles.
// - packed_linear: a layer packed for oneDNN (engines/cpu_prepack.py), choosing per call between its
//   dense copy's few-row product and oneDNN, so one compiled graph serves every row count.
#if defined(__AVX512VNNI__) || defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <csetjmp>
#include <csignal>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AVX512VNNI__) || defined(__AVX512BF16__) || defined(__AVX2__)
// Asks for the `bytes` from `p` on, a cache line at a time, with the prefetch hint HINT (_MM_HINT_*): how
// the products ask for a weight row ahead of its turn.
template <decltype(_MM_HINT_T0) HINT>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(start + line, HINT);
}
#endif

// Whether a weight's rows, each `row_bytes` long from `weight` on, all start 64-byte aligned: what the
// non-temporal loads below (streamed_chunk) need.
inline bool rows_aligned(const void* weight, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(weight) % 64 == 0 && row_bytes % 64 == 0;
}

#if defined(__AVX512F__)
// 64 weight bytes at `p` (64-byte aligned) by a non-temporal load (MOVNTDQA).
inline __m512i streamed_chunk(const void* p) { return _mm512_stream_load_si512(const_cast<void*>(p)); }
#endif

// A tile of TILE weight rows against one or two rows of x (x1 == nullptr: one): sums[r][i] = x_r . w[i],
// each weight row read once for both. The accumulators are spelled out: written as arrays of vectors,
// 8 rows through GPT-2-small's 48 layer weights took 47 ms against 33 (2 AVX2 cores).
constexpr int64_t TILE = 4;
inline void dot_tile(const float* x0, const float* x1, const float* const* w, int64_t dim, float (*sums)[TILE]) {
  Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f), b0(0.0f), b1(0.0f), b2(0.0f), b3(0.0f);
  int64_t d = 0;
  if (x1 == nullptr) {
    for (; d + Vec::size() <= dim; d += Vec::size()) {
      const Vec u = Vec::loadu(x0 + d);
      a0 = at::vec::fmadd(u, Vec::loadu(w[0] + d), a0);
      a1 = at::vec::fmadd(u, Vec::loadu(w[1] + d), a1);
      a2 = at::vec::fmadd(u, Vec::loadu(w[2] + d), a2);
      a3 = at::vec::fmadd(u, Vec::loadu(w[3] + d), a3);
    }
  } else {
    for (; d + Vec::size() <= dim; d += Vec::size()) {
      const Vec u = Vec::loadu(x0 + d), v = Vec::loadu(x1 + d);
      const Vec w0 = Vec::loadu(w[0] + d), w1 = Vec::loadu(w[1] + d), w2 = Vec::loadu(w[2] + d),
                w3 = Vec::loadu(w[3] + d);
      a0 = at::vec::fmadd(u, w0, a0);
      a1 = at::vec::fmadd(u, w1, a1);
      a2 = at::vec::fmadd(u, w2, a2);
      a3 = at::vec::fmadd(u, w3, a3);
      b0 = at::vec::fmadd(v, w0, b0);
      b1 = at::vec::fmadd(v, w1, b1);
      b2 = at::vec::fmadd(v, w2, b2);
      b3 = at::vec::fmadd(v, w3, b3);
    }
  }
  const Vec first[TILE] = {a0, a1, a2, a3}, second[TILE] = {b0, b1, b2, b3};
  for (int64_t i = 0; i < TILE; ++i) {
    sums[0][i] = sum_of(first[i]);
    sums[1][i] = sum_of(second[i]);
    for (int64_t e = d; e < dim; ++e) {
      sums[0][i] += x0[e] * w[i][e];
      if (x1 != nullptr) sums[1][i] += x1[e] * w[i][e];
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool BF16_DOT = true;
// One bfloat16 weight row against R bfloat16 rows of x (R <= BF16_ROWS), the values as they are: each
// dot-product instruction multiplies 32 bfloat16 pairs and adds them, two to a float32 lane; two
// accumulators a row (alternate chunks) hide the instruction's latency. A short tail is loaded under a
// mask (zeros). Weight rows are taken one after another, so the weight is read in address order:
// four rows interleaved (dot_tile's order) read bfloat16 weights at 11 GB/s on one Zen 4 core, where
// a plain sum of the same bytes reads 25 and this order 17-18. Two rows of x a pass: with four, the
// loads outnumber what the core issues (GPT-2-small's 48 layer weights at 4 rows: 10 ms, against 7.5
// packed for oneDNN and 6.9 in two passes of two).
//
// STREAMED: the weight's 64-byte chunks are read by streamed_chunk (the row must start 64-byte
// aligned), see bf16_rows_linear.
constexpr int64_t BF16_ROWS = 2;
template <int64_t R, bool STREAMED>
inline void bf16_dot_rows(const c10::BFloat16* const* x, const c10::BFloat16* w, int64_t dim, float* sums) {
  __m512 even[R], odd[R];
  for (int64_t r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  auto chunk = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  auto weight_chunk = [&](const c10::BFloat16* p) {
    if constexpr (STREAMED) {
      return (__m512bh)streamed_chunk(p);
    } else {
      return chunk(p);
    }
  };
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    const __m512bh w0 = weight_chunk(w + d), w1 = weight_chunk(w + d + 32);
    for (int64_t r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], chunk(x[r] + d), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], chunk(x[r] + d + 32), w1);
    }
  }
  for (; d < dim; d += 32) {
    const __mmask32 mask = dim - d >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (dim - d)) - 1);
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + d);
    for (int64_t r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + d), w0);
    }
  }
  for (int64_t r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

// How a step's bfloat16 weights pass the caches. Each is read once a step, and a step streams every
// weight (173 MB for GPT-2-small) through a 32 MB L3, evicting what the rest of the step and the
// server's other threads find there next. Where the weight's rows start 64-byte aligned (a width that
// is a multiple of 32 in a tensor from torch's allocator), its chunks are read by non-temporal loads,
// with no software prefetch: the hardware's own runs ahead. On a 2-core Zen 4 (AVX-512 EPYC), GPT-2-
// small's 48 layer weights at one row took 0.71x as long as with the non-temporal prefetch below (40
// alternated rounds, 0.62-0.79), and one bfloat16 stream through the server (the benchmark model under
// PT2_COMPILE) read ITL p50 0.82x (0.68-0.97, 12 paired rounds in both orders, faster in every one).
// Ordinary loads with no prefetch read 0.77-0.85x in process but 1.07x through the server (12 rounds):
// there what the caches keep is worth more than the product's own speed. Measured on Zen 4 only: Intel
// documents the hint for write-combining memory, so its CPUs may take these as ordinary loads. Other
// rows are asked for BF16_PREFETCH_ROWS rows ahead of their turn, non-temporal, as int4_sums asks.
constexpr int64_t BF16_PREFETCH_ROWS = 2;

template <bool STREAMED>
void bf16_rows_share(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias,
                     c10::BFloat16* out, int64_t rows, int64_t outputs, int64_t dim, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    const c10::BFloat16* w = weight + o * dim;
    if (!STREAMED && o + BF16_PREFETCH_ROWS < end) prefetch_lines<_MM_HINT_NTA>(w + BF16_PREFETCH_ROWS * dim, dim * 2);
    const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[o]);
    for (int64_t r = 0; r < rows; r += BF16_ROWS) {
      const int64_t group = std::min(BF16_ROWS, rows - r);
      const c10::BFloat16* x_rows[BF16_ROWS];
      for (int64_t i = 0; i < group; ++i) x_rows[i] = x + (r + i) * dim;
      float sums[BF16_ROWS];
      if (group == 1) {
        bf16_dot_rows<1, STREAMED>(x_rows, w, dim, sums);
      } else {
        bf16_dot_rows<2, STREAMED>(x_rows, w, dim, sums);
      }
      for (int64_t i = 0; i < group; ++i) out[(r + i) * outputs + o] = static_cast<c10::BFloat16>(sums[i] + b);
    }
  }
}

// out [rows, outputs] = x [rows, dim] times every row of the bfloat16 weight [outputs, dim] (+ bias),
// each thread reading one contiguous share of the weight's rows in order, BF16_ROWS rows of x at a time.
void bf16_rows_linear(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t rows, int64_t outputs, int64_t dim) {
  const bool streamed = rows_aligned(weight, dim * 2);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, outputs, (outputs + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    if (streamed) {
      bf16_rows_share<true>(x, weight, bias, out, rows, outputs, dim, begin, end);
    } else {
      bf16_rows_share<false>(x, weight, bias, out, rows, outputs, dim, begin, end);
    }
  });
}
#else
constexpr bool BF16_DOT = false;
#endif

#if defined(__AVX512F__)
// A float32 weight of one or two rows of x, read as the bfloat16 product reads its own (above): one
// weight row after another in address order, by non-temporal loads, the hardware's prefetch running
// ahead. dot_tile's four interleaved rows with ordinary loads stay for more rows of x and for weights
// whose rows are not 64-byte aligned. On a 2-core Zen 4 (AVX-512 EPYC), GPT-2-small's 48 float32 layer
// weights took 0.83 / 0.91 / 1.16 / 1.81x dot_tile's time at 1 / 2 / 4 / 8 rows of x (10 alternated
// rounds), and one float32 stream through the server (the benchmark model under PT2_COMPILE) read ITL
// p50 0.84x (0.83-0.89, 8 paired rounds in both orders, faster in all 8). The same order with ordinary
// loads read 0.95x in process; dot_tile's order with non-temporal loads 1.01x, and 1.00x through the
// server.
constexpr int64_t F32_STREAMED_ROWS = 2;

// One float32 weight row `w` (64-byte aligned, `dim` a multiple of 16) against R rows of x.
template <int64_t R>
inline void f32_streamed_dot_rows(const float* const* x, const float* w, int64_t dim, float* sums) {
  __m512 even[R], odd[R];
  for (int64_t r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  auto weight_chunk = [](const float* p) { return _mm512_castsi512_ps(streamed_chunk(p)); };
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    const __m512 w0 = weight_chunk(w + d), w1 = weight_chunk(w + d + 16);
    for (int64_t r = 0; r < R; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + d), w0, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + d + 16), w1, odd[r]);
    }
  }
  if (d < dim) {  // the last 16
    const __m512 w0 = weight_chunk(w + d);
    for (int64_t r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + d), w0, even[r]);
  }
  for (int64_t r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

// few_rows_linear's float32 product for up to F32_STREAMED_ROWS rows of x and an aligned weight.
void f32_streamed_linear(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
                         int64_t outputs, int64_t dim) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, outputs, (outputs + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    const float* x_rows[F32_STREAMED_ROWS] = {x, x + (rows - 1) * dim};
    for (int64_t o = begin; o < end; ++o) {
      float sums[F32_STREAMED_ROWS];
      if (rows == 1) {
        f32_streamed_dot_rows<1>(x_rows, weight + o * dim, dim, sums);
      } else {
        f32_streamed_dot_rows<2>(x_rows, weight + o * dim, dim, sums);
      }
      const float b = bias == nullptr ? 0.0f : bias[o];
      for (int64_t r = 0; r < rows; ++r) out[r * outputs + o] = sums[r] + b;
    }
  });
}

inline bool f32_streamed(const float* weight, int64_t rows, int64_t dim) {
  return rows >= 1 && rows <= F32_STREAMED_ROWS && rows_aligned(weight, dim * 4);
}
#endif

// out [rows, outputs] = x [rows, dim] times every row of weight [outputs, dim], plus bias [outputs] if
// given: a linear layer (or a tied head's table) for a few rows, bound by reading the weight. Each
// thread reads one contiguous share of the weight's rows, TILE at a time, against two rows of x at a
// time, so every weight row is read from memory once for all of x.
template <typename T>
void few_rows_linear_kernel(const T* x, const T* weight, const T* bias, T* out, int64_t rows, int64_t outputs,
                            int64_t dim) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    bf16_rows_linear(x, weight, bias, out, rows, outputs, dim);
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (f32_streamed(weight, rows, dim)) {
      f32_streamed_linear(x, weight, bias, out, rows, outputs, dim);
      return;
    }
  }
#endif
  std::vector<float> inputs(rows * dim);
  for (int64_t r = 0; r < rows; ++r) copy_as_float(x + r * dim, inputs.data() + r * dim, dim);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, outputs, (outputs + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(TILE * dim);  // bfloat16 and half rows as float32
    const float* tile[TILE];
    float sums[2][TILE];
    for (int64_t o = begin; o < end; o += TILE) {
      const int64_t n = std::min(TILE, end - o);
      for (int64_t i = 0; i < TILE; ++i) {  // a short last tile repeats its last row
        tile[i] = float_row(weight + (o + std::min(i, n - 1)) * dim, buffer.data() + i * dim, dim);
      }
      for (int64_t r = 0; r < rows; r += 2) {
        const int64_t pair = std::min<int64_t>(2, rows - r);
        const float* row = inputs.data() + r * dim;
        dot_tile(row, pair == 2 ? row + dim : nullptr, tile, dim, sums);
        for (int64_t j = 0; j < pair; ++j) {
          for (int64_t i = 0; i < n; ++i) {
            const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[o + i]);
            out[(r + j) * outputs + o + i] = static_cast<T>(sums[j][i] + b);
          }
        }
      }
    }
  });
}

constexpr int64_t INT8_MAX_ROWS = 8;

// Whether this is an AMD CPU: the int8 and int4 kernels ask for their weight rows ahead differently on
// AMD's CPUs and on Intel's (measured on a Zen 4 EPYC and on a Xeon with AMX; see each kernel).
#if defined(__x86_64__) || defined(__i386__)
inline bool amd_cpu() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool INT8_ROWS = true;
constexpr int64_t INT8_TILE = 16;  // outputs whose sums are handed over together
// The int8 rows (given offset by 128 into unsigned bytes: `shifted` [m, k]) times every row of the int8
// weight [n, k]. The int32 sums are handed over in tiles of consecutive outputs, `emit(r, c, count,
// sums)` for row r's outputs c to c + count, in the thread that computed them, so that the caller's
// rescaling runs in parallel too. VNNI multiplies unsigned by signed bytes; 128 times each weight row's
// sum (`weight_sums`) is taken back out. Each weight row is read once for all the rows.
//
// Off AMD's CPUs each weight row is asked for INT8_PREFETCH_ROWS rows ahead of its turn. On a 2-core Zen
// 4 the kernel, bound by reading alone, got slower asking ahead (1.3x at one row). On a 2-core AVX-512
// Xeon with AMX (family 6, model 167) GPT-2-small's 48 int8 layers (scripts/cpu_products_rows.py, two
// alternated pairs of runs) took the same at one row (5.64-5.71 ms against 5.55-5.66) and less from two:
// 5.73 against 5.89-6.16 at two rows, 6.25 against 6.90-6.94 at four, 7.25-7.28 against 8.54-8.94 at
// eight.
constexpr int64_t INT8_PREFETCH_ROWS = 8;
template <typename Emit>
void int8_sums(const uint8_t* shifted, int64_t m, const int8_t* w, const int32_t* weight_sums, int64_t n,
               int64_t k, const Emit& emit) {
  const int64_t tail = k % 64;
  const __mmask64 tail_mask = tail ? (~0ULL >> (64 - tail)) : 0;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool ask_ahead = !amd_cpu();
  at::parallel_for(0, n, (n + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    int32_t tile[INT8_MAX_ROWS][INT8_TILE];
    for (int64_t o = begin; o < end; ++o) {
      const int8_t* row = w + o * k;
      if (ask_ahead && o + INT8_PREFETCH_ROWS < end) prefetch_lines<_MM_HINT_T0>(row + INT8_PREFETCH_ROWS * k, k);
      __m512i acc[INT8_MAX_ROWS];
      for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_si512();
      int64_t e = 0;
      for (; e + 64 <= k; e += 64) {
        const __m512i wv = _mm512_loadu_si512(row + e);
        for (int64_t r = 0; r < m; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(shifted + r * k + e), wv);
        }
      }
      if (tail) {  // masked-off bytes load as 0 on both sides: they add nothing
        const __m512i wv = _mm512_maskz_loadu_epi8(tail_mask, row + e);
        for (int64_t r = 0; r < m; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(tail_mask, shifted + r * k + e), wv);
        }
      }
      const int64_t slot = (o - begin) % INT8_TILE;
      for (int64_t r = 0; r < m; ++r) tile[r][slot] = _mm512_reduce_add_epi32(acc[r]) - 128 * weight_sums[o];
      if (slot == INT8_TILE - 1 || o == end - 1) {
        for (int64_t r = 0; r < m; ++r) emit(r, o - slot, slot + 1, tile[r]);
      }
    }
  });
}
#else
constexpr bool INT8_ROWS = false;
template <typename Emit>
void int8_sums(const uint8_t*, int64_t, const int8_t*, const int32_t*, int64_t, int64_t, const Emit&) {}
#endif

// The packed layout's unit: 128 values (64 bytes, value j in byte j's low nibble, value j + 64 in its high
// one) where the group size is a multiple of 128, else 64 (32 bytes, value j + 32 high). A whole unit is
// unpacked by one mask and one shift. In units of 64 only, GPT-2-small's 768-wide layers read at 18-20
// GB/s at one row, where int8's read at 26-30 (2-core Zen 4).
inline int64_t int4_unit(int64_t group) { return group % 128 == 0 ? 128 : 64; }
constexpr int64_t INT4_MAX_ROWS = 4;  // rows of x a pass takes against each unpacked unit of the weight

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TGIS_INT4_KERNEL 1

// R rows of int8 x (`x[r]` [k]) against one weight row of packed int4 values [k / 2]: for each row, the
// sum over groups g of scale[g] * (the weight's values . x over g), in `totals` (before the zero points).
// A unit is unpacked in registers into its values (low nibbles, then high), once for all R rows; the dot
// products are exact int32 sums (VNNI: the weight's unsigned values times x's signed ones), scaled into
// float32 lanes a group at a time and summed across at the end.
template <int64_t R, int64_t UNIT>
inline void int4_dot_rows(const int8_t* const* x, const uint8_t* packed, const float* scale, int64_t k, int64_t group,
                          float* totals) {
  __m512 total[R];
  for (int64_t r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t start = 0, g = 0; start < k; start += group, ++g) {
    __m512i dot[R];
    for (int64_t r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t e = start; e < start + group; e += UNIT) {
      if constexpr (UNIT == 128) {
        const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
        const __m512i bytes = _mm512_loadu_si512(packed + e / 2);
        const __m512i low = _mm512_and_si512(bytes, low_nibbles);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        for (int64_t r = 0; r < R; ++r) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], low, _mm512_loadu_si512(x[r] + e));
          dot[r] = _mm512_dpbusd_epi32(dot[r], high, _mm512_loadu_si512(x[r] + e + 64));
        }
      } else {
        const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + e / 2));
        const __m256i low = _mm256_and_si256(bytes, low_nibbles);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
        const __m512i values = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
        for (int64_t r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], values, _mm512_loadu_si512(x[r] + e));
      }
    }
    const __m512 group_scale = _mm512_set1_ps(scale[g]);
    for (int64_t r = 0; r < R; ++r) total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), group_scale, total[r]);
  }
  for (int64_t r = 0; r < R; ++r) totals[r] = _mm512_reduce_add_ps(total[r]);
}

#elif defined(__AVX2__) && defined(__FMA__)
#define TGIS_INT4_KERNEL 1

// The same on AVX2 (no VNNI): 32 unsigned values times 32 signed bytes multiplied in pairs into 16-bit
// sums (at most 2 * 15 * 127, so never saturated), widened into int32 by a multiply-add with ones: the
// same integers. A unit is taken 32 bytes (64 values) at a time: its low nibbles, then its high ones.
template <int64_t R, int64_t UNIT>
inline void int4_dot_rows(const int8_t* const* x, const uint8_t* packed, const float* scale, int64_t k, int64_t group,
                          float* totals) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[R];
  for (int64_t r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t start = 0, g = 0; start < k; start += group, ++g) {
    __m256i dot[R];
    for (int64_t r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int64_t e = start; e < start + group; e += UNIT) {
      for (int64_t part = 0; part < UNIT / 64; ++part) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + e / 2 + part * 32));
        const __m256i low = _mm256_and_si256(bytes, low_nibbles);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
        const int64_t low_at = e + part * 32, high_at = e + UNIT / 2 + part * 32;
        for (int64_t r = 0; r < R; ++r) {
          const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + low_at));
          const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + high_at));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(low, xl), ones));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(high, xh), ones));
        }
      }
    }
    const __m256 group_scale = _mm256_set1_ps(scale[g]);
    for (int64_t r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), group_scale, total[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(total[r]), _mm256_extractf128_ps(total[r], 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    totals[r] = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
  }
}
#endif

#if defined(TGIS_INT4_KERNEL)
constexpr bool INT4_ROWS = true;
// How far ahead int4_sums asks for weight rows. It does more arithmetic a byte than the int8 kernel, and
// the hardware's own prefetch fell behind when the layers came one after the other: the compiled int4
// decode step of the GPT-2-small benchmark model (one sequence) took 0.85x as long with it (median 3.26
// against 3.86 ms, 4 alternated rounds, every one faster; 2-core AVX-512 EPYC, Zen 4). The 48 layer
// weights called one by one from Python: 0.87x at two rows, the same within noise at one, four and
// eight. The int8 kernel, bound by reading alone, got slower asking ahead (1.3x at one row from Python;
// its compiled step slower in 3 of 4 rounds).
//
// On an AMD CPU the rows are asked for as non-temporal (_MM_HINT_NTA): each is read once a step, and a
// step streams every weight through the caches, evicting what the rest of the step (the engine's Python,
// the event loop, the KV cache) would find there next. 2-core Zen 4, int4 under PT2_COMPILE: the decode
// step alone in process took the same time (0.999x, 10 alternated rounds), and one stream's ITL p50
// through the server read 0.90x (0.69-1.03, 10 paired rounds, faster in 9); 32 streams' tokens/s
// 0.95-1.03x. On an Intel CPU the same hint stalled the kernel: on a 2-core AVX-512 Xeon with AMX (family
// 6, model 167), 86 % of this loop's own samples (the dot products apart) sat on the prefetch, and GPT-2-
// small's 48 int4 layer weights at one row took 4.25 ms with it, 3.60 with no prefetch and 2.86 asking
// into every cache level (_MM_HINT_T0; medians of 11-15 alternated rounds, scripts/cpu_products_rows.py),
// and one int4 stream through the server made 1.99x the tokens/s. Other CPUs take T0.
constexpr int64_t INT4_PREFETCH_ROWS = 8;

template <int64_t R>
inline void int4_dot_rows(const int8_t* const* x, const uint8_t* packed, const float* scale, int64_t k, int64_t group,
                          float* totals) {
  if (int4_unit(group) == 128) {
    int4_dot_rows<R, 128>(x, packed, scale, k, group, totals);
  } else {
    int4_dot_rows<R, 64>(x, packed, scale, k, group, totals);
  }
}

// For each x row r and weight row c, the sum over groups g of scale[c, g] * (q[c] . x[r] over g) -
// scaled_zero[c, g] * (the sum of x[r] over g), handed to `emit(r, c, sum)` (before the row's scale) in
// the thread that computed it; from int8 rows `x` [m, k], their group sums `x_sums` [m, groups] and
// the packed weight [n, k / 2]. Each thread reads one contiguous share of the weight's rows, each once
// for up to INT4_MAX_ROWS rows of x; every (r, c) takes the same steps whatever m is. Each weight row is
// asked for INT4_PREFETCH_ROWS rows ahead of its turn, non-temporal on an AMD CPU.
template <typename Emit>
void int4_sums(const int8_t* x, const int32_t* x_sums, int64_t m, const uint8_t* packed, const float* scale,
               const float* scaled_zero, int64_t n, int64_t k, int64_t group, const Emit& emit) {
  const int64_t groups = k / group;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool non_temporal = amd_cpu();
  at::parallel_for(0, n, (n + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const uint8_t* row = packed + c * (k / 2);
      const float* row_scale = scale + c * groups;
      const float* row_zero = scaled_zero + c * groups;
      if (c + INT4_PREFETCH_ROWS < end) {
        const uint8_t* ahead = row + INT4_PREFETCH_ROWS * (k / 2);
        if (non_temporal) {
          prefetch_lines<_MM_HINT_NTA>(ahead, k / 2);
        } else {
          prefetch_lines<_MM_HINT_T0>(ahead, k / 2);
        }
      }
      for (int64_t r = 0; r < m; r += INT4_MAX_ROWS) {
        const int64_t block = std::min(INT4_MAX_ROWS, m - r);
        const int8_t* rows[INT4_MAX_ROWS];
        for (int64_t i = 0; i < block; ++i) rows[i] = x + (r + i) * k;
        float totals[INT4_MAX_ROWS];
        switch (block) {
          case 1: int4_dot_rows<1>(rows, row, row_scale, k, group, totals); break;
          case 2: int4_dot_rows<2>(rows, row, row_scale, k, group, totals); break;
          case 3: int4_dot_rows<3>(rows, row, row_scale, k, group, totals); break;
          default: int4_dot_rows<4>(rows, row, row_scale, k, group, totals); break;
        }
        for (int64_t i = 0; i < block; ++i) {
          const int32_t* sums = x_sums + (r + i) * groups;
          float zero_part = 0.0f;
          for (int64_t g = 0; g < groups; ++g) zero_part += row_zero[g] * static_cast<float>(sums[g]);
          emit(r + i, c, totals[i] - zero_part);
        }
      }
    }
  });
}
#else
constexpr bool INT4_ROWS = false;
template <typename Emit>
void int4_sums(const int8_t*, const int32_t*, int64_t, const uint8_t*, const float*, const float*, int64_t, int64_t,
               int64_t, const Emit&) {}
#endif

// The int4 product on the AMX tiles (a Xeon with AMX-INT8, where Linux lets the process use them). The
// row kernel above reads each weight row once for up to INT4_MAX_ROWS rows of x and works through its
// values 64 at a time per row, so its cost grows with the rows: GPT-2-small's 48 int4 layer weights took
// 22-28 ms at 32 rows, against 10 for int8's torch._int_mm (oneDNN's AMX kernels; 2-core Xeon, family 6,
// model 167). One tile product multiplies 16 rows of x by 16 outputs' 64 values each.
//
// The weight is laid out for the tiles at load (engines/int4_layouts.py's pack_int4_tiles): blocks of 16
// outputs [n / 16], in each the input features 64 at a time [k / 64], 512 bytes each. Those bytes unpack
// (low nibbles, then high, 64 bytes at a time) into the 16 x 64 bytes of a tile of the weight in the
// order the tile product reads it: tile row i holds input features 4i to 4i + 3 of each of the 16
// outputs, so byte j of row pair p holds row 2p's byte j low and row 2p + 1's high. The scales and
// scaled zero points come as [n / 16, groups, 16]: a block's group is one vector of 16 outputs.
//
// Every output is computed by the same steps whatever the step's width: the exact int32 sums of each
// group (signed x times the unsigned 4-bit values), then, in float32, the sum over groups of each
// group's scale times its sums, less the sum over groups of its scaled zero point times x's group sum.
// A row's result depends on that row alone.
constexpr int64_t TILE_OUTPUTS = 16;    // outputs in a block of the tiled weight: a tile's columns
constexpr int64_t TILE_FEATURES = 64;   // input features of one tile product
constexpr int64_t TILE_ROWS = 16;       // rows of x in one tile
constexpr int64_t TILE_BLOCK_BYTES = TILE_OUTPUTS * TILE_FEATURES / 2;  // packed bytes of one tile of weight

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__linux__)
// The tiles' shapes, loaded by each thread before its products (the configuration is a thread's, and
// oneDNN's kernels load their own): tiles 0 and 1 hold the sums of two blocks of `rows` rows of x, tiles
// 2 and 3 those rows (64 signed bytes each), tile 4 the weight's values (16 rows of 16 outputs x 4 bytes).
inline void configure_tiles(int64_t rows) {
  struct {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int tile = 0; tile < 4; ++tile) {
    config.rows[tile] = static_cast<uint8_t>(rows);
    config.bytes_per_row[tile] = 64;
  }
  config.rows[4] = TILE_FEATURES / 4;
  config.bytes_per_row[4] = 64;
  _tile_loadconfig(&config);
}

sigjmp_buf tile_probe_exit;
void leave_tile_probe(int) { siglongjmp(tile_probe_exit, 1); }

// One tile product of a row of x and 16 outputs' values, against the same sums added up one by one. A
// VM may report AMX and grant its state, yet trap the tile instructions (SIGILL; llama.cpp's AMX
// kernels died so on one): the probe's SIGILL ends the probe, not the process.
bool tile_product_works() {
  struct sigaction on_fault = {}, previous = {};
  on_fault.sa_handler = leave_tile_probe;
  sigemptyset(&on_fault.sa_mask);
  if (sigaction(SIGILL, &on_fault, &previous) != 0) return false;
  volatile bool works = false;  // volatile: read after a jump out of the probe
  if (sigsetjmp(tile_probe_exit, 1) == 0) {
    alignas(64) int8_t row[TILE_FEATURES];
    alignas(64) uint8_t values[TILE_FEATURES / 4][64];
    alignas(64) int32_t sums[TILE_OUTPUTS] = {};
    for (int64_t e = 0; e < TILE_FEATURES; ++e) row[e] = static_cast<int8_t>(e * 5 % 255 - 127);
    for (int64_t i = 0; i < TILE_FEATURES / 4; ++i) {
      for (int64_t j = 0; j < 64; ++j) values[i][j] = static_cast<uint8_t>((i * 64 + j) * 7 % 16);
    }
    configure_tiles(1);
    _tile_loadd(2, row, TILE_FEATURES);
    _tile_loadd(4, values, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, sums, 64);
    _tile_release();
    works = true;
    for (int64_t c = 0; c < TILE_OUTPUTS; ++c) {
      int32_t expected = 0;
      for (int64_t e = 0; e < TILE_FEATURES; ++e) expected += row[e] * values[e / 4][c * 4 + e % 4];
      works = works && sums[c] == expected;
    }
  }
  sigaction(SIGILL, &previous, nullptr);
  return works;
}

// Whether this process multiplies on the tiles, asked once: Linux grants it their state (as oneDNN asks
// for it), and a probe's tile product runs and adds up.
inline bool tiles_usable() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 && tile_product_works();
  }();
  return permitted;
}

// One tile of the weight's 4-bit values (TILE_BLOCK_BYTES packed bytes) as the 16 x 64 bytes tile 4 loads.
inline void unpack_tile(const uint8_t* packed, uint8_t (*values)[64]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t pair = 0; pair < TILE_FEATURES / 8; ++pair) {
    const __m512i bytes = _mm512_loadu_si512(packed + pair * 64);
    _mm512_store_si512(values[2 * pair], _mm512_and_si512(bytes, low_nibbles));
    _mm512_store_si512(values[2 * pair + 1], _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles));
  }
}

// A thread's tiles of the weight, unpacked in the order its products take them (block after block, each
// block's tiles once per pass over the rows of x), TILES_AHEAD tiles ahead of their product. A tile load
// waits for the stores that wrote its bytes to finish: loading each tile right after unpacking it, the
// loads stalled one row of x through a 3072 x 768 layer in 61 us against the row kernel's 48. Each tile
// unpacked in the first pass also asks for the next block's tile at the same depth.
constexpr int64_t TILES_AHEAD = 2;
constexpr int64_t TILE_BUFFERS = 4;  // > TILES_AHEAD: the tile being loaded is not the one being written
class TileStream {
 public:
  TileStream(const uint8_t* tiles, int64_t depth, int64_t passes, int64_t begin, int64_t end)
      : tiles_(tiles), depth_(depth), passes_(passes), end_(end), block_(begin) {
    for (int64_t i = 0; i < TILES_AHEAD; ++i) unpack_next();
  }

  // The next tile in order, unpacked; the one TILES_AHEAD after it is unpacked now.
  const uint8_t (*take())[64] {
    unpack_next();
    return values_[taken_++ % TILE_BUFFERS];
  }

 private:
  void unpack_next() {
    if (block_ >= end_) return;
    const uint8_t* tile = tiles_ + (block_ * depth_ + depth_at_) * TILE_BLOCK_BYTES;
    if (pass_ == 0 && block_ + 1 < end_) prefetch_lines<_MM_HINT_T0>(tile + depth_ * TILE_BLOCK_BYTES, TILE_BLOCK_BYTES);
    unpack_tile(tile, values_[unpacked_++ % TILE_BUFFERS]);
    if (++depth_at_ == depth_) {
      depth_at_ = 0;
      if (++pass_ == passes_) {
        pass_ = 0;
        ++block_;
      }
    }
  }

  const uint8_t* tiles_;
  int64_t depth_, passes_, end_;
  int64_t block_, pass_ = 0, depth_at_ = 0;  // the next tile to unpack
  int64_t unpacked_ = 0, taken_ = 0;
  alignas(64) uint8_t values_[TILE_BUFFERS][TILE_FEATURES / 4][64];
};

// For each x row r and output c, as int4_sums: the sum over groups of scale * (q . x over the group) less
// scaled_zero * (x's sum over the group), handed to `emit(r, c, sum)` in the thread that computed it.
// `x` [m, k] is padded with zero rows to a multiple of TILE_ROWS where m is larger than TILE_ROWS. Each
// thread takes a contiguous share of the blocks of 16 outputs; a pass over the rows takes two blocks of
// rows against each tile of the weight.
template <typename Emit>
void int4_tile_sums(const int8_t* x, const int32_t* x_sums, int64_t m, const uint8_t* tiles, const float* scale,
                    const float* scaled_zero, int64_t n, int64_t k, int64_t group, const Emit& emit) {
  const int64_t groups = k / group, blocks = n / TILE_OUTPUTS, depth = k / TILE_FEATURES;
  const int64_t per_group = group / TILE_FEATURES, row_blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t tile_rows = std::min(m, TILE_ROWS), passes = (row_blocks + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, blocks, (blocks + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    configure_tiles(tile_rows);
    TileStream weight(tiles, depth, passes, begin, end);
    alignas(64) int32_t sums[2][TILE_ROWS][TILE_OUTPUTS];
    std::vector<float> totals(row_blocks * TILE_ROWS * TILE_OUTPUTS);
    for (int64_t b = begin; b < end; ++b) {
      const float* block_scale = scale + b * groups * TILE_OUTPUTS;
      const float* block_zero = scaled_zero + b * groups * TILE_OUTPUTS;
      std::fill(totals.begin(), totals.end(), 0.0f);
      for (int64_t first = 0; first < row_blocks; first += 2) {
        const bool two = first + 1 < row_blocks;
        const int8_t* rows = x + first * TILE_ROWS * k;
        for (int64_t g = 0; g < groups; ++g) {
          _tile_zero(0);
          if (two) _tile_zero(1);
          for (int64_t d = g * per_group; d < (g + 1) * per_group; ++d) {
            _tile_loadd(4, weight.take(), 64);
            _tile_loadd(2, rows + d * TILE_FEATURES, k);
            _tile_dpbsud(0, 2, 4);
            if (two) {
              _tile_loadd(3, rows + TILE_ROWS * k + d * TILE_FEATURES, k);
              _tile_dpbsud(1, 3, 4);
            }
          }
          _tile_stored(0, sums[0], 64);
          if (two) _tile_stored(1, sums[1], 64);
          const __m512 group_scale = _mm512_loadu_ps(block_scale + g * TILE_OUTPUTS);
          for (int64_t part = 0; part < (two ? 2 : 1); ++part) {
            float* total = totals.data() + (first + part) * TILE_ROWS * TILE_OUTPUTS;
            for (int64_t r = 0; r < tile_rows; ++r) {
              const __m512 group_sums = _mm512_cvtepi32_ps(_mm512_load_si512(sums[part][r]));
              _mm512_storeu_ps(total + r * TILE_OUTPUTS,
                               _mm512_fmadd_ps(group_sums, group_scale, _mm512_loadu_ps(total + r * TILE_OUTPUTS)));
            }
          }
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        __m512 zero_part = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          zero_part = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(x_sums[r * groups + g])),
                                      _mm512_loadu_ps(block_zero + g * TILE_OUTPUTS), zero_part);
        }
        alignas(64) float outputs[TILE_OUTPUTS];
        _mm512_store_ps(outputs, _mm512_sub_ps(_mm512_loadu_ps(totals.data() + r * TILE_OUTPUTS), zero_part));
        for (int64_t i = 0; i < TILE_OUTPUTS; ++i) emit(r, b * TILE_OUTPUTS + i, outputs[i]);
      }
    }
    _tile_release();
  });
}
#else
inline bool tiles_usable() { return false; }
template <typename Emit>
void int4_tile_sums(const int8_t*, const int32_t*, int64_t, const uint8_t*, const float*, const float*, int64_t,
                    int64_t, int64_t, const Emit&) {}
#endif

// Row `x` [k] as int8 values in `out` (symmetric: its largest magnitude maps to 127, floored at 1e-12
// so that a zero row stays zero) plus `offset` (128 for int8_sums' unsigned bytes, else 0); returns the
// row's scale (largest magnitude / 127). engines/quantized.py's torch fallback computes the same.
template <typename T, typename Q>
float quantize_row(const T* x, int64_t k, Q* out, int32_t offset) {
  float peak = 0.0f;
  for (int64_t i = 0; i < k; ++i) peak = std::max(peak, std::abs(static_cast<float>(x[i])));
  peak = std::max(peak, 1e-12f);
  const float inverse = 127.0f / peak;
  for (int64_t i = 0; i < k; ++i) {
    const float level = std::min(127.0f, std::max(-127.0f, std::nearbyint(static_cast<float>(x[i]) * inverse)));
    out[i] = static_cast<Q>(static_cast<int32_t>(level) + offset);
  }
  return peak / 127.0f;
}

}  // namespace

// A linear layer's optional bias, one value for each of its n outputs: checked to be in x's dtype,
// made contiguous.
static std::optional<torch::Tensor> checked_bias(const std::optional<torch::Tensor>& given, int64_t n,
                                                 const torch::Tensor& x) {
  if (!given.has_value()) return given;
  TORCH_CHECK(given->dim() == 1 && given->size(0) == n && given->scalar_type() == x.scalar_type(),
              "the bias must hold one value per output, in x's dtype");
  return given->contiguous();
}

// Output column c in T: a rescaled sum plus the bias (nullptr: none).
template <typename T>
inline T with_bias(float value, const T* bias, int64_t c) {
  return static_cast<T>(bias == nullptr ? value : value + static_cast<float>(bias[c]));
}

// A checked bias's values (nullptr: none).
template <typename T>
const T* bias_data(const std::optional<torch::Tensor>& bias) {
  return bias.has_value() ? bias->data_ptr<T>() : nullptr;
}

// out[c] = sums[c] rescaled by `row_scale` and weight_scale[c], plus bias[c] (nullptr: none), for c below
// count. Never inlined: every int8 path (the kernel's tiles, torch._int_mm's rows) runs this one code,
// so that -ffast-math cannot round a column one way in one path and another way in the other (a row's
// result must not depend on how many rows share its step).
template <typename T>
__attribute__((noinline)) void rescale_int8_sums(const int32_t* sums, int64_t count, float row_scale,
                                                 const float* weight_scale, const T* bias, T* out) {
  for (int64_t c = 0; c < count; ++c) {
    out[c] = with_bias(static_cast<float>(sums[c]) * (row_scale * weight_scale[c]), bias, c);
  }
}

// `out` [m, n] viewed with x's leading dimensions: [..., n].
static torch::Tensor with_leading_dims(const torch::Tensor& out, const torch::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

// x [..., dim] times a dense weight [outputs, dim], plus an optional bias [outputs] (what F.linear
// computes), in x's dtype: for a few rows, where the product is bound by reading the weight once.
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                              const std::optional<torch::Tensor>& given_bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "few_rows_linear needs CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "the weight must be a contiguous [outputs, dim] matrix");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "x's last dimension must be the weight's width");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and the weight must have one dtype");
  const int64_t outputs = weight.size(0), dim = weight.size(1);
  const std::optional<torch::Tensor> bias = checked_bias(given_bias, outputs, x);
  auto flat = x.reshape({-1, dim}).contiguous();
  auto out = torch::empty({flat.size(0), outputs}, x.options());
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    few_rows_linear_kernel<T>(flat.data_ptr<T>(), weight.data_ptr<T>(), bias_data<T>(bias), out.data_ptr<T>(),
                              flat.size(0), outputs, dim);
  });
  return with_leading_dims(out, x, outputs);
}

// Whether few_rows_linear multiplies bfloat16 weights as they are (AVX512_BF16), so that keeping a dense
// bfloat16 copy for it pays (engines/cpu_prepack.py).
bool has_bf16_rows() { return BF16_DOT; }

// Whether int8 products of up to INT8_MAX_ROWS rows run on this file's VNNI kernel.
bool has_int8_rows() { return INT8_ROWS; }

void check_int8_weight(const torch::Tensor& weight, const torch::Tensor& weight_sums) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kChar, "an int8 CPU weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "the weight must be a contiguous [n, k] matrix");
  TORCH_CHECK(weight_sums.scalar_type() == torch::kInt && weight_sums.is_contiguous() &&
                  weight_sums.numel() == weight.size(0),
              "int32 weight sums, one per weight row");
}

// The int32 sums of int8 rows [rows, dim] times every row of an int8 weight [outputs, dim] (what
// torch._int_mm(rows, weight.t()) computes) through the VNNI kernel, for 1 to INT8_MAX_ROWS rows.
torch::Tensor int8_rows(const torch::Tensor& rows, const torch::Tensor& weight, const torch::Tensor& weight_sums) {
  TORCH_CHECK(INT8_ROWS, "int8_rows needs AVX-512 VNNI");
  check_int8_weight(weight, weight_sums);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == torch::kChar && rows.dim() == 2, "int8 rows [m, k]");
  const int64_t m = rows.size(0), n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(rows.size(1) == k, "the rows must be as wide as the weight");
  TORCH_CHECK(m >= 1 && m <= INT8_MAX_ROWS, "int8_rows takes 1 to 8 rows");
  auto out = torch::empty({m, n}, rows.options().dtype(torch::kInt));
  auto given = rows.contiguous();
  std::vector<uint8_t> shifted(m * k);
  const int8_t* x = given.data_ptr<int8_t>();
  for (int64_t i = 0; i < m * k; ++i) shifted[i] = static_cast<uint8_t>(static_cast<int32_t>(x[i]) + 128);
  int32_t* sums = out.data_ptr<int32_t>();
  int8_sums(shifted.data(), m, weight.data_ptr<int8_t>(), weight_sums.data_ptr<int32_t>(), n, k,
            [&](int64_t r, int64_t c, int64_t count, const int32_t* tile) {
              std::copy_n(tile, count, sums + r * n + c);
            });
  return out;
}

// A quantized linear layer: x [..., k] (float32, bfloat16 or half) times an int8 weight [n, k] with a
// float32 scale per weight row [n] and the rows' int32 sums [n], plus an optional bias [n] in x's dtype.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                          const torch::Tensor& weight_sums, const std::optional<torch::Tensor>& given_bias) {
  check_int8_weight(weight, weight_sums);
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, "x [..., k] on the CPU");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == n,
              "a float32 scale per weight row");
  const std::optional<torch::Tensor> bias = checked_bias(given_bias, n, x);
  auto flat = x.reshape({-1, k}).contiguous();
  const int64_t m = flat.size(0);
  auto out = torch::empty({m, n}, x.options());
  std::vector<float> row_scales(m);
  const bool few = INT8_ROWS && m <= INT8_MAX_ROWS;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));  // rows a thread takes at least
  const float* weight_scale = scale.data_ptr<float>();
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* rows = flat.data_ptr<T>();
    T* result = out.data_ptr<T>();
    const T* b = bias_data<T>(bias);
    // Row r's outputs c to c + count from their int32 sums.
    auto rescaled = [&](int64_t r, int64_t c, int64_t count, const int32_t* sums) {
      rescale_int8_sums(sums, count, row_scales[r], weight_scale + c, b == nullptr ? nullptr : b + c,
                        result + r * n + c);
    };
    if (few) {
      std::vector<uint8_t> shifted(m * k);
      for (int64_t r = 0; r < m; ++r) row_scales[r] = quantize_row(rows + r * k, k, shifted.data() + r * k, 128);
      int8_sums(shifted.data(), m, weight.data_ptr<int8_t>(), weight_sums.data_ptr<int32_t>(), n, k, rescaled);
      return;
    }
    auto quantized = torch::empty({m, k}, flat.options().dtype(torch::kChar));
    int8_t* q = quantized.data_ptr<int8_t>();
    at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row_scales[r] = quantize_row(rows + r * k, k, q + r * k, 0);
    });
    const auto sums = at::_int_mm(quantized, weight.t());
    const int32_t* s = sums.data_ptr<int32_t>();
    at::parallel_for(0, m, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rescaled(r, 0, n, s + r * n);
    });
  });
  return with_leading_dims(out, x, n);
}

// Whether int4_linear runs here (AVX-512 VNNI or AVX2); engines/quantized.py uses torch's int4 product otherwise.
bool has_int4_rows() { return INT4_ROWS; }

// Whether int4_linear takes weights laid out for the AMX tiles here (int4_tile_sums), which
// engines/quantized.py then lays them out for.
bool has_int4_tiles() { return tiles_usable(); }

// An int4 layer: x [..., k] (float32, bfloat16 or half) times a weight of 4-bit values, two a byte,
// standing for scale * (value - zero) per group of `group` input features, given as float32 `scale` and
// `scaled_zero` (scale times zero); plus an optional bias [n] in x's dtype. Each row of x is quantized to
// int8 as int8_linear does. The weight comes in one of two layouts:
// - rows (int4_sums): `packed` [n, k / 2] in int4_unit's layout, scales [n, k / group];
// - tiles (int4_tile_sums, where has_int4_tiles): `packed` [n / 16, k / 64, 512], scales
//   [n / 16, k / group, 16].
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& scaled_zero, int64_t group, const std::optional<torch::Tensor>& given_bias) {
  const bool tiled = packed.dim() == 3;
  TORCH_CHECK(tiled ? has_int4_tiles() : INT4_ROWS,
              tiled ? "int4_linear's tiled layout needs AMX" : "int4_linear needs AVX-512 VNNI or AVX2");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kByte && packed.is_contiguous() &&
                  (tiled ? packed.size(2) == TILE_BLOCK_BYTES : packed.dim() == 2),
              "a contiguous uint8 CPU weight [n, k / 2], or [n / 16, k / 64, 512] for the tiles");
  const int64_t n = tiled ? packed.size(0) * TILE_OUTPUTS : packed.size(0);
  const int64_t k = tiled ? packed.size(1) * TILE_FEATURES : packed.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 64 == 0 && k % group == 0, "groups of a multiple of 64 features that divide k");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, "x [..., k] on the CPU");
  const int64_t groups = k / group;
  const auto scales_shape = tiled ? std::vector<int64_t>{n / TILE_OUTPUTS, groups, TILE_OUTPUTS}
                                  : std::vector<int64_t>{n, groups};
  for (const auto* t : {&scale, &scaled_zero}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->sizes() == scales_shape,
                "float32 scales and scaled zeros [n, k / group], or [n / 16, k / group, 16] for the tiles");
  }
  const std::optional<torch::Tensor> bias = checked_bias(given_bias, n, x);
  auto flat = x.reshape({-1, k}).contiguous();
  const int64_t m = flat.size(0);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return with_leading_dims(out, x, n);
  // The tiles take rows of x 16 at a time past the first 16: the rows after x's are zeros.
  const int64_t stored_rows = tiled && m > TILE_ROWS ? (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS : m;
  std::vector<int8_t> quantized(stored_rows * k);
  std::vector<float> row_scales(m);
  std::vector<int32_t> group_sums(m * groups);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* rows = flat.data_ptr<T>();
    at::parallel_for(0, m, std::max<int64_t>(1, 32768 / k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int8_t* q = quantized.data() + r * k;
        row_scales[r] = quantize_row(rows + r * k, k, q, 0);
        for (int64_t g = 0; g < groups; ++g) {
          int32_t total = 0;
          for (int64_t e = g * group; e < (g + 1) * group; ++e) total += q[e];
          group_sums[r * groups + g] = total;
        }
      }
    });
    T* result = out.data_ptr<T>();
    const T* b = bias_data<T>(bias);
    const auto emit = [&](int64_t r, int64_t c, float sum) { result[r * n + c] = with_bias(sum * row_scales[r], b, c); };
    if (tiled) {
      int4_tile_sums(quantized.data(), group_sums.data(), m, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                     scaled_zero.data_ptr<float>(), n, k, group, emit);
    } else {
      int4_sums(quantized.data(), group_sums.data(), m, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                scaled_zero.data_ptr<float>(), n, k, group, emit);
    }
  });
  return with_leading_dims(out, x, n);
}

// A packed linear layer (engines/cpu_prepack.py): up to `few_rows` rows through few_rows_linear on the
// layer's dense copy, where it keeps one, else oneDNN's product on the packed weight. The choice is made
// here, per call, so that one compiled graph serves every row count. Both are called through the
// dispatcher, so torch's profiler names the one that ran.
torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed_weight,
                            const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& dense_weight,
                            int64_t few_rows) {
  if (dense_weight.has_value() && input.numel() <= few_rows * input.size(-1)) {
    static const auto few = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("tgis::few_rows_linear", "")
                                .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                                     const std::optional<torch::Tensor>&)>();
    return few.call(input, *dense_weight, bias);
  }
  static const auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{input, packed_weight, bias, c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<c10::Scalar>>()), c10::IValue()};
  linear.callBoxed(&stack);
  return stack.back().toTensor();
}

// Operators in torch's dispatcher (torch.ops.tgis), so that a compiled step (PT2_COMPILE on the CPU)
// calls them from inductor's C++ wrapper without going back to Python, and inductor does not lower the
// packed linear itself (its own lowering of mkldnn::_linear_pointwise takes only weights it froze and
// packed).
TORCH_LIBRARY_FRAGMENT(tgis, m) {
  m.def(
      "packed_linear(Tensor input, Tensor packed_weight, Tensor? bias, Tensor? dense_weight, int few_rows) "
      "-> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor weight_sums, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor scaled_zero, int group, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis, CompositeExplicitAutograd, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("few_rows_linear", &few_rows_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
