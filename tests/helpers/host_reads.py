"""Recording every read of tensor values to the host during a block of code: on a GPU each one is
a host-device synchronisation (and breaks CUDA-graph capture), so a test on CPU tensors that
records none proves the same code reads nothing on the GPU.

Two nets, in the calling thread and in every thread started inside the block (the DBO ubatch
threads): the ``Tensor`` methods that hand values to Python (``item``, ``tolist``, ``cpu``,
``numpy``, ``bool()``, ``int()``, ``float()``, ``index()``), and, through a ``TorchDispatchMode``,
the aten ops whose output shape or result depends on tensor values (``nonzero``, boolean-mask
indexing, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, ...). Reads
inside C++ code that dispatches nothing cannot be seen.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# value-dependent aten ops (a GPU computes them, then the host reads a size or a scalar)
_READING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",
        "equal",
        "is_nonzero",
    }
)


def _where() -> str:
    """``file:line`` of the first frame outside this module and torch."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            return (
                f"{frame.filename.rsplit('/', 2)[-2]}/"
                f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
            )
    return "?"


def _reads_values(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in _READING_OPS:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and len(args) < 3
    if name in ("index", "index_put", "index_put_"):  # a boolean mask index: nonzero inside
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class _OpRecorder(TorchDispatchMode):
    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            self.reads.append(f"aten.{func.overloadpacket.__name__} at {_where()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording_host_reads() -> Iterator[list[str]]:
    """Yield a list that collects ``"<what> at <dir/file:line>"`` for every host read in the block.

    The dispatch mode makes ``moe.platforms.custom_op.is_tracing()`` true inside the block (paths
    that depend on host-side state take their plain form), so warm up inside one too."""
    reads: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in _METHODS}

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            reads.append(f"Tensor.{name} at {_where()}")
            return original(self, *args, **kwargs)

        return method

    # a dispatch mode is per thread: threads started in the block enter their own
    thread_run = threading.Thread.run

    def run(self):
        with _OpRecorder(reads):
            thread_run(self)

    for name in _METHODS:
        setattr(torch.Tensor, name, wrap(name))
    threading.Thread.run = run
    try:
        with _OpRecorder(reads):
            yield reads
    finally:
        threading.Thread.run = thread_run
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def reads_per_file(reads: Iterable[str]) -> dict[str, int]:
    """``recording_host_reads``' entries counted per ``dir/file`` (e.g. ``engine/sampler.py``)."""
    return dict(collections.Counter(r.split(" at ")[1].rsplit(":", 1)[0] for r in reads))
