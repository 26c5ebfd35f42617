// The rows a rank sends in a Standard dispatch, packed in one pass (CPU).
//
// distributed/all2all/token_packing.py's pack_sent_rows does this with torch ops: the (rank,
// token) pairs of is_token_in_rank by nonzero, the top-k ids made local to each destination, a
// gather of the hidden states and copies into a packed uint8 row per pair, then (padded dispatch)
// an index_copy into per-rank blocks. On a decode ubatch those are ~30 ops of a few rows each, a
// fixed cost that DBO pays once per ubatch and layer; this kernel does it in one call, byte for
// byte the same rows (tests/distributed/test_token_packing_kernel.py compares both).
//
// unpack_row_ranges is the receiving side: the rows of some ranges of a received buffer (the
// valid rows of a padded dispatch's blocks) as three contiguous tensors, one copy of each field,
// where torch ops index the rows, then copy each field out of them.
//
// Row layout (token_packing.RowLayout): topk_ids int64 [k] at byte 0, topk_weights float32 [k]
// at weights_offset, the hidden state (any dtype, copied as bytes) at hidden_offset, zero padding
// to row_bytes. Pairs are ordered by destination rank, then token (DeepEP's order).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace moe_dbo_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_sent_rows(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const std::optional<at::Tensor>& is_token_in_rank, int64_t ep_size, int64_t num_local_experts,
    int64_t weights_offset, int64_t hidden_offset, int64_t row_bytes, int64_t block) {
  TORCH_CHECK(hidden_states.dim() == 2 && hidden_states.is_contiguous() &&
                  hidden_states.device().is_cpu(),
              "hidden_states must be a contiguous CPU [num_tokens, hidden_size] tensor");
  const int64_t n = hidden_states.size(0);
  const int64_t hidden_bytes = hidden_states.size(1) * hidden_states.element_size();
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == n && topk_ids.is_contiguous() &&
                  topk_ids.scalar_type() == at::kLong,
              "topk_ids must be contiguous int64 [num_tokens, num_topk]");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat,
              "topk_weights must be contiguous float32 shaped like topk_ids");
  TORCH_CHECK_VALUE(num_local_experts >= 1 && ep_size >= 1,
                    "num_local_experts and ep_size must be >= 1");
  TORCH_CHECK_VALUE(weights_offset >= 8 * k && hidden_offset >= weights_offset + 4 * k &&
                        row_bytes >= hidden_offset + hidden_bytes,
                    "the row layout does not fit the fields");
  const int64_t* ids = topk_ids.data_ptr<int64_t>();

  // is_token_in_rank [n, ep_size]: given (any strides), or made of the ids as token_rank_mask does
  std::vector<uint8_t> mask(n * ep_size, 0);
  if (is_token_in_rank.has_value()) {
    const at::Tensor& given = *is_token_in_rank;
    TORCH_CHECK(given.dim() == 2 && given.size(0) == n && given.size(1) == ep_size &&
                    given.scalar_type() == at::kBool,
                "is_token_in_rank must be bool [num_tokens, ep_size]");
    const bool* data = given.data_ptr<bool>();
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r = 0; r < ep_size; ++r) {
        mask[t * ep_size + r] = data[t * given.stride(0) + r * given.stride(1)];
      }
    }
  } else {
    for (int64_t i = 0; i < n * k; ++i) {
      const int64_t e = ids[i];
      TORCH_CHECK_VALUE(e < ep_size * num_local_experts, "topk_ids holds expert id ", e,
                        ", past the ", ep_size * num_local_experts, " experts");
      if (e >= 0) mask[(i / k) * ep_size + e / num_local_experts] = 1;  // -1: no selection
    }
  }
  std::vector<int64_t> counts(ep_size, 0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < ep_size; ++r) counts[r] += mask[t * ep_size + r];
  }
  int64_t num_pairs = 0;
  for (int64_t c : counts) num_pairs += c;
  TORCH_CHECK_VALUE(block == 0 || block >= 1 + n,
                    "block must hold a header row and every token: got ", block, " for ", n,
                    " tokens");
  const int64_t num_rows = block == 0 ? num_pairs : ep_size * block;

  at::Tensor packed = at::zeros({num_rows, row_bytes}, at::kByte);
  at::Tensor send_counts = at::empty({ep_size}, at::kLong);
  at::Tensor send_token_idx = at::empty({num_pairs}, at::kLong);
  uint8_t* out = packed.data_ptr<uint8_t>();
  int64_t* token_idx = send_token_idx.data_ptr<int64_t>();
  const float* weights = topk_weights.data_ptr<float>();
  const auto* hidden = static_cast<const uint8_t*>(hidden_states.data_ptr());

  int64_t pair = 0;
  for (int64_t r = 0; r < ep_size; ++r) {
    send_counts.data_ptr<int64_t>()[r] = counts[r];
    const int64_t first_expert = r * num_local_experts;
    int64_t row = block == 0 ? pair : r * block + 1;  // padded: after the rank's header row
    for (int64_t t = 0; t < n; ++t) {
      if (!mask[t * ep_size + r]) continue;
      uint8_t* dst = out + row * row_bytes;
      auto* local_ids = reinterpret_cast<int64_t*>(dst);
      auto* local_weights = reinterpret_cast<float*>(dst + weights_offset);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ids[t * k + j];
        const bool is_local = e >= first_expert && e < first_expert + num_local_experts;
        local_ids[j] = is_local ? e - first_expert : -1;
        local_weights[j] = is_local ? weights[t * k + j] : 0.0f;
      }
      std::memcpy(dst + hidden_offset, hidden + t * hidden_bytes, hidden_bytes);
      token_idx[pair++] = t;
      ++row;
    }
  }
  return {packed, send_counts, send_token_idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> unpack_row_ranges(
    const at::Tensor& packed, const std::vector<int64_t>& first_rows,
    const std::vector<int64_t>& num_rows, int64_t num_topk, int64_t weights_offset,
    int64_t hidden_offset, int64_t hidden_bytes) {
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.device().is_cpu(),
              "packed must be a contiguous CPU [num_rows, row_bytes] uint8 tensor");
  const int64_t total_rows = packed.size(0), row_bytes = packed.size(1);
  TORCH_CHECK_VALUE(num_topk >= 1 && weights_offset >= 8 * num_topk &&
                        hidden_offset >= weights_offset + 4 * num_topk && hidden_bytes >= 0 &&
                        row_bytes >= hidden_offset + hidden_bytes,
                    "the row layout does not fit rows of ", row_bytes, " bytes");
  TORCH_CHECK_VALUE(first_rows.size() == num_rows.size(),
                    "first_rows and num_rows differ in length");
  int64_t m = 0;
  for (size_t b = 0; b < first_rows.size(); ++b) {
    TORCH_CHECK_VALUE(first_rows[b] >= 0 && num_rows[b] >= 0 &&
                          first_rows[b] + num_rows[b] <= total_rows,
                      "rows [", first_rows[b], ", ", first_rows[b] + num_rows[b],
                      ") lie outside the ", total_rows, " rows");
    m += num_rows[b];
  }
  at::Tensor ids = at::empty({m, num_topk}, at::kLong);
  at::Tensor weights = at::empty({m, num_topk}, at::kFloat);
  at::Tensor hidden = at::empty({m, hidden_bytes}, at::kByte);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  auto* ids_out = reinterpret_cast<uint8_t*>(ids.data_ptr<int64_t>());
  auto* weights_out = reinterpret_cast<uint8_t*>(weights.data_ptr<float>());
  uint8_t* hidden_out = hidden.data_ptr<uint8_t>();
  int64_t i = 0;
  for (size_t b = 0; b < first_rows.size(); ++b) {
    for (int64_t row = first_rows[b]; row < first_rows[b] + num_rows[b]; ++row, ++i) {
      const uint8_t* r = src + row * row_bytes;
      std::memcpy(ids_out + i * 8 * num_topk, r, 8 * num_topk);
      std::memcpy(weights_out + i * 4 * num_topk, r + weights_offset, 4 * num_topk);
      std::memcpy(hidden_out + i * hidden_bytes, r + hidden_offset, hidden_bytes);
    }
  }
  return {ids, weights, hidden};
}

}  // namespace moe_dbo_cpu
