"""Command-line flags of the engine, with vLLM's names, and their validation.

Validation happens before any process group exists, on every rank alike, so a bad flag ends every
rank within seconds with the same one-line message instead of leaving a peer waiting in a collective.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import NoReturn

ALL2ALL_BACKENDS = ("all_to_all", "allgather_reducescatter")
# float64 is for exactness tests (transformers builds the same checkpoint in float64), not serving.
DTYPES = ("float32", "bfloat16", "float64")
MAX_DISTRIBUTED_TIMEOUT_S = 86400.0  # a day: beyond it a hung peer is a hang, whatever the flag


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """What the engine needs, whatever the entry point (generate, serve, bench).

    Raises:
        ValueError: naming the offending value and what is accepted, if the flags contradict each
            other (``--enable-dbo`` without ``--enable-expert-parallel`` or with one DP rank, a
            non-positive size, an unknown backend or dtype, a seed outside the 64-bit signed range,
            a non-finite or out-of-range timeout).
    """

    model: str | None = None
    dtype: str = "bfloat16"
    custom_ops: str = "all"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks_override: int | None = None  # KV cache blocks per rank (default: no preemption)
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    all2all_backend: str = "all_to_all"
    distributed_timeout_s: float = 120.0
    timeline_dir: str | None = None
    emulate_link: str | None = None  # "latency_us=…,gbps=…": see distributed.link_emulation

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not supported; choose one of {DTYPES}")
        from moe.platforms.custom_op import parse_custom_ops

        parse_custom_ops(self.custom_ops)
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"--all2all-backend {self.all2all_backend!r} is not supported; "
                f"choose one of {ALL2ALL_BACKENDS}"
            )
        for flag, value, minimum in (
            ("--max-num-seqs", self.max_num_seqs, 1),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
            ("--block-size", self.block_size, 1),
            ("--data-parallel-size", self.data_parallel_size, 1),
            ("--dbo-decode-token-threshold", self.dbo_decode_token_threshold, 2),
            ("--dbo-prefill-token-threshold", self.dbo_prefill_token_threshold, 2),
        ):
            if value < minimum:
                raise ValueError(f"{flag} must be >= {minimum}, got {value}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if not (
            math.isfinite(self.distributed_timeout_s)
            and 0 < self.distributed_timeout_s <= MAX_DISTRIBUTED_TIMEOUT_S
        ):
            raise ValueError(
                f"--distributed-timeout must be in (0, {MAX_DISTRIBUTED_TIMEOUT_S:g}] s, "
                f"got {self.distributed_timeout_s}"
            )
        from launch.engine.request import check_seed

        check_seed(self.seed, "--seed")
        if self.enable_dbo and self.data_parallel_size < 2:
            raise ValueError(
                "--enable-dbo needs --data-parallel-size >= 2 (DBO overlaps the expert all-to-all "
                f"between DP ranks), got --data-parallel-size {self.data_parallel_size}"
            )
        self.link_spec()  # raises ValueError on a malformed --emulate-link
        if self.enable_dbo and not self.enable_expert_parallel:
            raise ValueError(
                "--enable-dbo needs --enable-expert-parallel: without expert parallelism there is "
                "no all-to-all to overlap"
            )

    def link_spec(self):
        """``--emulate-link`` parsed (``distributed.LinkSpec``), or None when not given."""
        if self.emulate_link is None:
            return None
        from distributed.link_emulation import LinkSpec  # torch-free module, but keep it lazy

        return LinkSpec.parse(self.emulate_link)

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless the launcher started exactly ``--data-parallel-size`` ranks."""
        if world_size != self.data_parallel_size:
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} does not match the "
                f"{world_size} rank(s) torchrun started (--nproc-per-node x --nnodes); "
                "they must be equal (one DP rank per process)"
            )


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (vLLM's names) to ``parser``."""
    d = EngineArgs()
    add = parser.add_argument
    add("--model", default=None, help="Hugging Face checkpoint directory (default: embedded model)")
    add(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="weights and activations dtype (float32 for comparisons; float64 for the exactness "
        "tests against transformers)",
    )
    add(
        "--custom-ops",
        default=d.custom_ops,
        help="which ops use their platform path: 'all', 'none', '+name', '-name', comma-separated "
        "(e.g. 'none,+experts'); the others run forward_native",
    )
    add("--seed", type=int, default=d.seed, help="seed for random weights and sampling")
    add("--max-model-len", type=int, default=None, help="max prompt + output tokens per request")
    add("--max-num-seqs", type=int, default=d.max_num_seqs, help="max requests per step per rank")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="max tokens per step per rank (prefill is chunked to fit)",
    )
    add("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    add(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV cache blocks per rank (default: max-num-seqs full-length requests); fewer "
        "blocks make the scheduler preempt and recompute requests",
    )
    add("--data-parallel-size", type=int, default=d.data_parallel_size, help="DP ranks")
    add("--enable-expert-parallel", action="store_true", help="shard experts over the DP ranks")
    add("--enable-dbo", action="store_true", help="Dual Batch Overlap of the expert all-to-all")
    add(
        "--dbo-decode-token-threshold",
        type=int,
        default=d.dbo_decode_token_threshold,
        help="min tokens of a decode-only batch to microbatch it",
    )
    add(
        "--dbo-prefill-token-threshold",
        type=int,
        default=d.dbo_prefill_token_threshold,
        help="min tokens of a batch with a prefill to microbatch it",
    )
    add("--all2all-backend", default=d.all2all_backend, choices=ALL2ALL_BACKENDS)
    add(
        "--distributed-timeout",
        dest="distributed_timeout_s",
        type=float,
        default=d.distributed_timeout_s,
        help="seconds any collective or ubatch wait may block before the run fails",
    )
    add("--timeline-dir", default=None, help="write a Chrome-trace timeline per rank here")
    add(
        "--emulate-link",
        default=None,
        metavar="latency_us=…,gbps=…",
        help="emulate a slower link for the expert all-to-all: bytes move through the backend, "
        "and each collective completes no earlier than issue + latency + bytes / bandwidth",
    )


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """Build EngineArgs from parsed flags (ValueError as EngineArgs raises it)."""
    fields = EngineArgs.__dataclass_fields__
    return EngineArgs(**{name: getattr(ns, name) for name in fields if hasattr(ns, name)})


def print_error(prog: str, rank: int | None, message: object) -> None:
    """Write ``message`` as one line on stderr, prefixed with the program and rank."""
    where = f" [rank {rank}]" if rank is not None else ""
    one_line = " ".join(str(message).split())
    # One write of the whole line: ranks share torchrun's stderr, and print()'s separate write of
    # the newline lets another rank's line land in between when stderr is unbuffered.
    sys.stderr.write(f"{prog}{where}: error: {one_line}\n")
    sys.stderr.flush()


def fail(prog: str, rank: int | None, message: object, status: int = 2) -> NoReturn:
    """``print_error`` the message, then exit with ``status``."""
    print_error(prog, rank, message)
    raise SystemExit(status)
