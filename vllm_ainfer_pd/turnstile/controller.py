"""Segment controller: the per-rank hand-off point between the P thread and the D thread.

A P epoch `e` publishes safe boundary ids `i = 0, 1, ...` (boundary 0 is the epoch's entry,
published before P issues any device work). The controller keeps

- `reached` r: the largest boundary published so far (initially -1);
- `permit` p: the endpoint P may reach; P stops (parks) at `i == p`;
- `span` K: how far one release moves the permit (`p <- p + K`);
- `state`: RUNNING, PARKED, DONE, FAILED or CANCELLED (IDLE when no epoch is open).

Initially `p = 0`, so ready D goes before P enters the device; if this round's D is already enqueued
(the epoch opens after the round's post-D phase), P starts with `p = K`. The final segment reports
completion with `finish`.

Threads: exactly one producer thread (the P thread) calls `attach`/`reach`/`finish`/`fail`; the
consumer (the D, i.e. main, thread) calls `open_epoch`/`wait_parked`/`advance`/`cancel`/`close`. One
condition variable guards all state; both sides wait only on the host, each wait with a timeout.
"""

from __future__ import annotations

import enum
import math
import numbers
import threading
import time
from dataclasses import dataclass

from vllm_ainfer_pd.turnstile.errors import (
    EpochActiveError,
    EpochCancelled,
    MissingProducerError,
    NonMonotoneBoundaryError,
    PermitExceededError,
    PermitTimeout,
    PrematureAdvanceError,
    ProducerFailed,
    SecondProducerError,
    StaleEpochError,
)

UNBOUNDED: float = math.inf
"""A span (and permit) with no endpoint: P runs to the end of its epoch (global ordering modes)."""


class TaskState(enum.Enum):
    IDLE = "idle"  # no epoch open on this rank
    RUNNING = "running"  # P is issuing work toward its permit
    PARKED = "parked"  # P stopped at boundary == permit, waiting for the next release
    DONE = "done"  # the final segment reported completion
    FAILED = "failed"  # the producer reported an exception
    CANCELLED = "cancelled"  # the consumer cancelled the epoch

    @property
    def stopped(self) -> bool:
        """True when P issues no more work until the consumer acts (the D-enqueue window)."""
        return self is not TaskState.RUNNING


@dataclass(frozen=True)
class SegmentStatus:
    """A consistent snapshot of one rank's controller."""

    rank: int
    epoch: int | None
    reached: int
    permit: float
    state: TaskState

    @property
    def done(self) -> bool:
        return self.state is TaskState.DONE


def validate_span(span: float, *, what: str = "span") -> float:
    """Return `span` if it is a positive int or UNBOUNDED; raise ValueError naming it otherwise."""
    if isinstance(span, float) and span == UNBOUNDED:
        return UNBOUNDED
    if isinstance(span, bool) or not isinstance(span, numbers.Integral) or span < 1:
        raise ValueError(f"{what} must be a positive int or UNBOUNDED, got {span!r}")
    return int(span)


class SegmentController:
    """Epoch, boundary and permit state of one rank (the paper's segment controller).

    Rules it enforces (each raises a `ProtocolError` subclass naming rank, epoch and boundary):

    - epochs strictly increase: reopening the last epoch or an older one is `StaleEpochError`;
      producer calls naming an epoch other than the open one are `StaleEpochError`;
    - one epoch at a time: opening while the previous one runs is `EpochActiveError`;
    - exactly one producer per epoch: a second `attach`, or `reach` from another thread, is
      `SecondProducerError`;
    - boundaries are published in order `0, 1, 2, ...`: a repeat, a step back, a gap, or a boundary
      after `finish` is `NonMonotoneBoundaryError`; `finish` before boundary 0 is one too;
    - no boundary beyond the permit: `reach(i)` with `i > permit` is `PermitExceededError`;
    - the permit moves only while P is stopped: `advance` while RUNNING is `PrematureAdvanceError`;
    - a missing producer is detected by timeout in `wait_parked` (`MissingProducerError`); a missing
      consumer by timeout in `reach` (`PermitTimeout`).
    """

    def __init__(self, rank: int = 0, span: int = 1, timeout_s: float = 300.0) -> None:
        """`span` is the default K for `open_epoch`/`advance`; `timeout_s` bounds every wait."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.rank = rank
        self.span = validate_span(span)
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._epoch: int | None = None
        self._last_epoch: int | None = None
        self._reached = -1
        self._permit: float = 0
        self._state = TaskState.IDLE
        self._producer: int | None = None  # thread ident of the attached producer
        self._producer_name = ""
        self._failure: BaseException | None = None
        self._cancel_reason = ""

    # --- snapshots ----------------------------------------------------------------------------

    def status(self) -> SegmentStatus:
        with self._cond:
            return self._status()

    def _status(self) -> SegmentStatus:
        return SegmentStatus(self.rank, self._epoch, self._reached, self._permit, self._state)

    # --- consumer (D thread) ------------------------------------------------------------------

    def open_epoch(self, epoch: int, *, d_enqueued: bool = False,
                   span: float | None = None) -> SegmentStatus:
        """Open P epoch `epoch` with `reached = -1` and `permit = 0`, or `permit = span` if
        `d_enqueued` (this round's D is already enqueued and released on every rank, i.e. the
        epoch opens after the round's post-D phase). All ranks must open the same epoch ids in the
        same inter-round gap with the same `d_enqueued`. Start the producer after this call.
        """
        k = self.span if span is None else validate_span(span)
        with self._cond:
            if self._last_epoch is not None and epoch <= self._last_epoch:
                kind = "duplicate" if epoch == self._last_epoch else "stale"
                raise StaleEpochError(f"{kind} epoch", rank=self.rank, epoch=epoch,
                                      detail=f"last opened epoch is {self._last_epoch}")
            if self._state in (TaskState.RUNNING, TaskState.PARKED):
                raise EpochActiveError("epoch opened while the previous one is active",
                                       rank=self.rank, epoch=epoch,
                                       detail=f"epoch {self._epoch} is {self._state.value}")
            self._epoch = self._last_epoch = epoch
            self._reached = -1
            self._permit = k if d_enqueued else 0
            self._state = TaskState.RUNNING
            self._producer = None
            self._producer_name = ""
            self._failure = None
            self._cond.notify_all()
            return self._status()

    def wait_parked(self, timeout_s: float | None = None) -> SegmentStatus:
        """Block until P stopped: parked at the permit, DONE or CANCELLED (IDLE returns at once).

        Raises `ProducerFailed` if the producer failed, `MissingProducerError` on timeout (nobody
        published the awaited boundary). Host wait only; P's submitted device work keeps running.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._state is TaskState.RUNNING:
                left = deadline - time.monotonic()
                if left <= 0:
                    who = (f"producer {self._producer_name!r} last published {self._reached}"
                           if self._producer is not None else "no producer attached")
                    raise MissingProducerError(
                        "no producer published the awaited boundary", rank=self.rank,
                        epoch=self._epoch, boundary=self._permit,
                        detail=f"waited {timeout:.3g} s; {who}")
                self._cond.wait(left)
            self._raise_if_failed()
            return self._status()

    def advance(self, span: float | None = None) -> SegmentStatus:
        """Release the next segment: `permit += span` (default K) while P is parked.

        IDLE, DONE and CANCELLED ranks follow the matched control path: a no-op. Raises
        `PrematureAdvanceError` if P is still running toward the permit, `ProducerFailed` if it
        failed.
        """
        k = self.span if span is None else validate_span(span)
        with self._cond:
            self._raise_if_failed()
            if self._state is TaskState.RUNNING:
                raise PrematureAdvanceError(
                    "permit advanced while P is running toward it", rank=self.rank,
                    epoch=self._epoch, boundary=self._permit,
                    detail=f"reached {self._reached}; call wait_parked first")
            if self._state is TaskState.PARKED:
                self._permit = self._permit + k
                self._state = TaskState.RUNNING
                self._cond.notify_all()
            return self._status()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the open epoch: a parked or later `reach` raises `EpochCancelled`. Idempotent."""
        with self._cond:
            if self._state in (TaskState.RUNNING, TaskState.PARKED):
                self._state = TaskState.CANCELLED
                self._failure = None
                self._cancel_reason = reason
                self._cond.notify_all()

    def close(self) -> None:
        """End the epoch on the consumer side, once its end was seen (DONE, FAILED, CANCELLED, or
        a producer given up on): IDLE again, so later rounds are the matched no-work calls and no
        failure is raised twice. A producer still running is cut off: its next call raises
        `StaleEpochError`."""
        with self._cond:
            self._epoch = None
            self._reached = -1
            self._permit = 0
            self._state = TaskState.IDLE
            self._producer = None
            self._failure = None
            self._cond.notify_all()

    # --- producer (P thread) ------------------------------------------------------------------

    def attach(self, epoch: int, name: str | None = None) -> None:
        """Bind the calling thread as the single producer of `epoch` (named `name` in errors)."""
        with self._cond:
            self._check_epoch(epoch, None)
            self._attach(epoch, name)

    def reach(self, epoch: int, boundary: int, timeout_s: float | None = None) -> None:
        """Publish `boundary` of `epoch`; at `boundary == permit`, park until the next release.

        Boundaries must be `0, 1, 2, ...` with none beyond the permit. Attaches the calling thread
        if no producer is attached. Raises `PermitTimeout` if no release comes in time and
        `EpochCancelled` if the consumer cancels meanwhile. Host wait only.
        """
        with self._cond:
            self._check_epoch(epoch, boundary)
            self._check_producer(epoch, boundary)
            self._check_running(epoch, boundary)
            if boundary <= self._reached:
                raise NonMonotoneBoundaryError(
                    "boundary repeats or goes back", rank=self.rank, epoch=epoch,
                    boundary=boundary, detail=f"already reached {self._reached}")
            if boundary > self._permit:
                raise PermitExceededError(
                    "boundary beyond the current permit", rank=self.rank, epoch=epoch,
                    boundary=boundary, detail=f"permit is {self._permit}")
            if boundary != self._reached + 1:
                raise NonMonotoneBoundaryError(
                    "boundary skips ids", rank=self.rank, epoch=epoch, boundary=boundary,
                    detail=f"expected {self._reached + 1}")
            self._reached = boundary
            if boundary < self._permit:
                return
            self._state = TaskState.PARKED
            self._cond.notify_all()
            timeout = self.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout
            while self._state is TaskState.PARKED:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PermitTimeout(
                        "no release of the parked producer", rank=self.rank, epoch=epoch,
                        boundary=boundary, detail=f"waited {timeout:.3g} s at permit")
                self._cond.wait(left)
            if self._state is TaskState.CANCELLED:
                raise EpochCancelled("epoch cancelled while parked", rank=self.rank,
                                     epoch=epoch, boundary=boundary,
                                     detail=self._cancel_reason)
            if self._epoch != epoch:
                raise StaleEpochError("epoch closed while parked", rank=self.rank, epoch=epoch,
                                      boundary=boundary, detail="the consumer gave up on it")

    def finish(self, epoch: int) -> None:
        """Report that the final segment (after the last boundary) completed its host enqueue."""
        with self._cond:
            self._check_epoch(epoch, None)
            self._check_producer(epoch, None)
            self._check_running(epoch, None)
            if self._reached < 0:
                raise NonMonotoneBoundaryError(
                    "epoch finished without publishing its entry boundary 0", rank=self.rank,
                    epoch=epoch, boundary=0)
            self._state = TaskState.DONE
            self._cond.notify_all()

    def fail(self, epoch: int, exc: BaseException) -> None:
        """Report a producer failure: the consumer's next wait or advance raises ProducerFailed."""
        with self._cond:
            if epoch != self._epoch or self._state not in (TaskState.RUNNING, TaskState.PARKED):
                return  # nothing to report to: the epoch is over or was replaced
            self._state = TaskState.FAILED
            self._failure = exc
            self._cond.notify_all()

    # --- checks (called with the lock held) ---------------------------------------------------

    def _check_epoch(self, epoch: int, boundary: int | None) -> None:
        if self._epoch is None or epoch != self._epoch:
            kind = "stale" if self._epoch is not None and epoch < self._epoch else "unopened"
            raise StaleEpochError(f"producer call for a {kind} epoch", rank=self.rank,
                                  epoch=epoch, boundary=boundary,
                                  detail=f"open epoch is {self._epoch}")

    def _attach(self, epoch: int, name: str | None) -> None:
        me = threading.get_ident()
        if self._producer is not None:
            raise SecondProducerError(
                "second producer", rank=self.rank, epoch=epoch,
                detail=f"{name or threading.current_thread().name!r} tried to attach; "
                       f"{self._producer_name!r} is the producer")
        self._producer = me
        self._producer_name = name or threading.current_thread().name

    def _check_producer(self, epoch: int, boundary: int | None) -> None:
        if self._producer is None:
            self._attach(epoch, None)
        elif self._producer != threading.get_ident():
            raise SecondProducerError(
                "boundary published by a second producer", rank=self.rank, epoch=epoch,
                boundary=boundary,
                detail=f"thread {threading.current_thread().name!r} is not the producer "
                       f"{self._producer_name!r}")

    def _check_running(self, epoch: int, boundary: int | None) -> None:
        if self._state is TaskState.CANCELLED:
            raise EpochCancelled("epoch cancelled", rank=self.rank, epoch=epoch,
                                 boundary=boundary, detail=self._cancel_reason)
        if self._state is not TaskState.RUNNING:
            raise NonMonotoneBoundaryError(
                "publication after the epoch ended", rank=self.rank, epoch=epoch,
                boundary=boundary, detail=f"epoch is {self._state.value}")

    def _raise_if_failed(self) -> None:
        if self._state is TaskState.FAILED:
            raise ProducerFailed("the producer failed", rank=self.rank, epoch=self._epoch,
                                 boundary=self._reached,
                                 detail=repr(self._failure)) from self._failure
