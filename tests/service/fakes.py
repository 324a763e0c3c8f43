"""Test doubles that admission and the fronts' gate share: an injected clock and a caller's future."""

from __future__ import annotations


class FakeClock:
    """A clock that moves only when a test sets `t` (seconds)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeFuture:
    """A waiting caller's future: done once the test marks it cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled
