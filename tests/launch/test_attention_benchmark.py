"""``launch.benchmarks.attention``: the bytes a call must move (hand-worked) and one run over a
tiny shape on the CPU platform's backends (the columns a GPU run prints for its own)."""

from __future__ import annotations

import torch

from launch.benchmarks import attention as bench
from moe.layers.attention_metadata import CommonAttentionMetadata
from moe.platforms import set_current_platform


def test_bytes_moved_hand_worked():
    """Two requests, contexts 5 + 3 rows and 0 + 2 rows (seq_lens 8 and 2), 4 heads over 2 KV
    heads of 8, float32: K/V rows of 2 * 2 * 8 * 4 = 128 bytes, 10 read, 5 written; queries and
    outputs 5 rows of 4 * 8 * 4 = 128 bytes each way."""
    md, _ = CommonAttentionMetadata.for_requests([(5, 3), (0, 2)], 4)
    assert bench.bytes_moved(md, 4, 2, 8, torch.float32) == 10 * 128 + 5 * 128 + 2 * 5 * 128


def test_one_run_prints_every_backend(monkeypatch, capsys):
    monkeypatch.setattr(bench, "SHAPES", (("tiny", [(5, 1), (0, 7)], 4, 2, 8),))
    try:
        bench.main(["--repeats", "1"])
    finally:
        set_current_platform(None)
    header, row = capsys.readouterr().out.splitlines()[1:]
    assert "CPU_ATTN ms" in header and "TORCH_SDPA/CPU_ATTN" in header
    assert row.startswith("tiny") and len(row.split()) == 1 + 3 + 2 + 2
