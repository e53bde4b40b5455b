"""What the planner (`executor/scheduler.py`, `connector.py`) relies on inside vLLM's scheduler.

No patch: `AInferPDScheduler` subclasses vLLM's `Scheduler` and overrides or calls some of its
private methods and fields, and the connector reads fields of vLLM's `Request`. Listed here so
the start-up check names a change in any of them.
"""

from __future__ import annotations

from vllm_ainfer_pd.vllm_glue.shapes import Patch

_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
PATCHES = [
    Patch(f"{_SCHEDULER}._update_from_kv_xfer_finished", "stale or returning P reports are "
          "filtered out before vLLM promotes a request on them", ("self", "kv_connector_output"),
          does="overrides"),
    Patch(f"{_SCHEDULER}._handle_invalid_blocks", "it folds a failed P job into "
          "`failed_recving_kv_req_ids` before `_update_from_kv_xfer_finished` runs, which then "
          "marks the job failed", does="relies on"),
    Patch(f"{_SCHEDULER}.schedule", "D occupancy is published to the lane's admission policy "
          "before vLLM's D-first step", ("self", "throttle_prefills"), does="overrides"),
    Patch(f"{_SCHEDULER}.set_pause_state", "a pause empties the lane (no P forward spans a "
          "weight update)", ("self", "pause_state"), does="overrides"),
    Patch(f"{_SCHEDULER}.has_requests", "the engine keeps stepping until cancelled P jobs have "
          "drained", ("self",), does="overrides"),
    Patch(_SCHEDULER, "D occupancy, the lane's connector, and returning a parked lane request to "
          "waiting without blocks",
          uses=("connector", "kv_cache_manager", "max_num_running_reqs", "running", "requests",
                "finished_recving_kv_req_ids", "failed_recving_kv_req_ids"), does="reads"),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager", "free blocks for the admission policy; "
          "freeing a returned request's blocks", uses=("block_pool", "free"), does="reads"),
    Patch("vllm.v1.core.block_pool:BlockPool", "free and total blocks for the admission policy",
          uses=("get_num_free_blocks", "num_gpu_blocks"), does="reads"),
    Patch("vllm.v1.request:Request", "a P job's tokens and blocks, and the prompts that need an "
          "inline prefill",
          uses=("request_id", "num_tokens", "all_token_ids", "block_hashes", "num_preemptions",
                "num_computed_tokens", "status", "skip_reading_prefix_cache", "prompt_embeds",
                "mm_features", "pooling_params"), does="reads"),
    Patch("vllm.v1.request:RequestStatus.WAITING_FOR_REMOTE_KVS", "a lane request parks there "
          "(vLLM's async KV-load state) until its P is reported", does="reads"),
    Patch("vllm.v1.core.sched.interface:PauseState.UNPAUSED", "a resume leaves the lane alone",
          does="reads"),
]
