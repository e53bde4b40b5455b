"""Fault injection into the P lane of a running engine, for the hang-safety and failure tests.

A worker extension: `LLM(..., worker_extension_cls="ainfer_pd_testing.faults.FaultInjection")` or
`vllm serve ... --worker-extension-cls ainfer_pd_testing.faults.FaultInjection`, then once the
engine is up and before the first P epoch, on every rank:
`llm.collective_rpc("inject_p_faults", kwargs={"stall": "1:3"})`, or `POST /collective_rpc` with
`{"method": "inject_p_faults", "kwargs": {"fail_epoch": "0@1"}}` (vLLM serves that endpoint with
`dev_server.SERVER_ENV`; with DP it reaches every engine). Faults (world ranks, epochs and
rendezvous rounds counted from the lane's start):
- `stall="<rank>:<round>"`: that rank sleeps for 1.25 x `timeout_s` just before its pre-D
  rendezvous of that round, as a rank that hangs a while would: its peers give up, and it comes
  back (before the engine's teardown kills it) to a rendezvous they left;
- `fail_epoch="<epoch>"`: P raises at boundary 1 of that epoch on every rank (a deterministic P
  failure, like an out-of-memory at one batch shape: before layer 0's attention, so no rank has
  begun a collective its peers would wait in);
- `fail_epoch="<epoch>@<rank>"`: only that rank's P fails, while it prepares its batch;
- `fail_at="<epoch>@<rank>:b<boundary>"` / `"<epoch>@<rank>:c<index>"`: only that rank's P fails,
  just before it publishes that boundary, or before it issues its collective number `index` of
  the epoch (inside a segment, while its peers go on issuing the segment's rest): an asymmetric
  failure, as an out-of-memory at one rank's own batch shape is; without `@<rank>`, every rank's
  P fails there (`"3:b2"`: before boundary 2, after layer 0's MoE dispatch and combine ran);
- `slow_boundary_s=<seconds>`: P sleeps that long before each boundary on every rank (a slow P:
  each round waits for P's stop at its permit, so an epoch spans more wall time, not more rounds;
  longer than `timeout_s`: a P that does not stop in time). A round whose D begins while P sleeps
  there logs "D began round <r> on rank <k> while P was between boundaries";
- `device_delay="<epoch>:<seconds>"`: that epoch's device work completes that long after P's
  last kernel was queued, on every rank (a slow device, or P's lowest-priority stream still
  behind D's kernels: the lane must not report the epoch's jobs, and so free their KV blocks,
  before then).
"""

from __future__ import annotations

import logging
import time

from ainfer_pd_testing.collective_log import CollectiveLog
from ainfer_pd_testing.dev_server import collective_rpc
from vllm_ainfer_pd.worker.faults import FaultHooks

logger = logging.getLogger(__name__)
EXTENSION = "ainfer_pd_testing.faults.FaultInjection"
WITH_LOG = "ainfer_pd_testing.faults.FaultsAndCollectiveLog"  # faults, and a log of collectives


class ScriptedFaults(FaultHooks):
    """The faults `inject_p_faults` describes, for one rank's lane."""

    def __init__(self, stall: str = "", fail_epoch: str = "", slow_boundary_s: float = 0.0,
                 fail_at: str = "", device_delay: str = "") -> None:
        stall_rank, _, stall_round = stall.partition(":")
        self.stall = (int(stall_rank), int(stall_round)) if stall else None
        epoch, _, rank = fail_epoch.partition("@")
        self.fail_epoch = int(epoch) if fail_epoch else None
        self.fail_rank = int(rank) if rank else None  # None: every rank, at boundary 1
        self.slow_boundary_s = slow_boundary_s
        # (epoch, rank or None for every rank, "b" or "c", boundary or collective index)
        self.fail_at = None
        if fail_at:
            where, _, point = fail_at.partition(":")
            epoch, _, rank = where.partition("@")
            self.fail_at = (int(epoch), int(rank) if rank else None, point[0], int(point[1:]))
        epoch, _, seconds = device_delay.partition(":")
        self.device_delay = (int(epoch), float(seconds)) if device_delay else None
        self.p_between_boundaries = False  # P sleeps in `at_boundary` (set on the P thread)

    def before_pre_d(self, rank: int, round: int, timeout_s: float) -> None:
        if self.p_between_boundaries:
            # The lane must never let D's iteration begin while P runs toward its permit (P may
            # be about to issue collectives on D's communicators): the tests look for this line.
            logger.error("D began round %d on rank %d while P was between boundaries", round,
                         rank)
        if self.stall == (rank, round):
            logger.warning("injected stall: rank %d stalls before round %d", rank, round)
            time.sleep(1.25 * timeout_s)

    def at_boundary(self, rank: int, epoch: int, boundary: int) -> None:
        if self.slow_boundary_s:
            self.p_between_boundaries = True
            try:
                time.sleep(self.slow_boundary_s)
            finally:
                self.p_between_boundaries = False
        if boundary == 1 and epoch == self.fail_epoch and self.fail_rank is None:
            raise RuntimeError(f"injected fault: P epoch {epoch} fails on rank {rank}")
        if self._fails_at(rank, epoch, "b", boundary):
            raise RuntimeError(f"injected fault: P epoch {epoch} fails on rank {rank} at "
                               f"boundary {boundary}")

    def at_collective(self, rank: int, epoch: int, index: int) -> None:
        if self._fails_at(rank, epoch, "c", index):
            raise RuntimeError(f"injected fault: P epoch {epoch} fails on rank {rank} before "
                               f"its collective {index}")

    def _fails_at(self, rank: int, epoch: int, kind: str, index: int) -> bool:
        if self.fail_at is None:
            return False
        at_epoch, at_rank, at_kind, at_index = self.fail_at
        return (at_epoch, at_kind, at_index) == (epoch, kind, index) and at_rank in (None, rank)

    def device_work(self, rank: int, epoch: int, event):
        if self.device_delay is None or self.device_delay[0] != epoch:
            return event
        return LateDevice(event, self.device_delay[1])

    def preparing_batch(self, rank: int, epoch: int) -> None:
        if epoch == self.fail_epoch and rank == self.fail_rank:
            raise RuntimeError(f"injected fault: P epoch {epoch} fails on rank {rank} while it "
                               f"prepares its batch")


class LateDevice:
    """An epoch's device work that completes `delay_s` from now, and not before the lane's own
    event (if any) does."""

    def __init__(self, event, delay_s: float) -> None:
        self.event = event
        self.done_at = time.monotonic() + delay_s

    def query(self) -> bool:
        return time.monotonic() >= self.done_at and (self.event is None or self.event.query())


class FaultInjection:
    """Mixed into the engine's worker class by vLLM (`worker_extension_cls`)."""

    def inject_p_faults(self, stall: str = "", fail_epoch: str = "",
                        slow_boundary_s: float = 0.0, fail_at: str = "",
                        device_delay: str = "") -> dict | None:
        """Install the faults in this rank's lane; returns {"rank": its world rank}, or None
        where the engine runs no lane (a dict, as `/collective_rpc` returns it unchanged)."""
        lane = self.p_lane  # `self` is the AInferPDWorker this class is mixed into
        if lane is None:
            return None
        lane.install_faults(ScriptedFaults(stall, fail_epoch, slow_boundary_s, fail_at,
                                           device_delay))
        return {"rank": lane.rank}


def inject_over_http(url: str, stall: str = "", fail_epoch: str = "",
                     slow_boundary_s: float = 0.0, fail_at: str = "") -> list:
    """`inject_p_faults` on every rank of a `vllm serve` started with `EXTENSION` and
    `dev_server.SERVER_ENV`; returns what the first engine's ranks answered (vLLM returns one
    engine's)."""
    return collective_rpc(url, "inject_p_faults", stall=stall, fail_epoch=fail_epoch,
                          slow_boundary_s=slow_boundary_s, fail_at=fail_at)


class FaultsAndCollectiveLog(FaultInjection, CollectiveLog):
    """Both extensions in one worker (vLLM takes one `worker_extension_cls`): faults injected,
    every collective recorded per rank."""
