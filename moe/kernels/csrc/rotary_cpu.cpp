// Rotary position embedding on the CPU, one call for the query and the key of a (u)batch.
//
// moe/layers/rotary.py's forward_table gathers each row's factors from a per-dtype table and runs
// x * cos + partner(x) * sin with torch ops: about a dozen ops of a few rows each per layer (and a
// host read of max(positions) for the bound check), a fixed cost DBO pays once per ubatch. This
// kernel does the same arithmetic element by element, in the tensors' dtype with one rounding per
// operation as torch's ops round (c10::BFloat16 / c10::Half arithmetic rounds each result;
// float and double are kept from contracting a * b + c into a fused multiply-add), so its output
// equals forward_table's bit for bit (tests/moe/test_rotary_kernel.py).
//
// table [max_positions, 2 * d] (RotaryEmbedding._rotation_table): per position the factor of
// each output element on x (cos) then on its partner (sin, sign included); the partner of element
// i is i + d/2 (mod d) in the neox layout, i ^ 1 (pairs of adjacent elements) otherwise.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <tuple>

#include "kernels.h"

namespace moe_dbo_cpu {

namespace {

#if defined(__clang__)
#define MOE_DBO_NO_FP_CONTRACT _Pragma("clang fp contract(off)")
#else
#define MOE_DBO_NO_FP_CONTRACT
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

template <typename T>
void rotate_rows(const at::Tensor& x, at::Tensor& out, const int64_t* positions, const T* table,
                 bool is_neox) {
  MOE_DBO_NO_FP_CONTRACT
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  for (int64_t t = 0; t < n; ++t) {
    const T* cos = table + positions[t] * 2 * d;
    const T* sin = cos + d;
    for (int64_t h = 0; h < heads; ++h) {
      const T* in = src + t * row_stride + h * head_stride;
      T* o = dst + (t * heads + h) * d;
      for (int64_t i = 0; i < d; ++i) {
        const int64_t partner = is_neox ? (i < half ? i + half : i - half) : (i ^ 1);
        const T a = in[i] * cos[i];
        const T b = in[partner] * sin[i];
        o[i] = a + b;
      }
    }
  }
}

#if !defined(__clang__)
#pragma GCC pop_options
#endif

template <typename T>
std::tuple<at::Tensor, at::Tensor> rotate(const at::Tensor& positions, const at::Tensor& query,
                                          const at::Tensor& key, const at::Tensor& table,
                                          bool is_neox) {
  at::Tensor out_q = at::empty(query.sizes(), query.options());
  at::Tensor out_k = at::empty(key.sizes(), key.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  rotate_rows<T>(query, out_q, pos, table.data_ptr<T>(), is_neox);
  rotate_rows<T>(key, out_k, pos, table.data_ptr<T>(), is_neox);
  return {out_q, out_k};
}

}  // namespace

std::tuple<bool, at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                          const at::Tensor& query,
                                                          const at::Tensor& key,
                                                          const at::Tensor& table, bool is_neox) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.size(1) % 4 == 0 &&
                  table.device().is_cpu(),
              "table must be a contiguous CPU [max_positions, 2 * rotary_dim] tensor");
  const int64_t d = table.size(1) / 2;
  for (const at::Tensor* x : {&query, &key}) {
    TORCH_CHECK(x->dim() == 3 && x->size(2) == d && x->stride(2) == 1 &&
                    x->scalar_type() == table.scalar_type() && x->device().is_cpu(),
                "query and key must be CPU [num_tokens, heads, ", d,
                "] tensors with a contiguous last dim, in the table's dtype");
  }
  TORCH_CHECK(positions.dim() == 1 && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong && positions.size(0) == query.size(0) &&
                  key.size(0) == query.size(0),
              "positions must be contiguous int64 [num_tokens], one per query and key row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    if (pos[t] < 0 || pos[t] >= table.size(0)) return {false, at::Tensor(), at::Tensor()};
  }
  at::Tensor q, k;
  switch (table.scalar_type()) {
    case at::kFloat:
      std::tie(q, k) = rotate<float>(positions, query, key, table, is_neox);
      break;
    case at::kDouble:
      std::tie(q, k) = rotate<double>(positions, query, key, table, is_neox);
      break;
    case at::kBFloat16:
      std::tie(q, k) = rotate<c10::BFloat16>(positions, query, key, table, is_neox);
      break;
    case at::kHalf:
      std::tie(q, k) = rotate<c10::Half>(positions, query, key, table, is_neox);
      break;
    default:
      TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", table.scalar_type());
  }
  return {true, q, k};
}

}  // namespace moe_dbo_cpu
