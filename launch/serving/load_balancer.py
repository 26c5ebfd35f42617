"""The DP load balancer: which DP rank serves a new request (rank 0 decides, the serve loop tells
every rank). Not the MoE router (``moe.fused_moe.router.Router``), which picks experts per token."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DPLoadBalancer:
    """Least-loaded assignment: a new request goes to the DP rank with the fewest open requests
    (assigned by rank 0 and not yet finished), the lowest rank on a tie."""

    dp_size: int
    num_open: list[int] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        self.num_open = [0] * self.dp_size

    def assign(self, request_id: int) -> int:
        """The DP rank that will serve ``request_id``, counted as open until ``close``."""
        dp_rank = min(range(self.dp_size), key=lambda r: (self.num_open[r], r))
        self.num_open[dp_rank] += 1
        self.owner[request_id] = dp_rank
        return dp_rank

    def close(self, request_id: int) -> None:
        """``request_id`` finished or was aborted (unknown ids are ignored)."""
        dp_rank = self.owner.pop(request_id, None)
        if dp_rank is not None:
            self.num_open[dp_rank] -= 1
