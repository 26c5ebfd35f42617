"""``moe.kernels.tuning``: the doubling measurement stops at the kernel's first loss or at its
bounds, and its answer is measured once per machine and key, then read back (in-process, then from
the file a later start reads), measured again only where the file holds no number for the key.
The timers here are fakes: what is tested is the search and the record, not a machine's speed.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from moe.kernels import tuning

BUILD = SimpleNamespace(isa=lambda: "avx512")  # a kernel build, as tuned_max_rows reads it


def fake_seconds(kernel_wins_up_to: float):
    """``measure_max_rows``'s timer for a kernel that is faster up to ``kernel_wins_up_to`` rows
    (kernel: 1 + rows; the other path: 1 + kernel_wins_up_to), recording the counts asked."""
    asked: list[tuple[bool, int]] = []

    def seconds(kernel: bool, rows: int) -> float:
        asked.append((kernel, rows))
        return 1.0 + (rows if kernel else kernel_wins_up_to)

    return seconds, asked


def test_measure_max_rows_is_the_last_doubling_the_kernel_wins():
    seconds, asked = fake_seconds(10)
    assert tuning.measure_max_rows(seconds, 1024) == 8.0
    # stops at the loss, measured twice
    assert [rows for kernel, rows in asked if kernel] == [1, 2, 4, 8, 16, 16]
    assert tuning.measure_max_rows(fake_seconds(0.5)[0], 1024) == 0.0  # lost at one row
    assert tuning.measure_max_rows(fake_seconds(1.0)[0], 1024) == 1.0  # a tie goes to the kernel


def test_a_loss_stands_only_when_measured_again_and_past_the_tolerance():
    """One noisy pair does not cut: the kernel keeps a count it lost once and won when measured
    again, and a count where it is within ``MEASURE_TOLERANCE`` of the other path."""
    calls = {"kernel": 0}

    def noisy(kernel: bool, rows: int) -> float:  # the kernel wins, but its first 16-row time
        if not kernel:  # is slow, as on a busy core
            return 10.0
        calls["kernel"] += 1
        return 20.0 if rows == 16 and calls["kernel"] == 5 else 9.0

    assert tuning.measure_max_rows(noisy, 64) == math.inf
    slower = 1 + tuning.MEASURE_TOLERANCE / 2
    assert tuning.measure_max_rows(lambda kernel, rows: slower if kernel else 1.0, 64) == math.inf
    beyond = 1 + 2 * tuning.MEASURE_TOLERANCE
    assert tuning.measure_max_rows(lambda kernel, rows: beyond if kernel else 1.0, 64) == 0.0


def test_measure_max_rows_can_start_past_one_row():
    """``first``: counts first, 2 first, ...; a loss at the first count is 0."""
    seconds, asked = fake_seconds(40)
    assert tuning.measure_max_rows(seconds, 1024, first=8) == 32.0
    assert [rows for kernel, rows in asked if kernel] == [8, 16, 32, 64, 64]
    assert tuning.measure_max_rows(fake_seconds(4)[0], 1024, first=8) == 0.0
    seconds, asked = fake_seconds(math.inf)  # a bound under the first count: measured once
    assert tuning.measure_max_rows(seconds, 4, first=8) == math.inf
    assert asked == [(True, 8), (False, 8)]


def test_measure_max_rows_stops_at_its_bounds_and_then_keeps_the_kernel():
    seconds, asked = fake_seconds(math.inf)
    assert tuning.measure_max_rows(seconds, 10**9) == math.inf
    assert max(rows for _, rows in asked) == tuning.MEASURE_MAX_ROWS
    seconds, asked = fake_seconds(math.inf)
    assert tuning.measure_max_rows(seconds, 7) == math.inf
    assert max(rows for _, rows in asked) == 4
    seconds, asked = fake_seconds(math.inf)  # a bound under one row: one row is still measured
    assert tuning.measure_max_rows(seconds, 0) == math.inf
    assert asked == [(True, 1), (False, 1)]


def test_cut_is_measured_once_per_machine_and_kept(tuning_file, monkeypatch):
    measured: list[str] = []

    def measure() -> float:
        measured.append("measure")
        return 16.0

    assert tuning.tuned_max_rows(BUILD, "case H=64", measure) == 16.0
    assert tuning.tuned_max_rows(BUILD, "case H=64", measure) == 16.0
    (key,) = json.loads(tuning_file.read_text())
    assert key.startswith("case H=64 threads=") and measured == ["measure"]
    assert "ONEDNN_MAX_CPU_ISA=" in key and "MKL_ENABLE_INSTRUCTIONS=" in key
    monkeypatch.setattr(tuning, "_max_rows", {})  # a later start on this machine
    assert tuning.tuned_max_rows(BUILD, "case H=64", measure) == 16.0
    assert measured == ["measure"]
    assert tuning.tuned_max_rows(BUILD, "case H=128", lambda: math.inf) == math.inf
    assert len(json.loads(tuning_file.read_text())) == 2  # both cases kept
    for bad in ("{not json", json.dumps({key: "many"}), "[]"):
        tuning_file.write_text(bad)
        monkeypatch.setattr(tuning, "_max_rows", {})
        assert tuning.tuned_max_rows(BUILD, "case H=64", measure) == 16.0
    assert measured == ["measure"] * 4


def test_a_cap_is_part_of_the_key(tuning_file, monkeypatch):
    """The same case under an ISA cap is another measurement (a capped library is another path).
    Starts uncapped, so it holds under a cap that the run itself sets (.ci/run's AVX2 pass)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    tuning.tuned_max_rows(BUILD, "case", lambda: 4.0)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert tuning.tuned_max_rows(BUILD, "case", lambda: 0.0) == 0.0
    assert sorted(json.loads(tuning_file.read_text()).values()) == [0.0, 4.0]


def test_each_kernel_build_has_its_own_cut(tuning_file):
    """The avx512 and avx512_bf16 builds multiply bfloat16 differently: one process that loads
    both (the tests do) keeps a cut for each, in-process and in the file."""
    other = SimpleNamespace(isa=lambda: "avx512_bf16")
    assert tuning.tuned_max_rows(BUILD, "case", lambda: 4.0) == 4.0
    assert tuning.tuned_max_rows(other, "case", lambda: math.inf) == math.inf
    assert tuning.tuned_max_rows(BUILD, "case", lambda: 0.0) == 4.0
    keys = json.loads(tuning_file.read_text())
    assert sorted(key.split("kernel_isa=")[1].split()[0] for key in keys) == [
        "avx512",
        "avx512_bf16",
    ]


def test_describe_names_each_case_looked_up(tuning_file, monkeypatch):
    """The start-up line: nothing looked up, none; then each case with its rows ("all" for no
    cut), and whether this start measured them or read an earlier start's."""
    monkeypatch.setattr(tuning, "_looked_up", {})
    assert tuning.describe() is None
    tuning.tuned_max_rows(BUILD, "experts torch.bfloat16 H=64 F=32", lambda: 8.0)
    tuning.tuned_max_rows(BUILD, "attention fresh", lambda: math.inf)
    line = tuning.describe()
    assert line.startswith("CPU kernel cuts (rows up to which our kernels run; measured in ")
    assert line.endswith(": attention fresh: all; experts torch.bfloat16 H=64 F=32: 8")
    monkeypatch.setattr(tuning, "_looked_up", {})  # a later start reads them
    monkeypatch.setattr(tuning, "_max_rows", {})
    tuning.tuned_max_rows(BUILD, "attention fresh", lambda: 0.0)
    assert "measured on an earlier start" in tuning.describe()
    assert tuning.describe().endswith(": attention fresh: all")


def test_measurements_leave_the_global_rng_as_it_was(tuning_file):
    """Binding a cache and loading experts measure on random data from generators of their own:
    a seeded run draws the same numbers whether this start measured or read the cuts."""
    import torch

    from moe import TorchExperts
    from moe.layers.attention import PagedAttention

    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    op = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    op.bind_kv_cache(torch.zeros(op.kv_cache_shape(8, 16)))
    experts = TorchExperts(num_local_experts=2, hidden_size=32, intermediate_size=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.fill_(0.01)
    experts.process_weights_after_loading()
    assert torch.equal(torch.rand(4), expected)
