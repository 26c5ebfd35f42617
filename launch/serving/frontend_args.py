"""The HTTP front end's flags: authentication, time limits, connection and queue bounds.

Names follow vLLM (``--api-key``, ``VLLM_API_KEY``; ``--timeout-keep-alive`` is uvicorn's, which
vLLM's server passes through) and SGLang (``--max-queued-requests``). Every limit has a finite
default, so that a slow, idle or flooding client degrades the server visibly (408, 503 with
``Retry-After``, ``/health`` 503) instead of holding it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

API_KEY_ENV = "VLLM_API_KEY"
MAX_TIMEOUT_S = 86400.0
QUEUED_PER_SEQ = 4  # default --max-queued-requests: this many x --max-num-seqs x DP ranks


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendArgs:
    """Checked front-end settings.

    Raises:
        ValueError: a timeout outside (0, 86400] s (or nan), a bound below 1, or an empty key.
    """

    api_keys: tuple[str, ...] = ()  # empty: no authentication
    timeout_keep_alive_s: float = 5.0
    body_read_timeout_s: float = 30.0
    max_connections: int = 512
    max_queued_requests: int | None = None  # None: QUEUED_PER_SEQ x max_num_seqs x DP ranks
    engine_stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for flag, value in (
            ("--timeout-keep-alive", self.timeout_keep_alive_s),
            ("--body-read-timeout", self.body_read_timeout_s),
            ("--engine-stall-timeout", self.engine_stall_timeout_s),
        ):
            if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan
                raise ValueError(f"{flag} must be in (0, {MAX_TIMEOUT_S:g}] s, got {value}")
        for flag, value in (
            ("--max-connections", self.max_connections),
            ("--max-queued-requests", self.max_queued_requests),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if any(not key for key in self.api_keys):
            raise ValueError("--api-key must not be empty")

    def queued_bound(self, *, max_num_seqs: int, dp_size: int) -> int:
        """``max_queued_requests``, or its default for this engine."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUED_PER_SEQ * max_num_seqs * dp_size


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """Add the front end's flags to ``parser`` (one argument group)."""
    d = FrontendArgs()
    group = parser.add_argument_group("Frontend")
    group.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (one of these keys) on /v1/* (default: "
        f"${API_KEY_ENV} if set, else no authentication); /health and /metrics stay open",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=d.timeout_keep_alive_s,
        metavar="S",
        help="seconds a connection may take to send a complete request's headers, or stay idle "
        "between requests, before it is closed",
    )
    group.add_argument(
        "--body-read-timeout",
        type=float,
        default=d.body_read_timeout_s,
        metavar="S",
        help="seconds a request body may take to arrive (else 408 and the connection closes)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        metavar="N",
        help="open HTTP connections at most; more are answered 503 and closed",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests waiting to be scheduled at most (summed over DP ranks); more are "
        f"answered 503 with Retry-After (default: {QUEUED_PER_SEQ} x --max-num-seqs x DP ranks)",
    )
    group.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=d.engine_stall_timeout_s,
        metavar="S",
        help="/health answers 503 (and new requests 503) once the engine loop has not completed "
        "a step or heartbeat for this long: a rank frozen or a step stuck",
    )


def frontend_args_from_namespace(ns: argparse.Namespace) -> FrontendArgs:
    """The checked settings; ``--api-key`` falls back on ``$VLLM_API_KEY``.

    Raises:
        ValueError: see ``FrontendArgs``.
    """
    api_keys = ns.api_key
    if api_keys is None:
        env_key = os.environ.get(API_KEY_ENV)
        api_keys = [env_key] if env_key else []
    return FrontendArgs(
        api_keys=tuple(api_keys),
        timeout_keep_alive_s=ns.timeout_keep_alive,
        body_read_timeout_s=ns.body_read_timeout,
        max_connections=ns.max_connections,
        max_queued_requests=ns.max_queued_requests,
        engine_stall_timeout_s=ns.engine_stall_timeout,
    )
