"""A single-rank LLMEngine on a checkpoint, without torch.distributed (for in-process tests)."""

from __future__ import annotations

import datetime
import types

import torch


def single_rank_groups() -> types.SimpleNamespace:
    """Stands in for ``distributed.ParallelGroups`` of a 1-rank run (no process groups)."""
    return types.SimpleNamespace(
        rank=0,
        world_size=1,
        dp_rank=0,
        dp_size=1,
        dp_group=None,
        ep_rank=0,
        ep_size=1,
        ep_group=None,
        device=torch.device("cpu"),
        timeout=datetime.timedelta(seconds=60),
        dp_rank_of_ep_rank=(0,),
    )


def single_rank_engine(model_dir: str, **overrides):
    """float32 engine, max_model_len 64, block size 4, plus ``overrides`` (EngineArgs fields)."""
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.llm_engine import LLMEngine, resolve_model

    args = EngineArgs(
        **{
            "model": model_dir,
            "dtype": "float32",
            "max_model_len": 64,
            "block_size": 4,
            **overrides,
        }
    )
    return LLMEngine(engine_args=args, model=resolve_model(args), groups=single_rank_groups())
