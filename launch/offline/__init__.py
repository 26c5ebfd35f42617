"""The offline Python API, with vLLM's names: ``LLM``, ``SamplingParams``, ``RequestOutput``,
``CompletionOutput``, ``Logprob`` and the prompt types (``launch.offline.llm`` says how DP ranks
share the work)."""

from launch.engine.request import SamplingParams
from launch.offline.llm import LLM
from launch.offline.outputs import CompletionOutput, Logprob, RequestOutput
from launch.offline.prompts import TextPrompt, TokensPrompt

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
