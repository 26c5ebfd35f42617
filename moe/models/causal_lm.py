"""``MoEForCausalLM``: the model one DP/EP rank serves, plus its memory accounting."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from distributed import FusedMoEPrepareAndFinalize
from moe.fused_moe.experts import TorchExperts
from moe.fused_moe.layer import FusedMoE
from moe.fused_moe.router import Router
from moe.layers.linear import Linear
from moe.layers.mlp import DenseMLP
from moe.models.config import MoEModelConfig
from moe.models.decoder import MoEModel

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata

PARAM_CATEGORIES = (
    "embedding",
    "attention",
    "dense",
    "router",
    "shared_experts",
    "routed_experts",
    "norm",
)


class MoEForCausalLM(nn.Module):
    """A decoder-only MoE model for one DP/EP rank: full attention + router, only this rank's
    routed experts.

    Args:
        config: model shape (any supported architecture).
        prepare_finalize: dispatch/combine strategy shared by all MoE layers
            (``NoEPPrepareAndFinalize`` when ep_size == 1, the all-to-all backend otherwise).
        ep_rank, ep_size: this rank's place in the EP group; it holds global experts
            ``[ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size)``.
        dtype: parameter / activation dtype (float32 or bfloat16); device: where parameters live.

    Weights are uninitialised (``torch.empty``): call ``moe.load_checkpoint`` or
    ``moe.init_random_weights`` next. Custom ops bind their implementation here, at build time.
    """

    def __init__(
        self,
        config: MoEModelConfig,
        *,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        ep_rank: int = 0,
        ep_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.config = config
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.dtype = dtype
        self.model = MoEModel(
            config,
            prepare_finalize=prepare_finalize,
            ep_rank=ep_rank,
            ep_size=ep_size,
            dtype=dtype,
            device=device,
        )
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # no_grad, not inference_mode: with DBO a combine started here may be completed by a recv hook
    # that runs after this call returns (outside inference mode), and in-place ops on inference
    # tensors are illegal there.
    @torch.no_grad()
    def forward(
        self, input_ids: Tensor, positions: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden_states [num_tokens, hidden_size].

        Rows past ``attn_metadata.num_actual_tokens`` are padding (computed, never cached)."""
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                f"must both be [num_tokens]"
            )
        if input_ids.shape[0] != attn_metadata.num_tokens:
            raise ValueError(
                f"got {input_ids.shape[0]} tokens but attn_metadata.num_tokens="
                f"{attn_metadata.num_tokens}"
            )
        return self.model(input_ids, positions, attn_metadata)

    @torch.no_grad()
    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """hidden_states [num_tokens, hidden_size] -> logits [num_tokens, vocab_size] float32
        (float64 for a float64 model: exact comparisons)."""
        logits = self.lm_head(hidden_states)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    @property
    def attention_layers(self) -> list[nn.Module]:
        """Each layer's cache holder (``PagedAttention`` or ``PagedMLACache``), in layer order."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Per-layer cache shape (all layers share one attention type)."""
        return self.attention_layers[0].kv_cache_shape(num_blocks, block_size)

    def kv_cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of KV cache one token takes over all layers (MLA: latent + rope key only)."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return sum(a.kv_elements_per_token for a in self.attention_layers) * itemsize

    def allocate_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[Tensor]:
        """Allocate zeroed caches, one per layer, AND bind them (``bind_kv_caches``); returns them.

        dtype defaults to the model's, device to the parameters'.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        if device is None:
            device = self.lm_head.weight.device
        kv_caches = [
            torch.zeros(
                attn.kv_cache_shape(num_blocks, block_size),
                dtype=dtype or self.dtype,
                device=device,
            )
            for attn in self.attention_layers
        ]
        self.bind_kv_caches(kv_caches)
        return kv_caches

    def bind_kv_caches(self, kv_caches: list[Tensor]) -> None:
        """Attach one cache per layer (in layer order); ValueError on a wrong count or shape."""
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(
                f"expected {len(layers)} KV caches (one per layer), got {len(kv_caches)}"
            )
        for attn, cache in zip(layers, kv_caches, strict=True):
            attn.bind_kv_cache(cache)


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of this rank's parameters per category (``PARAM_CATEGORIES``); tied ones count once.

    routed_experts: ``TorchExperts`` (this rank's share only); shared_experts: the shared MLP and
    its gate; router: the MoE gates; dense: dense-layer MLPs; attention: everything under
    ``self_attn`` (its q/k/latent norms included); norm: the other RMSNorms; embedding: embeddings
    and lm_head.
    """
    owner: dict[int, str] = {}
    # named_modules visits parents first, so the first claim (setdefault) is the outermost one
    for module_name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.shared_expert_name:
            shared = [getattr(module, module.shared_expert_name), module.shared_expert_gate]
            for sub in shared:
                for p in () if sub is None else sub.parameters():
                    owner.setdefault(id(p), "shared_experts")
        if isinstance(module, TorchExperts):
            claim = ("routed_experts", True)
        elif isinstance(module, Router):
            claim = ("router", True)
        elif isinstance(module, DenseMLP):
            claim = ("dense", True)
        elif module_name.endswith("self_attn"):
            claim = ("attention", True)
        elif module_name.endswith("norm"):
            claim = ("norm", False)
        else:
            claim = ("embedding", False)
        for p in module.parameters(recurse=claim[1]):
            owner.setdefault(id(p), claim[0])
    totals = dict.fromkeys(PARAM_CATEGORIES, 0)
    seen: set[int] = set()
    for p in model.parameters():  # deduplicates tied parameters
        if id(p) not in seen:
            seen.add(id(p))
            totals[owner[id(p)]] += p.numel() * p.element_size()
    return totals
