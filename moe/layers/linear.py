"""``Linear``: ``nn.Linear`` as a ``CustomOp`` whose CPU path runs on a weight prepacked once by
oneDNN (bfloat16, float32), with the limits where the pack pays; ``process_weights_after_loading``
makes the packs. When each path runs: docs/hardware.md, "Linear packs" and "Linear layers"."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.platforms.cpu_capability import onednn_linear_unavailable_reason
from moe.platforms.custom_op import CustomOp, is_tracing
from moe.platforms.device_probes import is_host
from moe.platforms.plugins import current_platform

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float32)


# Where float32 GEMMs use the pack: the platform answers per CPU vendor and ISA
# (``Platform.float32_pack_limits``; docs/hardware.md, "Linear layers").
# None: the platform's value; a number overrides it (tests set them). Read at call time.
FLOAT32_MAX_PACKED_ROWS: int | None = None
FLOAT32_MIN_PACKED_ELEMENTS: int | None = None


def float32_max_packed_rows() -> int:
    """Rows above which a float32 batch takes ``F.linear`` instead of the pack."""
    if FLOAT32_MAX_PACKED_ROWS is not None:
        return FLOAT32_MAX_PACKED_ROWS
    return current_platform().float32_pack_limits().max_rows


def float32_min_packed_elements() -> int:
    """Weight elements (per matrix) below which a float32 weight is not packed."""
    if FLOAT32_MIN_PACKED_ELEMENTS is not None:
        return FLOAT32_MIN_PACKED_ELEMENTS
    return current_platform().float32_pack_limits().min_elements


_MIN_PADDED_ROWS = 16  # below it every size is its own bucket
_FINE_PADDING_ROWS = 256  # from here on buckets are 1/64 of a power of two (at least 16 rows)
# bfloat16 GEMMs this small run faster in float32 on exact float32 copies of the weights: oneDNN's
# per-call cost dominates them. bfloat16 is a subset of float32 and a product of two bfloat16
# values is exact in float32, so both paths sum the same exact products in float32 and round once
# to bfloat16 (only the summation order differs). Limits chosen from the timings in
# docs/hardware.md, "Linear layers" (``upcast_wins`` applies them).
BFLOAT16_UPCAST_MAX_ELEMENTS = 1 << 16  # weight elements (a float32 copy is kept: 256 KiB at most)
BFLOAT16_UPCAST_MAX_MACS = 1 << 19  # rows * weight elements
_warned: set[str] = set()


def packing_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why weights of ``dtype`` cannot be prepacked for oneDNN on this CPU, or None if they can
    (probed once: ``moe.platforms.cpu_capability.onednn_linear_unavailable_reason``)."""
    if dtype not in PACKED_DTYPES:
        return f"{dtype} has no oneDNN linear kernel"
    return onednn_linear_unavailable_reason(dtype)


def padded_num_rows(num_rows: int) -> int:
    """Rows a batch of ``num_rows`` is padded to: itself up to 16, then steps of 1/8 of a power of
    two below ``_FINE_PADDING_ROWS`` (17 -> 20, 100 -> 112), of 1/64 from there (at least 16:
    577 -> 592, 2000 -> 2016, 2049 -> 2112): at most 12.5 % of a small batch's rows are padding
    and 3.1 % of a large one's."""
    if num_rows <= _MIN_PADDED_ROWS:
        return num_rows
    octave = (num_rows - 1).bit_length()  # >= 5 here
    if num_rows < _FINE_PADDING_ROWS:
        step = 1 << (octave - 3)
    else:
        step = max(_MIN_PADDED_ROWS, 1 << (octave - 6))
    return math.ceil(num_rows / step) * step


def can_upcast(weight: Tensor, *, num_elements: int | None = None) -> bool:
    """Whether ``weight`` (bfloat16, at most ``BFLOAT16_UPCAST_MAX_ELEMENTS`` elements per matrix)
    keeps a float32 copy for ``upcast_linear``."""
    size = weight.numel() if num_elements is None else num_elements
    return weight.dtype == torch.bfloat16 and size <= BFLOAT16_UPCAST_MAX_ELEMENTS


def upcast_wins(x: Tensor, weight_elements: int) -> bool:
    """Whether ``x`` [..., in_features] (bfloat16) times a ``weight_elements`` weight is small
    enough for ``upcast_linear`` to beat the packed bfloat16 GEMM (see the thresholds above)."""
    num_rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.dtype == torch.bfloat16
        and weight_elements <= BFLOAT16_UPCAST_MAX_ELEMENTS
        and num_rows * weight_elements <= BFLOAT16_UPCAST_MAX_MACS
    )


def upcast_linear(x: Tensor, weight32: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` of bfloat16 ``x`` in float32 on ``weight32`` (the exact float32 copy of a
    bfloat16 weight), rounded once to bfloat16: the bfloat16 GEMM's result up to summation order."""
    bias32 = None if bias is None else bias.float()
    return F.linear(x.float(), weight32, bias32).to(torch.bfloat16)


def onednn_pack(weight: Tensor) -> Tensor | None:
    """``weight`` [out_features, in_features] bfloat16 or float32 (CPU) reordered for oneDNN, or
    None (with a warning logged once per reason) where this torch or CPU cannot."""
    reason = packing_unavailable_reason(weight.dtype)
    if reason is None:
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        except RuntimeError as e:  # e.g. a CPU oneDNN has no bfloat16 reorder for
            reason = f"oneDNN could not reorder a {weight.dtype} weight: {e}"
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("linear layers run on F.linear: %s", reason)
    return None


def onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x`` [..., in_features] @ packed.T (+ bias) -> [..., out_features], in x's dtype.

    ``packed`` comes from ``onednn_pack``; rows are zero-padded to ``padded_num_rows`` (padding
    rows are computed and dropped)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    num_rows = x2d.shape[0]
    if num_rows == 0:
        return x.new_zeros((*lead, packed.shape[0]))
    num_padded = padded_num_rows(num_rows)
    if num_padded != num_rows:
        padded = x2d.new_empty((num_padded, x2d.shape[1]))
        padded[:num_rows] = x2d
        padded[num_rows:].zero_()  # zero only the padding rows (one pass over x, not two)
        x2d = padded
    out = torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")
    return out[:num_rows].view(*lead, out.shape[-1])


@dataclass(frozen=True, slots=True)
class PackedWeights:
    """Packs of some source tensors, valid while every source is unchanged; ``packed`` is empty
    where packing failed (the plain path runs until a source changes)."""

    sources: tuple[Tensor, ...]
    stamps: tuple[tuple[int, int, torch.dtype], ...]
    packed: tuple[Tensor, ...]

    @classmethod
    def of(cls, sources: tuple[Tensor, ...], packed: tuple[Tensor, ...]) -> PackedWeights:
        return cls(sources=sources, stamps=tuple(cls.stamp(t) for t in sources), packed=packed)

    @staticmethod
    def stamp(t: Tensor) -> tuple[int, int, torch.dtype]:
        return (t._version, t.data_ptr(), t.dtype)

    def is_current(self, sources: tuple[Tensor, ...]) -> bool:
        return len(sources) == len(self.sources) and all(
            s is o and self.stamp(s) == st
            for s, o, st in zip(sources, self.sources, self.stamps, strict=True)
        )


def can_pack(weight: Tensor, *, num_elements: int | None = None) -> bool:
    """Whether ``weight`` is one this module prepacks: bfloat16, or float32 with at least
    ``FLOAT32_MIN_PACKED_ELEMENTS`` elements per matrix (``num_elements``, default the whole
    weight), on the CPU, no trace running."""
    if weight.dtype not in PACKED_DTYPES or not is_host(weight.device) or is_tracing():
        return False
    size = weight.numel() if num_elements is None else num_elements
    return weight.dtype != torch.float32 or size >= float32_min_packed_elements()


def serves_packed(weight: Tensor, *, num_elements: int | None = None) -> bool:
    """Whether a forward may use ``weight``'s pack now: ``can_pack`` and no autograd through it
    (the oneDNN op has no backward; the model runs under ``no_grad``)."""
    return can_pack(weight, num_elements=num_elements) and not (
        torch.is_grad_enabled() and weight.requires_grad
    )


@CustomOp.register("linear")
class Linear(CustomOp):
    """``nn.Linear`` (y = x W^T + b) with a prepacked oneDNN weight on CPU (see module docstring).

    Args:
        in_features, out_features: W is [out_features, in_features].
        bias: whether to add a bias [out_features].

    forward: x [..., in_features] -> [..., out_features], x's dtype (that of the weight).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
        else:
            self.register_parameter("bias", None)
        self._packs: PackedWeights | None = None
        self._weight32: Tensor | None = None  # float32 copy of a small bfloat16 weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init, looked up per call so ``skip_default_init`` skips it."""
        nn.Linear.reset_parameters(self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )

    def process_weights_after_loading(self) -> None:
        """Pack the weight now (bfloat16 on CPU with oneDNN; otherwise drop any pack)."""
        self._packs = None
        self._weight32 = None
        if can_pack(self.weight):
            packed = onednn_pack(self.weight)
            self._packs = PackedWeights.of((self.weight,), () if packed is None else (packed,))
            if can_upcast(self.weight):
                self._weight32 = self.weight.detach().float()

    def packed_weight(self) -> Tensor | None:
        """The current pack, re-made if the weight changed; None where the plain path runs."""
        if not serves_packed(self.weight):
            return None
        packs = self._packs
        if packs is None or not packs.is_current((self.weight,)):
            self.process_weights_after_loading()
            packs = self._packs
        return packs.packed[0] if packs is not None and packs.packed else None

    def upcast_weight(self) -> Tensor | None:
        """The current float32 copy of a small bfloat16 weight (``upcast_linear``), re-made with
        the pack; None where none is kept or the plain path runs."""
        if not serves_packed(self.weight):
            return None
        self.packed_weight()  # re-makes both if the weight changed
        return self._weight32

    def forward_native(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward_cpu(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and upcast_wins(x, self.weight.numel()):
            weight32 = self.upcast_weight()
            if weight32 is not None:
                return upcast_linear(x, weight32, self.bias)
        packed = self.packed_weight()
        if (
            packed is None
            or x.dtype != self.weight.dtype
            or (x.dtype == torch.float32 and x.numel() > float32_max_packed_rows() * x.shape[-1])
        ):
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, packed, self.bias)


def process_weights_after_loading(model: nn.Module) -> None:
    """Call ``process_weights_after_loading()`` on every module of ``model`` that has it (after
    the checkpoint or random weights are in place; vLLM's loader does the same)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()
