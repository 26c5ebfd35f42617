"""Checkpoint loading (safetensors) and deterministic random initialisation.

Both walk the same list of (checkpoint tensor name, destination tensor) pairs, so a model built for
any (ep_rank, ep_size) receives, for every global expert it holds, the very tensor the checkpoint
(or the seeded generator) gives that expert's name. Each rank reads only the expert tensors it owns.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from moe.fused_moe.experts import TorchExperts
from moe.layers.linear import process_weights_after_loading
from moe.models.config import MoEModelConfig
from moe.platforms.device_probes import is_host

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*)\.(?P<w>w1|w2|w3)$")
# safetensors dtype names that load as weights: casting an int or bool tensor (a bool lm_head makes
# every token 0) or an fp8 one without its scales would load a different model without a word.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStats:
    """What ``load_checkpoint`` read: tensor names in read order and the files opened."""

    tensor_names: tuple[str, ...]
    files: tuple[str, ...]

    @property
    def num_tensors_read(self) -> int:
        return len(self.tensor_names)


def _shard_targets(model: nn.Module) -> dict[str, list[tuple[str, Tensor]]]:
    """Parameters merged from several checkpoint tensors: a module's ``checkpoint_shards``
    ``{child: ((checkpoint child, rows), ...)}`` says that each parameter of ``child`` (weight,
    bias) stacks, along dim 0 and in that order, the same-named parameters of those checkpoint
    children (e.g. ``qkv_proj.weight`` <- ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``).
    Returns {parameter name: [(checkpoint name, row-block view), ...]}."""
    targets: dict[str, list[tuple[str, Tensor]]] = {}
    for prefix, module in model.named_modules():
        for child, parts in getattr(module, "checkpoint_shards", {}).items():
            base = f"{prefix}.{child}" if prefix else child
            for param_name, param in getattr(module, child).named_parameters(recurse=False):
                start, views = 0, []
                for source, rows in parts:
                    where = f"{prefix}.{source}" if prefix else source
                    views.append((f"{where}.{param_name}", param[start : start + rows]))
                    start += rows
                targets[f"{base}.{param_name}"] = views
    return targets


def checkpoint_targets(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield (checkpoint tensor name, destination tensor) for every parameter of ``model``.

    Stacked expert weights expand to one entry per GLOBAL expert this rank holds:
    ``...experts.w1[l]`` <- ``...experts.{offset + l}.w1.weight`` (Mixtral) or
    ``...experts.{offset + l}.gate_proj.weight`` (others; ``TorchExperts.checkpoint_names``).
    Merged projections expand to their row blocks (``_shard_targets``). Tied parameters appear
    once.
    """
    expert_modules = {name: m for name, m in model.named_modules() if isinstance(m, TorchExperts)}
    shards = _shard_targets(model)
    for name, param in model.named_parameters():
        if name in shards:
            yield from shards[name]
            continue
        match = _EXPERT_PARAM.match(name)
        experts = expert_modules.get(match["prefix"]) if match else None
        if experts is None:
            yield name, param
            continue
        for local_id in range(experts.num_local_experts):
            global_id = experts.global_expert_offset + local_id
            ckpt_name = experts.checkpoint_names[match["w"]]
            yield f"{match['prefix']}.{global_id}.{ckpt_name}.weight", param[local_id]


def load_config(path: str | os.PathLike) -> MoEModelConfig:
    """Parse ``<path>/config.json``.

    Raises:
        FileNotFoundError: the directory or config.json is missing (message names the path).
        ValueError: config.json is not valid JSON or describes an unsupported model.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in checkpoint directory {str(directory)!r}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse {str(config_path)!r}: {e}") from e
    return MoEModelConfig.from_hf_config(raw)


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index (sharded) or the single/only files."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"cannot parse {str(index_path)!r}: {e!r}") from e
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in checkpoint directory {str(directory)!r}"
        )
    result: dict[str, Path] = {}
    for file in files:  # unindexed: list every file's keys (headers only, no tensor data)
        with _open(file) as f:
            result.update(dict.fromkeys(f.keys(), file))
    return result


def _open(file: Path, device: torch.device | str = "cpu"):
    """``file`` opened by safetensors; ``get_tensor`` reads straight onto ``device``."""
    if not file.is_file():
        raise FileNotFoundError(f"safetensors file {str(file)!r} (listed in the index) is missing")
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except Exception as e:  # SafetensorError is not importable as a stable name across versions
        raise ValueError(f"cannot read safetensors file {str(file)!r}: {e}") from e


def _check_config(model: nn.Module, config: MoEModelConfig, directory: Path) -> None:
    model_config = getattr(model, "config", None)
    if model_config is None or model_config == config:
        return
    diffs = [
        f"{f}: model={getattr(model_config, f)!r} checkpoint={getattr(config, f)!r}"
        for f in config.__dataclass_fields__
        if getattr(model_config, f) != getattr(config, f)
    ]
    raise ValueError(f"model config does not match {str(directory / 'config.json')!r}: {diffs}")


def _plan(model: nn.Module, directory: Path) -> dict[Path, list[tuple[str, Tensor]]]:
    """Group (checkpoint name, destination) pairs by the file holding the tensor."""
    _check_config(model, load_config(directory), directory)
    weight_map = _weight_map(directory)
    by_file: dict[Path, list[tuple[str, Tensor]]] = {}
    for name, target in checkpoint_targets(model):
        if name not in weight_map:
            raise ValueError(f"tensor {name!r} is missing from checkpoint {str(directory)!r}")
        by_file.setdefault(weight_map[name], []).append((name, target))
    return by_file


def _check_entry(f, file: Path, keys: set[str], name: str, target: Tensor) -> None:
    if name not in keys:
        raise ValueError(f"tensor {name!r} is missing from {str(file)!r}")
    tensor_slice = f.get_slice(name)
    dtype = tensor_slice.get_dtype()
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"tensor {name!r} in {str(file)!r} has dtype {dtype}; weights must be floating point, "
            f"one of {list(FLOAT_DTYPES)} (quantized checkpoints are not supported)"
        )
    shape = tuple(tensor_slice.get_shape())
    if shape != tuple(target.shape):
        raise ValueError(
            f"tensor {name!r} in {str(file)!r} has shape {list(shape)}, "
            f"expected {list(target.shape)}"
        )


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> LoadStats:
    """Copy a HF safetensors checkpoint into ``model`` (built for any ep_rank / ep_size).

    Reads ``config.json`` (must describe the same model), then ``model.safetensors.index.json`` +
    shards, or a single ``model.safetensors`` / the ``*.safetensors`` files present. Only the expert
    tensors this rank owns are read. Tensors are cast to the parameters' dtype. At the end every
    module's ``process_weights_after_loading`` runs (CPU weight prepacking).

    Returns:
        LoadStats with every tensor name read and every file opened.

    Raises:
        FileNotFoundError: directory, config.json, a listed shard, or any safetensors missing.
        ValueError: unreadable/corrupt file, a tensor missing from the checkpoint, a shape
            mismatch, or a config.json that disagrees with ``model.config`` (messages name the
            file or tensor).
    """
    by_file = _plan(model, Path(path))
    names_read: list[str] = []
    device = next(model.parameters()).device  # read onto the device, no host copy of the model
    for file, entries in by_file.items():
        with _open(file, device) as f:
            keys = set(f.keys())
            for name, target in entries:
                _check_entry(f, file, keys, name, target)
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name!r} from {str(file)!r}: {e}") from e
                target.copy_(tensor)
                names_read.append(name)
    process_weights_after_loading(model)
    return LoadStats(tensor_names=tuple(names_read), files=tuple(str(f) for f in by_file))


def check_checkpoint(path: str | os.PathLike) -> MoEModelConfig:
    """Validate a checkpoint without reading tensor data: config.json, the index, every file's
    header, and that every tensor the full model (all experts) needs is present with its shape.

    Returns:
        The parsed config.

    Raises:
        Same as ``load_checkpoint`` (FileNotFoundError / ValueError naming the path or tensor).
    """
    from moe.models.registry import build_model

    directory = Path(path)
    config = load_config(directory)
    # meta device: parameter shapes without memory
    model = build_model(config, device="meta")
    for file, entries in _plan(model, directory).items():
        with _open(file) as f:
            keys = set(f.keys())
            for name, target in entries:
                _check_entry(f, file, keys, name, target)
    return config


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, *, on_device: bool = False) -> None:
    """Fill every parameter deterministically from (seed, checkpoint tensor name).

    1-D tensors (norm weights) are ones; matrices are N(0, 1/fan_in) with fan_in = shape[-1], drawn
    in float32 on the CPU and cast, so results do not depend on dtype rounding order, device, or
    the EP layout (experts are named by global id). ``on_device``: drawn by a generator on the
    weights' device instead, in place (seconds instead of minutes for 30B parameters on a GPU;
    values then depend on the device). Ends with ``process_weights_after_loading``.
    """
    for name, target in checkpoint_targets(model):
        if target.dim() == 1:
            target.fill_(1.0)
            continue
        device = target.device if on_device else torch.device("cpu")
        gen = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
        scale = target.shape[-1] ** -0.5
        if on_device or (target.dtype == torch.float32 and is_host(target.device)):
            # straight into place: normal_ draws what randn draws (randn is empty + normal_), and
            # the float32 product is the same; no temporary (tested against the randn formula)
            target.normal_(generator=gen).mul_(scale)
            continue
        values = torch.randn(tuple(target.shape), generator=gen, dtype=torch.float32)
        target.copy_(values * scale)
    process_weights_after_loading(model)
