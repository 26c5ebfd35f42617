"""The planner's roofline cost model (``RooflineCostModel``): the per-layer compute of a MoE model
predicted for a device from presets, each GEMM or attention kernel taking max(FLOPs / achieved
FLOP/s, bytes / achieved bandwidth) plus the device's kernel floor. (Measuring how close a real
step runs to this machine's limits is ``launch.benchmarks.roofline``.)

Splitting a batch into N ubatches is priced by the same formulas at num_tokens / N: every ubatch
re-reads the weights (memory-bound GEMMs cost nearly as much for half the rows) and pays every
kernel floor again, which is why DBO loses on small decode batches.

Per device with DP attention and expert parallelism (the deployment of the lmsys blog 2025-05-05):
attention, router and shared experts run on the device's own tokens; its ceil(num_experts / EP)
experts receive num_tokens * top-k rows (balanced routing); dispatch sends num_tokens * top-k
token copies (DeepEP's low-latency layout), combine returns as many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dbo.planning.devices import DeviceSpec
from dbo.planning.schedule import LayerCosts

if TYPE_CHECKING:  # the planner prices a model's config; it never builds the model
    from moe.models.config import MoEModelConfig

BYTES = {"fp8": 1.0, "bf16": 2.0, "fp32": 4.0}
FP8_SCALE_BYTES_PER_ELEMENT = 4 / 128  # DeepEP FP8 dispatch: one fp32 scale per 128 channels
# kernels per layer and ubatch besides the GEMMs, attention and grouped GEMMs priced below, as in
# a DeepSeek decode layer: 4 RMSNorms, rope, the second absorbed bmm, 6 FP8 activation
# quantisations, top-k, 2 SiLU-and-mul, the residual add (a count, not a measurement)
NUM_MISC_KERNELS = 16
# of those, the ones before the attention core: the input and the two latent RMSNorms, rope and
# three of the quantisations (a count, as above)
NUM_MISC_KERNELS_BEFORE_ATTENTION_CORE = 7
KINDS = ("decode", "prefill")


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What a device computes per step: ``context_len`` tokens already cached per decode request,
    ``prompt_len`` tokens per prefill request.

    Raises:
        ValueError: a length < 1.
    """

    context_len: int = 2000
    prompt_len: int = 2000

    def __post_init__(self) -> None:
        if self.context_len < 1 or self.prompt_len < 1:
            raise ValueError(
                "context and prompt lengths must be >= 1, "
                f"got {self.context_len}, {self.prompt_len}"
            )


class RooflineCostModel:
    """``CostModel`` of a preset model on a preset device (see the module docstring).

    Args:
        config: the model's shapes.
        device: peaks and achieved fractions.
        ep_size: expert-parallel ranks (experts per device = ceil(num_experts / ep_size)).
        weight_dtype: "fp8" / "bf16" / "fp32" for the linear layers' weights and GEMMs.
        combine_dtype: dtype of the combine payload ("bf16" / "fp32").
        workload: context and prompt lengths.

    Raises:
        ValueError: ``ep_size < 1`` or an unknown dtype.
    """

    def __init__(
        self,
        config: MoEModelConfig,
        device: DeviceSpec,
        *,
        ep_size: int,
        weight_dtype: str = "fp8",
        combine_dtype: str = "bf16",
        workload: Workload | None = None,
    ) -> None:
        if ep_size < 1:
            raise ValueError(f"--ep-size must be >= 1, got {ep_size}")
        for dtype in (weight_dtype, combine_dtype):
            if dtype not in BYTES:
                raise ValueError(f"dtype must be one of {sorted(BYTES)}, got {dtype!r}")
        self.config = config
        self.device = device
        self.ep_size = ep_size
        self.weight_dtype = weight_dtype
        self.combine_dtype = combine_dtype
        self.workload = workload or Workload()
        self.num_moe_layers = sum(config.moe_layers)
        self.num_dense_layers = config.num_hidden_layers - self.num_moe_layers

    def turn_ms(self, num_tokens: float, num_ubatches: int) -> float:
        """0: ubatch switches are stream events inside a CUDA graph (no CPU baton), and a
        transfer's receive runs as kernels, priced in ``sm_fraction``."""
        return 0.0

    def peer_arrival_ms(self, num_tokens: float, num_ubatches: int) -> tuple[float, ...]:
        """(): from presets, ranks are taken to issue each collective together (no measured
        drift between them; ``CalibratedCostModel`` measures it)."""
        return ()

    # --- one kernel ------------------------------------------------------------------------
    def _kernel_ms(
        self, flops: float, num_bytes: float, dtype: str, count: int = 1, rows: float = 4096
    ) -> float:
        d = self.device
        compute_s = flops / d.flops_per_s(dtype, rows)
        return max(compute_s, num_bytes / d.bytes_per_s) * 1e3 + count * d.kernel_us / 1e3

    def gemm_ms(self, rows: float, k: int, n: int, *, dtype: str | None = None) -> float:
        """One GEMM ``[rows, k] @ [k, n]``: max(2 rows k n / FLOP/s, bytes / bandwidth) + the
        kernel floor, in ms; weights in ``dtype`` (default the model's), activations bf16."""
        dtype = dtype or self.weight_dtype
        act = 2.0  # bf16 activations in and out
        return self._kernel_ms(
            2 * rows * k * n, k * n * BYTES[dtype] + rows * (k + n) * act, dtype, rows=rows
        )

    # --- parts of a layer ------------------------------------------------------------------
    def attention_ms(self, kind: str, num_tokens: float) -> float:
        """Projections and the attention kernel for ``num_tokens`` tokens of ``kind``."""
        return sum(self.attention_parts_ms(kind, num_tokens))

    def attention_parts_ms(self, kind: str, num_tokens: float) -> tuple[float, float]:
        """``attention_ms`` as (before the attention core: the query and key/value projections,
        and for absorbed MLA the query's absorption into the latent; the core: the attention
        kernel and the output projections)."""
        c = self.config
        if c.attention_type == "mla":
            return self._mla_parts_ms(kind, num_tokens)
        h, hd, q, kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        prepare = self.gemm_ms(num_tokens, h, (q + 2 * kv) * hd)
        out = self.gemm_ms(num_tokens, q * hd, h)
        if kind == "decode":
            ctx = self.workload.context_len
            core = self._kernel_ms(
                4 * num_tokens * ctx * q * hd, num_tokens * ctx * 4 * kv * hd, "bf16"
            )
        else:
            ctx = self.workload.prompt_len / 2  # causal: a prompt token sees half the prompt
            core = self._kernel_ms(
                4 * num_tokens * ctx * q * hd, num_tokens * 2 * (q + 2 * kv) * hd, "bf16"
            )
        return prepare, core + out

    def _mla_parts_ms(self, kind: str, t: float) -> tuple[float, float]:
        c = self.config
        h, nh = c.hidden_size, c.num_attention_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        latent = c.kv_lora_rank + c.qk_rope_head_dim
        if c.q_lora_rank:
            q = self.gemm_ms(t, h, c.q_lora_rank) + self.gemm_ms(t, c.q_lora_rank, nh * qk)
        else:
            q = self.gemm_ms(t, h, nh * qk)
        kv_a = self.gemm_ms(t, h, latent)
        kv_b = self.gemm_ms(t, c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim))
        # kv_b's key half absorbs the query before the core, its value half the core's output
        kv_b_key = kv_b * c.qk_nope_head_dim / (c.qk_nope_head_dim + c.v_head_dim)
        o = self.gemm_ms(t, nh * c.v_head_dim, h)
        if kind == "decode":  # absorbed: multi-query attention over the cached latent (bf16)
            ctx = self.workload.context_len
            core = self._kernel_ms(
                2 * t * ctx * nh * (latent + c.kv_lora_rank), t * ctx * latent * 2, "bf16"
            )
        else:
            ctx = self.workload.prompt_len / 2
            core = self._kernel_ms(
                2 * t * ctx * nh * (qk + c.v_head_dim), t * nh * (2 * qk + c.v_head_dim) * 2, "bf16"
            )
        return q + kv_a + kv_b_key, kv_b - kv_b_key + o + core

    def experts_ms(self, num_tokens: float) -> float:
        """This device's routed experts on the ``num_tokens * top-k`` rows it receives."""
        c = self.config
        num_local = math.ceil(c.num_experts / self.ep_size)
        rows = num_tokens * c.num_experts_per_tok
        # distinct local experts hit by `rows` uniformly routed rows: only those weights are read
        active = num_local * (1 - (1 - 1 / num_local) ** rows) if num_local > 1 else 1.0
        inter, h = c.moe_intermediate_size, c.hidden_size
        w_bytes = active * 3 * h * inter * BYTES[self.weight_dtype]
        flops = 2 * rows * 3 * h * inter
        return self._kernel_ms(
            flops,
            w_bytes + rows * (3 * h + 2 * inter) * 2,
            self.weight_dtype,
            count=3,
            rows=rows / max(active, 1.0),  # rows per expert: the grouped GEMM's M
        )

    def mlp_ms(self, num_tokens: float, intermediate: int) -> float:
        """A gated MLP (shared experts, dense layers) of width ``intermediate``; 0 if none."""
        if intermediate <= 0:
            return 0.0
        h = self.config.hidden_size
        return self.gemm_ms(num_tokens, h, 2 * intermediate) + self.gemm_ms(
            num_tokens, intermediate, h
        )

    def _misc_ms(self, num_tokens: float, count: int = NUM_MISC_KERNELS) -> float:
        h = self.config.hidden_size
        return self._kernel_ms(0, num_tokens * h * 2 * 2 * count, "bf16", count)

    # --- the CostModel interface ----------------------------------------------------------
    def parts_ms(self, kind: str, num_tokens: float) -> dict[str, float]:
        """One MoE layer's compute by part (ms) for ``num_tokens`` tokens."""
        c = self.config
        return {
            "attention": self.attention_ms(kind, num_tokens),
            "router": self.gemm_ms(num_tokens, c.hidden_size, c.num_experts, dtype="bf16"),
            "other kernels": self._misc_ms(num_tokens),
            "experts": self.experts_ms(num_tokens),
            "shared experts": self.mlp_ms(num_tokens, c.shared_intermediate_size),
        }

    def layer_costs(self, kind: str, num_tokens: float, *, num_ubatches: int = 1) -> LayerCosts:
        """One ubatch of ``num_tokens`` tokens in one MoE layer (the roofline prices a ubatch
        the same whatever ``num_ubatches``)."""
        c = self.config
        parts = self.parts_ms(kind, num_tokens)
        copies = num_tokens * c.num_experts_per_tok
        dispatch_elem = (
            1 + FP8_SCALE_BYTES_PER_ELEMENT if self.weight_dtype == "fp8" else BYTES["bf16"]
        )
        prepare = self.attention_parts_ms(kind, num_tokens)[0]
        return LayerCosts(
            pre_ms=parts["attention"] + parts["router"] + parts["other kernels"],
            attn_prepare_ms=prepare
            + self._misc_ms(num_tokens, NUM_MISC_KERNELS_BEFORE_ATTENTION_CORE),
            mid_ms=parts["experts"],
            shared_ms=parts["shared experts"],
            dispatch_bytes=copies * c.hidden_size * dispatch_elem,
            combine_bytes=copies * c.hidden_size * BYTES[self.combine_dtype],
        )

    def outside_ms(self, kind: str, num_tokens: float, num_ubatches: int) -> float:
        """Per step outside the MoE layers: dense layers (each ubatch in turn, no transfers)
        and the LM head on the sampled rows."""
        c = self.config
        per = num_tokens / num_ubatches
        dense = (
            self.num_dense_layers
            * num_ubatches
            * (
                self.attention_ms(kind, per)
                + self.mlp_ms(per, c.intermediate_size)
                + self._misc_ms(per)
            )
        )
        rows = num_tokens if kind == "decode" else math.ceil(num_tokens / self.workload.prompt_len)
        return dense + self.gemm_ms(rows, c.hidden_size, c.vocab_size, dtype="bf16")

    def describe(self) -> str:
        return (
            f"roofline: {self.device.name}, {self.weight_dtype} weights, EP {self.ep_size}, "
            f"context {self.workload.context_len}, prompt {self.workload.prompt_len}"
        )
