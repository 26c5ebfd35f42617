"""The ping-pong protocol between ubatch threads (two, and N in a ring): order, recv hooks,
failures, timeouts."""

from __future__ import annotations

import threading
import time

import pytest

from dbo import (
    UBatchAborted,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    make_ubatch_contexts,
)

TIMEOUT_S = 2.0


def run_threads(contexts, body):
    """Run ``body(ctx)`` inside each context on its own thread; return the errors by ubatch."""
    errors = [None] * len(contexts)

    def target(ctx):
        try:
            with ctx:
                body(ctx)
        except BaseException as error:  # noqa: BLE001 - inspected by the test
            errors[ctx.id] = error

    threads = [
        threading.Thread(target=target, args=(ctx,), name=f"ubatch{ctx.id}", daemon=True)
        for ctx in contexts
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5 * TIMEOUT_S)
        assert not thread.is_alive(), f"{thread.name} hangs"
    return errors


def test_free_functions_are_no_ops_without_a_context():
    calls = []
    assert not dbo_enabled()
    assert dbo_current_ubatch_id() == 0
    dbo_yield()
    dbo_register_recv_hook(lambda: calls.append("hook"))
    dbo_maybe_run_recv_hook()
    assert calls == []


def test_baton_passes_in_a_ring_and_one_thread_runs_at_a_time():
    log = []
    running = []

    def body(ctx):
        log.append(("enter", ctx.id, dbo_current_ubatch_id(), dbo_enabled()))
        for step in range(3):
            running.append(ctx.id)
            assert len(running) == 1, running
            log.append(("work", ctx.id, step))
            running.remove(ctx.id)
            dbo_yield()
        log.append(("exit", ctx.id))

    errors = run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body)
    assert errors == [None, None]
    assert log == [
        ("enter", 0, 0, True),
        ("work", 0, 0),
        ("enter", 1, 1, True),
        ("work", 1, 0),
        ("work", 0, 1),
        ("work", 1, 1),
        ("work", 0, 2),
        ("work", 1, 2),
        ("exit", 0),  # ubatch 0 gets the baton back after ubatch 1's last yield
        ("exit", 1),
    ]


def test_three_ubatches_take_turns_in_order():
    log = []

    def body(ctx):
        for step in range(2):
            log.append((ctx.id, step))
            dbo_yield()

    assert run_threads(make_ubatch_contexts(3, timeout_s=TIMEOUT_S), body) == [None] * 3
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_recv_hook_runs_in_the_other_ubatch():
    ran = []

    def hook():
        ran.append((threading.current_thread().name, dbo_current_ubatch_id()))

    def body(ctx):
        if ctx.id == 0:
            dbo_maybe_run_recv_hook()
            dbo_register_recv_hook(hook)
            dbo_yield()
            assert ran == [("ubatch1", 1)]
        else:
            dbo_maybe_run_recv_hook()  # runs ubatch 0's hook
            dbo_maybe_run_recv_hook()  # cleared: nothing runs twice
            dbo_yield()

    assert run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body) == [None, None]
    assert ran == [("ubatch1", 1)]


@pytest.mark.parametrize("num_ubatches", [3, 4])
def test_recv_hook_runs_in_the_ubatch_that_runs_last_before_its_owner(num_ubatches):
    """With N ubatches a hook goes to the previous one in the ring: the transfer it completes
    stays in flight while all N-1 others compute, and is complete when its owner resumes."""
    ran = []  # (registered by, run by, its owner had resumed)
    resumed = set()

    def body(ctx):
        for _ in range(3):
            dbo_maybe_run_recv_hook()
            resumed.discard(ctx.id)
            dbo_register_recv_hook(
                lambda k=ctx.id: ran.append((k, dbo_current_ubatch_id(), k in resumed))
            )
            dbo_yield()
            resumed.add(ctx.id)

    contexts = make_ubatch_contexts(num_ubatches, timeout_s=TIMEOUT_S)
    assert run_threads(contexts, body) == [None] * num_ubatches
    assert sorted(ran) == sorted(
        (k, (k - 1) % num_ubatches, False) for k in range(num_ubatches) for _ in range(3)
    )


def test_hook_skips_a_finished_previous_ubatch():
    ran = []

    def body(ctx):
        if ctx.id == 2:
            dbo_yield()  # ubatch 1 finishes meanwhile: the hook goes to ubatch 0
            dbo_register_recv_hook(lambda: ran.append(dbo_current_ubatch_id()))
        for _ in range(3 if ctx.id == 0 else 1):
            dbo_yield()

    assert run_threads(make_ubatch_contexts(3, timeout_s=TIMEOUT_S), body) == [None] * 3
    assert ran == [0]


def test_pending_hook_runs_when_its_ubatch_leaves_the_context():
    ran = []

    def body(ctx):
        if ctx.id == 0:
            dbo_yield()
            # leaves without dbo_maybe_run_recv_hook(): __exit__ runs ubatch 1's hook
        else:
            dbo_register_recv_hook(lambda: ran.append(threading.current_thread().name))
            dbo_yield()
            ran.append("ubatch1 resumed")

    assert run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body) == [None, None]
    assert ran == ["ubatch0", "ubatch1 resumed"]


def test_yields_after_the_peer_finished_do_not_wait():
    def body(ctx):
        for _ in range(1 if ctx.id == 0 else 50):
            dbo_yield()
        if ctx.id == 1:
            # nobody left to hand the hook to: it is kept for this ubatch itself
            dbo_register_recv_hook(lambda: None)

    start = time.perf_counter()
    errors = run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body)
    assert errors == [None, None]
    assert time.perf_counter() - start < TIMEOUT_S / 2


def test_exception_wakes_the_waiting_peer():
    def body(ctx):
        dbo_yield()
        if ctx.id == 1:
            raise ValueError("boom in ubatch 1")
        dbo_yield()  # ubatch 0 waits here for a baton that never comes

    start = time.perf_counter()
    errors = run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body)
    assert time.perf_counter() - start < TIMEOUT_S / 2  # woken, not timed out
    assert isinstance(errors[1], ValueError)
    assert isinstance(errors[0], UBatchAborted)
    assert errors[0].__cause__ is errors[1]


@pytest.mark.parametrize("num_ubatches", [3, 4])
def test_exception_in_any_of_n_ubatches_wakes_all_the_others(num_ubatches):
    for fail_in in range(num_ubatches):

        def body(ctx, fail_in=fail_in):
            dbo_yield()
            if ctx.id == fail_in:
                raise ValueError(f"boom in ubatch {fail_in}")
            dbo_yield()
            dbo_yield()

        start = time.perf_counter()
        errors = run_threads(make_ubatch_contexts(num_ubatches, timeout_s=TIMEOUT_S), body)
        assert time.perf_counter() - start < TIMEOUT_S / 2  # woken, not timed out
        assert isinstance(errors[fail_in], ValueError)
        others = [e for k, e in enumerate(errors) if k != fail_in]
        assert all(isinstance(e, UBatchAborted) for e in others), errors
        assert all(e.__cause__ is errors[fail_in] for e in others)


def test_failure_before_the_first_yield_stops_the_peer_at_its_start():
    def body(ctx):
        if ctx.id == 0:
            raise KeyError("early")

    errors = run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body)
    assert isinstance(errors[0], KeyError)
    assert isinstance(errors[1], UBatchAborted)


def test_peer_that_never_yields_back_times_out():
    contexts = make_ubatch_contexts(2, timeout_s=0.1)
    # no thread ever runs ubatch 1, so ubatch 0 never gets the baton back
    match = r"ubatch 0 waited 0.1 s for the baton at a dbo_yield"
    with pytest.raises(TimeoutError, match=match), contexts[0]:
        dbo_yield()
    assert not dbo_enabled()  # the thread-local context is cleared on the way out
    # the group is aborted: a late ubatch 1 stops at once instead of running
    with pytest.raises(UBatchAborted), contexts[1]:
        pass


def test_waiting_to_start_times_out():
    contexts = make_ubatch_contexts(2, timeout_s=0.1)
    with pytest.raises(TimeoutError, match="ubatch 1 waited 0.1 s for the baton to start"):
        contexts[1].__enter__()
    assert not dbo_enabled()


def test_contexts_validate_arguments():
    with pytest.raises(ValueError, match="num_ubatches must be >= 1, got 0"):
        make_ubatch_contexts(0, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        make_ubatch_contexts(2, timeout_s=0)


def test_failing_hook_run_at_exit_aborts_the_peer():
    def failing_hook():
        raise ConnectionError("combine failed")

    def body(ctx):
        if ctx.id == 1:
            dbo_register_recv_hook(failing_hook)
        dbo_yield()  # ubatch 0 leaves after this: its __exit__ runs the failing hook

    errors = run_threads(make_ubatch_contexts(2, timeout_s=TIMEOUT_S), body)
    assert isinstance(errors[0], ConnectionError)
    assert isinstance(errors[1], UBatchAborted)
