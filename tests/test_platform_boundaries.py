"""Device differences live in ``moe/platforms``: no other module compares a device-type string.

Modules ask the platform (``current_platform()``, ``platform_for(device)`` and its
``is_host_memory``, ``is_triton_target``, ``profiler_kinds``; ``moe.platforms.device_probes``)
instead of testing ``device.type == "cuda"`` or ``tensor.is_cpu``, so that a platform plugin
changes the answers in one place (docs/architecture.md, "Platforms"). This check reads the
sources: a comparison with a device-type name, or a read of torch's ``is_<device>`` flags, outside
``moe/platforms`` fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dbo", "moe", "distributed", "launch")
PLATFORMS = ROOT / "moe" / "platforms"
# torch's device families (``torch.device(...).type``); not ``meta`` (shapes without data, on
# every platform alike)
DEVICE_TYPES = frozenset({"cpu", "cuda", "hip", "mps", "xpu", "hpu", "npu", "mtia"})
DEVICE_FLAGS = frozenset(f"is_{t}" for t in DEVICE_TYPES)


def _device_names(node: ast.expr) -> set[str]:
    """The device-type names among ``node``'s string constants (alone or in a tuple, list or
    set: ``in ("cpu", "cuda")``)."""
    elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {
        e.value
        for e in elements
        if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in DEVICE_TYPES
    }


def device_branches(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each comparison with a device-type name and each read of an
    ``is_<device>`` flag in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_device_names(operand) for operand in operands):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr in DEVICE_FLAGS:
            found.append((node.lineno, ast.unparse(node)))
    return found


def _modules() -> list[Path]:
    paths = (p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    return sorted(p for p in paths if PLATFORMS not in p.parents)


def test_no_module_outside_the_platforms_compares_device_types():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in _modules()
        for line, code in device_branches(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "ask the platform instead:\n" + "\n".join(found)


def test_the_check_finds_each_form_of_device_branch():
    source = "\n".join(
        (
            'a = x.device.type == "cuda"',
            'b = "cpu" != t.device.type',
            'c = d.type in ("cpu", "mps")',
            "e = t.is_cpu or t.is_cuda",
            'f = config.profiler == "torch" and y.dtype == z and name != "cpuinfo"',
            'g = torch.device("cpu")',
        )
    )
    lines = [line for line, _ in device_branches(source)]
    assert lines == [1, 2, 3, 4, 4]
