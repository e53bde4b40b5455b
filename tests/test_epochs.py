"""The lane's job bookkeeping (`worker/epochs.py`) without an engine: every accepted job is
reported exactly once, after its P work drained."""

from __future__ import annotations

from vllm_ainfer_pd.wire import PJob, PLaneMetadata
from vllm_ainfer_pd.worker.epochs import Epochs
from vllm_ainfer_pd.worker.lane_stats import LaneStats


def _job(req_id: str, n: int, lifetime: int = 0) -> PJob:
    return PJob(req_id, lifetime, tuple(range(n)), 0, n, ((0,),))


def _epochs(budget: int = 100) -> Epochs:
    return Epochs(budget, LaneStats())


def test_a_prompt_past_the_step_budget_is_split_over_epochs_and_reported_after_its_last_part():
    epochs = _epochs(100)
    epochs.accept(PLaneMetadata(new_jobs=[_job("a", 60), _job("b", 90)]))
    first = epochs.open()
    assert [(c.req_id, c.start, c.end) for c in first.chunks] == [("a", 0, 60), ("b", 0, 40)]
    assert [j.req_id for j in first.jobs] == ["a"] and epochs.next_epoch_tokens() == 50
    epochs.finish(epochs.close())
    assert [(j.req_id, failed) for j, failed in epochs.take_reports()] == [("a", False)]
    second = epochs.open()
    assert [(c.start, c.end) for c in second.chunks] == [(40, 90)]
    epochs.finish(epochs.close())
    assert [(j.req_id, j.start, failed) for j, failed in epochs.take_reports()] == [
        ("b", 40, False)]
    assert epochs.stats.jobs_done == 2 and epochs.stats.inflight == 0


def test_a_failed_epoch_fails_the_queued_rest_of_a_prompt_split_over_it():
    epochs = _epochs(100)
    epochs.accept(PLaneMetadata(new_jobs=[_job("a", 150), _job("c", 10)]))
    epochs.open()
    epochs.fail(epochs.close())
    assert sorted((j.req_id, failed) for j, failed in epochs.take_reports()) == [("a", True)]
    assert [j.req_id for j in epochs.pending] == ["c"] and epochs.stats.jobs_failed == 1


def test_a_cancel_reports_a_queued_job_at_once_and_a_running_one_with_its_epoch():
    epochs = _epochs(100)
    epochs.accept(PLaneMetadata(new_jobs=[_job("a", 150), _job("q", 10)]))
    epochs.open()  # a's first 100 tokens run; its rest and q stay queued
    epochs.accept(PLaneMetadata(cancelled=[("q", 0), ("a", 0)]))
    assert [(j.req_id, failed) for j, failed in epochs.take_reports()] == [("q", False)]
    assert not epochs.pending  # a's rest drains with the running part, not as a new epoch
    epochs.finish(epochs.close())
    reports = epochs.take_reports()
    assert [(j.req_id, j.start, failed) for j, failed in reports] == [("a", 100, False)]
    assert epochs.stats.jobs_cancelled == 2 and epochs.stats.jobs_done == 0
    assert epochs.take_reports() == [] and not epochs.cancelled
