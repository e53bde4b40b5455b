"""How much of P's device time overlapped D's, from CUDA timing events (benchmarks only).

The lane records a window per released P segment on P's stream (from the event after the permit
to the event where P parks again) and a window per D iteration on D's stream (around vLLM's step)
while P work is in flight. Windows are device times: a P window starts when P's stream reaches its
first event, so time P's stream spends blocked on D (the stream route, the epoch's wait for D's
earlier writes) counts as P time that "overlapped" D. The figure is therefore an upper bound on
kernel-level overlap; a profiler trace gives the exact one.

Events are resolved lazily, oldest first, once they have completed: no call here synchronizes the
device. A P window is final once every D window recorded before it ended has resolved.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


class OverlapMeter:
    """`new_event`: makes a timing event that `record()`s on the current stream (CUDA's by
    default; the unit test passes a scripted clock)."""

    def __init__(self, new_event: Any = None) -> None:
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._base: Any = None
        self._open: dict[str, Any] = {}  # "p" / "d" -> start event of the window being recorded
        self._pending: dict[str, collections.deque] = {"p": collections.deque(),
                                                        "d": collections.deque()}
        self._d_windows: collections.deque[tuple[float, float]] = collections.deque()
        self._p_windows: collections.deque[tuple[float, float]] = collections.deque()

    def start(self, side: str) -> None:
        """Open a window of `side` ("p" or "d") on the calling thread's current stream."""
        if side in self._open:
            return
        event = self._new_event()
        event.record()
        if self._base is None:
            self._base = event
        self._open[side] = event

    def end(self, side: str) -> None:
        start = self._open.pop(side, None)
        if start is None:
            return
        event = self._new_event()
        event.record()
        self._pending[side].append((start, event))

    def collect(self) -> tuple[float, float]:
        """(P device seconds, of which overlapped by D) for the P windows finalized now."""
        for side, windows in (("d", self._d_windows), ("p", self._p_windows)):
            pending = self._pending[side]
            while pending and pending[0][1].query():
                start, end = pending.popleft()
                windows.append((self._base.elapsed_time(start) / 1e3,
                                self._base.elapsed_time(end) / 1e3))
        d_settled = not self._pending["d"] and "d" not in self._open
        p_s = overlap_s = 0.0
        while self._p_windows:
            p0, p1 = self._p_windows[0]
            if not d_settled and (not self._d_windows or self._d_windows[-1][1] < p1):
                break  # a D window still running may overlap this P window
            self._p_windows.popleft()
            p_s += p1 - p0
            overlap_s += sum(max(0.0, min(p1, d1) - max(p0, d0)) for d0, d1 in self._d_windows
                             if d1 > p0 and d0 < p1)
            # D windows wholly before the next P window can no longer overlap anything.
            next_start = self._p_windows[0][0] if self._p_windows else p1
            while self._d_windows and self._d_windows[0][1] <= next_start:
                self._d_windows.popleft()
        return p_s, overlap_s
