"""EngineBridge hand-over and the HTTP status a failed request's output maps to."""

from __future__ import annotations

import asyncio

import pytest

from launch.engine.request import SamplingParams
from launch.serving.engine_bridge import EngineBridge, ServerShuttingDown
from launch.serving.serving_engine import EngineError


def test_fail_all_delivers_the_typed_error_and_shutdown_maps_to_503():
    async def scenario():
        bridge = EngineBridge(asyncio.get_running_loop())
        _, outputs = bridge.submit([1, 2], SamplingParams())
        bridge.stop_accepting()
        with pytest.raises(ServerShuttingDown, match="accepts no new requests"):
            bridge.submit([3], SamplingParams())
        error = ServerShuttingDown("the server shut down")
        assert bridge.fail_all(error) == 1
        output = await asyncio.wait_for(outputs.get(), timeout=5)
        assert output.is_last and output.error is error
        assert bridge.num_in_flight == 0

    asyncio.run(scenario())
    assert EngineError(ServerShuttingDown("any text")).status == 503
    # the text no longer decides: an engine error that mentions "shut down" is still a 500
    assert EngineError(ValueError("the model shut down a layer")).status == 500
