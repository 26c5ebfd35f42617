"""Decode-only steps captured whole (``cudagraph_mode`` FULL_AND_PIECEWISE): ``DecodeGraphs``, one
graph per bucket of the model's eager forward, attention included, on persistent input buffers
that each step overwrites. The buffers, the padding requests and why only some attention
backends qualify: docs/hardware.md#whole-decode-graphs-buffers-and-padding."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dbo.forward_context import ForwardContext, set_forward_context
from dbo.timeline.recorder import timeline_span
from moe.compilation import bucket_for
from moe.compilation.backends import in_ubatch
from moe.layers.attention_metadata import CommonAttentionMetadata


def is_uniform_decode(attn_metadata) -> bool:
    """Whether a (u)batch is decode-only: every request has one query row (host values only)."""
    num_reqs = attn_metadata.num_reqs
    return (
        num_reqs > 0
        and attn_metadata.max_query_len == 1
        and (attn_metadata.num_actual_tokens == num_reqs)
    )


class DecodeGraphs:
    """Whole-forward graphs of decode-only steps, one per bucket (see the module docstring).

    Args:
        model: the causal LM, ``forward(input_ids [n] int64, positions [n] int64,
            attn_metadata) -> [n, hidden_size]``, weights loaded and KV cache allocated.
        capture_sizes: ascending buckets (the rows of a decode step: one per request).
        capture_whole: ``forward -> replay`` (``CUDAGraphPiece.capture_whole``; a recording
            double in CPU tests): ``replay()`` returns ``forward``'s output as of this replay.
        max_num_blocks_per_req, block_size: the block table's width and the KV cache block (in
            tokens); their product bounds a request's ``seq_len``.
        device: where the buffers live (the rank's device).
        pin_memory: stage the host-built metadata in pinned memory (``Platform.pin_host_memory``).

    Raises:
        ValueError: empty ``capture_sizes``, or a width or block size below 1.
    """

    def __init__(
        self,
        model: nn.Module,
        capture_sizes: tuple[int, ...],
        *,
        capture_whole: Callable[[Callable[[], Tensor]], Callable[[], Tensor]],
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        if not capture_sizes:
            raise ValueError("decode graphs need at least one capture size")
        if max_num_blocks_per_req < 1 or block_size < 1:
            raise ValueError(
                f"need max_num_blocks_per_req >= 1 and block_size >= 1, got "
                f"{max_num_blocks_per_req} and {block_size}"
            )
        self.model = model
        self.capture_sizes = tuple(capture_sizes)
        self._capture_whole = capture_whole
        self.max_seq_len = max_num_blocks_per_req * block_size
        rows = self.capture_sizes[-1]

        def buffers(on: torch.device, pin: bool) -> dict[str, Tensor]:
            def zeros(*shape: int, dtype: torch.dtype) -> Tensor:
                return torch.zeros(shape, dtype=dtype, device=on, pin_memory=pin)

            return {
                "query_start_loc": zeros(rows + 1, dtype=torch.int32),
                "seq_lens": zeros(rows, dtype=torch.int32),
                "block_table": zeros(rows, max_num_blocks_per_req, dtype=torch.int32),
                "slot_mapping": zeros(rows, dtype=torch.int64),
            }

        self._device = buffers(device, False)  # what the graphs read
        self._staging = buffers(torch.device("cpu"), pin_memory)  # filled on the host
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self._arange = torch.arange(rows + 1, dtype=torch.int32)
        self._replays: dict[int, Callable[[], Tensor]] = {}

    @property
    def buffers(self) -> dict[str, Tensor]:
        """The persistent device buffers by name (``input_ids``, ``positions`` and the
        metadata's), the same tensors at every step."""
        return {"input_ids": self.input_ids, "positions": self.positions, **self._device}

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, the largest first (smaller graphs then reuse its memory); the
        seconds it took. Idempotent."""
        start = time.perf_counter()
        for bucket in sorted(self.capture_sizes, reverse=True):
            if bucket in self._replays:
                continue
            self._fill_dummy(bucket)
            self._replays[bucket] = self._capture_whole(lambda bucket=bucket: self._forward(bucket))
        return time.perf_counter() - start

    def bucket_for(self, num_rows: int, attn_metadata) -> int | None:
        """The bucket a forward of ``num_rows`` rows replays, or None: not decode-only, inside
        a DBO ubatch, larger than the largest bucket, or not captured yet."""
        if not self._replays or not is_uniform_decode(attn_metadata) or in_ubatch():
            return None
        return bucket_for(num_rows, self.capture_sizes)

    def replay(self, bucket: int, input_ids: Tensor, positions: Tensor, attn_metadata) -> Tensor:
        """The model on this decode step: input_ids, positions [n] int64 on the device (n <=
        ``bucket``), ``attn_metadata`` with host tensors -> hidden states [n, hidden_size] (a
        view of the graph's output, valid until the next step)."""
        num_rows, num_reqs = input_ids.shape[0], attn_metadata.num_reqs
        host = self._staging
        # host side: the step's values, then the padding requests of the bucket
        host["query_start_loc"][: num_reqs + 1].copy_(attn_metadata.query_start_loc)
        host["query_start_loc"][num_reqs + 1 : bucket + 1].copy_(
            self._arange[num_reqs + 1 : bucket + 1]
        )
        host["seq_lens"][:num_reqs].copy_(attn_metadata.seq_lens)
        host["seq_lens"][num_reqs:bucket].fill_(1)
        host["block_table"][:num_reqs].copy_(attn_metadata.block_table)
        host["block_table"][num_reqs:bucket].zero_()
        host["slot_mapping"][:num_rows].copy_(attn_metadata.slot_mapping[:num_rows])
        host["slot_mapping"][num_rows:bucket].fill_(-1)
        self._upload(bucket)
        self.input_ids[:num_rows].copy_(input_ids)  # device to device
        self.positions[:num_rows].copy_(positions)
        with timeline_span("graph"):
            return self._replays[bucket]()[:num_rows]

    def _upload(self, bucket: int) -> None:
        """Staging rows of ``bucket`` to the device buffers (non-blocking from pinned memory)."""
        for name, device in self._device.items():
            rows = bucket + 1 if name == "query_start_loc" else bucket
            device[:rows].copy_(self._staging[name][:rows], non_blocking=True)

    def _fill_dummy(self, bucket: int) -> None:
        """A valid step for capture: ``bucket`` one-row requests at the largest ``seq_len``,
        reading block 0, writing nothing."""
        host = self._staging
        host["query_start_loc"][: bucket + 1].copy_(self._arange[: bucket + 1])
        host["seq_lens"][:bucket].fill_(self.max_seq_len)
        host["block_table"][:bucket].zero_()
        host["slot_mapping"][:bucket].fill_(-1)
        self._upload(bucket)
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()

    def _metadata(self, bucket: int) -> CommonAttentionMetadata:
        """The bucket's metadata over the device buffers; its ``max_seq_len`` is the staging's
        (the bound while capturing)."""
        device = self._device
        return CommonAttentionMetadata(
            query_start_loc=device["query_start_loc"][: bucket + 1],
            seq_lens=device["seq_lens"][:bucket],
            block_table=device["block_table"][:bucket],
            slot_mapping=device["slot_mapping"][:bucket],
            num_reqs=bucket,
            num_actual_tokens=bucket,
            num_tokens=bucket,
            max_query_len=1,
            max_seq_len=int(self._staging["seq_lens"][:bucket].max()),  # host tensor: no sync
        )

    def _forward(self, bucket: int) -> Tensor:
        """The eager forward of ``bucket`` rows on the buffers, in a forward context of its own
        metadata (a fresh object: its derived values are computed inside the capture)."""
        metadata = self._metadata(bucket)
        with set_forward_context(ForwardContext(attn_metadata=metadata)):
            return self.model(self.input_ids[:bucket], self.positions[:bucket], metadata)
