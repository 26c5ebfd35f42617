"""Track names as the recorder writes them sort in display order for the trace merger and plot."""

from __future__ import annotations

from dbo.timeline.tracks import STEP_TRACK, lane_name, track_name, track_order


def test_written_names_sort_in_display_order():
    written = [
        lane_name(track_name("comm", 1), 1),
        track_name("comm", 1),
        "custom",
        track_name("compute", 1),
        track_name("gpu", 1),
        track_name("comm", 0),
        track_name("gpu", None),
        track_name("compute", 0),
        track_name("comm", None),
        track_name("compute", None),
        STEP_TRACK,
        track_name("compute", 10),
    ]
    assert sorted(written, key=track_order) == [
        "engine step",
        "main compute",
        "main gpu",
        "main comm",
        "ubatch0 compute",
        "ubatch0 comm",
        "ubatch1 compute",
        "ubatch1 gpu",
        "ubatch1 comm",
        "ubatch1 comm #2",
        "ubatch10 compute",
        "custom",
    ]
    assert lane_name("main comm", 0) == "main comm"
