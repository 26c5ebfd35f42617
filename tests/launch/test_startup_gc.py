"""The engine freezes its start-up heap (vLLM's freeze_gc_heap) so later full GCs skip it."""

from __future__ import annotations

import gc

from tests.helpers.single_rank import single_rank_engine


def test_engine_start_up_freezes_the_gc_heap(tiny_mixtral_dir):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    engine = single_rank_engine(tiny_mixtral_dir)
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(engine.model_runner) and engine.kv_cache_manager.num_blocks > 0
    gc.unfreeze()  # leave the test process as it was
