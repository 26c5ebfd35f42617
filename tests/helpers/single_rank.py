"""A single-rank LLMEngine on a checkpoint, without torch.distributed (for in-process tests)."""

from __future__ import annotations

from distributed import single_process_groups


def single_rank_engine(model_dir: str, **overrides):
    """float32 engine, max_model_len 64, block size 4, plus ``overrides`` (EngineArgs fields)."""
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.llm_engine import LLMEngine

    args = EngineArgs(
        **{
            "model": model_dir,
            "dtype": "float32",
            "max_model_len": 64,
            "block_size": 4,
            **overrides,
        }
    )
    return LLMEngine(
        engine_args=args, model=args.resolve_model(), groups=single_process_groups(timeout_s=60)
    )
