"""The platforms ops dispatch on: CPU, CUDA, and the base class out-of-tree platforms subclass."""

from __future__ import annotations


class Platform:
    """A device family. ``dispatch_key`` names the ``CustomOp.forward_<key>`` method its ops use
    (``"native"``: plain torch everywhere; out-of-tree platforms use ``"oot"``)."""

    name: str = "unspecified"
    dispatch_key: str = "native"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dispatch_key={self.dispatch_key!r})"


class CpuPlatform(Platform):
    name = "cpu"
    dispatch_key = "cpu"


class CudaPlatform(Platform):
    name = "cuda"
    dispatch_key = "cuda"
