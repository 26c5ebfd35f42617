"""Requests and results of the offline throughput benchmark (``launch.bench_throughput``).

Datasets as ``vllm bench throughput`` names them: ``random`` (token ids drawn uniformly from the
vocabulary, lengths uniform in ``[len * (1 - r), len * (1 + r)]`` for ``--random-range-ratio r``, as
vLLM's ``RandomDataset``) and ``jsonl`` (our prompt files: lines ``{"prompt_token_ids": [...]}``,
the first ``--num-prompts`` lines, cycled if the file has fewer). Every rank builds the same list
from the same seed; DP rank r serves requests r, r + dp_size, ...
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass

DATASET_NAMES = ("random", "jsonl")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRequest:
    """One benchmark request: its prompt and how many tokens to generate (eos ignored)."""

    prompt_token_ids: list[int]
    output_len: int


def _uniform_lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    low, high = max(1, math.floor(mean * (1 - ratio))), math.ceil(mean * (1 + ratio))
    return [rng.randint(low, high) for _ in range(count)]


def sample_requests(
    *,
    dataset_name: str,
    dataset_path: str | None,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    vocab_size: int,
    load_prompts,
) -> list[BenchRequest]:
    """The benchmark's requests (see the module docstring); ``load_prompts(path)`` reads JSONL.

    Raises:
        ValueError: unknown dataset, ``jsonl`` without a path, a count or length < 1, a range
            ratio outside [0, 1), or a malformed prompt file (from ``load_prompts``).
        OSError: an unreadable ``--dataset-path``.
    """
    if dataset_name not in DATASET_NAMES:
        raise ValueError(f"--dataset-name {dataset_name!r} is not one of {DATASET_NAMES}")
    for flag, value in (
        ("--num-prompts", num_prompts),
        ("--input-len", input_len),
        ("--output-len", output_len),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    if dataset_name == "jsonl":
        if not dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE.jsonl")
        prompts = load_prompts(dataset_path)
        return [
            BenchRequest(prompt_token_ids=list(prompts[i % len(prompts)]), output_len=output_len)
            for i in range(num_prompts)
        ]
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(
            prompt_token_ids=[rng.randrange(vocab_size) for _ in range(n_in)], output_len=n_out
        )
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; elsewhere since this module loaded)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _MODULE_LOADED_AT


_MODULE_LOADED_AT = time.monotonic()


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputResult:
    """Totals over all DP ranks of the timed run (JSON keys as ``vllm bench throughput``'s
    ``--output-json`` plus ours)."""

    model_id: str
    elapsed_time: float  # s, slowest rank, timed requests only
    num_requests: int
    total_num_tokens: int  # prompt + output tokens
    total_output_tokens: int
    requests_per_second: float
    tokens_per_second: float
    output_tokens_per_second: float
    num_steps: int  # rank 0's engine steps in the timed run
    num_ubatched_steps: int
    startup_s: float  # process start -> engine ready (graphs compiled)
    graph_capture_s: float
    graph_mode: bool
    capture_sizes: list[int]
    dtype: str
    data_parallel_size: int
    enable_dbo: bool
    cudagraph_mode: str = "NONE"
    num_whole_graphs: int = 0  # decode-only buckets captured whole (FULL_AND_PIECEWISE)

    def summary_line(self) -> str:
        """vLLM's line, same wording and format."""
        t = self.elapsed_time
        return (
            f"Throughput: {self.num_requests / t:.2f} requests/s, "
            f"{self.total_num_tokens / t:.2f} total tokens/s, "
            f"{self.total_output_tokens / t:.2f} output tokens/s"
        )

    def detail_line(self) -> str:
        mode = "eager"
        if self.graph_mode:
            whole = (
                f", {self.num_whole_graphs} decode graphs whole" if self.num_whole_graphs else ""
            )
            mode = f"graph mode {self.cudagraph_mode}{whole}, buckets {self.capture_sizes}"
        return (
            f"{self.num_steps} steps ({self.num_ubatched_steps} microbatched), "
            f"start-up {self.startup_s:.2f} s (graph capture {self.graph_capture_s:.2f} s), "
            f"{mode}, {self.dtype}, {self.data_parallel_size} DP rank(s), "
            f"DBO {'on' if self.enable_dbo else 'off'}"
        )

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=4)
