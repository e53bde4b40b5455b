"""The P lane on vLLM's KV-connector async-load protocol (docs/planner.md).

An admitted background prefill ("P job") is parked by vLLM's scheduler in
`WAITING_FOR_REMOTE_KVS` with its KV blocks reserved. The worker's lane (`worker/p_lane.py`)
computes the prompt's first `num_tokens - 1` tokens into those blocks and reports the request id
in `KVConnectorOutput.finished_recving`; vLLM then promotes the request and runs its last prompt
token as a one-token row in the D batch. vLLM hooks used: `get_num_new_matched_tokens`,
`update_state_after_alloc`, `build_connector_meta`, `request_finished`, `update_connector_output`
(scheduler role); `start_load_kv`, `get_finished`, `get_block_ids_with_load_errors`,
`build_connector_worker_meta` (worker role). What travels between the two roles is in `wire.py`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

from vllm_ainfer_pd.config import CONFIG_KEY, AInferPDConfig
from vllm_ainfer_pd.metrics import PLanePromMetrics, PLaneStats, StatsDelta
from vllm_ainfer_pd.vllm_glue import kv_connector
from vllm_ainfer_pd.wire import JobKey, LaneEndpoint, PJob, PLaneMetadata, PLaneWorkerMeta, Report

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "AInferPDConnector"


@dataclass(frozen=True)
class DState:
    """What the planner publishes before each step (scheduler -> connector)."""

    num_running: int = 0
    max_num_seqs: int = 1
    free_blocks: int = 0
    total_blocks: int = 1


def window_prompt_limit(kv_cache_config: KVCacheConfig | None) -> int | None:
    """The longest prompt the lane can prefill on this KV cache: None, or the smallest attention
    window of a sliding-window or chunked-local-attention KV cache group.

    For such a group, vLLM gives a request whose prompt KV a connector loads (the lane's
    admission) the null block for every block before the last token's window, already at
    allocation. The lane computes the whole prompt, and its later tokens' attention reads the
    KV of the earlier ones, so a longer prompt's KV would be written to and read from the null
    block. Models that mix such layers with full attention are not affected: the backend runs
    without vLLM's hybrid KV cache manager, which then makes every group full attention."""
    windows = []
    for group in kv_cache_config.kv_cache_groups if kv_cache_config is not None else []:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windows.append(spec.sliding_window)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            windows.append(spec.attention_chunk_size)
    return min(windows, default=None)


def needs_inline_prefill(request: Request) -> bool:
    """Whether a prompt needs more of its prefill than the KV the lane writes: the lane's P
    forward takes token ids only and returns no logits, so prompt logprobs (vLLM also marks them
    `skip_reading_prefix_cache`, as it does a request that asks not to read cached KV), prompt
    embeddings, multimodal inputs and pooling run inline in D's step, as in stock vLLM."""
    return bool(request.skip_reading_prefix_cache or request.prompt_embeds is not None
                or request.mm_features or request.pooling_params is not None)


class AInferPDConnector(KVConnectorBase_V1):
    """Admission policy and P-job bookkeeping of the P lane.

    Policy, asked once per step for each fresh prompt after vLLM has committed the step's D rows:
    - inline (`(0, False)`): the lane is off (`mode="normal"`), the prompt has fewer than
      the lane's threshold of uncached tokens (`AInferPDConfig.lane_min_tokens`), its P
      already failed in the lane (it recomputes inline, so a broken worker cannot loop a
      request forever), it needs what only D's own forward gives (`needs_inline_prefill`),
      or it is longer than an attention window whose earlier blocks vLLM does not keep
      (`window_prompt_limit`);
    - wait (`(None, False)`, asked again next step; later prompts may still go): another
      prompt's P is writing this prompt's next uncached block (`_prefix_being_written`), the
      lane is full (`max_p_inflight` jobs, P pressure), or reserving the prompt's blocks would
      leave fewer free blocks than running D rows (D occupancy: each running row keeps one block
      of headroom to grow, so a parked P, which vLLM cannot preempt, does not force D's
      preemption);
    - background (`(num_tokens - 1 - local, True)`): otherwise. vLLM's `allocate_slots(...,
      reserved_blocks=...)` then admits it only if it fits beside in-flight reservations.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = AInferPDConfig.from_dict(extra.get(CONFIG_KEY))
        self.lane_min_tokens = self.config.lane_min_tokens(
            vllm_config.parallel_config.data_parallel_size)
        self.inflight: dict[str, PJob] = {}  # req id -> its job in flight (one at most)
        self.lifetimes: dict[str, int] = {}  # req id -> lifetime of its next job
        self.failed: set[str] = set()  # req ids whose P failed: they recompute inline
        # req ids whose job is cancelled while the request lives on (a pause): once the job has
        # drained, the scheduler returns the request to waiting (`_return_to_waiting`).
        self.returning: set[str] = set()
        # req id -> hashes of the full prompt blocks its P writes (admitted this step or in
        # flight): a prompt whose next uncached block is among them waits for those blocks.
        self._writing: dict[str, frozenset] = {}
        self.d_state = DState()
        self._new_jobs: list[PJob] = []
        self._cancelled: list[JobKey] = []
        self._pending: dict[str, int] = {}  # req id -> blocks admitted this step, not allocated
        self._step_blocks = 0  # blocks admitted to the lane this step
        self.block_size = vllm_config.cache_config.block_size
        self.max_lane_prompt = window_prompt_limit(kv_cache_config)
        if (self.max_lane_prompt is not None and self.config.p_lane_enabled
                and role == KVConnectorRole.SCHEDULER):
            logger.warning("ainfer_pd: the model's KV cache keeps only a %d-token attention "
                           "window; longer prompts prefill inline, not in the P lane",
                           self.max_lane_prompt)
        # Worker role: this step's reports (get_finished -> errors -> worker meta, in that order).
        self._reported: list[Report] = []
        self._failed_blocks: set[int] = set()
        self._stats_delta: StatsDelta | None = None

    # ---- policy -------------------------------------------------------------------------------

    def admits(self, request: Request, num_local_computed: int) -> bool | None:
        """True: background lane; False: inline; None: wait (see the class docstring)."""
        uncached = request.num_tokens - 1 - num_local_computed
        if (
            not self.config.p_lane_enabled
            or request.request_id in self.failed
            or uncached < self.lane_min_tokens
            or needs_inline_prefill(request)
            or (self.max_lane_prompt is not None and request.num_tokens > self.max_lane_prompt)
        ):
            return False
        if self._prefix_being_written(request, num_local_computed):
            return None
        if len(self.inflight) + len(self._pending) >= self.config.max_p_inflight:
            return None
        need = self._blocks_for(request.num_tokens)  # includes the promoted last token's slot
        # Blocks of this step's earlier admissions are not in d_state yet (published before the
        # step); inline admissions are left to allocate_slots, which still guards the pool.
        if self.d_state.free_blocks - self._step_blocks - need < self.d_state.num_running:
            return None
        self._pending[request.request_id] = need
        self._step_blocks += need
        self._writing[request.request_id] = frozenset(
            request.block_hashes[num_local_computed // self.block_size:])
        return True

    def _prefix_being_written(self, request: Request, num_local_computed: int) -> bool:
        """Whether another prompt's P is writing this prompt's next uncached block (the same
        prefix: block hashes chain over all earlier tokens), e.g. the samples of an `n > 1`
        request. It waits for those blocks to be cached and then computes only the rest, as in
        stock vLLM, where a prompt admitted in the same step hits the blocks its sibling
        computes; taking the lane at once would prefill the shared prefix once per sample."""
        first = num_local_computed // self.block_size
        if first >= len(request.block_hashes):
            return False
        block = request.block_hashes[first]
        return any(block in written for written in self._writing.values())

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- scheduler-side hooks -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        admitted = self.admits(request, num_computed_tokens)
        if not admitted:
            return (None if admitted is None else 0), False
        return request.num_tokens - 1 - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        admitted = self._pending.pop(req_id, None) is not None
        if num_external_tokens == 0 or not admitted:
            return  # inline prefill, or the second call after promotion
        n = num_external_tokens
        lifetime = self.lifetimes.get(req_id, 0)
        self.lifetimes[req_id] = lifetime + 1
        end = request.num_tokens - 1
        job = PJob(
            req_id=req_id,
            lifetime=lifetime,
            token_ids=tuple(request.all_token_ids[end - n : end]),
            start=end - n,
            end=end,
            block_ids=tuple(tuple(g) for g in blocks.get_block_ids()),
        )
        self.inflight[req_id] = job
        self._new_jobs.append(job)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PLaneMetadata:
        # A request admitted but not allocated (allocate_slots refused it) is retried next step.
        self._pending.clear()
        self._writing = {r: w for r, w in self._writing.items() if r in self.inflight}
        self._step_blocks = 0
        meta = PLaneMetadata(new_jobs=self._new_jobs, cancelled=self._cancelled)
        self._new_jobs, self._cancelled = [], []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free while a job is in flight: the worker may still be writing the blocks."""
        self.lifetimes.pop(request.request_id, None)
        self.failed.discard(request.request_id)
        job = self.inflight.get(request.request_id)
        if job is None:
            return False, None
        if request.request_id in self.returning:
            self.returning.discard(request.request_id)  # its cancel is already on its way
        else:
            self._cancelled.append(job.key)
        return True, None

    def cancel_to_waiting(self, req_id: str) -> None:
        """Cancel the job of a request that lives on: the scheduler returns the request to
        waiting, without blocks, once the worker has reported the job drained."""
        if req_id not in self.returning:
            self.returning.add(req_id)
            self._cancelled.append(self.inflight[req_id].key)

    def is_current(self, req_id: str, lifetime: int | None) -> bool:
        """Whether a worker report for (`req_id`, `lifetime`) matches the job in flight; a report
        with no lifetime matches any job of `req_id`."""
        job = self.inflight.get(req_id)
        return job is not None and (lifetime is None or lifetime == job.lifetime)

    def job_done(self, req_id: str, failed: bool = False) -> None:
        """The worker reported the job of `req_id` drained (completed, cancelled or failed)."""
        self.inflight.pop(req_id, None)
        self._writing.pop(req_id, None)
        self.returning.discard(req_id)
        if failed:
            self.failed.add(req_id)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # The scheduler (AInferPDScheduler) has filtered stale reports out before this call.
        for req_id in connector_output.finished_recving or ():
            self.job_done(req_id)

    # ---- worker-side hooks: hand jobs to the worker's P lane, report what drained ---------------

    lane: LaneEndpoint | None = None  # set by AInferPDWorker on the worker-role instance

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.lane is not None:
            self.lane.accept(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Jobs whose P work drained, as `finished_recving` (aborted requests arrive as cancels in
        the metadata, so `finished_req_ids` needs no action). Failed jobs also name their blocks
        in `get_block_ids_with_load_errors`, and vLLM recomputes them."""
        if self.lane is None:
            return None, None
        reports = self.lane.take_reports()
        self._reported = reports
        self._failed_blocks = set()
        for job, failed in reports:
            if failed:
                self._failed_blocks.update(self._written_blocks(job))
        return None, {job.req_id for job, _ in reports} or None

    def _written_blocks(self, job: PJob) -> list[int]:
        """The blocks a job writes (its cached prefix blocks are shared and stay valid)."""
        first, last = job.start // self.block_size, (job.end - 1) // self.block_size
        return [b for group in job.block_ids for b in group[first : last + 1]]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._failed_blocks

    def build_connector_worker_meta(self) -> PLaneWorkerMeta | None:
        reports, self._reported = self._reported, []
        if not reports:
            return None
        return PLaneWorkerMeta({job.req_id: job.lifetime for job, _ in reports})

    def get_kv_connector_stats(self) -> PLaneStats | None:
        """Worker role: the lane's counters changed since the last step (vllm_ainfer_pd.metrics)."""
        if self.lane is None:
            return None
        if self._stats_delta is None:
            self._stats_delta = StatsDelta(self.lane.rank)
        return self._stats_delta.take(self.lane.stats.as_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PLaneStats:
        return PLaneStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PLanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # also fires inside P's own forward: must not block

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None


def register_connector() -> None:
    """Register `AInferPDConnector` with vLLM's `KVConnectorFactory`; safe to call repeatedly."""
    kv_connector.register(CONNECTOR_NAME, __name__, CONNECTOR_NAME)


def kv_transfer_config_for(config: AInferPDConfig) -> dict[str, Any] | None:
    """The `kv_transfer_config` (as a dict for `KVTransferConfig(**...)`) that turns the P lane on,
    or None for `mode="normal"` (no P lane, no connector). Failed P jobs recompute inline."""
    if not config.p_lane_enabled:
        return None
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {CONFIG_KEY: dataclasses.asdict(config)},
    }
