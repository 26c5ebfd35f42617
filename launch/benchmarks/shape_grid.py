"""The shapes of ``launch.benchmarks.shape_sweep``: Mixtral-, Qwen2-MoE- and DeepSeek-V3-shaped
random checkpoints over the range users' models span (``DEFAULT_GRID``), and how each is built by
transformers. The grid's bounds and the checkpoints:
docs/benchmarks.md#shape-grid-how-the-checkpoints-are-built."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

FAMILIES = {
    # family -> transformers class prefix
    "mixtral": "Mixtral",
    "qwen2moe": "Qwen2Moe",
    "deepseekv3": "DeepseekV3",
}
MAX_POSITIONS = 2048  # prompts (<= 512) + generated tokens fit with room to spare
SHAPE_FILE = "sweep_shape.json"  # written last: its presence means the checkpoint is complete


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """One point of the sweep.

    ``num_kv_heads`` is ignored by ``deepseekv3`` (MLA); ``prompt_len`` is the inclusive range
    (min, max) of prompt lengths in tokens.

    Raises:
        ValueError: an unknown family, a count < 1, top-k above the experts, a head narrower than
            32 (hidden / heads; not for MLA), kv heads not dividing the heads, a DeepSeek shape
            with fewer than 2 layers (its first layer is dense), or an empty prompt range.
    """

    family: str
    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    prompt_len: tuple[int, int]

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {sorted(FAMILIES)}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{field.name} must be >= 1, got {value}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} > num_experts {self.num_experts}")
        if self.family != "deepseekv3":
            if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
                raise ValueError(
                    f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a "
                    "whole head of >= 32 (vLLM's CPU attention)"
                )
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide {self.num_heads}")
        elif self.num_layers < 2:
            raise ValueError(f"a deepseekv3 shape needs >= 2 layers, got {self.num_layers}")
        low, high = self.prompt_len
        if not 1 <= low <= high:
            raise ValueError(f"prompt_len must be 1 <= min <= max, got {self.prompt_len}")

    @property
    def name(self) -> str:
        """``<family>-e<experts>-k<top-k>-h<hidden>-p<max prompt length>``."""
        return (
            f"{self.family}-e{self.num_experts}-k{self.top_k}-h{self.hidden_size}"
            f"-p{self.prompt_len[1]}"
        )


def _shape(family, h, e, k, i, layers, heads, kv_heads, vocab, prompts) -> Shape:
    return Shape(
        family=family,
        hidden_size=h,
        num_experts=e,
        top_k=k,
        moe_intermediate_size=i,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        prompt_len=prompts,
    )


# family, hidden, experts, top-k, expert intermediate, layers, heads, kv heads, vocab, prompts
DEFAULT_GRID: tuple[Shape, ...] = (
    _shape("mixtral", 64, 8, 2, 96, 3, 2, 1, 512, (16, 32)),
    _shape("mixtral", 1024, 8, 2, 2048, 2, 16, 8, 8192, (128, 256)),
    _shape("mixtral", 2048, 16, 4, 1024, 2, 16, 4, 4096, (32, 64)),
    _shape("mixtral", 256, 32, 6, 512, 2, 8, 2, 4096, (256, 512)),
    _shape("qwen2moe", 256, 16, 2, 128, 2, 8, 8, 2048, (8, 16)),
    _shape("qwen2moe", 512, 60, 4, 352, 2, 8, 8, 8192, (128, 256)),
    _shape("qwen2moe", 1024, 64, 8, 512, 2, 16, 4, 8192, (64, 128)),
    _shape("deepseekv3", 256, 16, 2, 128, 2, 4, 4, 4096, (256, 512)),
    _shape("deepseekv3", 512, 32, 8, 256, 3, 8, 8, 8192, (128, 256)),
    _shape("deepseekv3", 2048, 64, 6, 384, 2, 16, 16, 4096, (16, 32)),
)

# two tiny shapes for the tests: a run takes seconds
SMALL_GRID: tuple[Shape, ...] = (
    _shape("mixtral", 64, 8, 2, 96, 2, 2, 1, 256, (8, 16)),
    _shape("deepseekv3", 64, 8, 4, 32, 2, 2, 2, 256, (8, 16)),
)

GRIDS = {"default": DEFAULT_GRID, "small": SMALL_GRID}


def _mla_kwargs(shape: Shape) -> dict:
    """DeepSeek-V3's MLA widths. The latent is the real one at every size (kv_lora_rank 512 +
    rope 64: vLLM's CPU MLA kernel takes only that 576-wide cache row); the per-head widths are
    V3's (nope 128, v 128) from hidden 1024 up and hidden / 8 (>= 32) below; q compressed
    (q_lora_rank hidden / 2) from 1024 up as in V3, plain below as in V2-Lite."""
    h = shape.hidden_size
    head_dim = 128 if h >= 1024 else max(32, h // 8)
    return dict(
        q_lora_rank=h // 2 if h >= 1024 else None,
        kv_lora_rank=512,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=64,
        v_head_dim=head_dim,
    )


def _family_kwargs(shape: Shape) -> dict:
    i = shape.moe_intermediate_size
    if shape.family == "mixtral":
        return dict(
            intermediate_size=i,
            num_local_experts=shape.num_experts,
            num_key_value_heads=shape.num_kv_heads,
        )
    if shape.family == "qwen2moe":  # Qwen1.5-MoE: shared expert 4x an expert, every layer MoE
        return dict(
            intermediate_size=4 * i,
            moe_intermediate_size=i,
            shared_expert_intermediate_size=4 * i,
            num_experts=shape.num_experts,
            num_key_value_heads=shape.num_kv_heads,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
    # DeepSeek-V3: one dense first layer, one shared expert, sigmoid + bias, group-limited top-k
    num_groups = min(8, max(1, shape.num_experts // 4))
    return dict(
        intermediate_size=4 * i,
        moe_intermediate_size=i,
        n_routed_experts=shape.num_experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=num_groups,
        topk_group=max(1, num_groups // 2),
        num_key_value_heads=shape.num_heads,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        # as DeepSeek-V3's own config.json: vLLM creates the correction bias only when it reads
        # topk_method "noaux_tc" (transformers' config class does not write it)
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        **_mla_kwargs(shape),
    )


def hf_config_kwargs(shape: Shape) -> dict:
    """Keyword arguments of transformers' ``<Family>Config`` for ``shape``: no eos token, untied
    embeddings, ``MAX_POSITIONS`` positions, weight std 1/sqrt(hidden)."""
    return dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_experts_per_tok=shape.top_k,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=1 / math.sqrt(shape.hidden_size),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        **_family_kwargs(shape),
    )


def hf_model(shape: Shape, *, seed: int = 0, device: str = "cpu"):
    """transformers' ``<Family>ForCausalLM`` of ``shape`` in float32, weights drawn from ``seed``
    (``device="meta"``: shapes only, nothing drawn).

    Raises:
        ImportError: transformers is not installed (``pip install transformers``).
    """
    import torch
    import transformers

    prefix = FAMILIES[shape.family]
    config = getattr(transformers, f"{prefix}Config")(**hf_config_kwargs(shape))
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    return model.to(torch.float32).eval()


def param_counts(shape: Shape) -> tuple[int, int]:
    """(all parameters, parameters one token computes with): the second leaves out the input
    embedding and the routed experts a token is not sent to (top_k of num_experts used)."""
    model = hf_model(shape, device="meta")
    total = routed = embedding = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if ".experts." in name:
            routed += param.numel()
        elif "embed_tokens" in name:
            embedding += param.numel()
    unused = routed * (shape.num_experts - shape.top_k) // shape.num_experts
    return total, total - embedding - unused


def write_prompts(shape: Shape, path: Path, num_prompts: int, *, seed: int = 1) -> None:
    """``num_prompts`` JSONL prompts of ``shape.prompt_len`` tokens, ids in [3, vocab)."""
    rng = random.Random(seed)
    low, high = shape.prompt_len
    with open(path, "w") as f:
        for _ in range(num_prompts):
            ids = [rng.randrange(3, shape.vocab_size) for _ in range(rng.randint(low, high))]
            f.write(json.dumps({"prompt_token_ids": ids}) + "\n")


def ensure_checkpoint(shape: Shape, root: Path, num_prompts: int) -> tuple[Path, Path]:
    """(checkpoint directory, prompts file) of ``shape`` under ``root``; the checkpoint is built
    unless an earlier run left it (its ``sweep_shape.json`` equal to ``shape``).

    Raises:
        ImportError: transformers is missing and the checkpoint is not cached.
        OSError: ``root`` is not writable.
    """
    model_dir = root / shape.name
    prompts = root / f"{shape.name}_prompts_{num_prompts}.jsonl"
    marker = model_dir / SHAPE_FILE
    described = json.dumps(dataclasses.asdict(shape), sort_keys=True)
    if not (marker.exists() and marker.read_text() == described):
        hf_model(shape).save_pretrained(model_dir, safe_serialization=True)
        marker.write_text(described)
    write_prompts(shape, prompts, num_prompts)  # cheap and deterministic: always rewritten
    return model_dir, prompts
