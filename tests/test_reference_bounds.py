"""Every comparison with transformers takes its model and bound from ``tests.helpers.precision``.

The float64 bound against transformers is what transformers' float32 steps can contribute on any
CPU (``precision.reference_rel``, derived in its module docstring). A test that fixed its own bound
passed on the CPU it was written on and failed on another (an AVX2 Zen 3, whose float32 GEMM
rounds by row count); the whole suite under an emulated AVX2 CPUID does not fit CI's time, so this
check reads the tests instead: no test builds a transformers model itself, no test names the raw
float64 constants, and no module that builds a reference fixes a tolerance finer than float32's
island bound.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.precision import FLOAT32_ISLAND_REL

TESTS = Path(__file__).parent
HELPERS = TESTS / "helpers"
PRECISION = HELPERS / "precision.py"
RAW_BOUNDS = {"FLOAT64_REL", "FLOAT32_ISLAND_REL", "FLOAT32_ISLANDS"}
TOLERANCE_KEYWORDS = {"atol", "rel", "abs"}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p != Path(__file__))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _constant_value(node: ast.expr) -> float | None:
    """The number a constant expression (``1e-10``, ``2**-20``, ``-1e-9``) evaluates to, else
    None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exp = _constant_value(node.left), _constant_value(node.right)
            return None if base is None or exp is None else base**exp
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _violations(path: Path) -> list[str]:
    tree = _tree(path)
    where = path.relative_to(TESTS.parent)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    found = []
    if path != PRECISION:
        found += [
            f"{where}:{c.lineno}: builds a transformers model (use precision.reference_model)"
            for c in calls
            if _called_name(c) == "from_pretrained"
        ]
    if HELPERS not in path.parents:
        found += [
            f"{where}:{n.lineno}: names {n.id} (use precision.assert_equals_transformers, "
            "reference_rel or assert_same_sums)"
            for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id in RAW_BOUNDS
        ]
        found += [
            f"{where}:{a.lineno}: imports {a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if a.name in RAW_BOUNDS
        ]
    if any(_called_name(c) == "reference_model" for c in calls):
        for call in calls:
            for keyword in call.keywords:
                value = (
                    _constant_value(keyword.value) if keyword.arg in TOLERANCE_KEYWORDS else None
                )
                if value is not None and 0 < value < FLOAT32_ISLAND_REL:
                    found.append(
                        f"{where}:{call.lineno}: {keyword.arg}={value:g} fixed beside a "
                        "transformers reference (take the bound from precision)"
                    )
    return found


def test_every_comparison_with_transformers_takes_its_bound_from_precision():
    found = [v for path in _modules() for v in _violations(path)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("m = AutoModelForCausalLM.from_pretrained(p)", "builds a transformers model"),
        ("from tests.helpers.precision import FLOAT64_REL", "imports FLOAT64_REL"),
        ("r = reference_model(p)\nassert_close(a, b, rtol=0, atol=1e-10)", "atol=1e-10 fixed"),
        ("r = reference_model(p)\nassert_logits_close(a, b, rel=2**-20)", "rel=9.53674e-07 fixed"),
    ],
)
def test_the_check_finds_each_kind_of_fixed_bound(tmp_path, monkeypatch, source, expected):
    module = TESTS / "launch" / "test_example_of_a_fixed_bound.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    (violation,) = _violations(module)
    assert expected in violation


def test_the_check_passes_a_module_that_uses_the_helpers(monkeypatch):
    source = (
        "r = reference_model(p)\n"
        "assert_equals_transformers(a, r, model_type='mixtral')\n"
        "assert_close(a, b, rtol=0, atol=FLOAT32_REL * m)\n"
        "assert_logits_close(a, b, rel=2**-14)\n"
    )
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert _violations(TESTS / "launch" / "test_example.py") == []
