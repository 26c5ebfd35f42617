"""Which platform this process runs (``current_platform()``, ``platform_for(device)``) and plugin
discovery through Python entry points (``moe_dbo.platform_plugins``, ``moe_dbo.general_plugins``),
after vLLM's; nothing happens at import time. How a package adds a platform: docs/hardware.md,
"Plugin discovery"."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import torch

from moe.platforms.interface import CpuPlatform, CudaPlatform, Platform

logger = logging.getLogger(__name__)


PLATFORM_PLUGINS_GROUP = "moe_dbo.platform_plugins"


GENERAL_PLUGINS_GROUP = "moe_dbo.general_plugins"


def load_plugins_by_group(group: str) -> dict[str, Callable[[], Any]]:
    """Entry-point name -> loaded function, for every installed plugin of ``group``.

    A plugin that fails to import is logged and skipped (one broken package must not stop serving).
    """
    plugins: dict[str, Callable[[], Any]] = {}
    for plugin in entry_points(group=group):
        try:
            plugins[plugin.name] = plugin.load()
        except Exception:  # noqa: BLE001 - reported, then ignored
            logger.exception("failed to load plugin %r of group %r", plugin.name, group)
    return plugins


_general_plugins_loaded = False


def load_general_plugins() -> None:
    """Call each ``moe_dbo.general_plugins`` function once per process (e.g. to add OOT ops)."""
    global _general_plugins_loaded
    if _general_plugins_loaded:
        return
    _general_plugins_loaded = True
    for func in load_plugins_by_group(GENERAL_PLUGINS_GROUP).values():
        func()


def _import_class(qualname: str) -> type:
    module_name, _, class_name = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)


PLATFORM_ENV = "MOE_DBO_PLATFORM"
BUILTIN_PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def resolve_platform() -> Platform:
    """Pick the platform now (see the module docstring).

    Raises:
        RuntimeError: more than one platform plugin activated (their names are listed).
        ValueError: ``MOE_DBO_PLATFORM`` names no built-in platform or installed plugin, or
            ``cuda`` where CUDA is not available.
    """
    chosen = os.environ.get(PLATFORM_ENV, "")
    if chosen:
        return _named_platform(chosen)
    activated = {}
    for name, register in load_plugins_by_group(PLATFORM_PLUGINS_GROUP).items():
        qualname = register()
        if qualname is not None:
            activated[name] = qualname
    if len(activated) > 1:
        raise RuntimeError(f"more than one platform plugin activated: {sorted(activated)}")
    if activated:
        return _import_class(next(iter(activated.values())))()
    if torch.cuda.is_available():
        return CudaPlatform()
    return CpuPlatform()


def _named_platform(name: str) -> Platform:
    """The platform ``MOE_DBO_PLATFORM`` names: a built-in one or a plugin's (even one that would
    not activate itself)."""
    if name in BUILTIN_PLATFORMS:
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{PLATFORM_ENV}=cuda, but CUDA is not available")
        return BUILTIN_PLATFORMS[name]()
    plugins = load_plugins_by_group(PLATFORM_PLUGINS_GROUP)
    if name not in plugins:
        known = sorted([*BUILTIN_PLATFORMS, *plugins])
        raise ValueError(f"{PLATFORM_ENV}={name!r} is not one of {known}")
    qualname = plugins[name]()
    if qualname is None:
        raise ValueError(f"{PLATFORM_ENV}={name!r}: the plugin is not available on this machine")
    return _import_class(qualname)()


_current_platform: Platform | None = None


def current_platform() -> Platform:
    """The platform of this process, resolved on first call and cached."""
    global _current_platform
    if _current_platform is None:
        _current_platform = resolve_platform()
    return _current_platform


def set_current_platform(platform: Platform | None) -> None:
    """Override (or with None, forget) the cached platform; for tests and embedding."""
    global _current_platform
    _current_platform = platform
    _platforms_by_device_type.clear()


class UnclaimedDevice(Platform):
    """Tensors on a device type no platform claims (``meta``: shapes, no data): not host memory,
    no kernels of ours."""

    name = "unclaimed"
    is_host_memory = False

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type


# device type -> the platform answering for its tensors; per layer and step: a dict lookup
_platforms_by_device_type: dict[str, Platform] = {}


def platform_for(device: torch.device) -> Platform:
    """The platform that answers for tensors on ``device`` (``is_host_memory``,
    ``is_triton_target``): the current platform for its own ``device_type``, a built-in one
    for another (host tensors of a CUDA process: ``CpuPlatform``), else ``UnclaimedDevice``.
    Resolved once per device type; cheap enough for hot paths."""
    try:
        return _platforms_by_device_type[device.type]
    except KeyError:
        pass
    current = current_platform()
    if current.device_type == device.type:
        platform = current
    elif device.type in BUILTIN_PLATFORMS:
        platform = BUILTIN_PLATFORMS[device.type]()
    else:
        platform = UnclaimedDevice(device.type)
    _platforms_by_device_type[device.type] = platform
    return platform
