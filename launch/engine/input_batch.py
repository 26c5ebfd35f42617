"""Persistent per-request state of the running requests (``InputBatch``, after vLLM's), the step
inputs built from it by array arithmetic (``ModelInputs``), and the staged host-to-device buffers
they travel through (``StagedBuffer``). docs/models.md#input-batch-persistent-rows-staged-inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.request import Request
from launch.engine.sampler import SamplingMetadata
from launch.engine.scheduler import SchedulerOutput
from moe.layers.attention_metadata import CommonAttentionMetadata


class StagedBuffer:
    """A persistent device buffer of 1-D ``dtype`` rows and its host staging buffer (pinned when
    ``pin_memory``), both grown (doubled) when a step needs more rows.

    ``upload(array)`` -> a view of the device buffer holding ``array`` [n]: the host copy, then a
    non-blocking host-to-device copy (it runs in stream order; a pinned source lets the host go
    on at once). The staging rows are next overwritten by the next ``upload``, a step later, after
    the step's results were read on the host, which orders after this copy.
    """

    def __init__(
        self, num_rows: int, dtype: torch.dtype, device: torch.device, *, pin_memory: bool
    ) -> None:
        self.dtype, self.device, self.pin_memory = dtype, device, pin_memory
        self._allocate(num_rows)

    def _allocate(self, num_rows: int) -> None:
        self.host = torch.zeros(num_rows, dtype=self.dtype, pin_memory=self.pin_memory)
        self.buffer = torch.zeros(num_rows, dtype=self.dtype, device=self.device)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        n = len(array)
        if n > self.buffer.shape[0]:
            self._allocate(max(n, 2 * self.buffer.shape[0]))
        self.host[:n].copy_(torch.from_numpy(array))
        out = self.buffer[:n]
        out.copy_(self.host[:n], non_blocking=True)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64; padding rows hold 0
    positions: torch.Tensor  # [num_tokens] int64; padding rows hold 0
    attn_metadata: CommonAttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: rows whose next token is sampled
    sampled_request_ids: tuple[int, ...]  # request of each logits row
    sampling_metadata: SamplingMetadata  # one entry per logits row


class InputBatch:
    """Rows of per-request state for up to ``max_num_reqs`` requests at once.

    ``pin_memory``: stage the step inputs in pinned host memory (``Platform.pin_host_memory``);
    ``num_token_rows``: the token rows its persistent buffers start with (grown on demand).

    Raises:
        ValueError: from ``prepare_inputs`` if more than ``max_num_reqs`` requests are live or
            ``num_rows`` is below the scheduled token count.
    """

    def __init__(
        self,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        kv_cache_manager: KVCacheManager,
        default_seed: int,
        device: torch.device | None = None,
        pin_memory: bool = False,
        num_token_rows: int = 256,
    ) -> None:
        self.device = torch.device("cpu") if device is None else device
        # step inputs through persistent device buffers (pinned staging where the platform pins)
        self._staged = {
            name: StagedBuffer(rows, torch.int64, self.device, pin_memory=pin_memory)
            for name, rows in (
                ("input_ids", num_token_rows),
                ("positions", num_token_rows),
                ("logits_indices", max_num_reqs),
            )
        }
        self.max_num_reqs = max_num_reqs
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.default_seed = default_seed
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known tokens in the row
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # block ids copied in the row
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        # float64: holds every top_p in (0, 1] that validation accepts (float32 rounds a top_p
        # below ~7e-46 to 0); the sampler computes the nucleus in float64 anyway
        self.top_p = np.ones(max_num_reqs, dtype=np.float64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none asked
        self.seeds = np.zeros(max_num_reqs, dtype=np.int64)
        self._row_of: dict[int, int] = {}  # request_id -> row
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self._row_of)

    def remove_request(self, request_id: int) -> None:
        """Free a finished, aborted or preempted request's row (no-op if it has none)."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _add_request(self, request: Request) -> int:
        if not self._free_rows:
            raise ValueError(
                f"more than {self.max_num_reqs} live requests in the input batch (--max-num-seqs)"
            )
        row = self._free_rows.pop()
        self._row_of[request.request_id] = row
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        params = request.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        seed = self.default_seed + request.request_id if params.seed is None else params.seed
        self.seeds[row] = seed
        return row

    def _sync_request(self, request: Request) -> int:
        """The request's row, with the tokens and blocks added since the last step copied in
        (all of them for a new request; usually one token and no block for a decode)."""
        row = self._row_of.get(request.request_id)
        if row is None:
            row = self._add_request(request)
        start, stop = int(self.num_tokens[row]), request.num_tokens
        if stop > start:
            self.token_ids[row, start:stop] = request.token_ids(start, stop)
            self.num_tokens[row] = stop
        # blocks only grow while a request keeps its row (a preempted request loses its row, so
        # its new blocks are copied afresh)
        block_ids = self.kv_cache_manager.block_ids(request.request_id)
        synced = int(self.num_blocks[row])
        if len(block_ids) > synced:
            self.block_table[row, synced : len(block_ids)] = block_ids[synced:]
            self.num_blocks[row] = len(block_ids)
        return row

    def prepare_inputs(self, scheduler_output: SchedulerOutput, *, num_rows: int) -> ModelInputs:
        """Model inputs for the scheduled requests, ``num_rows`` rows (padding at the end).

        Padding rows have input id 0, position 0 and slot -1 (no KV write).
        """
        for request in scheduler_output.preempted:  # recomputed later into new blocks
            self.remove_request(request.request_id)
        scheduled = scheduler_output.scheduled
        rows = np.array([self._sync_request(s.request) for s in scheduled], dtype=np.int64)
        num_new = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        num_computed = np.array([s.request.num_computed_tokens for s in scheduled], dtype=np.int64)
        request_ids = np.array([s.request.request_id for s in scheduled], dtype=np.int64)
        cu_num_new = np.cumsum(num_new)
        num_tokens = int(cu_num_new[-1]) if len(scheduled) else 0
        if num_rows < num_tokens:
            raise ValueError(f"num_rows {num_rows} < {num_tokens} scheduled tokens")
        input_ids, positions, slot_mapping = self._token_arrays(
            rows, num_new, num_computed, num_rows=num_rows
        )
        seq_lens = num_computed + num_new
        is_sampled = seq_lens == self.num_tokens[rows]  # all known tokens computed
        sampled_rows = rows[is_sampled]
        # on the host: each (u)batch's attention plan is built from it once (no device sync)
        # and copied to the device (moe.layers.batched_attention, kv_write_slots)
        attn_metadata = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(np.concatenate(([0], cu_num_new)).astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(self.block_table[rows]),
            slot_mapping=torch.from_numpy(slot_mapping),
            num_reqs=len(scheduled),
            num_actual_tokens=num_tokens,
            num_tokens=num_rows,
            max_query_len=int(num_new.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
        )
        staged = self._staged
        return ModelInputs(
            input_ids=staged["input_ids"].upload(input_ids),
            positions=staged["positions"].upload(positions),
            attn_metadata=attn_metadata,
            logits_indices=staged["logits_indices"].upload(cu_num_new[is_sampled] - 1),
            sampled_request_ids=tuple(request_ids[is_sampled].tolist()),
            sampling_metadata=self._sampling_metadata(sampled_rows),
        )

    def _token_arrays(
        self, rows: np.ndarray, num_new: np.ndarray, num_computed: np.ndarray, *, num_rows: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``input_ids``, ``positions`` and ``slot_mapping`` [num_rows] int64 of the scheduled
        requests (persistent rows ``rows``, ``num_new`` tokens each after ``num_computed``), by
        block-table arithmetic; padding rows: id 0, position 0, slot -1."""
        cu_num_new = np.cumsum(num_new)
        num_tokens = int(cu_num_new[-1]) if len(rows) else 0
        # per token: its request (index into scheduled) and its position in the request
        token_req = np.repeat(np.arange(len(rows)), num_new)
        positions = np.zeros(num_rows, dtype=np.int64)
        positions[:num_tokens] = (
            np.arange(num_tokens) - (cu_num_new - num_new)[token_req] + num_computed[token_req]
        )
        token_row = rows[token_req]
        real_positions = positions[:num_tokens]
        input_ids = np.zeros(num_rows, dtype=np.int64)
        input_ids[:num_tokens] = self.token_ids[token_row, real_positions]  # int32 -> int64
        slot_mapping = np.full(num_rows, -1, dtype=np.int64)
        block_ids = self.block_table[token_row, real_positions // self.block_size]
        slot_mapping[:num_tokens] = (
            block_ids.astype(np.int64) * self.block_size + real_positions % self.block_size
        )
        return input_ids, positions, slot_mapping

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a tensor on the rank's device (host-to-device copy off the CPU)."""
        return torch.from_numpy(array).to(self.device)

    def _sampling_metadata(self, sampled_rows: np.ndarray) -> SamplingMetadata:
        """The sampling parameters of the persistent rows ``sampled_rows``, in that order; the
        sampler's decisions (greedy only, nucleus) from the host copies, so it reads no device
        value."""
        temperature = self.temperature[sampled_rows]
        top_p = self.top_p[sampled_rows]
        return SamplingMetadata(
            temperature=self._to_device(temperature),
            top_p=self._to_device(top_p),
            seeds=self._to_device(self.seeds[sampled_rows]),
            output_positions=self._to_device(
                self.num_tokens[sampled_rows] - self.num_prompt_tokens[sampled_rows]
            ),
            num_logprobs=tuple(self.num_logprobs[sampled_rows].tolist()),
            is_all_greedy=not temperature.any(),
            has_top_p=bool(((temperature > 0) & (top_p < 1)).any()),
        )
