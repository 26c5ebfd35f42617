"""The attention backend of the ops built from now on (vLLM's ``attention/selector.py``): the one
set by ``--attention-backend``, else the current platform's default (the backends are listed in
``moe.layers.attention_backend``)."""

from __future__ import annotations

from moe.layers.attention_backend import AttentionBackendEnum, default_attention_backend

_selected: AttentionBackendEnum | None = None  # None: the platform's default


def set_attention_backend(backend: AttentionBackendEnum | None) -> None:
    """Set the backend of attention ops built from now on (None: the platform's default)."""
    global _selected
    _selected = backend


def selected_attention_backend() -> AttentionBackendEnum:
    """The backend set by ``set_attention_backend``, else the current platform's default."""
    if _selected is not None:
        return _selected
    from moe.platforms.plugins import current_platform

    return default_attention_backend(current_platform().attention_backends)
