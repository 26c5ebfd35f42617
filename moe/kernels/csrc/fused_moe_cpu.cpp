// SwiGLU experts on the CPU over weights packed for streaming, one call for all local experts.
//
// The torch path (moe/fused_moe/experts.py, forward_cpu) runs two oneDNN GEMMs, an activation, a
// weighting and a scatter-add per expert from Python. In decode an expert gets a few rows, so each
// GEMM is a pass over the expert's weights with a few FMAs per element loaded: the time is the
// weight stream plus the per-call costs, times the number of experts. This kernel does the whole
// layer in one call, as vLLM's CPU fused MoE does (csrc/cpu/cpu_fused_moe.cpp, "vec" ISA): per
// expert it gathers the rows routed to it, runs gate_up = x W13^T and down = h W2^T with register
// tiles over a weight layout that is one linear stream per 16 output columns, applies SwiGLU in
// between, and adds the weighted rows into the output.
//
// Packed weight layout (moe/fused_moe/experts.py packs it once, with torch ops):
//   w13  [E, 2F / 16, H, 16]   column c of expert e's [w1_e; w3_e] ([2F, H]) at [e, c / 16, :, c % 16]
//   w2   [E, H / 16, F, 16]    likewise for w2_e ([H, F])
// so a register tile of 16 (or 32) columns reads 16 (or 32) adjacent weights per k, from one (or
// two) contiguous streams. H and 2F must be multiples of 16.
// The avx512_bf16 build (MOE_DBO_AVX512_BF16) packs bfloat16 weights in pairs of k instead,
//   w13  [E, 2F / 16, H / 2, 16, 2]   w2  [E, H / 16, F / 2, 16, 2]
// (column c, rows k and k + 1 adjacent), the operand of vdpbf16ps: one instruction multiplies 16
// columns by two k at once, with the two activations of a row broadcast as one 32-bit pair. Its
// activations are then bfloat16 too: the rows as they come, and the SwiGLU output rounded once to
// bfloat16 before down (the reference rounds it there as well). Products of bfloat16 are exact in
// float32 and are summed in float32 (subnormals flushed), as in the widening path.
//
// Register tiles: M rows x kTileVecs vectors, M <= kMaxTileRows (8 rows x 2 vectors = 16 sums with
// AVX-512's 32 registers, 6 x 2 = 12 with AVX2's 16), the rest of the registers hold the weight
// vectors and a broadcast row element. An expert with more rows than a tile runs its GEMM in
// column chunks of about kChunkBytes of weights (L2-resident while every row tile passes over it).
//
// Precision: float32 throughout (bfloat16 rows and weights are widened exactly; with
// MOE_DBO_AVX512_BF16 the SwiGLU output is rounded to bfloat16 before down), the activation
// with the exp of vec_common.h (relative error below 2.4e-7), one rounding to the output dtype at
// the end: at least as accurate as the reference's per-op rounding in the model's dtype.
// Sums are added into each token's output in ascending expert order (the reference's order), so
// the result does not depend on the number of threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_common.h"

#if defined(MOE_DBO_AVX512_BF16)
#include <immintrin.h>
#endif

namespace moe_dbo_cpu {
namespace {

#if defined(MOE_DBO_AVX512_BF16)
constexpr int64_t kPair = 2;  // bfloat16 weights packed in pairs of k (vdpbf16ps)
#else
constexpr int64_t kPair = 1;
#endif

// The type the experts' activations are multiplied in: the rows' dtype where the weights are packed
// in pairs of k (bfloat16 with vdpbf16ps), else float32.
template <typename scalar_t>
using act_t = std::conditional_t<kPair == 2 && std::is_same_v<scalar_t, c10::BFloat16>,
                                 c10::BFloat16, float>;

constexpr int64_t kBlock = 16;  // output columns per packed block
constexpr int kTileVecs = 2;    // vectors per row of a register tile
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kMaxTileRows = 8;
#else
constexpr int kMaxTileRows = 6;
#endif
constexpr int64_t kChunkBytes = 256 * 1024;
static_assert(kBlock % kLanes == 0, "a vector never straddles two packed blocks");

// c[m][col0 .. col0 + V kLanes) = sum_k a[m lda + k] B[k][col] for m < M, B packed as above
// (column col of row k at b[(col / kBlock) K kBlock + k kBlock + col % kBlock]).
template <int M, int V, typename w_t>
inline void tile(const float* a, int64_t lda, const w_t* b, int64_t K, int64_t col0, float* c,
                 int64_t ldc) {
  static_assert(kPair == 1 || !std::is_same_v<w_t, c10::BFloat16>, "bfloat16 weights in pairs");
  const w_t* bp[V];
  for (int v = 0; v < V; ++v) {
    const int64_t col = col0 + v * kLanes;
    bp[v] = b + (col / kBlock) * K * kBlock + col % kBlock;
  }
  Vec acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = Vec(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load_float(bp[v] + k * kBlock);
    for (int m = 0; m < M; ++m) {
      const Vec av(a[m * lda + k]);
      for (int v = 0; v < V; ++v) acc[m][v] = at::vec::fmadd(av, bv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v].store(c + m * ldc + col0 + v * kLanes);
}

#if defined(MOE_DBO_AVX512_BF16)
// The same tile for bfloat16 rows a and weights b packed in pairs of k ([cols / 16, K / 2, 16, 2],
// K even): per pair, one vdpbf16ps per row and vector adds a[k] b[k][col] + a[k + 1] b[k + 1][col].
template <int M, int V>
inline void tile(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t K,
                 int64_t col0, float* c, int64_t ldc) {
  static_assert(kLanes == kBlock, "one vector per packed block");
  const c10::BFloat16* bp[V];
  for (int v = 0; v < V; ++v) bp[v] = b + (col0 / kBlock + v) * K * kBlock;
  __m512 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh bv[V];
    for (int v = 0; v < V; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(bp[v] + k * kBlock);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + k, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(c + m * ldc + col0 + v * kLanes, acc[m][v]);
}
#endif

// tile<m, V> for a row count m in [1, M] known only at run time
template <int V, typename a_t, typename w_t, int M = kMaxTileRows>
inline void tile_rows(int64_t m, const a_t* a, int64_t lda, const w_t* b, int64_t K,
                      int64_t col0, float* c, int64_t ldc) {
  if constexpr (M > 1) {
    if (m < M) return tile_rows<V, a_t, w_t, M - 1>(m, a, lda, b, K, col0, c, ldc);
  }
  tile<M, V>(a, lda, b, K, col0, c, ldc);
}

// c[n][ncols] (row stride ldc) = a[n][K] (row stride lda) B, B packed [ncols / kBlock, K, kBlock]
// (or in pairs of k, for bfloat16 a); column chunks in parallel, each chunk's weights passed over
// by every row tile in turn.
template <typename a_t, typename w_t>
void packed_gemm(const a_t* a, int64_t lda, int64_t n, int64_t K, const w_t* b, int64_t ncols,
                 float* c, int64_t ldc) {
  constexpr int64_t kTileCols = kTileVecs * kLanes;
  const int64_t per_chunk = kChunkBytes / (K * static_cast<int64_t>(sizeof(w_t)));
  const int64_t chunk = std::max<int64_t>(kTileCols, per_chunk / kTileCols * kTileCols);
  const int64_t num_chunks = (ncols + chunk - 1) / chunk;
  at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t c0 = i * chunk, c1 = std::min(ncols, c0 + chunk);
      for (int64_t m0 = 0; m0 < n; m0 += kMaxTileRows) {
        const int64_t m = std::min<int64_t>(kMaxTileRows, n - m0);
        int64_t col = c0;
        for (; col + kTileCols <= c1; col += kTileCols)
          tile_rows<kTileVecs>(m, a + m0 * lda, lda, b, K, col, c + m0 * ldc, ldc);
        for (; col < c1; col += kLanes)  // ncols is a multiple of kBlock, so whole vectors
          tile_rows<1>(m, a + m0 * lda, lda, b, K, col, c + m0 * ldc, ldc);
      }
    }
  });
}

// silu(x) = x sigmoid(x), sigmoid from e = exp(-|x|) (exp_vec's domain): 1 / (1 + e) for x >= 0,
// e / (1 + e) below
inline Vec silu(const Vec& x) {
  const Vec e = exp_vec(Vec(0.0f) - x.abs());
  const Vec r = Vec(1.0f) / (Vec(1.0f) + e);
  return x * Vec::blendv(r, e * r, x < Vec(0.0f));
}

// g[m][f] = silu(g[m][f]) g[m][F + f] for f < F, m < n (rows of stride 2F, in place)
void silu_and_mul(float* g, int64_t n, int64_t F) {
  for (int64_t m = 0; m < n; ++m) {
    float* gate = g + m * 2 * F;
    const float* up = gate + F;
    int64_t f = 0;
    for (; f + kLanes <= F; f += kLanes)
      (silu(Vec::loadu(gate + f)) * Vec::loadu(up + f)).store(gate + f);
    for (; f < F; ++f) gate[f] = gate[f] / (1.0f + std::exp(-gate[f])) * up[f];
  }
}

// dst[0 .. n) = src[0 .. n) widened to float
template <typename scalar_t>
inline void to_float_row(float* dst, const scalar_t* src, int64_t n) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) load_float(src + d).store(dst + d);
  for (; d < n; ++d) dst[d] = to_float(src[d]);
}

// dst[0 .. n) = src[0 .. n) in scalar_t (round to nearest even for bfloat16)
template <typename scalar_t>
inline void from_float_row(scalar_t* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Buffers a calling thread reuses across calls (grown, never shrunk): a fresh allocation of this
// size would be new pages, and their first-touch faults cost about what the GEMMs do in decode.
// rows and hidden hold activations in the type they are multiplied in (act_t).
struct Scratch {
  std::vector<float> rows, gate_up, down, acc;
  std::vector<c10::BFloat16> rows_bf16, hidden_bf16;
  static Scratch& of_this_thread() {
    thread_local Scratch scratch;
    return scratch;
  }
  template <typename T>
  static T* sized(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
  template <typename a_t>
  a_t* rows_of(int64_t n) {
    if constexpr (std::is_same_v<a_t, float>) return sized(rows, n);
    else return sized(rows_bf16, n);
  }
};

// One expert on n rows a [n, H] (row stride lda): y[n][H] = W2 (silu(W13 a)). With bfloat16
// activations the SwiGLU output is rounded to bfloat16 (in scratch) before down.
template <typename a_t, typename w_t>
void expert_swiglu(const a_t* a, int64_t lda, int64_t n, const w_t* w13, const w_t* w2,
                   int64_t H, int64_t F, float* gate_up, float* y) {
  packed_gemm(a, lda, n, H, w13, 2 * F, gate_up, 2 * F);
  silu_and_mul(gate_up, n, F);
  if constexpr (std::is_same_v<a_t, float>) {
    packed_gemm(gate_up, 2 * F, n, F, w2, H, y, H);
  } else {
    a_t* hidden = Scratch::sized(Scratch::of_this_thread().hidden_bf16, n * F);
    for (int64_t m = 0; m < n; ++m) from_float_row(hidden + m * F, gate_up + m * 2 * F, F);
    packed_gemm(hidden, F, n, F, w2, H, y, H);
  }
}

// dst[0 .. n) = src[0 .. n) as the activation type (a copy, or widened to float)
template <typename a_t, typename scalar_t>
inline void to_act_row(a_t* dst, const scalar_t* src, int64_t n) {
  if constexpr (std::is_same_v<a_t, scalar_t>) std::copy(src, src + n, dst);
  else to_float_row(dst, src, n);
}

struct Dims {
  int64_t num_experts, hidden, inter;  // E, H, F
};

Dims check_weights(const at::Tensor& w13, const at::Tensor& w2, at::ScalarType dtype,
                   int64_t hidden) {
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype,
              "packed weights must have the rows' dtype");
  // bfloat16 weights in pairs of k where this build multiplies bfloat16 pairs
  const int64_t pair = dtype == at::kBFloat16 ? kPair : 1;
  const bool paired = pair == 2 && w13.dim() == 5 && w13.size(4) == 2 && w2.dim() == 5 &&
                      w2.size(4) == 2;
  const bool single = pair == 1 && w13.dim() == 4 && w2.dim() == 4;
  TORCH_CHECK((paired || single) && w13.size(3) == kBlock && w2.size(3) == kBlock,
              pair == 2 ? "w13 and w2 must be packed [E, cols / 16, K / 2, 16, 2]"
                        : "w13 and w2 must be packed [E, cols / 16, K, 16]");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "packed weights must be contiguous");
  const Dims d{w13.size(0), hidden, w13.size(1) * kBlock / 2};
  TORCH_CHECK(w13.size(2) * pair == hidden && w2.size(0) == d.num_experts &&
                  w2.size(1) * kBlock == hidden && w2.size(2) * pair == d.inter,
              "w13 must be [E, 2F / 16, H, 16] and w2 [E, H / 16, F, 16] (K halved in pairs)");
  return d;
}

// Pairs (token, slot) routed to each local expert, in token order: offsets [E + 1] and the token
// of each pair. ValueError for a local id >= E; negative ids (other ranks' experts) are skipped.
void route(const int64_t* ids, int64_t num_tokens, int64_t topk, int64_t num_experts,
           std::vector<int64_t>& offsets, std::vector<int64_t>& pair_token,
           std::vector<float>& pair_weight, const float* weights) {
  offsets.assign(num_experts + 1, 0);
  for (int64_t i = 0; i < num_tokens * topk; ++i) {
    TORCH_CHECK_VALUE(ids[i] < num_experts, "topk_ids holds local expert id ", ids[i],
                      " >= num_local_experts=", num_experts);
    if (ids[i] >= 0) ++offsets[ids[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  pair_token.resize(offsets[num_experts]);
  pair_weight.resize(offsets[num_experts]);
  for (int64_t i = 0; i < num_tokens * topk; ++i) {
    if (ids[i] < 0) continue;
    const int64_t p = fill[ids[i]]++;
    pair_token[p] = i / topk;
    pair_weight[p] = weights[i];
  }
}

template <typename scalar_t>
void fused_moe_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w13,
                    const at::Tensor& w2, const at::Tensor& topk_ids,
                    const at::Tensor& topk_weights) {
  const int64_t N = x.size(0), topk = topk_ids.size(1);
  const Dims d = check_weights(w13, w2, x.scalar_type(), x.size(1));
  const int64_t H = d.hidden, F = d.inter;
  std::vector<int64_t> offsets, pair_token;
  std::vector<float> pair_weight;
  route(topk_ids.data_ptr<int64_t>(), N, topk, d.num_experts, offsets, pair_token, pair_weight,
        topk_weights.data_ptr<float>());
  int64_t max_rows = 0;
  for (int64_t e = 0; e < d.num_experts; ++e)
    max_rows = std::max(max_rows, offsets[e + 1] - offsets[e]);
  Scratch& s = Scratch::of_this_thread();
  act_t<scalar_t>* rows = s.rows_of<act_t<scalar_t>>(max_rows * H);
  float* gate_up = Scratch::sized(s.gate_up, max_rows * 2 * F);
  float* y = Scratch::sized(s.down, max_rows * H);
  scalar_t* out_data = out.data_ptr<scalar_t>();
  // float32 sums in place in out; bfloat16 ones in a float32 buffer rounded once at the end
  float* acc = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(out_data)
                                               : Scratch::sized(s.acc, N * H);
  std::fill(acc, acc + N * H, 0.0f);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  const auto* w13_data = w13.data_ptr<scalar_t>();
  const auto* w2_data = w2.data_ptr<scalar_t>();
  for (int64_t e = 0; e < d.num_experts; ++e) {
    const int64_t p0 = offsets[e], n = offsets[e + 1] - p0;
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r) to_act_row(rows + r * H, x_data + pair_token[p0 + r] * H, H);
    expert_swiglu(rows, H, n, w13_data + e * 2 * F * H, w2_data + e * H * F, H, F, gate_up, y);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = acc + pair_token[p0 + r] * H;
      const Vec w(pair_weight[p0 + r]);
      int64_t c = 0;  // H is a multiple of kBlock, so of kLanes
      for (; c < H; c += kLanes)
        at::vec::fmadd(w, Vec::loadu(y + r * H + c), Vec::loadu(dst + c)).store(dst + c);
    }
  }
  if constexpr (!std::is_same_v<scalar_t, float>) from_float_row(out_data, acc, N * H);
}

template <typename scalar_t>
void fused_moe_batched_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w13,
                            const at::Tensor& w2, const std::vector<int64_t>& counts) {
  const int64_t M = x.size(1);
  const Dims d = check_weights(w13, w2, x.scalar_type(), x.size(2));
  const int64_t H = d.hidden, F = d.inter;
  TORCH_CHECK_VALUE(static_cast<int64_t>(counts.size()) == d.num_experts,
                    "expert_num_tokens must hold one count per local expert");
  for (int64_t n : counts)
    TORCH_CHECK_VALUE(0 <= n && n <= M, "expert_num_tokens must lie in [0, ", M, "], got ", n);
  Scratch& s = Scratch::of_this_thread();
  using a_t = act_t<scalar_t>;
  a_t* rows = std::is_same_v<a_t, scalar_t> ? nullptr : s.rows_of<a_t>(M * H);
  float* gate_up = Scratch::sized(s.gate_up, M * 2 * F);
  float* y = Scratch::sized(s.down, M * H);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  for (int64_t e = 0; e < d.num_experts; ++e) {
    const int64_t n = counts[e];
    scalar_t* dst = out_data + e * M * H;
    std::fill(dst + n * H, dst + M * H, scalar_t(0));
    if (n == 0) continue;
    const scalar_t* src = x_data + e * M * H;
    const a_t* a = nullptr;
    if constexpr (std::is_same_v<a_t, scalar_t>) {
      a = src;  // multiplied as they are
    } else {
      to_float_row(rows, src, n * H);
      a = rows;
    }
    float* result = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(dst) : y;
    expert_swiglu(a, H, n, w13.data_ptr<scalar_t>() + e * 2 * F * H,
                  w2.data_ptr<scalar_t>() + e * H * F, H, F, gate_up, result);
    if constexpr (!std::is_same_v<scalar_t, float>) from_float_row(dst, y, n * H);
  }
}

}  // namespace

void fused_moe(at::Tensor out, const at::Tensor& hidden_states, const at::Tensor& w13,
               const at::Tensor& w2, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(hidden_states.dim() == 2 && hidden_states.is_contiguous(),
              "hidden_states must be contiguous [N, H]");
  TORCH_CHECK(out.sizes() == hidden_states.sizes() && out.is_contiguous() &&
                  out.scalar_type() == hidden_states.scalar_type(),
              "out must be contiguous, with hidden_states' shape and dtype");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden_states.size(0) &&
                  topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous(),
              "topk_ids must be contiguous int64 [N, K]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous(),
              "topk_weights must be contiguous float32 [N, K]");
  switch (hidden_states.scalar_type()) {
    case at::kFloat:
      return fused_moe_impl<float>(out, hidden_states, w13, w2, topk_ids, topk_weights);
    case at::kBFloat16:
      return fused_moe_impl<c10::BFloat16>(out, hidden_states, w13, w2, topk_ids, topk_weights);
    default:
      TORCH_CHECK(false, "fused_moe: unsupported dtype ", hidden_states.scalar_type());
  }
}

void fused_moe_batched(at::Tensor out, const at::Tensor& hidden_states, const at::Tensor& w13,
                       const at::Tensor& w2, const std::vector<int64_t>& expert_num_tokens) {
  TORCH_CHECK(hidden_states.dim() == 3 && hidden_states.is_contiguous(),
              "hidden_states must be contiguous [E, M, H]");
  TORCH_CHECK(out.sizes() == hidden_states.sizes() && out.is_contiguous() &&
                  out.scalar_type() == hidden_states.scalar_type(),
              "out must be contiguous, with hidden_states' shape and dtype");
  switch (hidden_states.scalar_type()) {
    case at::kFloat:
      return fused_moe_batched_impl<float>(out, hidden_states, w13, w2, expert_num_tokens);
    case at::kBFloat16:
      return fused_moe_batched_impl<c10::BFloat16>(out, hidden_states, w13, w2,
                                                   expert_num_tokens);
    default:
      TORCH_CHECK(false, "fused_moe_batched: unsupported dtype ", hidden_states.scalar_type());
  }
}

}  // namespace moe_dbo_cpu
