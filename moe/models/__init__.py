"""Models: ``MoEModelConfig``, the generic decoder stack, ``MoEForCausalLM``, and one module per
architecture holding its ``ArchitectureSpec`` (``moe.models.spec``), listed in
``moe.models.architectures``; ``build_model`` builds any of them.

Adding an architecture: one module with its spec and one line in
``architectures.ARCHITECTURE_MODULES`` (docs/models.md).
"""

from moe.models.architectures import ARCHITECTURES, supported_architectures
from moe.models.causal_lm import MoEForCausalLM
from moe.models.config import MoEModelConfig
from moe.models.registry import build_model
from moe.models.spec import ArchitectureSpec

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "MoEForCausalLM",
    "MoEModelConfig",
    "build_model",
    "supported_architectures",
]
