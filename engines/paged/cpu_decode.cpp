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
// (GQA groups share theirs). Scores, softmax and the weighted sum run in float32.
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
  load_row(in.q + part.n * heads * dim, q.data(), heads * dim);
  scores.resize(heads * span);
  const int64_t* table = in.tables + part.n * in.max_blocks;
  auto for_each_row = [&](const T* cache, auto&& visit) {
    for (int64_t block = part.first / in.block_size; block * in.block_size < part.stop; ++block) {
      const int64_t start = std::max(block * in.block_size, part.first);
      const int64_t stop = std::min((block + 1) * in.block_size, part.stop);
      const T* base = cache + table[block] * in.block_stride;
      for (int64_t p = start; p < stop; ++p) {
        load_row(base + (p - block * in.block_size) * in.row_stride, row.data(), in.row_stride);
        visit(p - part.first);
      }
    }
  };
  for_each_row(in.k, [&](int64_t i) {
    for (int64_t h = 0; h < heads; ++h) {
      scores[h * span + i] = dot(q.data() + h * dim, row.data() + (h / group) * dim, dim) * in.scale;
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * span;
    const float peak = *std::max_element(s, s + span);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < span; ++i) {
      s[i] = std::exp(s[i] - peak);
      total += s[i];
    }
    peaks[h] = peak;
    totals[h] = total;
  }
  std::fill(acc, acc + heads * dim, 0.0f);
  for_each_row(in.v, [&](int64_t i) {
    for (int64_t h = 0; h < heads; ++h) {
      axpy(scores[h * span + i], row.data() + (h / group) * dim, acc + h * dim, dim);
    }
  });
}

template <typename T>
void decode_kernel(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                   int64_t sliding_window, int64_t skip, torch::Tensor& out, torch::Tensor& lse) {
  const int64_t sequences = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t row_stride = kv_heads * dim;
  const Inputs<T> in{query.data_ptr<T>(),     key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                     block_tables.data_ptr<int64_t>(), heads,         kv_heads,
                     heads / kv_heads,        dim,                     block_size,
                     block_tables.size(1),    row_stride,              block_size * row_stride,
                     static_cast<float>(scale)};
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  float* lse_ptr = lse.data_ptr<float>();
  // Each sequence's positions first..length-1 (a sliding window or `skip` leaves the earlier ones to
  // others), cut into up to `parts` parts of at least MIN_PART_POSITIONS.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = sequences >= threads ? 1 : 2 * ((threads + sequences - 1) / sequences);
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
    for (int64_t t = begin; t < end; ++t) {
      float* peak = peaks.data() + t * heads;
      float* total = totals.data() + t * heads;
      float* acc = accs.data() + t * heads * dim;
      if (tasks[t].stop > tasks[t].first) {
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
