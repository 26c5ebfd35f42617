"""Model configs known by name: the published presets and the embedded default.

Presets are the published ``config.json`` values of each model card (the fields the engine and the
planner read, copied from huggingface.co/<repo>/blob/main/config.json, named in ``source``):
``--load-format dummy`` builds their shapes with random weights without a download, and
``launch.plan`` predicts DBO on them. Every config is read by the project's own parser
(``MoEModelConfig.from_hf_config``), as the engine reads a checkpoint's.

``EMBEDDED_MODEL_CONFIG`` is the model served without ``--model``: a small Mixtral-like model with
seeded random weights (``launch.engine.embedded``: the synthetic prompts sized for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe.models.config import MoEModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPreset:
    """A named model: its HF config fields and where they come from."""

    name: str
    source: str
    hf_config: dict


def _deepseek_v3() -> dict:
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
    }


def _qwen3(hidden, inter, layers, heads, kv_heads, experts, moe_inter, vocab) -> dict:
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": moe_inter,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
    }


def _mixtral_8x7b() -> dict:
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
    }


def _olmoe_1b_7b() -> dict:
    return {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 4096,
    }


PRESETS: dict[str, ModelPreset] = {
    p.name.lower(): p
    for p in (
        ModelPreset(
            name="DeepSeek-V3",
            source="huggingface.co/deepseek-ai/DeepSeek-V3 config.json",
            hf_config=_deepseek_v3(),
        ),
        ModelPreset(
            name="Qwen3-30B-A3B",
            source="huggingface.co/Qwen/Qwen3-30B-A3B config.json",
            hf_config=_qwen3(2048, 6144, 48, 32, 4, 128, 768, 151936),
        ),
        ModelPreset(
            name="Qwen3-235B-A22B",
            source="huggingface.co/Qwen/Qwen3-235B-A22B config.json",
            hf_config=_qwen3(4096, 12288, 94, 64, 4, 128, 1536, 151936),
        ),
        ModelPreset(
            name="OLMoE-1B-7B",
            source="huggingface.co/allenai/OLMoE-1B-7B-0924 config.json",
            hf_config=_olmoe_1b_7b(),
        ),
        ModelPreset(
            name="Mixtral-8x7B",
            source="huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json",
            hf_config=_mixtral_8x7b(),
        ),
    )
}


# A Hugging Face config.json for MixtralForCausalLM, as transformers would write it.
EMBEDDED_MODEL_CONFIG: dict = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": None,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def config_from_hf(hf_config: dict) -> MoEModelConfig:
    """``MoEModelConfig`` of an HF config dict.

    Raises:
        ValueError: unsupported ``model_type`` or a missing / invalid field (the parser's message).
    """
    return MoEModelConfig.from_hf_config(hf_config)


def load_model(name_or_path: str) -> tuple[str, MoEModelConfig]:
    """A preset (case-insensitive name) or a ``config.json`` path (or a directory holding one).

    Returns:
        (display name, config).

    Raises:
        ValueError: neither a preset nor a readable JSON config, or an invalid config.
    """
    preset = PRESETS.get(name_or_path.lower())
    if preset is not None:
        return preset.name, config_from_hf(preset.hf_config)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(p.name for p in PRESETS.values())
        raise ValueError(f"--model {name_or_path!r}: not a preset ({names}) nor a config.json path")
    try:
        hf_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {name_or_path!r}: cannot read {path} as JSON ({e})") from None
    return str(path), config_from_hf(hf_config)
