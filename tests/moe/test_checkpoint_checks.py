"""Bad checkpoints are refused with one line naming the field or tensor, never loaded silently.

config.json fields are type- and range-checked (``hidden_size: 64.5`` was truncated; ``[1, 2]``,
``num_attention_heads: 0`` and ``max_position_embeddings: null`` ended in tracebacks); tensors must
be floating point (a bool ``lm_head`` was cast and made every token 0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe import MoEModelConfig, build_model, check_checkpoint, load_checkpoint, load_config
from tests.conftest import TINY_MIXTRAL


def _config(**changes) -> dict:
    return {**TINY_MIXTRAL, "model_type": "mixtral", **changes}


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        (
            _config(hidden_size=64.5),
            r"^config.json: hidden_size must be an integer >= 1, got 64.5$",
        ),
        (_config(num_attention_heads=0), r"num_attention_heads must be an integer >= 1, got 0$"),
        (_config(max_position_embeddings=None), r"max_position_embeddings must be .*got null$"),
        (_config(vocab_size="128"), r"vocab_size must be an integer >= 1, got '128'$"),
        (_config(rms_norm_eps=-1), r"rms_norm_eps must be a finite number > 0, got -1$"),
        (_config(tie_word_embeddings=1), r"tie_word_embeddings must be true or false, got 1$"),
        (_config(eos_token_id=[2, "x"]), r"eos_token_id must be a token id >= 0"),
        (_config(rope_parameters=[1]), r"rope_parameters must be an object, got \[1\]$"),
        ([1, 2], r"^config.json must be a JSON object, got list$"),
        ({"model_type": [1]}, r"unsupported model \(model_type=\[1\]"),
    ],
)
def test_config_fields_are_checked_with_one_line(config, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        MoEModelConfig.from_hf_config(json.loads(json.dumps(config)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float8_e4m3fn])
def test_non_float_tensors_are_refused_naming_the_tensor(tmp_path, tiny_mixtral_dir, dtype):
    for item in Path(tiny_mixtral_dir).iterdir():
        shutil.copy(item, tmp_path / item.name)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    file = tmp_path / index["weight_map"]["lm_head.weight"]
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    pattern = (
        r"tensor 'lm_head.weight' in .* has dtype (BOOL|I32|F8_E4M3); weights must be floating"
    )
    with pytest.raises(ValueError, match=pattern):
        check_checkpoint(tmp_path)
    model = build_model(load_config(tmp_path))
    with pytest.raises(ValueError, match=pattern):
        load_checkpoint(model, tmp_path)
