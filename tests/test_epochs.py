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


def test_jobs_about_to_decode_count_from_their_epoch_until_the_step_after_their_report():
    """The epoch gate's decode rows include lane jobs whose requests D runs within a round or
    two: an epoch's end alone must not look like an idle D (which opens the next epoch at once).
    Failed and cancelled jobs never decode from the lane."""
    epochs = _epochs(100)
    epochs.accept(PLaneMetadata(new_jobs=[_job("a", 30), _job("b", 30), _job("c", 150)]))
    assert epochs.awaiting_decode() == 0  # queued only: nothing will decode soon
    epochs.open()  # a, b and c's first 40 tokens
    assert epochs.awaiting_decode() == 2  # c's rest is still queued
    epochs.accept(PLaneMetadata(cancelled=[("b", 0)]))
    epochs.finish(epochs.close())  # reported with the epoch; b as cancelled
    assert epochs.awaiting_decode() == 1
    assert len(epochs.take_reports()) == 2
    assert epochs.awaiting_decode() == 1  # handed over: vLLM promotes a in its next schedule
    assert epochs.take_reports() == [] and epochs.awaiting_decode() == 0
    epochs.open()
    epochs.fail(epochs.close())
    assert epochs.awaiting_decode() == 0 and [f for _, f in epochs.take_reports()] == [True]
