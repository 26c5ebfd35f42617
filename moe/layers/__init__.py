"""Model layers: linear (prepacked on CPU), RMSNorm, rotary embedding, SwiGLU, dense MLP, paged GQA
attention, MLA, and the attention metadata they share."""

from moe.layers.activation import SiluAndMul, swiglu
from moe.layers.attention import GQAAttention, PagedAttention, paged_attention, write_kv_cache
from moe.layers.attention_metadata import CommonAttentionMetadata, split_attn_metadata
from moe.layers.linear import Linear, process_weights_after_loading
from moe.layers.mla import MLAAttention, PagedMLACache
from moe.layers.mlp import DenseMLP
from moe.layers.norm import RMSNorm
from moe.layers.rotary import RotaryEmbedding, rotate_half

__all__ = [
    "CommonAttentionMetadata",
    "DenseMLP",
    "GQAAttention",
    "Linear",
    "MLAAttention",
    "PagedAttention",
    "PagedMLACache",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "paged_attention",
    "process_weights_after_loading",
    "rotate_half",
    "split_attn_metadata",
    "swiglu",
    "write_kv_cache",
]
