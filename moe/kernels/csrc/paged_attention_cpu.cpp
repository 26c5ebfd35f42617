// Paged attention on the CPU that reads K/V where they lie in the paged cache.
//
// The batched torch path (moe/layers/batched_attention.py) gathers every request's K/V blocks into
// a padded scratch buffer and runs scaled_dot_product_attention on it: the context is read from
// the cache, written to the scratch and read again by SDPA. For decode rows that traffic is the
// whole cost. This kernel reads the cache in place, as vLLM's CPU paged attention does
// (csrc/cpu/attention.cpp, "paged attention v1": one pass over the block table per request), with
// a two-pass softmax: per request it streams each cached block's keys once for all heads (a
// block's [block_size, num_kv_heads, head_dim] rows are adjacent), keeps the scores in a
// per-thread buffer, takes the softmax, then streams the values once.
//
// Layout (the engine's, moe/layers/attention.py):
//   query, out    [num_tokens, num_heads, head_dim]            (contiguous, same dtype as the cache)
//   kv_cache      [2, num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)
//   block_table   [num_reqs, max_blocks_per_req] int32
//   seq_lens      [num_reqs] int32     context length including this step's query rows
//   query_start_loc [num_reqs + 1] int32
//   req_ids       [n] int64            the requests to compute (others are left untouched)
// Query row i of request r sits at position seq_lens[r] - q_len + i and attends to key positions
// 0 .. that position (causal). Query head h reads KV head h / (num_heads / num_kv_heads).
//
// Precision: float32 and bfloat16 accumulate in float32 with exp from a degree-6 polynomial
// (relative error below 2e-7, under float32's half-ulp of 6e-8 times a few); float64 accumulates in
// double with std::exp (the reference tests compare in float64).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline double to_float(double x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename acc_t>
struct Exp;

template <>
struct Exp<double> {
  static inline double eval(double x) { return std::exp(x); }
};

// exp(x) for x <= 0 (scores minus their max), in float: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by
// its Taylor polynomial to degree 6 (truncation < 3e-8 relative), then times 2^k. The scalar
// Exp<float> and the 16-lane loop in exp_shifted_sum share these constants.
constexpr float kExpMin = -87.0f;  // exp(-87) ~ 1.6e-38, still a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in float
constexpr float kLn2Lo = 1.42860682030941723212e-6f;
constexpr float kExpTaylor[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f,
                                 0.5f,           1.0f,          1.0f};  // Horner, highest first

template <>
struct Exp<float> {
  // 2^k by building the exponent bits
  static inline float eval(float x) {
    x = x < kExpMin ? kExpMin : x;
    const float k = std::floor(x * kLog2e + 0.5f);
    const float r = x - k * kLn2Hi - k * kLn2Lo;
    float p = kExpTaylor[0];
    for (int i = 1; i < 7; ++i) p = p * r + kExpTaylor[i];
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
  }
};

// Vector helpers. With AVX-512 (compiled with -march=native on a machine that has it) the dot
// products reduce through a shuffle tree and exp runs 16 lanes at a time; without it the plain loops
// below run (same results up to summation order, slower; `vectorized()` tells the caller).
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// sum_d q[d] * k[d] (q already in the accumulation type)
template <typename scalar_t, typename acc_t>
inline acc_t dot(const acc_t* q, const scalar_t* k, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (n % 16 == 0) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t d = 0; d < n; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), sum);
      return _mm512_reduce_add_ps(sum);
    }
  }
#endif
  acc_t s = 0;
  for (int64_t d = 0; d < n; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc[d] += p * v[d]
template <typename scalar_t, typename acc_t>
inline void axpy(acc_t* acc, acc_t p, const scalar_t* v, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (n % 16 == 0) {
      const __m512 pv = _mm512_set1_ps(p);
      for (int64_t d = 0; d < n; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
      return;
    }
  }
#endif
  for (int64_t d = 0; d < n; ++d) acc[d] += p * to_float(v[d]);
}

#if defined(__AVX512F__)
// out[0 .. 16 * NV) = sum_{t < n} p[t] * v_t, v_t = rows[t] + offset: the accumulators stay in
// registers (two sets, for alternate positions, so consecutive FMAs do not wait on each other)
template <int NV, typename scalar_t>
inline void weighted_sum(float* out, const float* p, const scalar_t* const* rows, int64_t offset,
                         int64_t n) {
  __m512 a[NV], b[NV];
  for (int j = 0; j < NV; ++j) a[j] = b[j] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    const scalar_t* v0 = rows[t] + offset;
    const scalar_t* v1 = rows[t + 1] + offset;
    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
    for (int j = 0; j < NV; ++j) {
      a[j] = _mm512_fmadd_ps(p0, load16(v0 + 16 * j), a[j]);
      b[j] = _mm512_fmadd_ps(p1, load16(v1 + 16 * j), b[j]);
    }
  }
  if (t < n) {
    const scalar_t* v0 = rows[t] + offset;
    const __m512 p0 = _mm512_set1_ps(p[t]);
    for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(p0, load16(v0 + 16 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_add_ps(a[j], b[j]));
}
#endif

// acc[0 .. head_dim) = sum_{t < n} p[t] * v_t, v_t = rows[t] + offset
template <typename scalar_t, typename acc_t>
inline void weighted_rows(acc_t* acc, const acc_t* p, const scalar_t* const* rows, int64_t offset,
                          int64_t n, int64_t head_dim) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    switch (head_dim) {
      case 16: return weighted_sum<1>(acc, p, rows, offset, n);
      case 32: return weighted_sum<2>(acc, p, rows, offset, n);
      case 64: return weighted_sum<4>(acc, p, rows, offset, n);
      case 128: return weighted_sum<8>(acc, p, rows, offset, n);
      default: break;
    }
  }
#endif
  std::fill(acc, acc + head_dim, acc_t(0));
  for (int64_t t = 0; t < n; ++t) axpy(acc, p[t], rows[t] + offset, head_dim);
}

// x[t] = exp(x[t] - m) for t < n; returns their sum
template <typename acc_t>
inline acc_t exp_shifted_sum(acc_t* x, acc_t m, int64_t n) {
  int64_t t = 0;
  acc_t sum = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    // Exp<float>'s algorithm and constants, 16 lanes: 2^k by scalef
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
      __m512 v = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(x + t), vm), _mm512_set1_ps(kExpMin));
      const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), v);
      v = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), v);
      __m512 p = _mm512_set1_ps(kExpTaylor[0]);
      for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(kExpTaylor[i]));
      p = _mm512_scalef_ps(p, k);
      _mm512_storeu_ps(x + t, p);
      vsum = _mm512_add_ps(vsum, p);
    }
    sum = _mm512_reduce_add_ps(vsum);
  }
#endif
  for (; t < n; ++t) {
    const acc_t p = Exp<acc_t>::eval(x[t] - m);
    x[t] = p;
    sum += p;
  }
  return sum;
}

#if defined(__AVX512F__)
// Keys of positions [0, seq_len) transposed to kt[e * seq_pad + t] (float; e = kv_head * head_dim +
// d indexes a slot's [num_kv_heads, head_dim] row), positions seq_len .. seq_pad - 1 zero: then 16
// consecutive positions' scores are one vector FMA per head_dim element, with no horizontal sums.
template <typename scalar_t>
void transpose_keys(float* kt, const scalar_t* const* slots, int64_t seq_len, int64_t seq_pad,
                    int64_t width) {
  for (int64_t t0 = 0; t0 < seq_pad; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, seq_len - t0);
    for (int64_t e = 0; e < width; ++e) {
      float* dst = kt + e * seq_pad + t0;
      for (int64_t j = 0; j < m; ++j) dst[j] = to_float(slots[t0 + j][e]);
      for (int64_t j = m; j < 16; ++j) dst[j] = 0.0f;
    }
  }
}

// Keeps the max of scores[t0 .. t0 + 16) that lie below n in vmax.
inline __m512 max_of_tile(__m512 vmax, __m512 tile, int64_t t0, int64_t n) {
  const int64_t valid = n - t0;
  if (valid >= 16) return _mm512_max_ps(vmax, tile);
  return _mm512_mask_max_ps(vmax, static_cast<__mmask16>((1u << valid) - 1), vmax, tile);
}

// scores[t] = q . k_t for t < n rounded up to 16, from one KV head's transposed keys kt_g
// ([head_dim, seq_pad], zero past the keys); returns max_{t < n} scores[t]. Every FMA chain
// has independent neighbours (four 16-position tiles at a time, then the last tiles one at a
// time with head_dim split four ways): a single chain waits on each FMA's latency, 4x slower.
inline float scores_transposed(float* scores, const float* q, const float* kt_g, int64_t seq_pad,
                               int64_t n, int64_t head_dim) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t0 = 0;
  for (; t0 + 64 <= n; t0 += 64) {
    __m512 a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; ++d) {
      const __m512 qd = _mm512_set1_ps(q[d]);
      const float* k = kt_g + d * seq_pad + t0;
      for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + 16 * j), a[j]);
    }
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_ps(scores + t0 + 16 * j, a[j]);
      vmax = _mm512_max_ps(vmax, a[j]);
    }
  }
  for (; t0 < n; t0 += 16) {  // head_dim is a multiple of 16, so of 4
    __m512 a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 4) {
      for (int j = 0; j < 4; ++j) {
        a[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + j]),
                               _mm512_loadu_ps(kt_g + (d + j) * seq_pad + t0), a[j]);
      }
    }
    const __m512 tile = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
    _mm512_storeu_ps(scores + t0, tile);
    vmax = max_of_tile(vmax, tile, t0, n);
  }
  return _mm512_reduce_max_ps(vmax);
}
#endif

// Query rows per request from which the keys are transposed once for all rows (prefill chunks);
// fewer rows (decode) take one dot product per key and head.
constexpr int64_t kTransposeMinQueryRows = 4;

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
void paged_attention_impl(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const at::Tensor& req_ids, double scale_d) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group_size = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const int64_t num_reqs_work = req_ids.size(0);
  const acc_t scale = static_cast<acc_t>(scale_d);

  const scalar_t* q_base = query.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = k_base + num_blocks * block_size * num_kv_heads * head_dim;
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* reqs = req_ids.data_ptr<int64_t>();
  const int64_t token_stride = num_kv_heads * head_dim;  // one cache slot

  // One work item per request: its tokens' K (then V) rows for all KV heads are adjacent in the
  // cache ([block_size, num_kv_heads, head_dim] per block), so each block streams from memory
  // once, in order, for all heads.
  at::parallel_for(0, num_reqs_work, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q(num_heads * head_dim), acc(num_heads * head_dim);
    std::vector<acc_t> scores, row_max(num_heads), row_sum(num_heads);
    std::vector<const scalar_t*> slots;
    std::vector<float> kt;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t r = reqs[work];
      const int64_t seq_len = lens[r];
      const int64_t q_start = qsl[r];
      const int64_t q_len = qsl[r + 1] - q_start;
      if (q_len <= 0) continue;
      // the cache slot ([num_kv_heads, head_dim] of K) of every context position
      slots.resize(seq_len);
      for (int64_t t = 0; t < seq_len; ++t) {
        const int64_t block = bt[r * max_blocks + t / block_size];
        slots[t] = k_base + (block * block_size + t % block_size) * token_stride;
      }
      const int64_t v_offset = v_base - k_base;
      const int64_t seq_pad = (seq_len + 15) / 16 * 16;  // the scores' row stride
      scores.resize(num_heads * seq_pad);
      bool transposed = false;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<acc_t, float>) {
        if (q_len >= kTransposeMinQueryRows && head_dim % 16 == 0) {
          kt.resize(token_stride * seq_pad);
          transpose_keys(kt.data(), slots.data(), seq_len, seq_pad, token_stride);
          transposed = true;
        }
      }
#endif
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t n = seq_len - q_len + i + 1;  // keys this row sees
        const scalar_t* q_row = q_base + (q_start + i) * num_heads * head_dim;
        acc_t* q_scaled = q.data();
#pragma omp simd
        for (int64_t e = 0; e < num_heads * head_dim; ++e) q_scaled[e] = to_float(q_row[e]) * scale;
        for (int64_t h = 0; h < num_heads; ++h)
          row_max[h] = -std::numeric_limits<acc_t>::infinity();
        // pass 1: scores[h][t] = q_h . k_t (query head h reads KV head h / group_size)
        if (transposed) {
#if defined(__AVX512F__)
          if constexpr (std::is_same_v<acc_t, float>) {
            for (int64_t h = 0; h < num_heads; ++h) {
              row_max[h] = scores_transposed(scores.data() + h * seq_pad, q.data() + h * head_dim,
                                             kt.data() + (h / group_size) * head_dim * seq_pad,
                                             seq_pad, n, head_dim);
            }
          }
#endif
        } else {
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* k_token = slots[t];
            for (int64_t h = 0; h < num_heads; ++h) {
              const scalar_t* k = k_token + (h / group_size) * head_dim;
              const acc_t s = dot(q.data() + h * head_dim, k, head_dim);
              scores[h * seq_pad + t] = s;
              row_max[h] = s > row_max[h] ? s : row_max[h];
            }
          }
        }
        // pass 2: softmax numerators and their sums
        for (int64_t h = 0; h < num_heads; ++h) {
          row_sum[h] = exp_shifted_sum(scores.data() + h * seq_pad, row_max[h], n);
        }
        // pass 3: acc_h = sum_t p[h][t] v_t, one head at a time (its sums stay in registers; the
        // request's values are read from the cache once per head, from L2 after the first)
        for (int64_t h = 0; h < num_heads; ++h) {
          weighted_rows(acc.data() + h * head_dim, scores.data() + h * seq_pad, slots.data(),
                        v_offset + (h / group_size) * head_dim, n, head_dim);
        }
        scalar_t* o_row = out_base + (q_start + i) * num_heads * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
          const acc_t inv = acc_t(1) / row_sum[h];
          for (int64_t d = 0; d < head_dim; ++d)
            o_row[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
        }
      }
    }
  });
}

void paged_attention(
    at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const at::Tensor& req_ids, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache: [2, NB, BS, KVH, D]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "head_dim of query and kv_cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "num_heads % num_kv_heads != 0");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous(),
              "query, out and kv_cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must have one dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_table, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(req_ids.scalar_type() == at::kLong, "req_ids must be int64");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous() && req_ids.is_contiguous(),
              "metadata tensors must be contiguous");
  switch (query.scalar_type()) {
    case at::kFloat:
      paged_attention_impl<float>(out, query, kv_cache, block_table, seq_lens, query_start_loc,
                                  req_ids, scale);
      break;
    case at::kDouble:
      paged_attention_impl<double>(out, query, kv_cache, block_table, seq_lens, query_start_loc,
                                   req_ids, scale);
      break;
    case at::kBFloat16:
      paged_attention_impl<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens,
                                          query_start_loc, req_ids, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

bool vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "Whether the kernels were built with AVX-512 vector paths");
  // the GIL is released while the kernel runs, as torch's own ops do: under DBO the other ubatch's
  // thread and the communication threads keep running Python meanwhile
  m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>(),
        "Paged attention over the cache in place (CPU): writes out rows of req_ids' requests");
}
