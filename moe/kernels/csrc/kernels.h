// The kernels this directory's extension module exports (module.cpp binds them for Python; their
// contracts are in moe/kernels/__init__.py). Only module.cpp includes torch/extension.h (pybind11
// and all of torch's headers): the kernels compile against ATen alone, a shorter build.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace moe_dbo_cpu {

// paged_attention_cpu.cpp
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& req_ids, double scale);

// fused_moe_cpu.cpp
void fused_moe(at::Tensor out, const at::Tensor& hidden_states, const at::Tensor& w13,
               const at::Tensor& w2, const at::Tensor& topk_ids, const at::Tensor& topk_weights);
void fused_moe_batched(at::Tensor out, const at::Tensor& hidden_states, const at::Tensor& w13,
                       const at::Tensor& w2, const std::vector<int64_t>& expert_num_tokens);

// rotary_cpu.cpp
std::tuple<bool, at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                          const at::Tensor& query,
                                                          const at::Tensor& key,
                                                          const at::Tensor& table, bool is_neox);

// token_packing_cpu.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_sent_rows(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const std::optional<at::Tensor>& is_token_in_rank, int64_t ep_size, int64_t num_local_experts,
    int64_t weights_offset, int64_t hidden_offset, int64_t row_bytes, int64_t block);
std::tuple<at::Tensor, at::Tensor, at::Tensor> unpack_row_ranges(
    const at::Tensor& packed, const std::vector<int64_t>& first_rows,
    const std::vector<int64_t>& num_rows, int64_t num_topk, int64_t weights_offset,
    int64_t hidden_offset, int64_t hidden_bytes);

}  // namespace moe_dbo_cpu
