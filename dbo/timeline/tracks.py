"""Timeline track names: written by the recorder, sorted by the Chrome-trace merger and the plot.

A track is ``engine step`` (one span per engine step), ``dbo policy`` (adaptive DBO's exploration
steps), ``main {kind}`` (DBO off) or
``ubatch{i} {kind}`` (DBO on, ubatch ``i``), with ``kind`` ``compute``, ``gpu`` (the compute
spans as the device ran them, with a device clock) or ``comm``. When spans of one track overlap,
the merger moves the later ones to extra lanes ``<track> #k`` (k >= 2).
Display order: engine step, dbo policy, main compute/gpu/comm, ubatch0 compute/gpu/comm,
ubatch1 ..., anything else.
"""

from __future__ import annotations

STEP_TRACK = "engine step"
POLICY_TRACK = "dbo policy"
_KIND_ORDER = {"compute": "0", "gpu": "1", "comm": "2"}
_LANE_SEP = " #"


def track_name(kind: str, ubatch_id: int | None) -> str:
    """The track of a ``kind`` span: ``ubatch{ubatch_id} {kind}``, or ``main {kind}`` when
    ``ubatch_id`` is None (DBO off)."""
    return f"main {kind}" if ubatch_id is None else f"ubatch{ubatch_id} {kind}"


def lane_name(track: str, lane: int) -> str:
    """Lane ``lane`` (0-based) of ``track``: the track for lane 0, else ``<track> #{lane+1}``."""
    return track if lane == 0 else f"{track}{_LANE_SEP}{lane + 1}"


def track_order(track: str) -> tuple:
    """Sort key of a track or lane name, in the display order above."""
    base, _, lane = track.partition(_LANE_SEP)
    if base == STEP_TRACK:
        key: tuple = (0, 0, "")
    elif base == POLICY_TRACK:
        key = (0, 1, "")
    elif base.startswith("main "):
        key = (1, 0, _KIND_ORDER.get(base[5:], base))
    elif base.startswith("ubatch"):
        head, _, kind = base.partition(" ")
        key = (2, int(head[6:]) if head[6:].isdigit() else 0, _KIND_ORDER.get(kind, kind))
    else:
        key = (3, 0, base)
    return (*key, int(lane or 1))
