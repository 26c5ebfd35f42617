"""``LLM(...)``'s arguments: vLLM's names mapped onto ``EngineArgs``, how the process was
launched (alone, or by torchrun with ``distributed_executor_backend="external_launcher"``), and
the model with its tokenizer and chat template, all checked before any process group exists."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from launch.engine.arg_utils import EngineArgs

EXECUTOR_BACKENDS = (None, "external_launcher")
# fields given as a JSON string on the command line, which LLM() also takes as a dict (vLLM's)
JSON_FIELDS = ("profiler_config",)
_TYPES = {
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "str": (str,),
    "None": (type(None),),
    "tuple[int, ...]": (tuple, list),
}


def _check_type(name: str, value, annotation: str) -> None:
    """TypeError naming ``name`` unless ``value`` fits ``annotation`` (e.g. ``int | None``)."""
    kinds = tuple(k for part in annotation.split(" | ") for k in _TYPES.get(part, (object,)))
    is_bool_for_number = isinstance(value, bool) and bool not in kinds
    if not isinstance(value, kinds) or is_bool_for_number:
        raise TypeError(f"LLM() argument {name}={value!r} must be {annotation}")


def engine_args_from_kwargs(model: str | None, kwargs: dict) -> EngineArgs:
    """``EngineArgs`` from ``LLM(model, **kwargs)``: every ``EngineArgs`` field by its name
    (vLLM's), ``dtype="auto"`` meaning the default, a ``JSON_FIELDS`` field as a dict or its
    JSON text.

    Raises:
        TypeError: an unknown argument (naming it and the accepted ones), or a value of the
            wrong type.
        ValueError: as ``EngineArgs`` raises it (naming the value and the accepted range).
    """
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    values = {"model": model}
    for name, value in kwargs.items():
        if name not in fields or name == "model":
            accepted = sorted(set(fields) - {"model"})
            raise TypeError(
                f"LLM() got an unexpected keyword argument {name!r}; accepted: "
                f"{', '.join(accepted)}, tokenizer, distributed_executor_backend, "
                "tensor_parallel_size"
            )
        if name == "dtype" and value == "auto":
            continue
        if name in JSON_FIELDS and isinstance(value, dict):
            value = json.dumps(value)
        _check_type(name, value, fields[name].type)
        values[name] = tuple(value) if isinstance(value, list) else value
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"LLM() argument model={model!r} must be a checkpoint directory or None")
    values["model"] = None if model is None else os.fspath(model)
    return EngineArgs(**values)


def is_launched_by_torchrun(
    args: EngineArgs, distributed_executor_backend: str | None, tensor_parallel_size: int
) -> bool:
    """Whether this process is one rank of a torchrun launch (else it runs alone, DP 1).

    Raises:
        ValueError: an unsupported ``distributed_executor_backend`` or ``tensor_parallel_size``,
            ``external_launcher`` without torchrun's environment, DP > 1 without torchrun, or a
            ``data_parallel_size`` other than torchrun's world size.
    """
    from distributed.parallel_state import TorchrunEnv

    if distributed_executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend={distributed_executor_backend!r} is not supported; "
            f"choose one of {EXECUTOR_BACKENDS} (DP ranks are processes started by torchrun)"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size!r} is not supported: only 1 (attention "
            "is data parallel, experts expert parallel)"
        )
    has_env = all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    if distributed_executor_backend == "external_launcher" or has_env:
        env = TorchrunEnv.from_environ()  # ValueError naming the missing variables
        args.check_world_size(env.world_size)
        return True
    if args.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={args.data_parallel_size} needs one process per DP rank: run "
            f"the script with torchrun --nproc-per-node {args.data_parallel_size} and pass "
            "distributed_executor_backend='external_launcher'"
        )
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class OfflineModel:
    """The resolved model (``moe.model_loader.ResolvedModel``), the directory its
    tokenizer was looked for in, the tokenizer (None: token-id prompts only) and the chat
    template (None: ``LLM.chat`` needs ``chat_template=``)."""

    resolved: object
    tokenizer_dir: str | None
    tokenizer: object | None
    chat_template: object | None


def load_offline_model(args: EngineArgs, tokenizer: str | None = None) -> OfflineModel:
    """Resolve ``args.model`` and read its tokenizer and chat template (from ``tokenizer`` if
    given, else the checkpoint directory).

    Raises:
        ValueError / OSError: as ``EngineArgs.resolve_model``, ``load_tokenizer`` and
            ``load_chat_template``
            raise them, or a ``tokenizer`` directory without ``tokenizer.json``.
    """
    from launch.text.chat_template import load_chat_template
    from launch.text.detokenizer import load_tokenizer

    resolved = args.resolve_model()
    tokenizer_dir = args.model if tokenizer is None else os.fspath(tokenizer)
    loaded = load_tokenizer(tokenizer_dir)
    if tokenizer is not None and loaded is None:
        raise ValueError(f"tokenizer={tokenizer!r}: no tokenizer.json in that directory")
    return OfflineModel(
        resolved=resolved,
        tokenizer_dir=tokenizer_dir,
        tokenizer=loaded,
        chat_template=load_chat_template(tokenizer_dir, None),
    )
