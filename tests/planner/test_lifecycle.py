"""The P request lifecycle: reserve -> promote / cancel-after-drain, stale lifetimes, preemption,
failure. Reports are hand-made `ModelRunnerOutput`s, as the worker will send them."""

from __future__ import annotations

from planner_util import free_blocks, make_request, make_scheduler, step
from vllm.v1.request import RequestStatus

from vllm_ainfer_pd.executor.scheduler import AInferPDScheduler

LANE = {"p_lane_min_tokens": 64, "max_p_inflight": 4}


def test_promotion_after_finished_recving_runs_the_last_prompt_token_as_a_one_token_row(
    tiny_model: str,
) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    p = make_request(100, max_tokens=3)
    s.add_request(p)
    step(s)
    out = step(s, finished_recving={p.request_id})  # the worker reports the drain
    assert out.num_scheduled_tokens == {}  # promotion happens at the next schedule
    out = step(s)
    assert out.num_scheduled_tokens == {p.request_id: 1}
    assert p.num_computed_tokens == 100
    assert list(p.output_token_ids) == [7]
    assert s.p_lane.inflight == {}


def test_full_lifecycle_returns_every_block(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    initial = free_blocks(s)
    p = make_request(100, max_tokens=3)
    s.add_request(p)
    step(s)
    step(s, finished_recving={p.request_id})
    for _ in range(3):
        step(s)
    assert p.is_finished()
    assert p.request_id not in s.requests
    assert free_blocks(s) == initial


def test_abort_while_parked_keeps_blocks_until_the_drain_is_reported_then_frees_them(
    tiny_model: str,
) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    initial = free_blocks(s)
    p = make_request(100)
    s.add_request(p)
    step(s)
    held = free_blocks(s)
    s.finish_requests(p.request_id, RequestStatus.FINISHED_ABORTED)
    out = step(s)
    assert out.kv_connector_metadata.cancelled == [(p.request_id, 0)]
    assert p.request_id in out.finished_req_ids
    step(s)
    assert free_blocks(s) == held  # the worker may still be writing them
    step(s, finished_recving={p.request_id})
    assert free_blocks(s) == initial
    assert p.request_id not in s.requests
    assert s.p_lane.inflight == {}


def test_report_for_an_unknown_request_is_ignored(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    initial = free_blocks(s)
    step(s, finished_recving={"never-admitted"})
    assert free_blocks(s) == initial


def _preempt_lane_request(s: AInferPDScheduler) -> tuple[str, str]:
    """Drive a lane request (appended after an inline D row) into preemption by KV pressure;
    return (lane request id, D request id)."""
    d = make_request(16, max_tokens=20)
    s.add_request(d)
    step(s)
    p = make_request(65, max_tokens=40)
    s.add_request(p)
    step(s)
    assert p.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, finished_recving={p.request_id})
    for _ in range(40):
        step(s)
        if p.num_preemptions:
            return p.request_id, d.request_id
    raise AssertionError("the lane request was never preempted")


def test_preempted_request_reenters_the_lane_with_a_new_lifetime(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE, num_blocks=9)  # 8 usable blocks
    initial = free_blocks(s)
    p_id, _ = _preempt_lane_request(s)
    p = s.requests[p_id]
    for _ in range(40):
        out = step(s)
        if p.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    (job,) = out.kv_connector_metadata.new_jobs
    assert job.key == (p_id, 1)
    assert job.end == p.num_tokens - 1  # prompt and the tokens sampled before preemption
    step(s, finished_recving={p_id})
    while not p.is_finished():
        step(s)
    assert free_blocks(s) == initial


def test_report_for_an_older_lifetime_is_ignored(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE, num_blocks=9)
    p_id, _ = _preempt_lane_request(s)
    p = s.requests[p_id]
    while p.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
        step(s)
    step(s, finished_recving={p_id}, lifetimes={p_id: 0})  # late result of the first job
    step(s)
    assert p.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.p_lane.inflight[p_id].lifetime == 1
    step(s, finished_recving={p_id}, lifetimes={p_id: 1})
    out = step(s)
    assert out.num_scheduled_tokens == {p_id: 1}


def test_failed_p_recomputes_inline_and_never_reenters_the_lane(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE, failure_policy="recompute")
    initial = free_blocks(s)
    p = make_request(100, max_tokens=2)
    s.add_request(p)
    out = step(s)
    (job,) = out.kv_connector_metadata.new_jobs
    bad = {job.block_ids[0][0]}
    step(s, finished_recving={p.request_id}, invalid_block_ids=bad)
    out = step(s)
    assert out.num_scheduled_tokens == {p.request_id: 100}  # the whole prompt, inline
    assert out.kv_connector_metadata.new_jobs == []
    while not p.is_finished():
        step(s)
    assert free_blocks(s) == initial


def test_failed_p_with_fail_policy_finishes_the_request_with_an_error(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE, failure_policy="fail")
    initial = free_blocks(s)
    p = make_request(100)
    s.add_request(p)
    out = step(s)
    (job,) = out.kv_connector_metadata.new_jobs
    step(s, finished_recving={p.request_id}, invalid_block_ids={job.block_ids[0][0]})
    step(s)
    assert p.status == RequestStatus.FINISHED_ERROR
    assert p.request_id not in s.requests
    assert free_blocks(s) == initial
    assert s.p_lane.inflight == {}


def test_abort_after_the_drain_report_but_before_promotion_frees_at_once(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE)
    initial = free_blocks(s)
    p = make_request(100)
    s.add_request(p)
    step(s)
    step(s, finished_recving={p.request_id})  # reported; promotion would be at the next step
    s.finish_requests(p.request_id, RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == initial
    out = step(s)
    assert out.kv_connector_metadata.cancelled == []  # nothing left for the worker to drain
    assert p.request_id not in s.requests


def test_samples_of_one_prompt_prefill_it_once(tiny_model: str) -> None:
    """Two samples of one prompt (`n=2`): the first takes the lane, the second waits while that
    P writes the prefix they share, then hits the cached blocks and computes only the rest
    inline (as in stock vLLM, where the second sample hits the blocks the first computes in the
    same step)."""
    s = make_scheduler(tiny_model, lane=LANE, prefix_caching=True)
    first, second = (make_request(100, max_tokens=2, req_id=r, hashed=True) for r in "ab")
    s.add_request(first)
    s.add_request(second)
    out = step(s)
    assert [job.req_id for job in out.kv_connector_metadata.new_jobs] == ["a"]
    assert out.num_scheduled_tokens == {}  # "b" waits; it is not prefilled a second time
    assert second.status == RequestStatus.WAITING
    out = step(s)  # P still running: "b" still waits
    assert out.num_scheduled_tokens == {} and out.kv_connector_metadata.new_jobs == []
    step(s, finished_recving={"a"})
    out = step(s)  # "a" promoted; "b" hits its 6 cached blocks (96 tokens)
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    assert out.kv_connector_metadata.new_jobs == []
    assert s.p_lane._writing == {}


def test_a_failed_p_releases_the_samples_waiting_on_its_prefix(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, lane=LANE, prefix_caching=True)
    first, second = (make_request(100, max_tokens=2, req_id=r, hashed=True) for r in "ab")
    s.add_request(first)
    s.add_request(second)
    step(s)
    blocks = set(s.kv_cache_manager.get_block_ids("a")[0])
    step(s, finished_recving={"a"}, invalid_block_ids=blocks)  # "a"'s P failed
    out = step(s)
    # "a" recomputes inline, and "b" no longer waits: it hits the blocks "a" computes in this
    # same step (vLLM caches an inline prefill's blocks when it allocates them), as in stock.
    assert out.num_scheduled_tokens == {"a": 100, "b": 4}
    assert out.kv_connector_metadata.new_jobs == [] and s.p_lane._writing == {}
