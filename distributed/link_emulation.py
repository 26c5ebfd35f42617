"""A software model of a slower network link (torch-free): ``LinkSpec``, ``EmulatedLink`` (the
deadline arithmetic) and ``LinkDelayedHandle`` (waits for it). An emulation, not a network; the
model: docs/backends.md, "Link emulation"."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from distributed.comm_handle import CommHandle, CommTiming

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One-way latency and bandwidth of the emulated link.

    Raises:
        ValueError: if ``latency_us < 0`` or ``gbps <= 0``.
    """

    latency_us: float
    gbps: float

    def __post_init__(self) -> None:
        if not self.latency_us >= 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")
        if not self.gbps > 0:
            raise ValueError(f"gbps must be > 0 (gigabits per second), got {self.gbps}")

    @classmethod
    def parse(cls, spec: str) -> LinkSpec:
        """Parse ``"latency_us=50,gbps=2"`` (both keys required, any order).

        Raises:
            ValueError: naming the malformed part, an unknown or missing key, or a bad value.
        """
        values: dict[str, float] = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in ("latency_us", "gbps"):
                raise ValueError(
                    f"--emulate-link {spec!r}: expected 'latency_us=<float>,gbps=<float>', "
                    f"got part {part!r}"
                )
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(
                    f"--emulate-link {spec!r}: {key}={value!r} is not a number"
                ) from None
        missing = {"latency_us", "gbps"} - values.keys()
        if missing:
            raise ValueError(f"--emulate-link {spec!r}: missing {sorted(missing)}")
        return cls(**values)

    def transfer_ns(self, num_bytes: int) -> int:
        """Nanoseconds ``num_bytes`` occupy the link (without the latency)."""
        return int(num_bytes * 8 / self.gbps)  # bits / (gbps * 1e9 bit/s) * 1e9 ns/s

    @property
    def latency_ns(self) -> int:
        return int(self.latency_us * 1000)


class EmulatedLink:
    """One rank's emulated link, shared by every collective this rank issues (thread-safe)."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._free_at_ns = 0

    def deadline_ns(self, issued_at_ns: int, num_bytes: int) -> int:
        """Book a transfer of ``num_bytes`` issued at ``issued_at_ns`` (``perf_counter_ns``) on the
        link; return the earliest ``perf_counter_ns`` at which it may complete."""
        with self._lock:
            start_ns = max(issued_at_ns, self._free_at_ns)
            self._free_at_ns = start_ns + self.spec.transfer_ns(num_bytes)
            return self._free_at_ns + self.spec.latency_ns

    def delayed(self, handle: CommHandle[T]) -> LinkDelayedHandle[T]:
        """Book ``handle``'s transfer (the larger of the bytes sent and received) on the link;
        the handle, completing no earlier than the link's deadline."""
        deadline_ns = self.deadline_ns(handle.timing.issued_at_ns, handle.timing.num_link_bytes)
        return LinkDelayedHandle(handle, deadline_ns)


class LinkDelayedHandle(Generic[T]):
    """A ``CommHandle`` that completes no earlier than ``deadline_ns`` (``perf_counter_ns``).

    ``wait()`` sleeps until the deadline (releasing the GIL), then completes the inner handle, so
    the receive-side work starts once both the bytes and the deadline are there.
    ``timing.payload_at_ns`` is when the inner handle's bytes were there.
    """

    __slots__ = ("_inner", "deadline_ns")

    def __init__(self, inner: CommHandle[T], deadline_ns: int) -> None:
        self._inner = inner
        self.deadline_ns = deadline_ns

    @property
    def timing(self) -> CommTiming:
        timing = self._inner.timing
        arrived_ns = timing.completed_at_ns
        if arrived_ns is None:
            return timing
        return dataclasses.replace(
            timing, completed_at_ns=max(arrived_ns, self.deadline_ns), payload_at_ns=arrived_ns
        )

    def is_completed(self) -> bool:
        return time.perf_counter_ns() >= self.deadline_ns and self._inner.is_completed()

    def wait(self) -> T:
        sleep_until(self.deadline_ns)  # blocking wait, bounded by the emulated deadline
        return self._inner.wait()  # blocking wait (the inner handle's timeout)


def sleep_until(deadline_ns: int | None) -> None:
    """Block until ``perf_counter_ns() >= deadline_ns`` (None: return at once).

    Blocking wait bounded by the deadline itself (the link model's transfer time). ``time.sleep``
    releases the GIL, so the other ubatch thread computes meanwhile.
    """
    if deadline_ns is None:
        return
    while True:
        remaining_ns = deadline_ns - time.perf_counter_ns()
        if remaining_ns <= 0:
            return
        time.sleep(remaining_ns / 1e9)
