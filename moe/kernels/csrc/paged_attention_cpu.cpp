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
// Layout (the engine's, moe/layers/attention.py and moe/layers/mla.py):
//   query         [num_tokens, num_heads, head_dim]       (contiguous, same dtype as the caches)
//   out           [num_tokens, num_heads, v_head_dim]     (contiguous)
//   k_cache       [num_blocks, block_size, num_kv_heads, head_dim]     (any strides but the last)
//   v_cache       [num_blocks, block_size, num_kv_heads, v_head_dim]   (any strides but the last)
//   block_table   [num_reqs, max_blocks_per_req] int32
//   seq_lens      [num_reqs] int32     context length including this step's query rows
//   query_start_loc [num_reqs + 1] int32
//   req_ids       [n] int64            the requests to compute (others are left untouched)
// Query row i of request r sits at position seq_lens[r] - q_len + i and attends to key positions
// 0 .. that position (causal). Query head h reads KV head h / (num_heads / num_kv_heads).
// The caches are strided views, so one kernel serves two layouts: GQA's [2, num_blocks, ...]
// cache (k_cache = kv_cache[0], v_cache = kv_cache[1]) and MLA's latent rows in the multi-query
// form of its absorbed attention (FlashMLA's): one KV head whose keys are the whole
// [kv_c, k_pe] row and whose values are the same row's first kv_lora_rank elements.
//
// Vectors: vec_common.h (ATen's at::vec::Vectorized<float>, kLanes = 8 floats with AVX2, 16 with
// AVX-512; one build per ISA). Without torch's ISA defines at::vec falls back to plain loops over
// an 8-lane array: correct, not fast (the Python side does not build that variant).
//
// Precision: float32 and bfloat16 accumulate in float32 with exp from a degree-6 polynomial
// (relative error below 2.4e-7 on [-87, 0], about two float32 ulps, mean 3e-8); float64
// accumulates in double with std::exp in plain loops (the reference tests compare in float64).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_common.h"

namespace moe_dbo_cpu {
namespace {

// sum_d q[d] * k[d] (q already in the accumulation type). Two sums: the FMAs of one dot product
// alternate between them, so they do not all wait on each other.
template <typename scalar_t, typename acc_t>
inline acc_t dot(const acc_t* q, const scalar_t* k, int64_t n) {
  int64_t d = 0;
  acc_t s = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    Vec a0(0.0f), a1(0.0f);
    for (; d + 2 * kLanes <= n; d += 2 * kLanes) {
      a0 = at::vec::fmadd(Vec::loadu(q + d), load_float(k + d), a0);
      a1 = at::vec::fmadd(Vec::loadu(q + d + kLanes), load_float(k + d + kLanes), a1);
    }
    if (d + kLanes <= n) {
      a0 = at::vec::fmadd(Vec::loadu(q + d), load_float(k + d), a0);
      d += kLanes;
    }
    s = reduce_add(a0 + a1);
  }
  for (; d < n; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// out[0 .. kLanes * NV) = sum_{t < n} p[t] * v_t, v_t = rows[t] + offset: the NV * NSETS sums stay
// in registers; NSETS sets take consecutive positions in turn, so consecutive FMAs on one output
// vector do not wait on each other where NV alone is too few.
template <int NV, int NSETS, typename scalar_t>
inline void weighted_sum(float* out, const float* p, const scalar_t* const* rows, int64_t offset,
                         int64_t n) {
  Vec a[NSETS][NV];
  for (int s = 0; s < NSETS; ++s)
    for (int j = 0; j < NV; ++j) a[s][j] = Vec(0.0f);
  int64_t t = 0;
  for (; t + NSETS <= n; t += NSETS) {
    for (int s = 0; s < NSETS; ++s) {
      const scalar_t* v = rows[t + s] + offset;
      const Vec ps(p[t + s]);
      for (int j = 0; j < NV; ++j)
        a[s][j] = at::vec::fmadd(ps, load_float(v + kLanes * j), a[s][j]);
    }
  }
  for (; t < n; ++t) {
    const scalar_t* v = rows[t] + offset;
    const Vec ps(p[t]);
    for (int j = 0; j < NV; ++j) a[0][j] = at::vec::fmadd(ps, load_float(v + kLanes * j), a[0][j]);
  }
  for (int j = 0; j < NV; ++j) {
    Vec sum = a[0][j];
    for (int s = 1; s < NSETS; ++s) sum = sum + a[s][j];
    sum.store(out + kLanes * j);
  }
}

// weighted_sum over num_vectors vectors of each row, in column chunks of NV vectors (then NV / 2,
// ...): two sets where 2 NV sums fit the budget, one set for the widest chunks (enough sums alone)
template <int NV, typename scalar_t>
inline void weighted_chunks(float* out, const float* p, const scalar_t* const* rows,
                            int64_t offset, int64_t n, int64_t num_vectors) {
  constexpr int kSets = 2 * NV <= kAccVectors ? 2 : 1;
  for (; num_vectors >= NV; num_vectors -= NV, out += NV * kLanes, offset += NV * kLanes)
    weighted_sum<NV, kSets>(out, p, rows, offset, n);
  if constexpr (NV > 1) {
    if (num_vectors > 0) weighted_chunks<NV / 2>(out, p, rows, offset, n, num_vectors);
  }
}

// acc[0 .. head_dim) = sum_{t < n} p[t] * v_t, v_t = rows[t] + offset
template <typename scalar_t, typename acc_t>
inline void weighted_rows(acc_t* acc, const acc_t* p, const scalar_t* const* rows, int64_t offset,
                          int64_t n, int64_t head_dim) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (head_dim % kLanes == 0)
      return weighted_chunks<kAccVectors>(acc, p, rows, offset, n, head_dim / kLanes);
  }
  std::fill(acc, acc + head_dim, acc_t(0));
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* v = rows[t] + offset;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[t] * to_float(v[d]);
  }
}

// x[t] = exp(x[t] - m) for t < n; returns their sum (double: std::exp in a plain loop). x's row
// is padded to a multiple of kLanes, so the last partial vector is loaded and stored whole (the
// lanes past n are never read back) and only its first n - t lanes are summed.
template <typename acc_t>
inline acc_t exp_shifted_sum(acc_t* x, acc_t m, int64_t n) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const Vec vm(m);
    Vec vsum(0.0f);
    int64_t t = 0;
    for (; t + kLanes <= n; t += kLanes) {
      const Vec p = exp_vec(Vec::loadu(x + t) - vm);
      p.store(x + t);
      vsum = vsum + p;
    }
    if (t < n) {
      const Vec p = exp_vec(Vec::loadu(x + t) - vm);
      p.store(x + t);
      vsum = vsum + Vec::set(Vec(0.0f), p, n - t);
    }
    return reduce_add(vsum);
  }
  acc_t sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    const acc_t p = std::exp(x[t] - m);
    x[t] = p;
    sum += p;
  }
  return sum;
}

// Keys of positions [0, seq_len) transposed to kt[(g * head_dim + d) * seq_pad + t] (float; KV
// head g's element d sits at slots[t][g * head_stride + d]), positions seq_len .. seq_pad - 1
// zero: then kLanes consecutive positions' scores are one vector FMA per head_dim element, with no
// horizontal sums.
template <typename scalar_t>
void transpose_keys(float* kt, const scalar_t* const* slots, int64_t seq_len, int64_t seq_pad,
                    int64_t num_kv_heads, int64_t head_dim, int64_t head_stride) {
  for (int64_t t0 = 0; t0 < seq_pad; t0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, seq_len - t0);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      for (int64_t d = 0; d < head_dim; ++d) {
        const int64_t e = g * head_stride + d;
        float* dst = kt + (g * head_dim + d) * seq_pad + t0;
        for (int64_t j = 0; j < m; ++j) dst[j] = to_float(slots[t0 + j][e]);
        for (int64_t j = m; j < kLanes; ++j) dst[j] = 0.0f;
      }
    }
  }
}

// Keeps the max of scores[t0 .. t0 + kLanes) that lie below n in vmax (the lanes past n hold
// scores of keys this row must not see, or of the zero padding).
inline Vec max_of_tile(const Vec& vmax, const Vec& tile, int64_t t0, int64_t n) {
  const int64_t valid = n - t0;
  if (valid >= kLanes) return at::vec::maximum(vmax, tile);
  return Vec::set(vmax, at::vec::maximum(vmax, tile), valid);
}

// Score tiles of kLanes positions that score_tiles computes together at most: one sum each, and
// enough of them to hide the FMA latency (see kAccVectors).
constexpr int kScoreTiles = kAccVectors / 2;

// scores[t0 + t] = q . k_{t0 + t} for t < T * kLanes, from one KV head's transposed keys kt_g
// ([head_dim, seq_pad]); returns vmax updated with the scores below n. The T * S sums are
// independent chains: S splits head_dim, so that fewer tiles (T < kScoreTiles) keep as many FMAs
// in flight as T = kScoreTiles does.
template <int T, int S>
inline Vec score_tiles(float* scores, const float* q, const float* kt_g, int64_t seq_pad,
                       int64_t t0, int64_t n, int64_t head_dim, Vec vmax) {
  Vec a[S][T];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < T; ++j) a[s][j] = Vec(0.0f);
  int64_t d = 0;
  for (; d + S <= head_dim; d += S) {
    for (int s = 0; s < S; ++s) {
      const Vec qd(q[d + s]);
      const float* k = kt_g + (d + s) * seq_pad + t0;
      for (int j = 0; j < T; ++j) a[s][j] = at::vec::fmadd(qd, Vec::loadu(k + kLanes * j), a[s][j]);
    }
  }
  for (; d < head_dim; ++d) {
    const Vec qd(q[d]);
    const float* k = kt_g + d * seq_pad + t0;
    for (int j = 0; j < T; ++j) a[0][j] = at::vec::fmadd(qd, Vec::loadu(k + kLanes * j), a[0][j]);
  }
  for (int j = 0; j < T; ++j) {
    Vec tile = a[0][j];
    for (int s = 1; s < S; ++s) tile = tile + a[s][j];
    tile.store(scores + t0 + kLanes * j);
    vmax = max_of_tile(vmax, tile, t0 + kLanes * j, n);
  }
  return vmax;
}

// score_tiles over num_tiles tiles from t0 on, T at a time (then T / 2, ...)
template <int T>
inline Vec score_tile_groups(float* scores, const float* q, const float* kt_g, int64_t seq_pad,
                             int64_t t0, int64_t num_tiles, int64_t n, int64_t head_dim, Vec vmax) {
  for (; num_tiles >= T; num_tiles -= T, t0 += T * kLanes)
    vmax = score_tiles<T, kScoreTiles / T>(scores, q, kt_g, seq_pad, t0, n, head_dim, vmax);
  if constexpr (T > 1) {
    if (num_tiles > 0)
      vmax = score_tile_groups<T / 2>(scores, q, kt_g, seq_pad, t0, num_tiles, n, head_dim, vmax);
  }
  return vmax;
}

// scores[t] = q . k_t for t < n rounded up to kLanes, from one KV head's transposed keys kt_g
// ([head_dim, seq_pad], zero past the keys); returns max_{t < n} scores[t]. Every FMA chain has
// independent neighbours (kScoreTiles tiles at a time, then fewer tiles with head_dim split): a
// single chain waits on each FMA's latency, 4x slower.
inline float scores_transposed(float* scores, const float* q, const float* kt_g, int64_t seq_pad,
                               int64_t n, int64_t head_dim) {
  const Vec vmax = score_tile_groups<kScoreTiles>(scores, q, kt_g, seq_pad, 0,
                                                  (n + kLanes - 1) / kLanes, n, head_dim,
                                                  Vec(-std::numeric_limits<float>::infinity()));
  return reduce_max(vmax);
}

// Query rows of a prefill chunk computed together: each key (pass 1) and value (pass 3) vector
// loaded once serves kRowTile rows, so a load feeds kRowTile FMAs instead of one.
constexpr int kRowTile = 4;

// scores_r[t] = q_r . k_t for r < R and t in [t0, t0 + T kLanes), from one KV head's transposed
// keys kt_g ([head_dim, seq_pad]): R x T sums in registers, each key vector loaded once.
template <int R, int T>
inline void score_rows_tile(float* const* scores, const float* const* q, const float* kt_g,
                            int64_t seq_pad, int64_t t0, int64_t head_dim) {
  Vec a[R][T];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < T; ++j) a[r][j] = Vec(0.0f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float* k = kt_g + d * seq_pad + t0;
    Vec kv[T];
    for (int j = 0; j < T; ++j) kv[j] = Vec::loadu(k + kLanes * j);
    for (int r = 0; r < R; ++r) {
      const Vec qd(q[r][d]);
      for (int j = 0; j < T; ++j) a[r][j] = at::vec::fmadd(qd, kv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < T; ++j) a[r][j].store(scores[r] + t0 + kLanes * j);
}

// score_rows_tile over the key tiles [0, num_tiles), T at a time (then T / 2, ...)
template <int R, int T>
inline void score_rows(float* const* scores, const float* const* q, const float* kt_g,
                       int64_t seq_pad, int64_t t0, int64_t num_tiles, int64_t head_dim) {
  for (; num_tiles >= T; num_tiles -= T, t0 += T * kLanes)
    score_rows_tile<R, T>(scores, q, kt_g, seq_pad, t0, head_dim);
  if constexpr (T > 1) {
    if (num_tiles > 0) score_rows<R, T / 2>(scores, q, kt_g, seq_pad, t0, num_tiles, head_dim);
  }
}

// out_r[0 .. NV kLanes) = sum_{t < n} p_r[t] v_t (v_t = rows[t] + offset) for r < R: each value
// vector loaded once for the R rows; rows whose context ends before n hold p_r[t] = 0 there.
template <int R, int NV, typename scalar_t>
inline void weighted_rows_tile(float* const* out, const float* const* p,
                               const scalar_t* const* rows, int64_t offset, int64_t n) {
  Vec a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = Vec(0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* v = rows[t] + offset;
    Vec vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_float(v + kLanes * j);
    for (int r = 0; r < R; ++r) {
      const Vec pr(p[r][t]);
      for (int j = 0; j < NV; ++j) a[r][j] = at::vec::fmadd(pr, vv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j].store(out[r] + kLanes * j);
}

// Query rows per request from which the keys are transposed once for all rows (prefill chunks);
// fewer rows (decode) take one dot product per key and head.
constexpr int64_t kTransposeMinQueryRows = 4;

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// The kernel's inputs as raw pointers and sizes (see the layout at the top).
template <typename scalar_t>
struct PagedAttentionArgs {
  const scalar_t* q_base;
  scalar_t* out_base;
  const scalar_t* k_base;
  const scalar_t* v_base;
  // element strides of the caches' first three dims (block, slot in block, KV head)
  int64_t k_block_stride, k_slot_stride, k_head_stride;
  int64_t v_block_stride, v_slot_stride, v_head_stride;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t num_heads, head_dim, v_head_dim, block_size, num_kv_heads, group_size, max_blocks;
  acc_type_t<scalar_t> scale;
};

// One thread's buffers, reused across its requests.
template <typename scalar_t>
struct Workspace {
  using acc_t = acc_type_t<scalar_t>;
  std::vector<acc_t> q, acc, scores, row_max, row_sum;
  std::vector<const scalar_t*> slots;   // the K slot ([num_kv_heads, head_dim]) of each position
  std::vector<const scalar_t*> vslots;  // the V slot ([num_kv_heads, v_head_dim]) of each position
  std::vector<float> kt;               // transposed keys (prefill chunks)
  int64_t seq_pad = 0;                 // the scores' row stride: seq_len rounded up to kLanes
  bool transposed = false;
};

// pass 1 for one query row: scores[h][t] = q_h . k_t for t < n (query head h reads KV head
// h / group_size); row_max[h] their max
template <typename scalar_t>
void row_scores(const PagedAttentionArgs<scalar_t>& a, Workspace<scalar_t>& w, int64_t n) {
  using acc_t = acc_type_t<scalar_t>;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (w.transposed) {
      for (int64_t h = 0; h < a.num_heads; ++h) {
        w.row_max[h] = scores_transposed(
            w.scores.data() + h * w.seq_pad, w.q.data() + h * a.head_dim,
            w.kt.data() + (h / a.group_size) * a.head_dim * w.seq_pad, w.seq_pad, n, a.head_dim);
      }
      return;
    }
  }
  for (int64_t h = 0; h < a.num_heads; ++h) w.row_max[h] = -std::numeric_limits<acc_t>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* k_token = w.slots[t];
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const acc_t s = dot(w.q.data() + h * a.head_dim,
                          k_token + (h / a.group_size) * a.k_head_stride, a.head_dim);
      w.scores[h * w.seq_pad + t] = s;
      w.row_max[h] = s > w.row_max[h] ? s : w.row_max[h];
    }
  }
}

// Query row i of the request whose context is in w: scaled query in, attention row out.
template <typename scalar_t>
void attend_row(const PagedAttentionArgs<scalar_t>& a, Workspace<scalar_t>& w, int64_t token,
                int64_t n) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t width = a.num_heads * a.head_dim;
  const int64_t v_width = a.num_heads * a.v_head_dim;
  const scalar_t* q_row = a.q_base + token * width;
  acc_t* q_scaled = w.q.data();
#pragma omp simd
  for (int64_t e = 0; e < width; ++e) q_scaled[e] = to_float(q_row[e]) * a.scale;
  row_scores(a, w, n);
  // pass 2: softmax numerators and their sums
  for (int64_t h = 0; h < a.num_heads; ++h)
    w.row_sum[h] = exp_shifted_sum(w.scores.data() + h * w.seq_pad, w.row_max[h], n);
  // pass 3: acc_h = sum_t p[h][t] v_t, one head at a time (its sums stay in registers; the
  // request's values are read from the cache once per head, from L2 after the first)
  for (int64_t h = 0; h < a.num_heads; ++h) {
    weighted_rows(w.acc.data() + h * a.v_head_dim, w.scores.data() + h * w.seq_pad,
                  w.vslots.data(), (h / a.group_size) * a.v_head_stride, n, a.v_head_dim);
  }
  scalar_t* o_row = a.out_base + token * v_width;
  for (int64_t h = 0; h < a.num_heads; ++h) {
    const acc_t inv = acc_t(1) / w.row_sum[h];
    for (int64_t d = 0; d < a.v_head_dim; ++d)
      o_row[h * a.v_head_dim + d] = static_cast<scalar_t>(w.acc[h * a.v_head_dim + d] * inv);
  }
}

// kRowTile consecutive query rows of a prefill chunk (keys transposed in w), the first at token
// with n keys visible, the next with n + 1, ...: attend_row's three passes, kRowTile rows at once.
// Pass 1 scores every row over the last row's n + kRowTile - 1 keys; the scores past a row's own
// context are left out of its max and zeroed after its exp, so they weigh nothing in pass 3.
template <typename scalar_t>
void attend_rows(const PagedAttentionArgs<scalar_t>& a, Workspace<scalar_t>& w, int64_t token,
                 int64_t n) {
  constexpr int R = kRowTile;
  const int64_t width = a.num_heads * a.head_dim;
  const int64_t v_width = a.num_heads * a.v_head_dim;
  const int64_t n_last = n + R - 1;
  const int64_t num_tiles = (n_last + kLanes - 1) / kLanes;
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t* q_row = a.q_base + (token + r) * width;
    for (int64_t e = 0; e < width; ++e) w.q[r * width + e] = to_float(q_row[e]) * a.scale;
  }
  constexpr int kTiles = std::max(1, kAccVectors / R);
  constexpr int kValueVecs = std::max(1, kAccVectors / R);
  const bool value_tiles = a.v_head_dim % kLanes == 0;
  for (int64_t h = 0; h < a.num_heads; ++h) {
    float* scores[R];
    const float* q[R];
    float* acc[R];
    for (int r = 0; r < R; ++r) {
      scores[r] = w.scores.data() + (r * a.num_heads + h) * w.seq_pad;
      q[r] = w.q.data() + r * width + h * a.head_dim;
      acc[r] = w.acc.data() + r * v_width + h * a.v_head_dim;
    }
    const float* kt_g = w.kt.data() + (h / a.group_size) * a.head_dim * w.seq_pad;
    score_rows<R, kTiles>(scores, q, kt_g, w.seq_pad, 0, num_tiles, a.head_dim);
    float row_sum[R];
    for (int r = 0; r < R; ++r) {
      const int64_t n_r = n + r;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n_r; ++t) m = std::max(m, scores[r][t]);
      row_sum[r] = exp_shifted_sum(scores[r], m, n_r);
      std::fill(scores[r] + n_r, scores[r] + n_last, 0.0f);
    }
    const int64_t offset = (h / a.group_size) * a.v_head_stride;
    if (value_tiles) {
      const float* p[R];
      float* out[R];
      for (int r = 0; r < R; ++r) p[r] = scores[r];
      for (int64_t d = 0; d < a.v_head_dim;) {
        for (int r = 0; r < R; ++r) out[r] = acc[r] + d;
        if (d + kValueVecs * kLanes <= a.v_head_dim) {
          weighted_rows_tile<R, kValueVecs>(out, p, w.vslots.data(), offset + d, n_last);
          d += kValueVecs * kLanes;
        } else {
          weighted_rows_tile<R, 1>(out, p, w.vslots.data(), offset + d, n_last);
          d += kLanes;
        }
      }
    } else {
      for (int r = 0; r < R; ++r)
        weighted_rows(acc[r], scores[r], w.vslots.data(), offset, n + r, a.v_head_dim);
    }
    for (int r = 0; r < R; ++r) {
      scalar_t* o = a.out_base + (token + r) * v_width + h * a.v_head_dim;
      const float inv = 1.0f / row_sum[r];
      for (int64_t d = 0; d < a.v_head_dim; ++d) o[d] = static_cast<scalar_t>(acc[r][d] * inv);
    }
  }
}

// All query rows of request r.
template <typename scalar_t>
void attend_request(const PagedAttentionArgs<scalar_t>& a, Workspace<scalar_t>& w, int64_t r) {
  const int64_t seq_len = a.seq_lens[r];
  const int64_t q_start = a.query_start_loc[r];
  const int64_t q_len = a.query_start_loc[r + 1] - q_start;
  if (q_len <= 0) return;
  w.slots.resize(seq_len);
  w.vslots.resize(seq_len);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t block = a.block_table[r * a.max_blocks + t / a.block_size];
    const int64_t slot = t % a.block_size;
    w.slots[t] = a.k_base + block * a.k_block_stride + slot * a.k_slot_stride;
    w.vslots[t] = a.v_base + block * a.v_block_stride + slot * a.v_slot_stride;
  }
  w.seq_pad = (seq_len + kLanes - 1) / kLanes * kLanes;
  w.scores.resize(kRowTile * a.num_heads * w.seq_pad);  // attend_rows: kRowTile rows
  w.transposed = false;
  if constexpr (std::is_same_v<acc_type_t<scalar_t>, float>) {
    if (q_len >= kTransposeMinQueryRows) {
      w.kt.resize(a.num_kv_heads * a.head_dim * w.seq_pad);
      transpose_keys(w.kt.data(), w.slots.data(), seq_len, w.seq_pad, a.num_kv_heads, a.head_dim,
                     a.k_head_stride);
      w.transposed = true;
    }
  }
  // row i sits at position seq_len - q_len + i: it sees that many keys plus one
  int64_t i = 0;
  if constexpr (std::is_same_v<acc_type_t<scalar_t>, float>) {
    if (w.transposed) {
      for (; i + kRowTile <= q_len; i += kRowTile)
        attend_rows(a, w, q_start + i, seq_len - q_len + i + 1);
    }
  }
  for (; i < q_len; ++i) attend_row(a, w, q_start + i, seq_len - q_len + i + 1);
}

template <typename scalar_t>
void paged_attention_impl(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const at::Tensor& req_ids, double scale) {
  PagedAttentionArgs<scalar_t> a;
  a.num_heads = query.size(1);
  a.head_dim = query.size(2);
  a.v_head_dim = v_cache.size(3);
  a.block_size = k_cache.size(1);
  a.num_kv_heads = k_cache.size(2);
  a.group_size = a.num_heads / a.num_kv_heads;
  a.max_blocks = block_table.size(1);
  a.scale = static_cast<acc_type_t<scalar_t>>(scale);
  a.q_base = query.data_ptr<scalar_t>();
  a.out_base = out.data_ptr<scalar_t>();
  a.k_base = k_cache.data_ptr<scalar_t>();
  a.v_base = v_cache.data_ptr<scalar_t>();
  a.k_block_stride = k_cache.stride(0);
  a.k_slot_stride = k_cache.stride(1);
  a.k_head_stride = k_cache.stride(2);
  a.v_block_stride = v_cache.stride(0);
  a.v_slot_stride = v_cache.stride(1);
  a.v_head_stride = v_cache.stride(2);
  a.block_table = block_table.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  const int64_t* reqs = req_ids.data_ptr<int64_t>();

  // One work item per request: its tokens' K (then V) rows for all KV heads are adjacent in the
  // cache ([block_size, num_kv_heads, head_dim] per block), so each block streams from memory
  // once, in order, for all heads.
  at::parallel_for(0, req_ids.size(0), 1, [&](int64_t begin, int64_t end) {
    Workspace<scalar_t> w;
    w.q.resize(kRowTile * a.num_heads * a.head_dim);
    w.acc.resize(kRowTile * a.num_heads * a.v_head_dim);
    w.row_max.resize(a.num_heads);
    w.row_sum.resize(a.num_heads);
    for (int64_t work = begin; work < end; ++work) attend_request(a, w, reqs[work]);
  });
}

}  // namespace

void paged_attention(
    at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const at::Tensor& req_ids, double scale) {
  TORCH_CHECK(query.dim() == 3, "query: [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "k_cache and v_cache: [NB, BS, KVH, D]");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
              "k_cache and v_cache differ in blocks, block size or KV heads");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and k_cache differ");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
                  out.size(2) == v_cache.size(3),
              "out: [T, H, v_head_dim]");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads % num_kv_heads != 0");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache and v_cache: the last dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out, k_cache and v_cache must have one dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_table, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(req_ids.scalar_type() == at::kLong, "req_ids must be int64");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous() && req_ids.is_contiguous(),
              "metadata tensors must be contiguous");
  switch (query.scalar_type()) {
    case at::kFloat:
      paged_attention_impl<float>(out, query, k_cache, v_cache, block_table, seq_lens,
                                  query_start_loc, req_ids, scale);
      break;
    case at::kDouble:
      paged_attention_impl<double>(out, query, k_cache, v_cache, block_table, seq_lens,
                                   query_start_loc, req_ids, scale);
      break;
    case at::kBFloat16:
      paged_attention_impl<c10::BFloat16>(out, query, k_cache, v_cache, block_table, seq_lens,
                                          query_start_loc, req_ids, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace moe_dbo_cpu
