"""The pure-compute pieces of a decoder step, between attention and the MoE communication.

A step of ``MoEModel`` alternates compute with two things a graph cannot hold: the paged attention
core (its request layout changes every step) and the MoE dispatch/combine (the DBO yield points,
``moe.fused_moe.modular_kernel``). Per layer the pieces are (vLLM's piecewise split, with the MoE
communication as a second splitting op)::

    AttnIn   (h, mlp_out, positions) -> residual = h + mlp_out; x = input_layernorm(residual);
             GQA: q, k, v = projections of x (q/k norm, clip), RoPE on q and k
             MLA: x (the MLA module runs eagerly on it)
    [attention core, eager: KV write + paged attention]
    AttnOut  (residual, attn) -> h = residual + o_proj(attn) (GQA) or residual + attn (MLA);
             y = post_attention_layernorm(h); MoE layer: router(y) -> topk_weights, topk_ids
                                               dense layer: mlp_out = mlp(y)
    [MoE kernel, eager: dispatch -> experts -> combine, shared experts; dbo_yield lives here]
    Final    (h, mlp_out) -> norm(h + mlp_out)

Layer 0's AttnIn has no ``mlp_out``. Every piece takes and returns row tensors (leading dim =
num_tokens), so a batch of ``n`` rows can run a graph of any bucket ``>= n`` on zero-padded rows and
keep the first ``n`` rows of each output: zero rows stay finite through RMSNorm (rsqrt(0 + eps))
and the router, and they never reach attention or the all-to-all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from moe.models.decoder import DecoderLayer, MoEModel


def is_gqa(layer: DecoderLayer) -> bool:
    """Whether the layer's attention splits into projections + core + o_proj (GQA), not MLA."""
    return hasattr(layer.self_attn, "q_proj") and hasattr(layer.self_attn, "attn")


def is_moe(layer: DecoderLayer) -> bool:
    return hasattr(getattr(layer, layer.mlp_name), "kernel")


class AttnIn(nn.Module):
    """Residual add, input norm and (GQA) q/k/v projections with RoPE of one layer."""

    def __init__(self, layer: DecoderLayer, *, is_first: bool):
        super().__init__()
        self.layer = layer
        self.is_first = is_first

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        """Args ``(h, positions)`` for layer 0, else ``(h, mlp_out, positions)``; h, mlp_out:
        [n, hidden_size], positions [n] int64. Returns ``(residual, q, k, v)`` with q
        [n, num_heads * head_dim], k/v [n, num_kv_heads * head_dim] (GQA), or ``(residual, x)``."""
        if self.is_first:
            residual, positions = args
        else:
            h, mlp_out, positions = args
            residual = h + mlp_out
        layer = self.layer
        x = layer.input_layernorm(residual)
        if not is_gqa(layer):
            return residual, x
        attn = layer.self_attn
        n = x.shape[0]
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        if attn.clip_qkv is not None:
            q, k, v = (t.clamp(-attn.clip_qkv, attn.clip_qkv) for t in (q, k, v))
        q = q.view(n, attn.attn.num_heads, attn.attn.head_dim)
        k = k.view(n, attn.attn.num_kv_heads, attn.attn.head_dim)
        rotary = attn.rotary_emb
        if rotary.forward_path == "forward_cpu":  # the table lookup, minus its host-sync check
            q, k = rotary.forward_table(positions, q, k)
        else:
            q, k = rotary(positions, q, k)
        return residual, q.reshape(n, -1), k.reshape(n, -1), v


class AttnOut(nn.Module):
    """o_proj (GQA), residual add, post-attention norm and the router or the dense MLP."""

    def __init__(self, layer: DecoderLayer):
        super().__init__()
        self.layer = layer

    def forward(self, residual: Tensor, attn_output: Tensor) -> tuple[Tensor, ...]:
        """residual [n, hidden_size]; attn_output [n, num_heads * head_dim] (GQA core output) or
        [n, hidden_size] (MLA). Returns ``(h, y, topk_weights [n, k] float32, topk_ids [n, k]
        int64)`` for a MoE layer, ``(h, mlp_out)`` for a dense one."""
        layer = self.layer
        if is_gqa(layer):
            attn_output = layer.self_attn.o_proj(attn_output)
        h = residual + attn_output
        y = layer.post_attention_layernorm(h)
        mlp = getattr(layer, layer.mlp_name)
        if not is_moe(layer):
            return h, mlp(y)
        routing = mlp.gate(y)
        return h, y, routing.topk_weights, routing.topk_ids


class Final(nn.Module):
    """The last residual add and the final norm."""

    def __init__(self, model: MoEModel):
        super().__init__()
        self.norm = model.norm

    def forward(self, h: Tensor, mlp_out: Tensor) -> Tensor:
        """h, mlp_out: [n, hidden_size] -> [n, hidden_size]."""
        return self.norm(h + mlp_out)
