"""A worker extension for the phase-owned expert-parallel tests (tests/test_phase_ep.py).

`vllm serve ... --worker-extension-cls ainfer_pd_testing.phase_ep.PhaseEPProbe` with
`dev_server.SERVER_ENV`, then over `dev_server.collective_rpc` (which reaches every DP engine):
- `start_collective_log(prefix)` (from `collective_log.CollectiveLog`): each rank appends one line
  per collective its threads issue, `<P|D> <collective> <group unique_name> <shape>`;
- `fail_p_epoch(epoch, boundary)`: P raises on every rank before it publishes `boundary` of
  `epoch`, so with `boundary >= 2` after layer 0's MoE dispatch and combine ran on P's own state.
"""

from __future__ import annotations

from ainfer_pd_testing.collective_log import CollectiveLog
from vllm_ainfer_pd.worker.faults import FaultHooks

EXTENSION = "ainfer_pd_testing.phase_ep.PhaseEPProbe"


class FailAtBoundary(FaultHooks):
    def __init__(self, epoch: int, boundary: int) -> None:
        self.epoch, self.boundary = epoch, boundary

    def at_boundary(self, rank: int, epoch: int, boundary: int) -> None:
        if (epoch, boundary) == (self.epoch, self.boundary):
            raise RuntimeError(f"injected fault: P epoch {epoch} fails at boundary {boundary} on "
                               f"rank {rank}")


class PhaseEPProbe(CollectiveLog):
    def fail_p_epoch(self, epoch: int, boundary: int) -> dict | None:
        lane = self.p_lane  # `self` is the AInferPDWorker this class is mixed into
        if lane is None:
            return None
        lane.install_faults(FailAtBoundary(epoch, boundary))
        return {"rank": lane.rank}
