"""``CustomOp`` (after vLLM's): one op, several implementations (``forward_native``, the reference;
``forward_cpu`` / ``forward_cuda`` / ``forward_oot``) bound per platform when the op is built; the
``--custom-ops`` setting and out-of-tree replacement. Rules: docs/hardware.md, "CustomOp
dispatch"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from moe.platforms.plugins import current_platform


def is_tracing() -> bool:
    """Whether a tracer (make_fx, FakeTensorMode, Dynamo) is running. ``forward_cpu`` paths that
    depend on host-side state (prepacked weights, Python loops over row blocks) take their plain
    form then, so a graph sees ordinary ops."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def is_graph_tracing() -> bool:
    """Whether a graph is being recorded (Dynamo, or ``make_fx``'s proxy / fake / functional
    modes), unlike ``is_tracing`` not any dispatch mode: a mode that only watches the ops (an op
    counter) runs the ops as they are. Paths that launch kernels the tracer cannot see (Triton)
    take their torch form then."""
    keys = torch._C._TorchDispatchModeKey
    return torch.compiler.is_compiling() or any(
        torch._C._get_dispatch_mode(key) is not None
        for key in (keys.PROXY, keys.FAKE, keys.FUNCTIONAL)
    )


DEFAULT_CUSTOM_OPS: tuple[str, ...] = ("all",)
_custom_ops: tuple[str, ...] = DEFAULT_CUSTOM_OPS


def parse_custom_ops(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Split and check a custom-ops setting (syntax only; ``set_custom_ops`` checks op names).

    Raises:
        ValueError: an empty entry, an entry that is not ``all``/``none``/``+name``/``-name``,
            ``all`` together with ``none``, or one op both enabled and disabled.
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    entries = tuple(p.strip() for p in parts)
    for entry in entries:
        if entry in ("all", "none"):
            continue
        if len(entry) < 2 or entry[0] not in "+-":
            raise ValueError(
                f"--custom-ops entry {entry!r} is not valid; use 'all', 'none', '+name' or '-name'"
            )
    if "all" in entries and "none" in entries:
        raise ValueError("--custom-ops cannot contain both 'all' and 'none'")
    both = {e[1:] for e in entries if e[0] == "+"} & {e[1:] for e in entries if e[0] == "-"}
    if both:
        raise ValueError(f"--custom-ops enables and disables the same op(s): {sorted(both)}")
    return entries


def set_custom_ops(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Set the process-wide custom-ops setting for ops built from now on; returns the entries.

    Raises:
        ValueError: bad syntax (see ``parse_custom_ops``) or an op name not registered (the message
            lists the registered ones).
    """
    global _custom_ops
    entries = parse_custom_ops(spec)
    unknown = sorted({e[1:] for e in entries if e[0] in "+-"} - set(CustomOp.op_registry))
    if unknown:
        raise ValueError(
            f"--custom-ops names unknown op(s) {unknown}; "
            f"registered ops: {sorted(CustomOp.op_registry)}"
        )
    _custom_ops = entries
    return entries


def get_custom_ops() -> tuple[str, ...]:
    return _custom_ops


class CustomOp(nn.Module):
    """Base class of dispatchable ops. Subclasses implement ``forward_native`` at least."""

    op_registry: ClassVar[dict[str, type[CustomOp]]] = {}
    op_registry_oot: ClassVar[dict[str, type[CustomOp]]] = {}
    name: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any):
        replacement = CustomOp.op_registry_oot.get(cls.__name__) or CustomOp.op_registry_oot.get(
            cls.__dict__.get("name", "")
        )
        if replacement is not None and replacement is not cls:
            cls = replacement
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        self._forward_method = self.dispatch_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement forward_native")

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    @classmethod
    def enabled(cls) -> bool:
        """Whether this op uses its platform path under the current custom-ops setting."""
        entries = get_custom_ops()
        if f"-{cls.name}" in entries:
            return False
        return f"+{cls.name}" in entries or "none" not in entries

    def dispatch_forward(self) -> Callable[..., Any]:
        return self.dispatch_method("forward")

    def dispatch_method(self, base: str) -> Callable[..., Any]:
        """The implementation of method family ``base`` this op binds: ``<base>_native`` if the
        op is disabled by the custom-ops setting or does not override the platform's
        ``<base>_<dispatch_key>``, else that one. ``forward`` is one family; an op with more
        than one entry point (the experts' ``apply_batched``, their post-load preparation)
        binds each the same way instead of testing which ``forward`` it took."""
        native = getattr(self, f"{base}_native")
        if not self.enabled():
            return native
        method = f"{base}_{current_platform().dispatch_key}"
        # an op that does not override the platform method runs the native one directly
        if getattr(type(self), method, None) in (None, getattr(CustomOp, method, None)):
            return native
        return getattr(self, method)

    @property
    def forward_path(self) -> str:
        """Name of the bound implementation, e.g. ``"forward_cpu"`` (for logs and tests)."""
        return self._forward_method.__name__

    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: register an in-tree op under ``name`` (ValueError if taken)."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if name in cls.op_registry and cls.op_registry[name] is not op_cls:
                raise ValueError(f"custom op {name!r} is already registered")
            op_cls.name = name
            cls.op_registry[name] = op_cls
            return op_cls

        return decorator

    @classmethod
    def register_oot(
        cls, name: str | None = None, *, op_cls: type[CustomOp] | None = None
    ) -> Callable[[type[CustomOp]], type[CustomOp]] | type[CustomOp]:
        """Register an out-of-tree replacement for the op whose class name (or op name) is
        ``name`` (default: the replacement's own class name). Use as a decorator, or pass
        ``op_cls=`` to register directly. Ops built afterwards are of the replacement class.

        Raises:
            TypeError: the replacement does not subclass CustomOp.
        """

        def decorator(replacement: type[CustomOp]) -> type[CustomOp]:
            if not (isinstance(replacement, type) and issubclass(replacement, CustomOp)):
                raise TypeError(f"{replacement!r} must subclass CustomOp")
            cls.op_registry_oot[name or replacement.__name__] = replacement
            return replacement

        return decorator(op_cls) if op_cls is not None else decorator
