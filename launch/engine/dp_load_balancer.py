"""The DP load balancer: which DP rank serves a new request (``DPLoadBalancer``, SGLang's
``--load-balance-method`` values), not the MoE router, which picks experts per token. The methods
and why ``minimum_tokens`` counts tokens: docs/serving.md#dp-load-balancer-the-methods."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")
DEFAULT_LOAD_BALANCE_METHOD = "shortest_queue"


@dataclass(slots=True)
class DPLoadBalancer:
    """Assigns requests to DP ranks by ``method`` (one of ``LOAD_BALANCE_METHODS``).

    Raises:
        ValueError: ``dp_size`` < 1 or an unknown ``method``.
    """

    dp_size: int
    method: str = DEFAULT_LOAD_BALANCE_METHOD
    num_open: list[int] = field(default_factory=list)  # open requests per rank
    num_open_tokens: list[int] = field(default_factory=list)  # their prompt + max new tokens
    owner: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (rank, tokens)
    num_assigned: int = 0

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"--load-balance-method {self.method!r} is not one of {LOAD_BALANCE_METHODS}"
            )
        self.num_open = [0] * self.dp_size
        self.num_open_tokens = [0] * self.dp_size

    def assign(self, request_id: int, num_tokens: int = 0) -> int:
        """The DP rank that will serve ``request_id`` (``num_tokens``: its prompt + max new
        tokens), counted as open until ``close``."""
        if self.method == "round_robin":
            dp_rank = self.num_assigned % self.dp_size
        elif self.method == "minimum_tokens":
            dp_rank = min(range(self.dp_size), key=lambda r: (self.num_open_tokens[r], r))
        else:
            dp_rank = min(range(self.dp_size), key=lambda r: (self.num_open[r], r))
        self.num_assigned += 1
        self.num_open[dp_rank] += 1
        self.num_open_tokens[dp_rank] += num_tokens
        self.owner[request_id] = (dp_rank, num_tokens)
        return dp_rank

    def close(self, request_id: int) -> None:
        """``request_id`` finished or was aborted (unknown ids are ignored)."""
        dp_rank, num_tokens = self.owner.pop(request_id, (None, 0))
        if dp_rank is not None:
            self.num_open[dp_rank] -= 1
            self.num_open_tokens[dp_rank] -= num_tokens


def assign_offline(num_tokens: Sequence[int], *, dp_size: int, method: str) -> list[int]:
    """The DP rank of each request of an offline run, all arriving at once in index order
    (``num_tokens[i]``: request i's prompt + max new tokens). Deterministic: every rank computes
    the same list without a message."""
    balancer = DPLoadBalancer(dp_size, method)
    return [balancer.assign(i, n) for i, n in enumerate(num_tokens)]


def offline_share(
    num_tokens: Sequence[int], *, dp_rank: int, dp_size: int, method: str
) -> list[int]:
    """The indices (ascending) of the requests ``assign_offline`` gives to ``dp_rank``."""
    ranks = assign_offline(num_tokens, dp_size=dp_size, method=method)
    return [i for i, r in enumerate(ranks) if r == dp_rank]
