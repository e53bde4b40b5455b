"""The P/D overlap arithmetic of `worker/overlap.py`, with a scripted clock standing in for CUDA
timing events (the meter itself only runs on GPU)."""

from __future__ import annotations

import pytest

from vllm_ainfer_pd.worker.overlap import OverlapMeter


class Clock:
    """Events take the device time `now` when recorded and complete when `done_until` passes it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.done_until = float("inf")

    def event(self):
        clock = self

        class Event:
            def record(self) -> None:
                self.t = clock.now

            def query(self) -> bool:
                return self.t <= clock.done_until

            def elapsed_time(self, end) -> float:  # milliseconds, like CUDA's
                return (end.t - self.t) * 1e3

        return Event()


def window(meter: OverlapMeter, clock: Clock, side: str, start: float, end: float) -> None:
    clock.now = start
    meter.start(side)
    clock.now = end
    meter.end(side)


def test_overlap_is_the_intersection_with_d_windows():
    clock = Clock()
    meter = OverlapMeter(clock.event)
    window(meter, clock, "d", 0.0, 1.0)
    window(meter, clock, "p", 0.5, 2.5)  # overlaps D's [0, 1] by 0.5 and [2, 3] by 0.5
    window(meter, clock, "d", 2.0, 3.0)
    window(meter, clock, "p", 4.0, 5.0)  # no D at all
    p_s, overlap_s = meter.collect()
    assert p_s == pytest.approx(3.0)
    assert overlap_s == pytest.approx(1.0)
    assert meter.collect() == (0.0, 0.0)  # each window counts once


def test_a_p_window_waits_for_the_d_windows_that_may_overlap_it():
    clock = Clock()
    meter = OverlapMeter(clock.event)
    window(meter, clock, "d", 0.0, 1.0)
    window(meter, clock, "p", 0.0, 2.0)
    window(meter, clock, "d", 1.5, 3.0)
    clock.done_until = 2.0  # the second D window has not completed on the device yet
    assert meter.collect() == (0.0, 0.0)
    clock.done_until = float("inf")
    p_s, overlap_s = meter.collect()
    assert (p_s, overlap_s) == (pytest.approx(2.0), pytest.approx(1.5))


def test_a_window_end_without_its_start_is_ignored():
    clock = Clock()
    meter = OverlapMeter(clock.event)
    meter.end("p")  # the lane's first boundary parks before any P segment ran
    window(meter, clock, "p", 1.0, 2.0)
    assert meter.collect() == (pytest.approx(1.0), 0.0)
