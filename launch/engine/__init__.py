"""The engine: flags (``EngineArgs``), ``LLMEngine``, scheduler, KV cache blocks, requests, and the
model runner that builds each step's inputs and runs the model (with DBO through
``UBatchWrapper``)."""

from launch.engine.arg_utils import EngineArgs
from launch.engine.llm_engine import LLMEngine

__all__ = ["EngineArgs", "LLMEngine"]
