"""OpenAI-compatible server over DP ranks: ``torchrun --nproc-per-node N -m launch.serve``.

Every rank builds its engine; rank 0 also runs the HTTP front end (``launch.serving.api_server``)
and assigns each request to a DP rank; all ranks then run ``launch.serving.serve_loop.ServeLoop``
in lockstep. Flags, start-up and shutdown: docs/serving.md; what fails how:
docs/serving.md#failure-model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from distributed.parallel_state import TorchrunEnv
from launch.engine.arg_utils import (
    OneLineErrorParser,
    add_engine_args,
    engine_args_from_namespace,
    fail,
    print_error,
)
from launch.engine.llm_engine import LLMEngine
from launch.engine.output_paths import check_output_paths
from launch.engine.startup import init_engine_groups
from launch.serving.frontend_args import add_frontend_args, frontend_args_from_namespace

PROG = "launch.serve"
EMBEDDED_MODEL_NAME = "moe-dbo-embedded"
MAX_SHUTDOWN_TIMEOUT_S = 3600.0
LAUNCHER_GONE_GRACE_S = 5.0  # past --shutdown-timeout: a rank whose launcher is gone exits anyway


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address rank 0 listens on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: --model)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=20.0,
        help="seconds in-flight requests may take to finish after SIGTERM before they fail "
        "(keep it below torchrun's 30 s grace before it kills the workers)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="jinja2 chat template file for /v1/chat/completions (default: the checkpoint's, "
        "from tokenizer_config.json or chat_template.jinja)",
    )
    add_frontend_args(parser)
    add_engine_args(parser)
    return parser


class StopRequest:
    """Set once this rank is asked to stop; ``reason`` names why (a signal, the launcher gone)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def _install_stop_handlers() -> StopRequest:
    stop = StopRequest()

    def on_signal(signum, _frame) -> None:
        stop.set(signal.Signals(signum).name)  # "SIGTERM" or "SIGINT" (Ctrl-C)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def _watch_launcher(stop: StopRequest, rank: int, shutdown_timeout_s: float):
    """Under torchrun: when the launcher is gone, print one line and stop as on SIGTERM; exit
    anyway ``shutdown_timeout_s + LAUNCHER_GONE_GRACE_S`` later (a drain that cannot finish)."""
    from launch.serving.launcher_watch import LauncherWatch

    def on_gone(message: str) -> None:
        grace_s = shutdown_timeout_s + LAUNCHER_GONE_GRACE_S
        print_error(PROG, rank, f"{message}; stopping (exit within {grace_s:g} s)")
        stop.set("the launcher exited")
        threading.Timer(grace_s, os._exit, args=(1,)).start()  # daemon-free on purpose: it fires

    return LauncherWatch(on_gone).start()


def _die(rank: int, message: str) -> None:
    """One error line, then exit at once: with a dead peer, orderly teardown could block."""
    print_error(PROG, rank, message)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args, model, tokenizer, chat_template = _check_inputs(ns, world_size)
        frontend = frontend_args_from_namespace(ns)
    except (ValueError, OSError) as e:
        fail(PROG, rank, e)
    stop = _install_stop_handlers()
    watch = _watch_launcher(stop, rank, ns.shutdown_timeout)

    import torch.distributed as dist

    from distributed import destroy_distributed
    from distributed.liveness import Heartbeat

    groups = init_engine_groups(args)
    # names the peer that stopped answering when a collective times out
    heartbeat = Heartbeat(
        rank=groups.rank, world_size=groups.world_size, should_beat=watch.is_launcher_alive
    ).start()
    # control traffic (requests, outputs, shutdown) on a gloo group of its own
    control_group = dist.new_group(
        list(range(groups.world_size)), backend="gloo", timeout=groups.timeout
    )
    engine, http, metrics = _start(
        ns, args, model, tokenizer, groups, control_group, chat_template, frontend
    )
    from launch.serving.serve_loop import ServeLoop

    loop = ServeLoop(
        engine=engine,
        control_group=control_group,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        stop_requested=stop.is_set,
        stop_reason=lambda: stop.reason,
        shutdown_timeout_s=ns.shutdown_timeout,
        bridge=None if http is None else http.bridge,
        metrics=metrics,
    )
    _serve(loop, http, rank, heartbeat)
    # a profile still recording at shutdown: its trace is written
    engine.observability.stop_profile()
    # with --timeline-dir: the steps served until now
    timeline_path = engine.observability.write_timeline()
    watch.stop()
    heartbeat.stop()
    destroy_distributed()
    print(
        f"{PROG} [rank {rank}]: stopped" + (f"; wrote {timeline_path}" if timeline_path else ""),
        flush=True,
    )
    return 0


def _check_inputs(ns: argparse.Namespace, world_size: int):
    """(EngineArgs, ResolvedModel, tokenizer or None, chat template or None), before any process
    group exists.

    Raises:
        ValueError / OSError: a bad flag, model or tokenizer (one line, naming the value).
    """
    args = engine_args_from_namespace(ns)
    args.check_world_size(world_size)
    if not 0 <= ns.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    if not 0 <= ns.shutdown_timeout <= MAX_SHUTDOWN_TIMEOUT_S:  # also refuses nan
        raise ValueError(
            f"--shutdown-timeout must be in [0, {MAX_SHUTDOWN_TIMEOUT_S:g}] s, "
            f"got {ns.shutdown_timeout}"
        )
    check_output_paths(args)
    model = args.resolve_model()
    from launch.text.chat_template import load_chat_template
    from launch.text.detokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    chat_template = load_chat_template(args.model, ns.chat_template)
    # last, so every input error is reported first: a plain `python -m` run gets one line, not a
    # traceback from init_distributed
    TorchrunEnv.from_environ()
    return args, model, tokenizer, chat_template


def _start(ns, args, model, tokenizer, groups, control_group, chat_template, frontend):
    """Build this rank's engine (and on rank 0 the HTTP server); (engine, http, metrics).

    A failure on any rank is shared over ``control_group`` so that every rank exits with it.
    """
    import torch.distributed as dist

    rank = groups.rank
    engine = http = metrics = None
    error = None
    try:
        engine = LLMEngine(engine_args=args, model=model, groups=groups)
        if rank == 0:
            http, metrics = _start_http(ns, model, tokenizer, chat_template, engine, frontend)
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = f"[rank {rank}] {type(e).__name__}: {e}"
    errors: list = [None] * groups.world_size
    # blocking collective over the control group (timeout: the group's timeout)
    dist.all_gather_object(errors, error, group=control_group)
    startup_error = next((e for e in errors if e is not None), None)
    if startup_error is not None:
        if http is not None:
            http.stop()
        _die(rank, f"could not start: {startup_error}")
    if rank == 0:
        print(
            f"{PROG}: serving {_model_name(ns)} on http://{ns.host}:{http.port} with "
            f"{groups.dp_size} DP rank(s)" + (", DBO on" if args.enable_dbo else ""),
            flush=True,
        )
    return engine, http, metrics


def _serve(loop, http, rank: int, heartbeat) -> None:
    """Run the serve loop until every rank is told to exit; a failure ends this rank with one
    line (after failing rank 0's open requests), naming the silent rank(s) on a timeout."""
    from distributed.liveness import describe_failure

    try:
        num_failed = loop.run()
    except Exception as e:  # noqa: BLE001 - a dead peer, a failed step: end with one clear line
        message = describe_failure(e, heartbeat)
        if http is not None:
            http.bridge.fail_all(RuntimeError(f"the engine failed: {message}"))
            http.stop(timeout_s=5.0)
        _die(rank, message)
    if http is not None:
        http.stop()
        print(
            f"{PROG}: shut down; {num_failed} in-flight request(s) failed with an error",
            flush=True,
        )


def _model_name(ns: argparse.Namespace) -> str:
    return ns.served_model_name or ns.model or EMBEDDED_MODEL_NAME


def _start_http(ns, model, tokenizer, chat_template, engine: LLMEngine, frontend):
    from launch.serving.api_server import HTTPServerThread, ServerConfig
    from launch.serving.metrics import ServerMetrics

    metrics = ServerMetrics(dp_size=engine.groups.dp_size)
    kv = engine.kv_cache_manager
    config = ServerConfig(
        model_name=_model_name(ns),
        max_model_len=model.max_model_len,
        vocab_size=model.config.vocab_size,
        tokenizer=tokenizer,
        metrics=metrics,
        kv_capacity_tokens=kv.num_blocks * kv.block_size,
        chat_template=chat_template,
        api_keys=frontend.api_keys,
        timeout_keep_alive_s=frontend.timeout_keep_alive_s,
        body_read_timeout_s=frontend.body_read_timeout_s,
        max_connections=frontend.max_connections,
        max_queued_requests=frontend.queued_bound(
            max_num_seqs=engine.args.max_num_seqs, dp_size=engine.groups.dp_size
        ),
        engine_stall_timeout_s=frontend.engine_stall_timeout_s,
        profiling=engine.observability.profiler is not None,
    )
    http = HTTPServerThread(config, host=ns.host, port=ns.port)
    http.start()
    return http, metrics


if __name__ == "__main__":
    sys.exit(main())
