"""The serving benchmark's workload and statistics, after ``vllm bench serve``
(``vllm/benchmarks/serve.py`` and ``datasets.py``): the random dataset, Poisson/gamma arrivals, and
the "Serving Benchmark Result" block printed in vLLM's layout so that both can be read side by side.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    ok: bool
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    itls_s: tuple[float, ...] = ()  # gaps between consecutive streamed tokens
    latency_s: float = 0.0  # end to end
    num_prompt_tokens: int | None = None  # the server's count (chat: the rendered template)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with a single token), as vLLM's TPOT."""
        if self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    num_ok: int
    num_failed: int
    duration_s: float
    num_output_tokens: int
    num_input_tokens: int
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    ubatched_step_fraction: float | None
    tpot_s: tuple[float, ...] = ()
    e2el_s: tuple[float, ...] = ()
    first_error: str = ""

    def rows(self) -> dict[str, str]:
        """The short side-by-side table (DBO off / on)."""

        def ms(values, q):
            return f"{percentile(values, q) * 1e3:.1f}" if values else "n/a"

        frac = self.ubatched_step_fraction
        return {
            "requests ok / failed": f"{self.num_ok} / {self.num_failed}",
            "duration (s)": f"{self.duration_s:.2f}",
            "request throughput (req/s)": f"{self.num_ok / self.duration_s:.2f}",
            "output throughput (tok/s)": f"{self.num_output_tokens / self.duration_s:.1f}",
            "total throughput (tok/s)": (
                f"{(self.num_output_tokens + self.num_input_tokens) / self.duration_s:.1f}"
            ),
            "TTFT median (ms)": ms(self.ttft_s, 50),
            "TTFT p99 (ms)": ms(self.ttft_s, 99),
            "ITL median (ms)": ms(self.itl_s, 50),
            "ITL p99 (ms)": ms(self.itl_s, 99),
            "steps microbatched (%)": "n/a" if frac is None else f"{100 * frac:.0f}",
        }

    def summary(
        self,
        *,
        percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
        metric_percentiles: tuple[float, ...] = (99.0,),
        max_concurrency: int | None = None,
    ) -> str:
        """vLLM's "Serving Benchmark Result" block (same labels, widths and precision)."""
        lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

        def add(label: str, value, fmt: str = "") -> None:
            lines.append(f"{label:<40} {value:<10{fmt}}")

        duration = self.duration_s
        add("Successful requests:", self.num_ok)
        add("Failed requests:", self.num_failed)
        if max_concurrency is not None:
            add("Maximum request concurrency:", max_concurrency)
        add("Benchmark duration (s):", duration, ".2f")
        add("Total input tokens:", self.num_input_tokens)
        add("Total generated tokens:", self.num_output_tokens)
        add("Request throughput (req/s):", self.num_ok / duration, ".2f")
        add("Output token throughput (tok/s):", self.num_output_tokens / duration, ".2f")
        total = self.num_input_tokens + self.num_output_tokens
        add("Total Token throughput (tok/s):", total / duration, ".2f")
        for metric in percentile_metrics:
            name, header = METRIC_HEADERS[metric]
            values_ms = [v * 1e3 for v in getattr(self, f"{metric}_s")]
            lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
            add(f"Mean {name} (ms):", statistics.fmean(values_ms) if values_ms else 0.0, ".2f")
            add(f"Median {name} (ms):", percentile(values_ms, 50) if values_ms else 0.0, ".2f")
            for p in metric_percentiles:
                word = str(int(p)) if int(p) == p else str(p)
                add(f"P{word} {name} (ms):", percentile(values_ms, p) if values_ms else 0.0, ".2f")
        lines.append("=" * 50)
        return "\n".join(lines)


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    vocab_low: int,
    vocab_high: int,
    seed: int,
) -> list[RandomRequest]:
    """vLLM's random dataset on token ids: ``prefix_len`` shared random tokens, then per request
    an input length drawn uniformly from [input_len * (1 - r), input_len * (1 + r)] (and the same
    for the output length), token ids uniform in [vocab_low, vocab_high).

    Raises:
        ValueError: ``range_ratio`` outside [0, 1).
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_low, vocab_high) for _ in range(prefix_len)]

    def length(center: int) -> int:
        low, high = int(center * (1 - range_ratio)), int(center * (1 + range_ratio))
        return max(rng.randint(low, high), 1)

    requests = []
    for _ in range(num_prompts):
        num_input, num_output = length(input_len), length(output_len)
        tokens = [rng.randrange(vocab_low, vocab_high) for _ in range(num_input)]
        requests.append(RandomRequest(prompt_token_ids=prefix + tokens, output_len=num_output))
    return requests


def arrival_gaps(
    num_requests: int, *, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Seconds between request starts: gamma-distributed with shape ``burstiness`` and mean
    1 / ``request_rate`` (1.0: a Poisson process), as vLLM's; all zero for an infinite rate."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num_requests)]
