"""Turnstile: one rank's round = wait for P's stop, pre-D rendezvous, D enqueue, post-D rendezvous,
release of the next P segment.

On the D (main) thread of every rank, once per D iteration:

    record = turnstile.pre_d()     # P stopped at its permit (or finished) here; all ranks met
    ...enqueue one D iteration...  # graph replay on GPU; eager on CPU
    turnstile.post_d(load)         # all ranks enqueued D; permit += K releases P's next segment

or equivalently `with turnstile.round(load) as record: ...enqueue D...`. Idle ranks run the same
calls with nothing to enqueue. P's thread publishes boundaries through `turnstile.controller`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vllm_ainfer_pd.turnstile.controller import SegmentController, SegmentStatus, TaskState
from vllm_ainfer_pd.turnstile.ladder import OrderingMode
from vllm_ainfer_pd.turnstile.policy import FixedSpan, Load, SegmentPolicy
from vllm_ainfer_pd.turnstile.rendezvous import Rendezvous


@dataclass(frozen=True)
class RoundRecord:
    """What one rank saw when its round's D enqueue was admitted (after the pre-D rendezvous)."""

    round: int
    epoch: int | None
    reached: int
    permit: float
    state: TaskState
    p_wait_s: float  # host time D waited for P to stop at its permit (decode boundary wait)
    rendezvous_s: float  # host time spent in the pre-D rendezvous


class Turnstile:
    """Composes a `SegmentController`, a `Rendezvous`, a `SegmentPolicy` and an `OrderingMode`.

    `device_fence(epoch)` blocks until the finished epoch's P work completed on the device; it is
    only called in `global-complete` mode (once per epoch, before the rendezvous that follows the
    epoch's completion). A caller that runs its rounds from the parts (`rendezvous`, `release`)
    instead of `pre_d` / `post_d`, as the P lane does with its round plan, fences where its
    epochs end and passes none. `policy` defaults to a fixed span of 1; it must be fed
    rank-shared `Load` figures so that every rank releases the same K.
    """

    def __init__(self, controller: SegmentController, rendezvous: Rendezvous,
                 policy: SegmentPolicy | None = None,
                 mode: OrderingMode | str = OrderingMode.FINE,
                 device_fence: Callable[[int], None] | None = None) -> None:
        self.controller = controller
        self.rendezvous = rendezvous
        self.policy = policy or FixedSpan(1)
        self.mode = OrderingMode.parse(mode)
        self.device_fence = device_fence
        self._fenced: int | None = None

    def open_epoch(self, epoch: int, *, d_enqueued: bool = False,
                   load: Load | None = None) -> SegmentStatus:
        """Open P epoch `epoch` (see `SegmentController.open_epoch`); then start the producer.

        `d_enqueued=False`: call before `pre_d`; P parks at boundary 0 until this round's D is
        enqueued. `d_enqueued=True`: call after `post_d`; P runs its first span at once.
        """
        span = self.mode.span(self.policy, load) if d_enqueued else None
        return self.controller.open_epoch(epoch, d_enqueued=d_enqueued, span=span)

    def pre_d(self, payload: tuple[int, ...] = ()) -> RoundRecord:
        """Wait until P stopped on this rank, fence if the mode says so, then the pre-D rendezvous
        (carrying `payload`; every rank's is in `rendezvous.payloads` afterwards).

        Raises what `wait_parked` and the rendezvous raise (each names rank, round and peers).
        """
        rnd = self.rendezvous.round
        start = time.perf_counter()
        status = self.controller.wait_parked()
        p_wait = time.perf_counter() - start
        if (self.mode.fences_device and status.state is TaskState.DONE
                and status.epoch != self._fenced):
            if self.device_fence is None:
                raise ValueError("ordering mode 'global-complete' needs a device_fence for "
                                 "Turnstile.pre_d (or a caller that fences where its epochs end)")
            self.device_fence(status.epoch)
            self._fenced = status.epoch
        waited = self.rendezvous.pre_d(payload)
        return RoundRecord(rnd, status.epoch, status.reached, status.permit, status.state,
                           p_wait, waited)

    def post_d(self, load: Load | Callable[[list[tuple[int, ...]]], Load] | None = None,
               payload: tuple[int, ...] = ()) -> SegmentStatus:
        """Post-D rendezvous (carrying `payload`), then release the next P segment
        (`permit += K`; no-op when idle). `load` may be a function of every rank's payload, which
        gives all ranks the same load figures and so the same K."""
        self.rendezvous.post_d(payload)
        if callable(load):
            load = load(self.rendezvous.payloads)
        return self.controller.advance(self.mode.span(self.policy, load))

    def release(self, load: Load | None = None) -> SegmentStatus:
        """Release the next P segment: the span the mode and policy give for `load` (which must
        be the same on every rank)."""
        return self.controller.advance(self.mode.span(self.policy, load))

    @contextlib.contextmanager
    def round(self, load: Load | None = None) -> Iterator[RoundRecord]:
        """`pre_d()`, the caller's D enqueue, `post_d(load)`. An exception in the body skips
        `post_d`, so peers time out naming this rank instead of releasing P past a broken D."""
        record = self.pre_d()
        yield record
        self.post_d(load)
