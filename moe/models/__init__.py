"""Models: ``MoEModelConfig`` (parsed from ``config.json`` by ``hf_config``), the generic decoder
stack, ``MoEForCausalLM``, one module per architecture and the registry ``build_model`` reads.

Adding an architecture: its class in a module of its own, its config parser in ``hf_config``, and
one entry in ``registry.MODEL_REGISTRY``.
"""

from moe.models.causal_lm import MoEForCausalLM
from moe.models.config import MoEModelConfig
from moe.models.hf_config import SUPPORTED_ARCHITECTURES
from moe.models.registry import MODEL_REGISTRY, build_model

__all__ = [
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "MoEForCausalLM",
    "MoEModelConfig",
    "build_model",
]
