"""The engine's scheduler, chosen by `AInferPDExecutor`: the D-first planner (docs/planner.md).

vLLM's `Scheduler.schedule()` already serves `running` (decode rows, spec-decode lookahead and
chunked prefills) before it admits new prompts from `waiting`: D is committed first, and new P gets
what remains of the token budget and free KV blocks. Admission of new P then splits:
- short prompts go inline (vLLM's chunked prefill, using the token budget);
- long ones go to the background P lane through `AInferPDConnector` (async-load protocol: no token
  budget, KV blocks reserved via `allocate_slots(..., reserved_blocks=...)`, which keeps in-flight
  reservations from eating running D's future blocks).

Without a KV connector (`mode="normal"`) it behaves exactly like vLLM's scheduler. There are two
classes, one per vLLM base: `AInferPDAsyncScheduler` when vLLM's async scheduling is on (the GPU
default: the next step is scheduled while the current one runs), `AInferPDScheduler` otherwise.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from vllm_ainfer_pd.connector import AInferPDConnector, DState


class _PLaneScheduling(Scheduler):
    @property
    def p_lane(self) -> AInferPDConnector | None:
        """The P lane's connector, or None when the lane is not configured."""
        connector = self.connector
        return connector if isinstance(connector, AInferPDConnector) else None

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """vLLM's D-first step, with D occupancy published to the P lane's policy first.
        `throttle_prefills` is vLLM's DP prefill cadence flag (EngineCore passes it), unchanged."""
        lane = self.p_lane
        if lane is not None:
            pool = self.kv_cache_manager.block_pool
            lane.d_state = DState(
                num_running=len(self.running),
                max_num_seqs=self.max_num_running_reqs,
                free_blocks=pool.get_num_free_blocks(),
                total_blocks=pool.num_gpu_blocks,
            )
        return super().schedule(throttle_prefills)

    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """Drop stale P reports before vLLM acts on them, mark failed P jobs, and return the
        requests whose job a pause cancelled to waiting.

        A report is stale when no job of that request is in flight, or when the worker's metadata
        (`PLaneWorkerMeta.lifetimes`) names an older lifetime than the job in flight. vLLM would
        otherwise promote a request on an old job's result, or assert on an unknown id.
        """
        lane = self.p_lane
        if lane is None:
            super()._update_from_kv_xfer_finished(kv_connector_output)
            return
        lifetimes = getattr(kv_connector_output.kv_connector_worker_meta, "lifetimes", {})
        reported = kv_connector_output.finished_recving or set()
        current = {r for r in reported if lane.is_current(r, lifetimes.get(r))}
        # Failures were folded into failed_recving_kv_req_ids by _handle_invalid_blocks (which runs
        # first in update_from_output); those requests recompute inline, never in the lane again.
        for req_id in current & self.failed_recving_kv_req_ids:
            lane.job_done(req_id, failed=True)
        returned = current & lane.returning
        for req_id in returned:
            lane.job_done(req_id)
            self._return_to_waiting(self.requests[req_id])
        super()._update_from_kv_xfer_finished(
            dataclasses.replace(kv_connector_output, finished_recving=current - returned)
        )

    # ---- pauses (vLLM's pause_generation / sleep, the RL weight sync) ---------------------------

    def set_pause_state(self, pause_state: PauseState) -> None:
        """A pause empties the lane: it cancels every P job of a live request and returns the
        request to waiting, without blocks, to be prefilled again after the resume.

        So no P forward spans what the caller does while paused (a weight update or sleep), the
        prefix-cache reset of `pause_generation(clear_cache=True)` finds no block reserved by the
        lane (vLLM raises if it does), and no request is promoted on KV of the weights before
        the pause. Aborted requests drain as before. `has_unfinished_requests` keeps the engine
        stepping (at DP > 1: the wave going) until the worker has reported every cancelled job:
        its D iterations drain the epoch.
        """
        super().set_pause_state(pause_state)
        lane = self.p_lane
        if lane is None or pause_state == PauseState.UNPAUSED:
            return
        for req_id in list(lane.inflight):
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                lane.cancel_to_waiting(req_id)
        # Jobs already reported have left `lane.inflight`; their requests wait for a promotion
        # that a paused scheduler does not make, holding blocks with the old weights' KV.
        for req_id in list(self.finished_recving_kv_req_ids):
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._return_to_waiting(request)

    def _return_to_waiting(self, request: Request) -> None:
        """A parked lane request back to waiting with no blocks and nothing computed, as vLLM's
        preemption leaves a running one (its next admission is a new job lifetime)."""
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.failed_recving_kv_req_ids.discard(request.request_id)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                          else RequestStatus.WAITING)

    def has_unfinished_requests(self) -> bool:
        """vLLM's answer, and also while the lane still holds jobs: under a pause vLLM counts
        neither waiting nor parked requests, but the cancelled jobs need rounds to drain.

        At DP > 1 this is the bit vLLM all-reduces to end a wave (`DPEngineCoreProc`): a rank
        whose only work is a draining job must keep the wave going, or every rank stops making
        forwards (and so rounds) with the job still in flight and the pause never completes.
        `has_requests` (DP = 1: whether the engine steps at all) reads this too."""
        lane = self.p_lane
        return super().has_unfinished_requests() or (lane is not None and bool(lane.inflight))


class AInferPDScheduler(_PLaneScheduling):
    pass


class AInferPDAsyncScheduler(_PLaneScheduling, AsyncScheduler):
    pass
