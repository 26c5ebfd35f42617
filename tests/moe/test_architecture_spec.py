"""An architecture is one module with its ``ArchitectureSpec`` plus one registry line.

A module written here (an OLMoE-shaped architecture under another ``model_type``) is registered
by one added entry in ``ARCHITECTURE_MODULES`` and must then parse, build, load and compute
exactly what the OLMoE model computes on the same weights; the guide's example in docs/models.md
is the real OLMoE module; specs refuse bad declarations with a message naming them.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moe import build_model, load_checkpoint, load_config  # noqa: E402
from moe.models import architectures  # noqa: E402
from moe.models.olmoe import parse_config as olmoe_parse_config  # noqa: E402
from moe.models.spec import ArchitectureSpec  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402
from tests.helpers.attention_metadata import BLOCK_SIZE, make_paged_metadata  # noqa: E402
from tests.helpers.distributed import REPO  # noqa: E402

NEW_MODULE = """
from moe.models.olmoe import parse_config
from moe.models.spec import ArchitectureSpec

SPEC = ArchitectureSpec(
    model_type="my_moe", architecture="MyMoeForCausalLM", parse_config=parse_config
)
"""


@pytest.fixture
def registered_my_moe(tmp_path, monkeypatch):
    """``my_moe`` registered by one added line, the way docs/models.md says."""
    (tmp_path / "my_moe_arch.py").write_text(NEW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = (*architectures.ARCHITECTURE_MODULES, "my_moe_arch")
    monkeypatch.setattr(architectures, "ARCHITECTURES", architectures.load_specs(modules))
    yield
    sys.modules.pop("my_moe_arch", None)


def _logits(path):
    model = build_model(load_config(path), dtype=torch.float64)
    load_checkpoint(model, path)
    model.allocate_kv_caches(8, BLOCK_SIZE)
    ids = torch.arange(3, 10)
    meta = make_paged_metadata([7], [7], [[1, 0]])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(7), meta))


def test_a_new_module_and_one_registry_line_are_all_an_architecture_needs(
    tmp_path, registered_my_moe
):
    olmoe_dir, new_dir = tmp_path / "olmoe", tmp_path / "my_moe"
    reference = make_tiny_model("olmoe", seed=0)
    reference.save_pretrained(olmoe_dir)
    reference.save_pretrained(new_dir)
    config = json.loads((new_dir / "config.json").read_text())
    config.update(model_type="my_moe", architectures=["MyMoeForCausalLM"])
    (new_dir / "config.json").write_text(json.dumps(config))
    assert load_config(new_dir).architecture == "MyMoeForCausalLM"
    assert torch.equal(_logits(new_dir), _logits(olmoe_dir))


def test_unregistered_model_type_names_the_supported_ones():
    from moe import MoEModelConfig

    with pytest.raises(ValueError, match=r"model_type='my_moe'.*'MixtralForCausalLM'"):
        MoEModelConfig.from_hf_config({"model_type": "my_moe"})


def test_the_guides_example_is_the_olmoe_module():
    guide = (REPO / "docs" / "models.md").read_text().split("## Adding an architecture")[1]
    block = re.search(r"```python\n(.*?)\n *```", guide, re.DOTALL).group(1)
    example = "\n".join(line.removeprefix("   ") for line in block.split("\n"))
    assert example == Path(REPO / "moe" / "models" / "olmoe.py").read_text().rstrip("\n")


def test_a_model_type_registered_twice_is_refused():
    with pytest.raises(ValueError, match=r"'olmoe' / 'OlmoeForCausalLM' is declared twice"):
        architectures.load_specs(("moe.models.olmoe", "moe.models.olmoe"))


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"attention": "mqa"}, r"X: attention 'mqa' is not one of \('gqa', 'mla'\)"),
        ({"router_dtype": "bfloat16"}, r"router_dtype 'bfloat16' is not one of"),
        ({"expert_names": {"w1": "a", "w2": "b"}}, r"expert_names must map exactly"),
        ({"has_shared_expert_gate": True}, r"a shared expert gate needs shared_experts"),
    ],
)
def test_bad_specs_are_refused(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        ArchitectureSpec(
            model_type="x", architecture="X", parse_config=olmoe_parse_config, **fields
        )
