"""The expert all-to-all link as the planner models it: ``alpha + bytes / beta`` per transfer.

A rank's transfers share its link one after another (the bandwidth term), while their latencies
overlap: the same model as ``distributed.link_emulation``. On a GPU part of a transfer also runs
kernels on the SMs (sending, receiving, reducing): ``sm_fraction`` of its transfer time is charged
to the compute stream, where no overlap can hide it.

Presets from DeepEP V1's published tables (github.com/deepseek-ai/DeepEP, docs/legacy.md, H800 with
CX7 400 Gb/s InfiniBand, "~50 GB/s maximum bandwidth"). Low-latency kernels (128 tokens, hidden
7168, top-8, FP8 dispatch, BF16 combine): a latency per EP size and op. Its "RDMA bandwidth"
column is those bytes over that latency, so it mixes the two terms; the planner splits it: the
bytes cross the NIC at its 50 GB/s line rate (the 1/EP a rank sends itself excluded) and the
rest of the published latency is alpha. Normal (high-throughput) kernels: NVLink 153-158 GB/s
intranode (EP 8), RDMA 43-58 GB/s internode, alpha assumed ``ASSUMED_ALPHA_US``. Between listed
EP sizes alpha and beta are interpolated in log2(EP); beyond them the nearest row is used.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

GB = 1e9

# DeepEP low-latency table: EP size -> (dispatch µs, combine µs) for 128 tokens (docs/legacy.md)
DEEPEP_LL_LATENCY_US: dict[int, tuple[float, float]] = {
    8: (77.0, 114.0),
    16: (118.0, 195.0),
    32: (155.0, 273.0),
    64: (173.0, 314.0),
    128: (192.0, 369.0),
    256: (194.0, 360.0),
}
# ... and its bandwidth column: EP size -> (dispatch GB/s, combine GB/s)
DEEPEP_LL_GBYTES: dict[int, tuple[float, float]] = {
    8: (98.0, 127.0),
    16: (63.0, 74.0),
    32: (48.0, 53.0),
    64: (43.0, 46.0),
    128: (39.0, 39.0),
    256: (39.0, 40.0),
}
NIC_GBYTES = 50.0  # DeepEP docs/legacy.md: CX7 400 Gb/s, "~50 GB/s maximum bandwidth"
HIDDEN_7168_BYTES = {"dispatch": 7168 * (1 + 4 / 128), "combine": 7168 * 2}  # FP8 + scales, BF16
DEEPEP_TABLE_COPIES = 128 * 8  # 128 tokens x top-8
# DeepEP normal kernels: EP size -> (dispatch GB/s, combine GB/s) (docs/legacy.md, "Normal kernels")
DEEPEP_HT_GBYTES: dict[int, tuple[float, float]] = {
    8: (153.0, 158.0),
    16: (43.0, 43.0),
    32: (58.0, 57.0),
    64: (51.0, 50.0),
}
ASSUMED_ALPHA_US = 10.0  # assumption (normal kernels): not in DeepEP's table
# lmsys blog 2025-05-05 ("Detail Breakdown", decode): a DeepEP unit test occupies the SMs 0.06 ms of
# a 0.17 ms dispatch; the same fraction is assumed for the combine
DEEPEP_LL_SM_FRACTION = 0.06 / 0.17


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkModel:
    """One rank's link: ``latency_us`` (alpha, µs; ``combine_latency_us`` if the combine's
    differs), ``dispatch_gbytes`` / ``combine_gbytes`` (beta, GB/s = 1e9 bytes/s),
    ``sm_fraction`` of a transfer's wire time that occupies compute.

    Raises:
        ValueError: negative latency, non-positive bandwidth, sm_fraction outside [0, 1).
    """

    name: str
    latency_us: float
    dispatch_gbytes: float
    combine_gbytes: float
    sm_fraction: float = 0.0
    source: str = ""
    combine_latency_us: float | None = None  # None: latency_us

    def __post_init__(self) -> None:
        if not (self.latency_us >= 0 and (self.combine_latency_us or 0) >= 0):
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

    def latency_ms(self, op: str) -> float:
        """Milliseconds from ``op``'s last byte on the wire to its data landing."""
        if op == "combine" and self.combine_latency_us is not None:
            return self.combine_latency_us / 1e3
        return self.latency_us / 1e3

    def transfer_ms(self, op: str, num_bytes: float) -> float:
        """Alone on the link: latency + bytes / bandwidth, in ms."""
        return self.latency_ms(op) + self.wire_ms(op, num_bytes)

    def scaled(self, *, bandwidth: float = 1.0, latency: float = 1.0) -> LinkModel:
        """This link with its bandwidths times ``bandwidth`` and latencies times ``latency``."""
        combine_latency = self.combine_latency_us
        return replace(
            self,
            dispatch_gbytes=self.dispatch_gbytes * bandwidth,
            combine_gbytes=self.combine_gbytes * bandwidth,
            latency_us=self.latency_us * latency,
            combine_latency_us=None if combine_latency is None else combine_latency * latency,
        )


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


def _interpolate(table: dict[int, tuple[float, ...]], ep_size: int) -> tuple[float, ...]:
    """The table's row at ``ep_size``, interpolated in log2(EP) between listed sizes (the nearest
    row outside them)."""
    sizes = sorted(table)
    if ep_size <= sizes[0] or ep_size >= sizes[-1]:
        return table[sizes[0] if ep_size <= sizes[0] else sizes[-1]]
    i = bisect.bisect_left(sizes, ep_size)
    lo, hi = sizes[i - 1], sizes[i]
    x = (math.log2(ep_size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return tuple(a + (b - a) * x for a, b in zip(table[lo], table[hi], strict=True))


def _ll_row(ep: int) -> tuple[float, float, float, float]:
    """(dispatch alpha µs, combine alpha µs, dispatch GB/s, combine GB/s) of the LL table at ``ep``:
    wire time at the NIC's line rate for the bytes leaving the rank, the rest is latency. Where the
    table beats the line rate (EP 8-16: part of the traffic stays on the node), its own bandwidth
    with zero latency."""
    out = []
    for i, op in enumerate(("dispatch", "combine")):
        latency_us = DEEPEP_LL_LATENCY_US[ep][i]
        gbytes = NIC_GBYTES * ep / (ep - 1)  # logical bytes: 1/EP stays on the rank
        wire_us = DEEPEP_TABLE_COPIES * HIDDEN_7168_BYTES[op] / (gbytes * GB) * 1e6
        if wire_us > latency_us:
            gbytes, wire_us = DEEPEP_LL_GBYTES[ep][i], latency_us
        out.append((latency_us - wire_us, gbytes))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def deepep_link(kind: str, ep_size: int) -> LinkModel:
    """DeepEP's published performance for ``kind`` ("deepep-ll" / "deepep-ht") at ``ep_size``.

    Raises:
        ValueError: unknown kind or ``ep_size < 2``.
    """
    if ep_size < 2:
        raise ValueError(f"--ep-size must be >= 2, got {ep_size}")
    if kind == "deepep-ll":
        rows = {ep: _ll_row(ep) for ep in DEEPEP_LL_LATENCY_US}
        d_alpha, c_alpha, d_gb, c_gb = _interpolate(rows, ep_size)
        return LinkModel(
            name=f"deepep-ll EP{ep_size}",
            latency_us=d_alpha,
            combine_latency_us=c_alpha,
            dispatch_gbytes=d_gb,
            combine_gbytes=c_gb,
            sm_fraction=DEEPEP_LL_SM_FRACTION,
            source=(
                f"DeepEP docs/legacy.md low-latency table split at the {NIC_GBYTES:g} GB/s NIC rate"
            ),
        )
    if kind != "deepep-ht":
        raise ValueError(f"--link {kind!r}: unknown; accepted: deepep-ll, deepep-ht, custom")
    d_gb, c_gb = _interpolate(DEEPEP_HT_GBYTES, ep_size)
    return LinkModel(
        name=f"deepep-ht EP{ep_size}",
        latency_us=ASSUMED_ALPHA_US,
        dispatch_gbytes=d_gb,
        combine_gbytes=c_gb,
        source=f"DeepEP docs/legacy.md normal kernels; alpha assumed {ASSUMED_ALPHA_US:g} µs",
    )
