"""The registry of architectures: one line per architecture module (each defines ``SPEC``).

Adding an architecture is one module with its ``ArchitectureSpec`` and one line here
(docs/models.md, "Adding an architecture").
"""

from __future__ import annotations

import importlib

from moe.models.spec import ArchitectureSpec

ARCHITECTURE_MODULES: tuple[str, ...] = (
    "moe.models.mixtral",
    "moe.models.deepseek_v2",
    "moe.models.deepseek_v3",
    "moe.models.qwen2_moe",
    "moe.models.olmoe",
    "moe.models.qwen3_moe",
)


def load_specs(modules: tuple[str, ...] = ARCHITECTURE_MODULES) -> dict[str, ArchitectureSpec]:
    """``model_type -> ArchitectureSpec`` of the ``SPEC`` in each module.

    Raises:
        ValueError: two modules declare the same model_type or architecture.
    """
    specs: dict[str, ArchitectureSpec] = {}
    for name in modules:
        spec = importlib.import_module(name).SPEC
        clash = [s for s in specs.values() if spec.architecture == s.architecture]
        if spec.model_type in specs or clash:
            raise ValueError(
                f"{name}: {spec.model_type!r} / {spec.architecture!r} is declared twice"
            )
        specs[spec.model_type] = spec
    return specs


ARCHITECTURES: dict[str, ArchitectureSpec] = load_specs()
"""model_type -> spec, in registry order."""


def spec_for_model_type(model_type: str) -> ArchitectureSpec | None:
    """The spec of a ``config.json`` ``model_type``, or None when it is not supported."""
    return ARCHITECTURES.get(model_type)


def spec_for_architecture(architecture: str) -> ArchitectureSpec:
    """The spec of an architecture class name (``"MixtralForCausalLM"``).

    Raises:
        ValueError: not supported (the message lists the supported ones).
    """
    for spec in ARCHITECTURES.values():
        if spec.architecture == architecture:
            return spec
    raise ValueError(
        f"architecture {architecture!r} is not supported; supported: "
        f"{sorted(supported_architectures())}"
    )


def supported_architectures() -> dict[str, str]:
    """``model_type -> architecture class name`` of every registered architecture."""
    return {t: s.architecture for t, s in ARCHITECTURES.items()}
