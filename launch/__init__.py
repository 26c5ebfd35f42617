"""launch package: the entry points, and the offline Python API with vLLM's names.

``from launch import LLM, SamplingParams`` (also ``RequestOutput``, ``CompletionOutput``,
``Logprob``, ``TextPrompt``, ``TokensPrompt``): these load ``launch.offline`` (and torch) on first
use only, so that ``python -m launch.<tool> --help`` stays fast.
"""

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str):
    if name in __all__:
        import launch.offline

        return getattr(launch.offline, name)
    raise AttributeError(f"module 'launch' has no attribute {name!r}")
