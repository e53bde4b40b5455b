"""`FaultHooks`: where a test makes the P lane fail as a broken rank would.

The product installs none (`PLane.faults` is None, one attribute check at each point); the test
harness installs its own in the worker processes (`ainfer_pd_testing/faults.py`, through a
worker extension and `collective_rpc`). Every method's default does nothing.
"""

from __future__ import annotations

from typing import Any


class FaultHooks:
    """Called at fixed points of the lane, with the world rank; raising is the fault."""

    def before_pre_d(self, rank: int, round: int, timeout_s: float) -> None:
        """Main thread, with an epoch open, just before the pre-D rendezvous of `round` (a rank
        that stalls here leaves its peers waiting in the rendezvous, bounded by `timeout_s`)."""

    def at_boundary(self, rank: int, epoch: int, boundary: int) -> None:
        """P thread, before P publishes `boundary` of `epoch`. Raising fails the epoch on this
        rank; before boundary 1 (layer 0's attention) no rank has begun a collective its peers
        would wait in."""

    def at_collective(self, rank: int, epoch: int, index: int) -> None:
        """P thread, before P issues its collective number `index` of `epoch` (counted from 0).
        Raising fails this rank's part of the epoch between two collectives of a segment, where
        its peers go on issuing the segment's rest."""

    def preparing_batch(self, rank: int, epoch: int) -> None:
        """P thread, while P prepares `epoch`'s batch. Raising fails this rank's jobs; at DP > 1
        the rank still runs the dummy tokens it announced, so its peers' collectives complete."""

    def device_work(self, rank: int, epoch: int, event: Any) -> Any:
        """P thread, once P's last kernels of `epoch` are queued, on every exit path: what stands
        for the epoch's device work, which the lane polls (`query()`) before it reports the
        epoch's jobs and vLLM frees their KV blocks. `event` is the lane's own (a CUDA event;
        None on CPU, where the work is done); returning one that completes later acts as a slow
        device."""
        return event
