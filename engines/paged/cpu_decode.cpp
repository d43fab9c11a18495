// Decode attention over paged KV blocks on the CPU: one query token per sequence attends that
// sequence's cached positions, read in place from its blocks (no gather copy).
//
// key_cache / value_cache: [num_blocks, block_size, kv_heads, head_dim] (float, bfloat16 or half)
// query: [sequences, heads, head_dim]; block_tables: [sequences, max_blocks] int64;
// seq_lens: [sequences] int64 (positions attended, the new token included); positions before `skip`
// are left out (another pass attends them, see attention.py's shared-prefix split).
// Returns the attention output and each (sequence, head)'s log-sum-exp of its scores [sequences,
// heads] float32, so that partial results over disjoint positions can be merged.
// Work is split over sequences, and a lone sequence's positions over the threads; each task reads a
// position's keys (and values) of all kv heads as one contiguous row, used by every query head
// (GQA groups share theirs). Scores, softmax and the weighted sum run in float32, in torch's vector
// types (at::vec, built for the CPU's capability: cpu_kernel.py), with float32 rows read in place.
// Against plain loops left to the compiler (a row copied first, a scalar exp per score), a lone
// float32 stream's layer at 512 positions on 2 AVX2 cores took about 2.5x less (410 -> 145 us, the
// cache read from memory).
// A bfloat16 cache on a CPU with AVX512_BF16 is attended head by head instead (attend_heads_bf16):
// bfloat16 dot products, each head's sums kept in registers.
//
// decode_layer is one attention layer of a step in which every token is a query of its own: a decode
// token, or one position of a short prompt or draft chunk, each with its sequence's block table and
// its own position + 1 as its length. It stores all the step's keys and values at their slots first
// (so a chunk's later positions see its earlier ones) and then attends, in one call, taking the query,
// keys and values in the layout transformers hands to an attention function ([1, heads, tokens,
// head_dim], any strides but a contiguous head_dim). At batch 1 the same work as separate torch
// operators (index_copy_, transposes, the output copy) cost about three times the attention itself.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

// A cache row as float32: float rows are read in place, bfloat16 and half rows converted into `buffer`.
inline const float* float_row(const float* src, float* /*buffer*/, int64_t /*n*/) { return src; }
inline const float* float_row(const c10::BFloat16* src, float* buffer, int64_t n) {
  // bfloat16 is float32's upper half: a shift the compiler vectorises (faster than at::vec::convert).
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(buffer);  // built with -fno-strict-aliasing
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
  return buffer;
}
inline const float* float_row(const c10::Half* src, float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(src[i]);
  return buffer;
}

// A row as float32 in `dst`, whatever the source dtype (float_row, copied where it was read in place).
template <typename T>
inline void copy_as_float(const T* src, float* dst, int64_t n) {
  const float* row = float_row(src, dst, n);
  if (row != dst) std::copy_n(row, n, dst);
}

// The sum of a vector's lanes.
inline float sum_of(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  Vec even(0.0f), odd(0.0f);
  int64_t d = 0;
  for (; d + 2 * Vec::size() <= n; d += 2 * Vec::size()) {
    even = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), even);
    odd = at::vec::fmadd(Vec::loadu(a + d + Vec::size()), Vec::loadu(b + d + Vec::size()), odd);
  }
  for (; d + Vec::size() <= n; d += Vec::size()) {
    even = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), even);
  }
  float total = sum_of(even + odd);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

inline void axpy(float weight, const float* __restrict x, float* __restrict y, int64_t n) {
  const Vec w(weight);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(w, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  }
  for (; d < n; ++d) y[d] += weight * x[d];
}

// A head's scores `s` [span] replaced in place by exp(score - peak), where peak is their largest; sets
// `peak` and `total` (the sum of the new values), what merging a sequence's parts needs.
inline void exp_from_peak(float* s, int64_t span, float& peak, float& total) {
  peak = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, span);
  const float top = peak;
  at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, s, s, span);  // Sleef's, 1 ulp
  total = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, span);
}

// A sequence's positions are split into parts when there are fewer sequences than threads (one
// stream decoding alone), so that every thread reads a share of its cache; parts shorter than this
// would cost more to merge than they save.
constexpr int64_t MIN_PART_POSITIONS = 32;

// What one task attends: sequence n's positions [first, stop), all its heads.
struct Part {
  int64_t n, first, stop;
};

template <typename T>
struct Inputs {
  const T* q;
  int64_t q_token_stride, q_head_stride;  // elements between sequences' / heads' query rows
  const T* k;
  const T* v;
  const int64_t* tables;
  int64_t heads, kv_heads, group, dim, block_size, max_blocks, row_stride, block_stride;
  float scale;
};

// Attends one part: for every query head, the peak score, the sum of exp(score - peak) and the
// values weighted by exp(score - peak), unnormalised. A position's keys (or values) of all kv heads
// are one contiguous row, read once for every query head of the sequence.
template <typename T>
void attend_part(const Inputs<T>& in, const Part& part, float* peaks, float* totals, float* acc,
                 std::vector<float>& q, std::vector<float>& row, std::vector<float>& scores) {
  const int64_t span = part.stop - part.first, heads = in.heads, dim = in.dim, group = in.group;
  q.resize(heads * dim);
  for (int64_t h = 0; h < heads; ++h) {
    copy_as_float(in.q + part.n * in.q_token_stride + h * in.q_head_stride, q.data() + h * dim, dim);
  }
  scores.resize(heads * span);
  const int64_t* table = in.tables + part.n * in.max_blocks;
  auto for_each_row = [&](const T* cache, auto&& visit) {
    for (int64_t block = part.first / in.block_size; block * in.block_size < part.stop; ++block) {
      const int64_t start = std::max(block * in.block_size, part.first);
      const int64_t stop = std::min((block + 1) * in.block_size, part.stop);
      const T* base = cache + table[block] * in.block_stride;
      for (int64_t p = start; p < stop; ++p) {
        const T* cached = base + (p - block * in.block_size) * in.row_stride;
        visit(p - part.first, float_row(cached, row.data(), in.row_stride));
      }
    }
  };
  for_each_row(in.k, [&](int64_t i, const float* keys) {
    for (int64_t h = 0; h < heads; ++h) {
      scores[h * span + i] = dot(q.data() + h * dim, keys + (h / group) * dim, dim) * in.scale;
    }
  });
  for (int64_t h = 0; h < heads; ++h) exp_from_peak(scores.data() + h * span, span, peaks[h], totals[h]);
  std::fill(acc, acc + heads * dim, 0.0f);
  for_each_row(in.v, [&](int64_t i, const float* values) {
    for (int64_t h = 0; h < heads; ++h) {
      axpy(scores[h * span + i], values + (h / group) * dim, acc + h * dim, dim);
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TGIS_BF16_HEADS 1

// Head 0's pass over a part asks for whole cache rows (every head's keys, or values) this many positions
// ahead, so that the later heads' passes, each reading its piece of every row, find them in the caches.
// The compiled int4 step of the benchmark model at 448 positions (its cache read from memory) took
// 0.988x the old kernel's time with it and 1.004x without (10 alternated rounds each).
constexpr int64_t ROWS_AHEAD = 8;
inline void ask_for_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
}

// attend_part's work on a bfloat16 cache with a head size that is a multiple of 64, head by head: each
// score is a dot product of bfloat16 pairs summed in float32 (AVX512_BF16), and a head's weighted sum of
// values stays in registers across the positions, each value widened to float32 as it is loaded. No row
// goes through a float32 buffer and no sum is stored after every position: at GPT-2-small's shape (12
// heads of 64) one sequence's layer at 96 positions took 13.3 us instead of 19.0 (2 threads, AVX-512
// Zen 4, the call's own cost included).
void attend_heads_bf16(const Inputs<c10::BFloat16>& in, const Part& part, float* peaks, float* totals, float* acc,
                       std::vector<int64_t>& offsets, std::vector<float>& scores) {
  const int64_t span = part.stop - part.first, heads = in.heads, dim = in.dim, group = in.group;
  const int64_t* table = in.tables + part.n * in.max_blocks;
  offsets.resize(span);  // each position's row, in elements from the cache's start (the same in both caches)
  for (int64_t i = 0; i < span; ++i) {
    const int64_t p = part.first + i;
    offsets[i] = table[p / in.block_size] * in.block_stride + (p % in.block_size) * in.row_stride;
  }
  scores.resize(heads * span);
  const auto* keys = reinterpret_cast<const uint16_t*>(in.k);
  const auto* values = reinterpret_cast<const uint16_t*>(in.v);
  const int64_t row_bytes = in.row_stride * 2;
  for (int64_t i = 0; i < std::min(span, ROWS_AHEAD); ++i) ask_for_row(keys + offsets[i], row_bytes);
  for (int64_t h = 0; h < heads; ++h) {
    const auto* q = reinterpret_cast<const uint16_t*>(in.q + part.n * in.q_token_stride + h * in.q_head_stride);
    const int64_t column = (h / group) * dim;
    float* s = scores.data() + h * span;
    for (int64_t i = 0; i < span; ++i) {
      if (h == 0 && i + ROWS_AHEAD < span) ask_for_row(keys + offsets[i + ROWS_AHEAD], row_bytes);
      const uint16_t* k = keys + offsets[i] + column;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 32) {
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
      }
      s[i] = _mm512_reduce_add_ps(sum) * in.scale;
    }
    if (h == 0) {
      for (int64_t i = 0; i < std::min(span, ROWS_AHEAD); ++i) ask_for_row(values + offsets[i], row_bytes);
    }
    exp_from_peak(s, span, peaks[h], totals[h]);
    for (int64_t d = 0; d < dim; d += 64) {
      __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t i = 0; i < span; ++i) {
        if (h == 0 && d == 0 && i + ROWS_AHEAD < span) ask_for_row(values + offsets[i + ROWS_AHEAD], row_bytes);
        const __m512 weight = _mm512_set1_ps(s[i]);
        const uint16_t* v = values + offsets[i] + column + d;
        for (int c = 0; c < 4; ++c) {
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c));
          const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
          sums[c] = _mm512_fmadd_ps(weight, wide, sums[c]);
        }
      }
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + h * dim + d + 16 * c, sums[c]);
    }
  }
}
#endif

// query [sequences, heads, head_dim] with a contiguous head_dim; out [sequences, heads, head_dim]
// contiguous, lse [sequences, heads].
template <typename T>
void decode_kernel(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                   int64_t sliding_window, int64_t skip, torch::Tensor& out, torch::Tensor& lse) {
  const int64_t sequences = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t row_stride = kv_heads * dim;
  const Inputs<T> in{query.data_ptr<T>(),     query.stride(0),         query.stride(1),
                     key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                     heads,                   kv_heads,                heads / kv_heads,
                     dim,                     block_size,              block_tables.size(1),
                     row_stride,              block_size * row_stride, static_cast<float>(scale)};
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  float* lse_ptr = lse.data_ptr<float>();
  // Each sequence's positions first..length-1 (a sliding window or `skip` leaves the earlier ones to
  // others), cut into up to `parts` parts of at least MIN_PART_POSITIONS.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = sequences >= threads ? 1 : (threads + sequences - 1) / sequences;
  std::vector<Part> tasks;
  std::vector<int64_t> first_task(sequences + 1);
  for (int64_t n = 0; n < sequences; ++n) {
    first_task[n] = static_cast<int64_t>(tasks.size());
    const int64_t length = lens[n];
    const int64_t window = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window) : 0;
    const int64_t first = std::max(window, skip);
    const int64_t span = std::max<int64_t>(length - first, 0);
    const int64_t count = std::clamp<int64_t>(span / MIN_PART_POSITIONS, 1, parts);
    const int64_t size = (span + count - 1) / std::max<int64_t>(count, 1);
    for (int64_t j = 0; j < count; ++j) {
      tasks.push_back({n, std::min(first + j * size, length), std::min(first + (j + 1) * size, length)});
    }
  }
  first_task[sequences] = static_cast<int64_t>(tasks.size());
  const int64_t total_tasks = static_cast<int64_t>(tasks.size());
  std::vector<float> peaks(total_tasks * heads), totals(total_tasks * heads), accs(total_tasks * heads * dim);
  at::parallel_for(0, total_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, row(row_stride), scores;
    std::vector<int64_t> offsets;
    for (int64_t t = begin; t < end; ++t) {
      float* peak = peaks.data() + t * heads;
      float* total = totals.data() + t * heads;
      float* acc = accs.data() + t * heads * dim;
      if (tasks[t].stop > tasks[t].first) {
#if defined(TGIS_BF16_HEADS)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (dim % 64 == 0) {
            attend_heads_bf16(in, tasks[t], peak, total, acc, offsets, scores);
            continue;
          }
        }
#endif
        attend_part(in, tasks[t], peak, total, acc, q, row, scores);
      } else {  // nothing to attend: weighs nothing when merged
        std::fill(peak, peak + heads, -std::numeric_limits<float>::infinity());
        std::fill(total, total + heads, 0.0f);
        std::fill(acc, acc + heads * dim, 0.0f);
      }
    }
  });
  // Every (sequence, head): its parts merged by their peaks; no position at all gives a zero output
  // and a log-sum-exp of -inf.
  at::parallel_for(0, sequences * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / heads, h = task % heads;
      float peak = -std::numeric_limits<float>::infinity();
      for (int64_t t = first_task[n]; t < first_task[n + 1]; ++t) peak = std::max(peak, peaks[t * heads + h]);
      T* o = o_ptr + (n * heads + h) * dim;
      if (peak == -std::numeric_limits<float>::infinity()) {
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(0.0f);
        lse_ptr[n * heads + h] = peak;
        continue;
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t t = first_task[n]; t < first_task[n + 1]; ++t) {
        const float part_peak = peaks[t * heads + h];
        if (part_peak == -std::numeric_limits<float>::infinity()) continue;
        const float weight = std::exp(part_peak - peak);
        total += totals[t * heads + h] * weight;
        axpy(weight, accs.data() + (t * heads + h) * dim, merged.data(), dim);
      }
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(merged[d] * inverse);
      lse_ptr[n * heads + h] = peak + std::log(total);
    }
  });
}

// Stores token t's keys [kv_heads, head_dim] (a strided view) as cache row slots[t].
template <typename T>
void store_rows(const torch::Tensor& rows, const int64_t* slots, torch::Tensor& cache) {
  const int64_t tokens = rows.size(1), kv_heads = rows.size(0), dim = rows.size(2);
  const T* src = rows.data_ptr<T>();
  T* dst = cache.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = dst + slots[t] * kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(row + h * dim, src + h * rows.stride(0) + t * rows.stride(1), dim * sizeof(T));
    }
  }
}

template <typename F>
void dispatch_dtype(torch::ScalarType dtype, F&& run) {
  switch (dtype) {
    case torch::kFloat:
      run(float{});
      break;
    case torch::kBFloat16:
      run(c10::BFloat16{});
      break;
    case torch::kHalf:
      run(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype for the CPU paged decode kernel");
  }
}

// query's dim 1 is its heads in both entry points ([sequences, heads, dim] and [1, heads, tokens, dim]).
void check_inputs(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache) {
  TORCH_CHECK(query.device().is_cpu(), "the CPU paged decode kernel needs CPU tensors");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && query.scalar_type() == value_cache.scalar_type(),
              "query and cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key and value caches must both be [blocks, block_size, kv_heads, head_dim]");
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(query.dim() >= 3 && kv_heads > 0 && query.size(1) % kv_heads == 0,
              "query heads must be a multiple of the cache's kv heads");
  TORCH_CHECK(query.size(-1) == key_cache.size(3), "query and cache head sizes differ");
}

// Every table entry names a block of the cache and every length fits in its table (rows padded with
// block 0 are fine): what the kernel reads is then inside the cache.
void check_tables(const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t rows,
                  const torch::Tensor& key_cache) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows && seq_lens.numel() == rows,
              "one block table and one length per query row");
  const int64_t num_blocks = key_cache.size(0), capacity = block_tables.size(1) * key_cache.size(1);
  const int64_t* table = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i) {
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block ", table[i], " is outside the cache");
  }
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= capacity, "length ", lens[i], " does not fit its block table");
  }
}

}  // namespace

std::vector<torch::Tensor> decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                           torch::Tensor value_cache, torch::Tensor block_tables,
                                           torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                           int64_t skip) {
  check_inputs(query, key_cache, value_cache);
  query = query.contiguous();
  block_tables = block_tables.to(torch::kLong).contiguous();
  seq_lens = seq_lens.to(torch::kLong).contiguous();
  check_tables(block_tables, seq_lens, query.size(0), key_cache);
  auto out = torch::empty_like(query);
  auto lse = torch::empty({query.size(0), query.size(1)}, query.options().dtype(torch::kFloat));
  dispatch_dtype(query.scalar_type(), [&](auto tag) {
    decode_kernel<decltype(tag)>(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, skip,
                                 out, lse);
  });
  return {out, lse};
}

// query [1, heads, tokens, head_dim], key and value [1, kv_heads, tokens, head_dim]; block_tables and
// seq_lens have one row per token. Returns the attention output [tokens, heads, head_dim].
torch::Tensor decode_layer(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                           torch::Tensor value_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t sliding_window) {
  check_inputs(query, key_cache, value_cache);
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value dtypes differ");
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.dim() == 4 && value.dim() == 4,
              "decode_layer takes [1, heads, tokens, head_dim]");
  const int64_t tokens = query.size(2), kv_heads = key_cache.size(2), dim = key_cache.size(3);
  TORCH_CHECK(key.size(1) == kv_heads && key.size(2) == tokens && key.size(3) == dim &&
                  value.sizes() == key.sizes() && query.size(3) == dim,
              "key and value must be [1, kv_heads, tokens, head_dim] of the cache's heads and dim");
  TORCH_CHECK(slot_mapping.numel() == tokens, "one slot per token");
  auto q = query[0].transpose(0, 1);  // [tokens, heads, dim], a view
  if (q.stride(2) != 1) q = q.contiguous();
  auto k = key[0], v = value[0];  // [kv_heads, tokens, dim], views
  if (k.stride(2) != 1) k = k.contiguous();
  if (v.stride(2) != 1) v = v.contiguous();
  slot_mapping = slot_mapping.to(torch::kLong).contiguous();
  block_tables = block_tables.to(torch::kLong).contiguous();
  seq_lens = seq_lens.to(torch::kLong).contiguous();
  check_tables(block_tables, seq_lens, tokens, key_cache);
  auto out = torch::empty({tokens, q.size(1), dim}, q.options().memory_format(torch::MemoryFormat::Contiguous));
  auto lse = torch::empty({tokens, q.size(1)}, q.options().dtype(torch::kFloat));  // decode_kernel's; unused here
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t cache_rows = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache_rows, "slot ", slots[t], " is outside the cache");
  }
  dispatch_dtype(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    store_rows<T>(k, slots, key_cache);
    store_rows<T>(v, slots, value_cache);
    decode_kernel<T>(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, 0, out, lse);
  });
  return out;
}

// The same layer as an operator in torch's dispatcher (torch.ops.tgis), so that a compiled step
// (PT2_COMPILE on the CPU) calls it from inductor's C++ wrapper without going back to Python, and
// inductor does not break its graph around attention. The linear products' operators are in
// cpu_products.cpp.
torch::Tensor decode_layer_op(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                              torch::Tensor& key_cache, torch::Tensor& value_cache,
                              const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale, int64_t sliding_window) {
  return decode_layer(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, scale,
                      sliding_window);
}

TORCH_LIBRARY(tgis, m) {
  m.def(
      "decode_layer(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis, CompositeExplicitAutograd, m) {
  m.impl("decode_layer", &decode_layer_op);
}
