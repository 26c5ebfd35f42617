"""The overlap model: one MoE layer stack run by N ubatches passing a baton in a ring.

Each ubatch runs, per MoE layer, two compute segments separated by two transfers::

    pre (attention, router, dispatch prep) -> [dispatch] -> mid (experts, combine prep)
    -> [combine] while shared experts run -> next layer's pre

The schedule (the one ``dbo.UBatchContext`` implements, for any N):
- one compute resource: exactly one ubatch computes at a time; the turn passes in a ring
  0 -> 1 -> ... -> N-1 -> 0 at each transfer (a yield);
- a ubatch that gets the turn first waits for its own last transfer to land, then ``turn_ms``
  passes before it computes (the baton pass and the receive-side work of its transfer; with DBO
  off, the receive after each transfer);
- one link per rank: a transfer starts when it is issued and the link is free (bytes go one
  transfer after another, ``wire_ms``), and lands ``latency`` after its last byte (latencies
  overlap); ``sm_fraction`` of the wire time also occupies the compute resource at issue;
- other ranks: a transfer lands no earlier than the last peer's payload, drawn per transfer from
  what a calibration measured (``peer_arrival_ms``; from presets the ranks issue together).
So each transfer hides behind the other N-1 ubatches' compute segments. DBO off is the same
schedule with N = 1 and the whole batch: every transfer is waited for at once (the combine before
the shared experts run, as the engine's synchronous combine does).

``simulate_sglang_decode`` is SGLang's two-batch overlap in decode instead (its
``operations_strategy.py``, ``_compute_moe_deepseek_blog_decode``): five stages per layer split at
its yield points, the second batch two stages behind the first, the stages of the two batches
alternating on one compute stream. A transfer hides only behind the one stage of the other batch
that runs between its issue and its receive (the other's attention projections, or its attention
core and gate); no transfer is in flight while a batch runs its experts.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCosts:
    """One ubatch's work in one MoE layer: compute in ms, transfers in bytes.

    ``pre_ms`` before the dispatch is issued, ``mid_ms`` between the dispatch landing and the
    combine being issued, ``shared_ms`` after the combine is issued (shared experts), ``post_ms``
    after the combine lands (receive-side unpacking); ``dispatch_bytes`` / ``combine_bytes`` on
    the wire. ``attn_prepare_ms``: the part of ``pre_ms`` before the attention core (the
    projections; where SGLang's decode schedule yields), 0 when not priced.

    Raises:
        ValueError: a negative entry, or ``attn_prepare_ms > pre_ms``.
    """

    pre_ms: float
    mid_ms: float
    shared_ms: float = 0.0
    post_ms: float = 0.0
    dispatch_bytes: float = 0.0
    combine_bytes: float = 0.0
    attn_prepare_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "pre_ms",
            "mid_ms",
            "shared_ms",
            "post_ms",
            "dispatch_bytes",
            "combine_bytes",
            "attn_prepare_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerCosts.{name} must be >= 0, got {getattr(self, name)}")
        if self.attn_prepare_ms > self.pre_ms:
            raise ValueError(
                f"LayerCosts.attn_prepare_ms ({self.attn_prepare_ms}) is part of pre_ms "
                f"({self.pre_ms}) and cannot exceed it"
            )

    @property
    def compute_ms(self) -> float:
        return self.pre_ms + self.mid_ms + self.shared_ms + self.post_ms


@dataclass(slots=True)
class _Link:
    free_ms: float = 0.0

    def send(self, issue_ms: float, wire_ms: float, latency_ms: float) -> float:
        """Book a transfer; return when it lands."""
        start = max(issue_ms, self.free_ms)
        self.free_ms = start + wire_ms
        return self.free_ms + latency_ms


def simulate_layers(
    costs: LayerCosts,
    *,
    num_layers: int,
    num_ubatches: int,
    link,
    turn_ms: float = 0.0,
    peer_arrival_ms: Sequence[float] = (),
    num_draws: int = 64,
) -> float:
    """Milliseconds for ``num_ubatches`` ubatches, each with ``costs`` per layer, to run
    ``num_layers`` MoE layers under the ring schedule of the module docstring (``link``: a
    ``LinkModel``). ``num_ubatches == 1`` is DBO off. ``turn_ms``: what passes between a ubatch
    taking its turn (its transfer landed, or the previous ubatch yielded) and its compute
    starting: charged at every turn of a DBO step but the first, and with DBO off after each
    transfer lands.

    ``peer_arrival_ms``: when the last peer's payload of a collective is there, in ms after this
    rank issued it (``calibration.PeerArrival``); each transfer then lands no earlier than its
    issue plus one of these drawn at random, and the result is the mean over ``num_draws``
    draws (seeded: the same inputs give the same answer). Empty: the link alone decides.

    Raises:
        ValueError: ``num_layers < 1``, ``num_ubatches < 1`` or ``num_draws < 1``.
    """
    if num_layers < 1 or num_ubatches < 1 or num_draws < 1:
        raise ValueError(
            f"need num_layers >= 1, num_ubatches >= 1 and num_draws >= 1, got {num_layers}, "
            f"{num_ubatches}, {num_draws}"
        )
    if not peer_arrival_ms:
        return _simulate_ring(costs, num_layers, num_ubatches, link, turn_ms, lambda: 0.0)
    rng = random.Random(0)
    offsets = list(peer_arrival_ms)
    draws = [
        _simulate_ring(costs, num_layers, num_ubatches, link, turn_ms, lambda: rng.choice(offsets))
        for _ in range(num_draws)
    ]
    return statistics.fmean(draws)


def _simulate_ring(costs, num_layers, num_ubatches, link, turn_ms, peer_offset) -> float:
    """One run of the ring schedule; ``peer_offset()``: ms after its issue before a transfer's
    peers' payloads are there."""
    wire = {op: link.wire_ms(op, getattr(costs, f"{op}_bytes")) for op in ("dispatch", "combine")}
    sm_ms = {op: link.sm_fraction * wire[op] for op in wire}
    dbo = num_ubatches > 1
    # a turn before a pre or post segment: DBO passes the baton there; DBO off charged its turn
    # when the combine landed, before the shared experts
    ring_turn = turn_ms if dbo else 0.0
    latency = {op: link.latency_ms(op) for op in wire}
    state = _Link()

    def send(issue_ms: float, op: str) -> float:
        return max(state.send(issue_ms, wire[op], latency[op]), issue_ms + peer_offset())

    now = 0.0
    ready = [0.0] * num_ubatches
    for layer in range(num_layers):
        for u in range(num_ubatches):  # pre, then issue the dispatch
            turn = ring_turn if (layer or u) else 0.0  # the step's first segment takes no turn
            now = max(now, ready[u]) + turn + (costs.post_ms if layer else 0.0) + costs.pre_ms
            now += sm_ms["dispatch"]
            ready[u] = send(now, "dispatch")
        for u in range(num_ubatches):  # mid, issue the combine, shared experts meanwhile
            now = max(now, ready[u]) + turn_ms + costs.mid_ms + sm_ms["combine"]
            ready[u] = send(now, "combine")
            if not dbo:  # DBO off: the combine is waited for before the shared experts
                now = ready[u] + turn_ms
            now += costs.shared_ms
    for u in range(num_ubatches):
        now = max(now, ready[u]) + ring_turn + costs.post_ms
    return now


@dataclass(frozen=True, slots=True)
class _Stage:
    """One stage of SGLang's decode schedule: wait for the batch's in-flight transfer (if
    ``wait``), compute ``before_ms``, issue ``send`` (if any), compute ``after_ms``."""

    before_ms: float = 0.0
    wait: bool = False
    send: str | None = None
    after_ms: float = 0.0


def _sglang_decode_stages(costs: LayerCosts, num_layers: int) -> list[_Stage]:
    """One batch's stages, all layers, split where SGLang's decode strategy yields."""
    core_ms = costs.pre_ms - costs.attn_prepare_ms
    stages = []
    for layer in range(num_layers):
        post = costs.post_ms if layer else 0.0
        stages += [
            _Stage(before_ms=post + costs.attn_prepare_ms),  # [output,] norm, projections
            _Stage(before_ms=core_ms),  # attention core, post-attention norm, gate, top-k
            _Stage(send="dispatch", after_ms=costs.shared_ms),  # dispatch_a, shared experts
            _Stage(wait=True, before_ms=costs.mid_ms, send="combine"),  # dispatch_b .. combine_a
            _Stage(wait=True),  # combine_b
        ]
    return [*stages, _Stage(before_ms=costs.post_ms)]


def simulate_sglang_decode(
    costs: LayerCosts, *, num_layers: int, link, delta_stages: int = 2
) -> float:
    """Milliseconds for SGLang's two-batch overlap in decode (``execute_overlapped_operations``)
    to run ``num_layers`` MoE layers, each batch with ``costs`` per layer (see the module
    docstring): batch a runs ``delta_stages`` stages alone, then the two alternate stage by
    stage, then batch b runs its last ``delta_stages``. One compute stream; a stage that
    receives a transfer waits for it to land; transfers share the link as in
    ``simulate_layers``, and ``sm_fraction`` of a transfer's wire time is compute at its issue.

    Raises:
        ValueError: ``num_layers < 1`` or ``delta_stages < 0``.
    """
    if num_layers < 1 or delta_stages < 0:
        raise ValueError(
            f"need num_layers >= 1 and delta_stages >= 0, got {num_layers}, {delta_stages}"
        )
    stages = _sglang_decode_stages(costs, num_layers)
    order = [(0, i) for i in range(delta_stages)]
    order += [(b, i - b * delta_stages) for i in range(delta_stages, len(stages)) for b in (0, 1)]
    order += [(1, i) for i in range(len(stages) - delta_stages, len(stages))]
    state, now, ready = _Link(), 0.0, [0.0, 0.0]
    for batch, index in order:
        stage = stages[index]
        if stage.wait:
            now = max(now, ready[batch])
        now += stage.before_ms
        if stage.send is not None:
            wire = link.wire_ms(stage.send, getattr(costs, f"{stage.send}_bytes"))
            now += link.sm_fraction * wire
            ready[batch] = state.send(now, wire, link.latency_ms(stage.send))
        now += stage.after_ms
    return now


def serial_layer_ms(costs: LayerCosts, link) -> tuple[float, float]:
    """(C, M) of one layer run alone: compute ms and transfer ms (latency included)."""
    comm = link.transfer_ms("dispatch", costs.dispatch_bytes) + link.transfer_ms(
        "combine", costs.combine_bytes
    )
    return costs.compute_ms, comm
