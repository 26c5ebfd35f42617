"""Model construction for one rank: the generic ``MoEForCausalLM`` shaped by the architecture's
spec (``moe.models.architectures``), with the prepare/finalize wired in."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from distributed import FusedMoEPrepareAndFinalize, NoEPPrepareAndFinalize
from moe.layers.linear import Linear
from moe.models.causal_lm import MoEForCausalLM, parameter_bytes
from moe.models.config import MoEModelConfig


@contextlib.contextmanager
def skip_default_init() -> Iterator[None]:
    """Build ``nn.Linear`` / ``nn.Embedding`` with ``torch.empty`` weights: their default random
    init (``reset_parameters``) is skipped, since the checkpoint or ``init_random_weights``
    overwrites every weight anyway (a sizeable share of a short run's start-up, and on the meta
    device it imports torch's Python decompositions). Not thread-safe: for start-up only.
    """
    saved = {cls: cls.reset_parameters for cls in _DEFAULT_INIT_MODULES}
    try:
        for cls in _DEFAULT_INIT_MODULES:
            cls.reset_parameters = _no_reset
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def _no_reset(self: nn.Module) -> None:
    pass


_DEFAULT_INIT_MODULES = (nn.Linear, Linear, nn.Embedding)


def build_model(
    config: MoEModelConfig,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    prepare_finalize: FusedMoEPrepareAndFinalize | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Build the model for EP rank ``ep_rank`` of ``ep_size`` (weights uninitialised:
    ``torch.empty``, no default random init; load a checkpoint or call ``init_random_weights``
    next).

    ``prepare_finalize`` (``distributed.make_prepare_finalize``) serves all MoE layers; without
    one, ep_size must be 1 and ``NoEPPrepareAndFinalize`` is used.

    Raises:
        ValueError: ep_rank outside [0, ep_size); ep_size > 1 without a prepare_finalize; a
            prepare_finalize whose num_local_experts disagrees (num_experts not a multiple of
            ep_size: the prepare_finalize refuses it when built).
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"need ep_size >= 1 and 0 <= ep_rank < ep_size, got {ep_rank=} {ep_size=}")
    if prepare_finalize is None:
        if ep_size > 1:
            raise ValueError(
                f"ep_size={ep_size} needs a prepare_finalize; "
                f"NoEPPrepareAndFinalize only serves ep_size=1"
            )
        prepare_finalize = NoEPPrepareAndFinalize(num_experts=config.num_experts)
    num_local_experts = config.num_experts // ep_size
    if prepare_finalize.num_local_experts != num_local_experts:
        raise ValueError(
            f"prepare_finalize serves {prepare_finalize.num_local_experts} local experts, but "
            f"num_experts={config.num_experts} / ep_size={ep_size} = {num_local_experts}"
        )
    with skip_default_init():
        return MoEForCausalLM(
            config,
            prepare_finalize=prepare_finalize,
            ep_rank=ep_rank,
            ep_size=ep_size,
            dtype=dtype,
            device=device,
        )


def config_parameter_bytes(
    config: MoEModelConfig, *, ep_size: int = 1, dtype: torch.dtype = torch.float32
) -> dict[str, int]:
    """``parameter_bytes`` of the model ``build_model(config, ep_size=ep_size, dtype=dtype)``
    builds on one rank (this rank's share of the routed experts), without allocating anything:
    measured on the meta device on models of one and two layers and scaled to the layer counts
    (all sparse layers have one shape, all dense ones another), so a config of any size costs three
    small builds.

    Returns:
        Bytes per ``PARAM_CATEGORIES`` entry.

    Raises:
        ValueError: as ``build_model``.
    """
    num_sparse = sum(config.moe_layers)
    counts = {True: num_sparse, False: config.num_hidden_layers - num_sparse}
    first = num_sparse > 0  # the kind measured twice: one present in the config

    def measure(moe_layers: tuple[bool, ...]) -> dict[str, int]:
        shape = dataclasses.replace(
            config, num_hidden_layers=len(moe_layers), moe_layers=moe_layers
        )
        # only its count of local experts shapes the model: no process group needed
        local = NoEPPrepareAndFinalize(num_experts=config.num_experts // ep_size)
        model = build_model(
            shape, ep_size=ep_size, prepare_finalize=local, dtype=dtype, device="meta"
        )
        return parameter_bytes(model)

    one, two = measure((first,)), measure((first, first))
    per_layer = {first: {k: two[k] - one[k] for k in one}}
    base = {k: one[k] - per_layer[first][k] for k in one}  # embeddings, final norm, lm_head
    if counts[not first]:
        other = measure((not first,))
        per_layer[not first] = {k: other[k] - base[k] for k in one}
    return {
        k: base[k] + sum(n * per_layer[kind][k] for kind, n in counts.items() if n) for k in one
    }
