"""Command-line flags of the engine, with vLLM's names, and their validation.

Validation happens before any process group exists, on every rank alike, so a bad flag ends every
rank within seconds with the same one-line message instead of leaving a peer waiting in a
collective.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import types
from dataclasses import MISSING, dataclass, field, fields
from typing import NoReturn

from distributed.all2all import BACKENDS
from launch.engine.dp_load_balancer import DEFAULT_LOAD_BALANCE_METHOD, LOAD_BALANCE_METHODS

# --all2all-backend choices: the registry's names (one list of backends)
ALL2ALL_BACKENDS = tuple(BACKENDS)
# --all2all-backend when not given: under --enable-dbo the platform's
# (``Platform.dbo_all2all_backend``), else the plain uneven all-to-all.
DEFAULT_ALL2ALL_BACKEND = "all_to_all"
# float64 is for exactness tests (transformers builds the same checkpoint in float64), not serving.
DTYPES = ("float32", "bfloat16", "float64")
# --load-format (vLLM's names): "dummy" runs a checkpoint's config.json with seeded random weights
LOAD_FORMATS = ("auto", "safetensors", "dummy")
MAX_DISTRIBUTED_TIMEOUT_S = 86400.0  # a day: beyond it a hung peer is a hang, whatever the flag
AUTO = "auto"  # a DBO threshold learned by dbo.AdaptiveDBOPolicy instead of fixed
MIN_DBO_THRESHOLD = 2
# --ubatch-size: ubatches per microbatched step (vLLM's ParallelConfig.ubatch_size counts
# ubatches, not tokens); one thread each, so a small bound
DEFAULT_UBATCH_SIZE = 2
MAX_UBATCH_SIZE = 16


def dbo_threshold(text: str) -> int | str:
    """argparse type of ``--dbo-*-token-threshold``: an integer or ``auto``.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse reports it as one line).
    """
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= {MIN_DBO_THRESHOLD} or 'auto', got {text!r}"
        ) from None


def bounded_number(
    kind: type = float,
    *,
    low: float,
    low_inclusive: bool = True,
    high: float | None = None,
    unit: str = "",
):
    """An argparse type: a finite ``kind`` (float or int) in ``[low, high)`` (``(low, high)``
    without ``low_inclusive``; no upper bound when ``high`` is None). nan, inf and values out of
    range are refused there, so a flag's value is checked before any work starts.

    Returns:
        The type function; its ``ArgumentTypeError`` names the accepted range and the text
        (argparse prefixes the flag): ``argument --link-gbps: expected a finite number > 0
        (Gbit/s), got 'inf'``.
    """
    what = "an integer" if kind is int else "a finite number"
    bound = f"{'>=' if low_inclusive else '>'} {low:g}"
    if high is not None:
        bound = f"in {'[' if low_inclusive else '('}{low:g}, {high:g})"
    accepted = f"{what} {bound}" + (f" ({unit})" if unit else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        above = value >= low if low_inclusive else value > low
        if not (math.isfinite(value) and above and (high is None or value < high)):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value

    parse.__name__ = accepted  # argparse's "invalid <name> value" fallback names the range
    return parse


def parse_link(text: str, flag: str = "--emulate-link"):
    """``distributed.LinkSpec.parse(text)`` with finite values only (``latency_us`` >= 0 and
    ``gbps`` > 0, both finite: an infinite link would never deliver).

    Raises:
        ValueError: as ``LinkSpec.parse``, or naming ``flag``, the text and the accepted range.
    """
    from distributed.link_emulation import LinkSpec  # torch-free module, but keep it lazy

    spec = LinkSpec.parse(text)
    if not (math.isfinite(spec.latency_us) and math.isfinite(spec.gbps)):
        raise ValueError(
            f"{flag} {text!r}: expected finite latency_us >= 0 (µs) and gbps > 0 (Gbit/s)"
        )
    return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """What the engine needs, whatever the entry point (generate, serve, bench).

    Raises:
        ValueError: naming the offending value and what is accepted, if the flags contradict each
            other (``--enable-dbo`` without ``--enable-expert-parallel`` or with one DP rank, a
            non-positive size, an ``--ubatch-size`` outside its range, an unknown backend or dtype,
            a seed outside the 64-bit signed range, a non-finite or out-of-range timeout).
    """

    model: str | None = None
    load_format: str = "auto"
    dtype: str = "bfloat16"
    custom_ops: str = "all"
    # moe.layers.attention_backend's names; None: the platform's default, named by __post_init__
    attention_backend: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks_override: int | None = None  # KV cache blocks per rank (wins over the budget)
    # KV cache budget per rank in bytes (default: launch.engine.kv_cache_sizing's)
    kv_cache_memory_bytes: int | None = None
    # fraction of a GPU's memory the rank may use, the KV cache taking what the weights and a
    # profile step leave (launch.engine.kv_cache_sizing); the host keeps its default budget
    gpu_memory_utilization: float = 0.9
    data_parallel_size: int = 1
    share_gpus: bool = False  # more ranks than GPUs on a node: share them (else refused)
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    dbo_decode_token_threshold: int | str = 32  # or "auto": learned (dbo.AdaptiveDBOPolicy)
    dbo_prefill_token_threshold: int | str = 512
    # `launch.plan --write-prior` JSON: the adaptive policy's predicted speedup per bucket
    dbo_adaptive_prior: str | None = None
    ubatch_size: int | None = None  # ubatches per microbatched step; None: DEFAULT_UBATCH_SIZE
    all2all_backend: str | None = (
        None  # None: the platform's dbo_all2all_backend under DBO, else all_to_all
    )
    distributed_timeout_s: float = 120.0
    load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD  # see launch.engine.dp_load_balancer
    timeline_dir: str | None = None
    # vLLM's --profiler-config JSON (launch.engine.profiler); None: no profiler
    profiler_config: str | None = None
    emulate_link: str | None = None  # "latency_us=…,gbps=…": see distributed.link_emulation
    # graph mode (vLLM's names): compiled/captured pieces per padding bucket, see moe.compilation
    enforce_eager: bool = False
    # NONE / PIECEWISE / FULL_AND_PIECEWISE; None: the platform's (resolved in __post_init__)
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: the platform's default buckets
    max_cudagraph_capture_size: int | None = None
    # what the platform's check_and_update_config changed, one line each (for the start-up log;
    # set by __post_init__, kept by dataclasses.replace)
    platform_notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        self._check_choices()
        for flag, value, minimum in (
            ("--max-num-seqs", self.max_num_seqs, 1),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
            ("--block-size", self.block_size, 1),
            ("--data-parallel-size", self.data_parallel_size, 1),
        ):
            if value < minimum:
                raise ValueError(f"{flag} must be >= {minimum}, got {value}")
        self._check_dbo_settings()
        self._check_optional_limits()
        from launch.engine.request import check_seed

        check_seed(self.seed, "--seed")
        if self.enable_dbo and self.data_parallel_size < 2:
            raise ValueError(
                "--enable-dbo needs --data-parallel-size >= 2 (DBO overlaps the expert all-to-all "
                f"between DP ranks), got --data-parallel-size {self.data_parallel_size}"
            )
        self.link_spec()  # raises ValueError on a malformed --emulate-link
        self.adaptive_prior()  # raises ValueError on an unreadable --dbo-adaptive-prior
        self._resolve_cudagraph_mode()
        self.graph_capture_sizes()  # raises ValueError on bad capture sizes
        if self.enable_dbo and not self.enable_expert_parallel:
            raise ValueError(
                "--enable-dbo needs --enable-expert-parallel: without expert parallelism there is "
                "no all-to-all to overlap"
            )
        self._apply_platform()

    def _check_choices(self) -> None:
        """``--dtype``, ``--custom-ops``, ``--all2all-backend`` (its default resolved here) and
        ``--load-balance-method`` against what is accepted (ValueError naming the value)."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not supported; choose one of {DTYPES}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format {self.load_format!r} is not one of {LOAD_FORMATS}")
        from moe.platforms.custom_op import parse_custom_ops

        parse_custom_ops(self.custom_ops)
        if self.all2all_backend is None:
            from moe.platforms import current_platform

            default = (
                current_platform().dbo_all2all_backend
                if self.enable_dbo
                else DEFAULT_ALL2ALL_BACKEND
            )
            object.__setattr__(self, "all2all_backend", default)  # frozen: resolve the default
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"--all2all-backend {self.all2all_backend!r} is not supported; "
                f"choose one of {ALL2ALL_BACKENDS}"
            )
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"--load-balance-method {self.load_balance_method!r} is not one of "
                f"{LOAD_BALANCE_METHODS}"
            )

    def _check_optional_limits(self) -> None:
        """The KV cache overrides and ``--max-model-len`` (each >= 1 when given),
        ``--gpu-memory-utilization`` (in (0, 1]) and ``--distributed-timeout`` (finite, in (0, a
        day]); ValueError naming the value."""
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"--kv-cache-memory-bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN fails too
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
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

    def _check_dbo_settings(self) -> None:
        """The DBO thresholds and ``--ubatch-size`` (ValueError naming the value and the range)."""
        for flag, value in (
            ("--dbo-decode-token-threshold", self.dbo_decode_token_threshold),
            ("--dbo-prefill-token-threshold", self.dbo_prefill_token_threshold),
        ):
            if value != AUTO and (not isinstance(value, int) or value < MIN_DBO_THRESHOLD):
                raise ValueError(
                    f"{flag} must be an integer >= {MIN_DBO_THRESHOLD} or 'auto', got {value!r}"
                )
        if self.ubatch_size is not None and not (
            isinstance(self.ubatch_size, int) and 2 <= self.ubatch_size <= MAX_UBATCH_SIZE
        ):
            raise ValueError(
                f"--ubatch-size (ubatches per microbatched step) must be an integer in "
                f"[2, {MAX_UBATCH_SIZE}], got {self.ubatch_size!r}"
            )

    def _apply_platform(self) -> None:
        """The platform's ``check_and_update_config`` (vLLM's hook): it raises ValueError for a
        setting it cannot run, or returns changes, applied here with a note each."""
        from launch.engine.profiler import check_profiler_kind
        from moe.platforms import current_platform

        platform = current_platform()
        update = platform.check_and_update_config(self)
        refusal = check_profiler_kind(self.profiler(), platform)
        if refusal is not None:
            raise ValueError(refusal)
        for name, value in update.changes.items():
            object.__setattr__(self, name, value)  # frozen: the platform's adjustment
        new_notes = tuple(n for n in update.notes if n not in self.platform_notes)
        object.__setattr__(self, "platform_notes", self.platform_notes + new_notes)

    def compute_dtype(self):
        """``moe.platforms.ComputeDtype``: the torch dtype the model, its activations and its KV
        cache run in (``--dtype`` as the platform runs it: a bfloat16 request runs in float32 on
        a CPU without bfloat16 GEMMs) and the reason when it differs."""
        import torch

        from moe.platforms import current_platform

        return current_platform().compute_dtype(getattr(torch, self.dtype))

    @property
    def num_ubatches(self) -> int:
        """Ubatches a microbatched step is cut into (``--ubatch-size``, default 2)."""
        return DEFAULT_UBATCH_SIZE if self.ubatch_size is None else self.ubatch_size

    @property
    def adaptive_dbo_kinds(self) -> frozenset[str]:
        """Batch kinds ("decode", "prefill") whose DBO threshold is ``auto``."""
        kinds = (
            ("decode", self.dbo_decode_token_threshold),
            ("prefill", self.dbo_prefill_token_threshold),
        )
        return frozenset(kind for kind, value in kinds if value == AUTO)

    def adaptive_prior(self):
        """``--dbo-adaptive-prior`` as the adaptive policy's ``prior`` (None when not given).

        Raises:
            ValueError: the file is unreadable, not JSON, or not ``launch.plan``'s prior table.
        """
        if self.dbo_adaptive_prior is None:
            return None
        import json

        from dbo.adaptive_policy import prior_from_table

        path = self.dbo_adaptive_prior
        try:
            with open(path, encoding="utf-8") as f:
                return prior_from_table(json.load(f))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"--dbo-adaptive-prior {path!r}: {e}") from None

    def profiler(self):
        """``--profiler-config`` parsed, or ``$VLLM_TORCH_PROFILER_DIR``'s torch profiler
        (``launch.engine.profiler.profiler_config``; its ``profiler`` is None when neither is
        given).

        Raises:
            ValueError: as ``parse_profiler_config`` raises it (naming the key and the rule).
        """
        from launch.engine.profiler import profiler_config

        return profiler_config(self.profiler_config)

    def resolve_model(self):
        """``--model`` / ``--load-format`` / ``--max-model-len`` / ``--seed`` as the model to
        serve, read and checked before any process group exists (``moe.model_loader``'s
        ``ResolvedModel``; vLLM's ``create_model_config``).

        Raises:
            ValueError / OSError: as ``moe.model_loader.resolve_model`` raises them.
        """
        from moe.model_loader import resolve_model

        return resolve_model(
            self.model,
            load_format=self.load_format,
            max_model_len=self.max_model_len,
            seed=self.seed,
        )

    def link_spec(self):
        """``--emulate-link`` parsed (``distributed.LinkSpec``), or None when not given."""
        if self.emulate_link is None:
            return None
        return parse_link(self.emulate_link)

    def _resolve_cudagraph_mode(self) -> None:
        """``cudagraph_mode`` resolved (vLLM's rules): NONE with ``--enforce-eager``; when not
        given, the platform's first ``graph_modes`` entry if graphs are on (capture sizes given,
        or ``graph_mode_by_default``), else NONE.

        Raises:
            ValueError: a mode that is no ``cudagraph_mode`` or that the platform does not run.
        """
        from moe.compilation.config import check_cudagraph_mode
        from moe.platforms import current_platform

        platform = current_platform()
        mode = self.cudagraph_mode
        if mode is not None:
            check_cudagraph_mode(mode, ("NONE", *platform.graph_modes))
        if self.enforce_eager:
            mode = "NONE"
        elif mode is None:
            is_on = self.cudagraph_capture_sizes is not None or graph_mode_by_default(platform)
            mode = platform.graph_modes[0] if is_on else "NONE"
        object.__setattr__(self, "cudagraph_mode", mode)  # frozen: resolve the default

    def graph_capture_sizes(self) -> tuple[int, ...]:
        """The padding buckets of graph mode, ascending; ``()`` when ``cudagraph_mode`` is NONE
        (``--enforce-eager``, or graphs off by default on this platform).

        ``--cudagraph-capture-sizes`` as given (sorted, deduplicated), else the platform's default
        buckets (``Platform.default_capture_sizes``: on CUDA vLLM's, up to ``--max-num-seqs``)
        up to ``--max-cudagraph-capture-size``.

        Raises:
            ValueError: a size < 1, or sizes above ``--max-cudagraph-capture-size``.
        """
        from moe.compilation.config import resolve_capture_sizes  # torch-free module
        from moe.platforms import current_platform

        if self.cudagraph_mode in (None, "NONE"):
            return ()
        platform = current_platform()
        return resolve_capture_sizes(
            self.cudagraph_capture_sizes,
            max_capture_size=self.max_cudagraph_capture_size,
            default_sizes=lambda limit: platform.default_capture_sizes(
                limit,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
            ),
        )

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless the launcher started exactly ``--data-parallel-size`` ranks."""
        if world_size != self.data_parallel_size:
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} does not match the "
                f"{world_size} rank(s) torchrun started (--nproc-per-node x --nnodes); "
                "they must be equal (one DP rank per process)"
            )


def graph_mode_by_default(platform) -> bool:
    """Whether graph mode is on when no graph flag is given: ``MOE_DBO_GRAPH_MODE=1`` / ``=0``
    where the environment sets it (the test suite runs eagerly), else the platform's answer
    (``Platform.graphs_by_default``: on for CUDA, as vLLM; off on CPUs, where it did not win end to
    end, docs/benchmarks.md "What was tried and not adopted", and a first start compiles for
    minutes). ``--cudagraph-capture-sizes`` / ``-cc`` turn it on, ``--enforce-eager`` off."""
    forced = os.environ.get("MOE_DBO_GRAPH_MODE")
    if forced in ("0", "1"):
        return forced == "1"
    return platform.graphs_by_default


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """argparse type of ``--kv-cache-memory-bytes`` (vLLM's ``human_readable_int``): an integer,
    or a number with a decimal (``k m g t``: 10**3 ...) or binary (``K M G T``: 2**10 ...) suffix;
    decimals only with decimal suffixes (``1.5g``).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse reports it as one line).
    """
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    try:
        if match is None:
            return int(value)
        number, suffix = match.groups()
        if suffix in _DECIMAL_SUFFIXES:
            return int(float(number) * _DECIMAL_SUFFIXES[suffix])
        return int(number) * _BINARY_SUFFIXES[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, optionally with a suffix k/m/g/t (10**3...) or K/M/G/T "
            f"(2**10..., no decimals), got {text!r}"
        ) from None


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (vLLM's names) to ``parser``, in vLLM's argument groups."""
    # the declared defaults, not an instance: building one asks the platform (and would show its
    # adjustments as defaults; --help must not probe the CPU)
    d = types.SimpleNamespace(
        **{f.name: f.default for f in fields(EngineArgs) if f.default is not MISSING}
    )
    _add_model_args(parser.add_argument_group("ModelConfig"), d)
    _add_cache_args(parser.add_argument_group("CacheConfig"), d)
    _add_parallel_args(parser.add_argument_group("ParallelConfig"), d)
    _add_graph_mode_args(parser.add_argument_group("CompilationConfig"))


def _add_model_args(group: argparse._ArgumentGroup, d: EngineArgs) -> None:
    add = group.add_argument
    add("--model", default=None, help="Hugging Face checkpoint directory (default: embedded model)")
    add(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="'dummy': only the checkpoint's config.json is read and the weights are seeded "
        "random (real model shapes without a download); 'auto'/'safetensors': load the weights",
    )
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
    add(
        "--attention-backend",
        default=None,
        help="paged attention implementation: CPU_ATTN (our CPU kernel; the CPU's default), "
        "TRITON_ATTN (our Triton kernel over the cache in place; CUDA's default with Triton), "
        "TORCH_SDPA (padded SDPA chunks; CUDA's default without Triton), FLEX_ATTENTION "
        "(torch's compiled flex_attention over the cache in place; CUDA, GQA models)",
    )
    add("--seed", type=int, default=d.seed, help="seed for random weights and sampling")
    add("--timeline-dir", default=None, help="write a Chrome-trace timeline per rank here")
    add(
        "--profiler-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s profiler config, e.g. {"profiler": "torch", "torch_profiler_dir": DIR}: '
        "each rank writes a torch.profiler trace of the steps between start_profile and "
        "stop_profile (keys and rules: docs/profiling.md)",
    )


def _add_cache_args(group: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """Scheduler limits and the KV cache size."""
    add = group.add_argument
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
        help="KV cache blocks per rank (wins over --kv-cache-memory-bytes); fewer blocks make "
        "the scheduler preempt and recompute requests",
    )
    add(
        "--kv-cache-memory-bytes",
        type=human_readable_int,
        default=None,
        metavar="BYTES",
        help="KV cache budget per rank, e.g. 4G (2**30), 500m (10**6) or bytes (default: on a "
        "GPU, what --gpu-memory-utilization leaves; on the host VLLM_CPU_KVCACHE_SPACE GiB if "
        "set, else 4 GiB; never more than --max-num-seqs full-length requests use; it must hold "
        "one --max-model-len request)",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="fraction in (0, 1] of a GPU's memory this rank may use: the KV cache gets it minus "
        "what is in use after a profile step at --max-num-batched-tokens (ignored on the host "
        "and under --kv-cache-memory-bytes or --num-gpu-blocks-override)",
    )


def _add_dbo_args(group: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """The DBO thresholds (an integer or 'auto'), the adaptive policy's prior, ``--ubatch-size``."""
    add = group.add_argument
    add(
        "--dbo-decode-token-threshold",
        type=dbo_threshold,
        default=d.dbo_decode_token_threshold,
        help="min tokens of a decode-only batch to microbatch it, or 'auto': the engine learns "
        "per batch size whether microbatching pays (explores both, keeps the faster)",
    )
    add(
        "--dbo-prefill-token-threshold",
        type=dbo_threshold,
        default=d.dbo_prefill_token_threshold,
        help="min tokens of a batch with a prefill to microbatch it, or 'auto' (learned)",
    )
    add(
        "--dbo-adaptive-prior",
        default=None,
        metavar="FILE",
        help="with 'auto' thresholds, start each new batch size from launch.plan's predicted "
        "speedup (launch.plan --write-prior FILE): fewer exploration steps where samples agree",
    )
    add(
        "--ubatch-size",
        "--num-ubatches",
        dest="ubatch_size",
        type=int,
        default=None,
        metavar="N",
        help=f"with --enable-dbo: ubatches (threads) a microbatched step is cut into, 2 to "
        f"{MAX_UBATCH_SIZE} (vLLM's name; a count of ubatches, not tokens; default "
        f"{DEFAULT_UBATCH_SIZE}); fewer for a step too small to give every ubatch a token",
    )


def _add_parallel_args(group: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """DP, EP, DBO, the expert all-to-all and the distributed timeout."""
    from moe.platforms.interface import CpuPlatform, CudaPlatform

    add = group.add_argument
    add("--data-parallel-size", type=int, default=d.data_parallel_size, help="DP ranks")
    add(
        "--share-gpus",
        action="store_true",
        help="let more ranks than GPUs run on a node, sharing GPUs round-robin (without it that "
        "is refused); their process groups then run on gloo, transfers staged through host memory",
    )
    add("--enable-expert-parallel", action="store_true", help="shard experts over the DP ranks")
    add("--enable-dbo", action="store_true", help="Dual Batch Overlap of the expert all-to-all")
    _add_dbo_args(group, d)  # listed right after --enable-dbo
    add(
        "--all2all-backend",
        default=None,
        choices=ALL2ALL_BACKENDS,
        help="expert all-to-all (default with --enable-dbo: the platform's, "
        f"{CpuPlatform.dbo_all2all_backend} on CPUs and {CudaPlatform.dbo_all2all_backend} on "
        f"CUDA; else {DEFAULT_ALL2ALL_BACKEND})",
    )
    add(
        "--load-balance-method",
        default=d.load_balance_method,
        choices=LOAD_BALANCE_METHODS,
        help="which DP rank serves a request (SGLang's names): round_robin, shortest_queue (fewest "
        "open requests; round robin when all arrive at once) or minimum_tokens (fewest open prompt "
        "+ max new tokens)",
    )
    add(
        "--distributed-timeout",
        dest="distributed_timeout_s",
        type=float,
        default=d.distributed_timeout_s,
        help="seconds any collective or ubatch wait may block before the run fails",
    )
    add(
        "--emulate-link",
        default=None,
        metavar="latency_us=…,gbps=…",
        help="emulate a slower link for the expert all-to-all: bytes move through the backend, "
        "and each collective completes no earlier than issue + latency + bytes / bandwidth",
    )


def _add_graph_mode_args(group: argparse._ArgumentGroup) -> None:
    """``--enforce-eager``, ``--cudagraph-capture-sizes``, ``--max-cudagraph-capture-size`` and the
    ``-cc/--compilation-config`` JSON subset (vLLM's spellings)."""
    add = group.add_argument
    add(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (no compiled / captured graphs; cudagraph_mode NONE)",
    )
    add(
        "--cudagraph-capture-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="padding buckets (tokens per forward, per ubatch under DBO) that get a graph; "
        "larger batches run eagerly",
    )
    add(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        help="largest default bucket (ignored when --cudagraph-capture-sizes is given)",
    )
    add(
        "-cc",
        "--compilation-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s compilation config, the subset {"cudagraph_mode": "FULL_AND_PIECEWISE" | '
        '"PIECEWISE" | "NONE", "cudagraph_capture_sizes": [...], "max_cudagraph_capture_size": N} '
        "(default mode: the platform's, FULL_AND_PIECEWISE on CUDA)",
    )


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """Build EngineArgs from parsed flags (ValueError as EngineArgs raises it, for
    ``--ubatch-size`` without ``--enable-dbo``, or for a ``--compilation-config`` that is not the
    supported JSON subset)."""
    fields = EngineArgs.__dataclass_fields__
    values = {name: getattr(ns, name) for name in fields if hasattr(ns, name)}
    if values.get("ubatch_size") is not None and not values.get("enable_dbo"):
        raise ValueError(
            f"--ubatch-size {values['ubatch_size']} needs --enable-dbo (it sets how many ubatches "
            "DBO cuts a step into)"
        )
    compilation_config = getattr(ns, "compilation_config", None)
    if compilation_config is not None:
        from moe.compilation.config import parse_compilation_config

        parsed = parse_compilation_config(compilation_config)
        for key, value in parsed.items():
            if values.get(key) is not None:
                raise ValueError(
                    f"--compilation-config sets {key} and --{key.replace('_', '-')} is given too; "
                    "they are mutually exclusive"
                )
            values[key] = value
    if values.get("cudagraph_capture_sizes") is not None:
        values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
    return EngineArgs(**values)


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
