"""The expert all-to-all link as the planner models it: ``alpha + bytes / beta`` per transfer.

A rank's transfers share its link one after another (the bandwidth term), while their latencies
overlap: the same model as ``distributed.link_emulation``. On a GPU part of a transfer also runs
kernels on the SMs (sending, receiving, reducing): ``sm_fraction`` of its transfer time is charged
to the compute stream, where no overlap can hide it.

Presets from DeepEP V1's published tables (github.com/deepseek-ai/DeepEP, docs/legacy.md, H800 with
CX7 400 Gb/s InfiniBand): low-latency kernels, 128 tokens, hidden 7168, top-8, FP8 dispatch and
BF16 combine: dispatch / combine "RDMA bandwidth" per EP size; normal (high-throughput) kernels:
NVLink 153 GB/s intranode (EP 8), RDMA 43-58 GB/s internode. DeepEP's bandwidth is its bytes over
its measured latency, so a fitted alpha from the same table is ~0; the fixed latency is an
assumption (``ASSUMED_ALPHA_US``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

GB = 1e9

# DeepEP low-latency table: EP size -> (dispatch GB/s, combine GB/s); latencies 77/114 µs at EP 8
# ... 194/360 µs at EP 256 for 128 tokens (DeepEP docs/legacy.md, "Low-latency kernels")
DEEPEP_LL_GBYTES: dict[int, tuple[float, float]] = {
    8: (98.0, 127.0),
    16: (63.0, 74.0),
    32: (48.0, 53.0),
    64: (43.0, 46.0),
    128: (39.0, 39.0),
    256: (39.0, 40.0),
}
# DeepEP normal kernels: EP size -> (dispatch GB/s, combine GB/s) (docs/legacy.md, "Normal kernels")
DEEPEP_HT_GBYTES: dict[int, tuple[float, float]] = {
    8: (153.0, 158.0),
    16: (43.0, 43.0),
    32: (58.0, 57.0),
    64: (51.0, 50.0),
}
ASSUMED_ALPHA_US = 10.0  # assumption: RDMA post + completion of a small LL transfer, not published
# lmsys blog 2025-05-05 ("Detail Breakdown", decode): a DeepEP unit test occupies the SMs 0.06 ms of
# a 0.17 ms dispatch; the same fraction is assumed for the combine
DEEPEP_LL_SM_FRACTION = 0.06 / 0.17


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkModel:
    """One rank's link: ``latency_us`` (alpha, µs), ``dispatch_gbytes`` / ``combine_gbytes``
    (beta, GB/s = 1e9 bytes/s), ``sm_fraction`` of a transfer's time that occupies compute.

    Raises:
        ValueError: negative latency, non-positive bandwidth, sm_fraction outside [0, 1).
    """

    name: str
    latency_us: float
    dispatch_gbytes: float
    combine_gbytes: float
    sm_fraction: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.latency_us >= 0:
            raise ValueError(f"link latency must be >= 0 µs, got {self.latency_us}")
        if not (self.dispatch_gbytes > 0 and self.combine_gbytes > 0):
            raise ValueError(
                f"link bandwidth must be > 0, got {self.dispatch_gbytes}/{self.combine_gbytes}"
            )
        if not 0 <= self.sm_fraction < 1:
            raise ValueError(f"sm_fraction must be in [0, 1), got {self.sm_fraction}")

    def wire_ms(self, op: str, num_bytes: float) -> float:
        """Milliseconds ``num_bytes`` of ``op`` ("dispatch" / "combine") occupy the link."""
        gbytes = self.dispatch_gbytes if op == "dispatch" else self.combine_gbytes
        return num_bytes / (gbytes * GB) * 1e3

    def transfer_ms(self, op: str, num_bytes: float) -> float:
        """Alone on the link: latency + bytes / bandwidth, in ms."""
        return self.latency_us / 1e3 + self.wire_ms(op, num_bytes)


def from_gbps(
    latency_us: float, gbps: float, *, name: str = "custom", source: str = ""
) -> LinkModel:
    """A symmetric link given in ``--emulate-link`` units (µs, Gbit/s).

    Raises:
        ValueError: as ``LinkModel``.
    """
    if not gbps > 0:
        raise ValueError(f"--link-gbps must be > 0 (Gbit/s), got {gbps}")
    return LinkModel(
        name=name,
        latency_us=latency_us,
        dispatch_gbytes=gbps / 8,
        combine_gbytes=gbps / 8,
        source=source or "given on the command line",
    )


def _nearest_ep(table: dict[int, tuple[float, float]], ep_size: int) -> int:
    """The table's EP size for ``ep_size``: the smallest listed one >= it, else the largest."""
    sizes = sorted(table)
    i = bisect.bisect_left(sizes, ep_size)
    return sizes[min(i, len(sizes) - 1)]


def deepep_link(kind: str, ep_size: int) -> LinkModel:
    """DeepEP's published bandwidth for ``kind`` ("deepep-ll" / "deepep-ht") at ``ep_size``.

    Raises:
        ValueError: unknown kind or ``ep_size < 2``.
    """
    if ep_size < 2:
        raise ValueError(f"--ep-size must be >= 2, got {ep_size}")
    if kind == "deepep-ll":
        table, sm, what = DEEPEP_LL_GBYTES, DEEPEP_LL_SM_FRACTION, "low-latency"
    elif kind == "deepep-ht":
        table, sm, what = DEEPEP_HT_GBYTES, 0.0, "normal"
    else:
        raise ValueError(f"--link {kind!r}: unknown; accepted: deepep-ll, deepep-ht, custom")
    ep = _nearest_ep(table, ep_size)
    dispatch, combine = table[ep]
    return LinkModel(
        name=f"{kind} EP{ep_size} (table row EP{ep})",
        latency_us=ASSUMED_ALPHA_US,
        dispatch_gbytes=dispatch,
        combine_gbytes=combine,
        sm_fraction=sm,
        source=f"DeepEP docs/legacy.md {what} kernels, EP{ep}; alpha assumed {ASSUMED_ALPHA_US} µs",
    )
