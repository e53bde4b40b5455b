"""SegmentController: normal sequences and every rejection rule, with real producer threads."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_ainfer_pd.turnstile import (
    UNBOUNDED,
    EpochActiveError,
    EpochCancelled,
    MissingProducerError,
    NonMonotoneBoundaryError,
    PermitExceededError,
    PermitTimeout,
    PrematureAdvanceError,
    ProducerFailed,
    ProtocolError,
    SecondProducerError,
    SegmentController,
    StaleEpochError,
    TaskState,
)

pytestmark = pytest.mark.timeout(60)

SHORT = 0.3  # seconds; timeouts that a test expects to fire


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


# --- normal sequences -------------------------------------------------------------------------


def test_new_epoch_starts_at_permit_zero_so_ready_d_goes_before_p(producer, publish):
    ctrl = SegmentController(rank=3, span=2)
    st0 = ctrl.open_epoch(0)
    assert (st0.epoch, st0.reached, st0.permit, st0.state) == (0, -1, 0, TaskState.RUNNING)
    producer(ctrl, publish(0, 4))
    parked = ctrl.wait_parked(timeout_s=5)
    assert (parked.reached, parked.permit, parked.state) == (0, 0, TaskState.PARKED)


def test_epoch_opened_after_d_enqueue_starts_with_permit_k(producer, publish):
    ctrl = SegmentController(span=3)
    assert ctrl.open_epoch(0, d_enqueued=True).permit == 3
    producer(ctrl, publish(0, 10))
    parked = ctrl.wait_parked(timeout_s=5)
    assert (parked.reached, parked.state) == (3, TaskState.PARKED)


def test_producer_parks_exactly_at_each_permit_and_final_segment_reports_done(producer, publish):
    ctrl = SegmentController(span=2)
    ctrl.open_epoch(7)
    p = producer(ctrl, publish(7, 7))
    parks = []
    while True:
        s = ctrl.wait_parked(timeout_s=5)
        if s.done:
            break
        parks.append((s.reached, s.permit))
        ctrl.advance()
    p.join(5)
    assert p.error is None
    assert parks == [(0, 0), (2, 2), (4, 4), (6, 6)]
    assert ctrl.status().reached == 6 and ctrl.status().state is TaskState.DONE


def test_advance_uses_the_span_given_per_round(producer, publish):
    ctrl = SegmentController(span=1)
    ctrl.open_epoch(0)
    producer(ctrl, publish(0, 20))
    parks = []
    for k in (3, 1, 4):
        parks.append(ctrl.wait_parked(timeout_s=5).reached)
        ctrl.advance(k)
    parks.append(ctrl.wait_parked(timeout_s=5).reached)
    assert parks == [0, 3, 4, 8]


def test_unbounded_span_lets_p_run_to_completion(producer, publish):
    ctrl = SegmentController()
    ctrl.open_epoch(0)
    producer(ctrl, publish(0, 40))
    assert ctrl.wait_parked(timeout_s=5).reached == 0
    ctrl.advance(UNBOUNDED)
    s = ctrl.wait_parked(timeout_s=5)
    assert s.done and s.reached == 39


def test_advance_is_a_no_op_on_idle_and_completed_ranks(producer, publish):
    ctrl = SegmentController()
    assert ctrl.wait_parked(timeout_s=SHORT).state is TaskState.IDLE
    assert ctrl.advance().state is TaskState.IDLE
    ctrl.open_epoch(0, d_enqueued=True, span=5)
    producer(ctrl, publish(0, 2))
    assert ctrl.wait_parked(timeout_s=5).done
    before = ctrl.status()
    assert ctrl.advance(3) == before  # matched control path: nothing moves


def test_next_epoch_may_open_once_the_previous_is_done(producer, publish):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=UNBOUNDED)
    producer(ctrl, publish(0, 3))
    assert ctrl.wait_parked(timeout_s=5).done
    s = ctrl.open_epoch(1)
    assert (s.epoch, s.reached, s.permit, s.state) == (1, -1, 0, TaskState.RUNNING)


def test_cancel_wakes_a_parked_producer_with_epoch_cancelled(producer, publish):
    ctrl = SegmentController()
    ctrl.open_epoch(0)
    p = producer(ctrl, publish(0, 5))
    ctrl.wait_parked(timeout_s=5)
    ctrl.cancel("request aborted")
    p.join(5)
    assert isinstance(p.error, EpochCancelled)
    assert "request aborted" in str(p.error)
    assert ctrl.wait_parked(timeout_s=SHORT).state is TaskState.CANCELLED
    ctrl.open_epoch(1)  # a cancelled epoch does not block the next one


# --- rejections: epochs -----------------------------------------------------------------------


def test_reopening_the_last_epoch_is_rejected_as_duplicate(producer, publish):
    ctrl = SegmentController(rank=2)
    ctrl.open_epoch(5, d_enqueued=True, span=UNBOUNDED)
    producer(ctrl, publish(5, 1))
    ctrl.wait_parked(timeout_s=5)
    with pytest.raises(StaleEpochError, match=r"duplicate epoch \(rank 2, epoch 5\)"):
        ctrl.open_epoch(5)


def test_opening_an_older_epoch_is_rejected_as_stale(producer, publish):
    ctrl = SegmentController()
    ctrl.open_epoch(5, d_enqueued=True, span=UNBOUNDED)
    producer(ctrl, publish(5, 1))
    ctrl.wait_parked(timeout_s=5)
    with pytest.raises(StaleEpochError, match="stale epoch"):
        ctrl.open_epoch(4)


def test_producer_call_for_a_stale_epoch_is_rejected(producer, publish):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=UNBOUNDED)
    producer(ctrl, publish(0, 1))
    ctrl.wait_parked(timeout_s=5)
    ctrl.open_epoch(1)
    with pytest.raises(StaleEpochError, match=r"stale epoch \(rank 0, epoch 0, boundary 1\)"):
        ctrl.reach(0, 1)


def test_producer_call_for_an_unopened_epoch_is_rejected():
    ctrl = SegmentController()
    with pytest.raises(StaleEpochError, match="unopened"):
        ctrl.reach(0, 0)
    ctrl.open_epoch(0)
    with pytest.raises(StaleEpochError, match="unopened"):
        ctrl.attach(1)


def test_opening_an_epoch_while_the_previous_runs_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0)
    with pytest.raises(EpochActiveError, match="epoch 0 is running"):
        ctrl.open_epoch(1)


# --- rejections: producers --------------------------------------------------------------------


def test_second_attach_is_rejected_as_second_producer():
    ctrl = SegmentController()
    ctrl.open_epoch(0)
    ctrl.attach(0, "layer-hooks")
    with pytest.raises(SecondProducerError, match=r"'deepep'.*'layer-hooks' is the producer"):
        ctrl.attach(0, "deepep")


def test_boundary_from_a_second_thread_is_rejected(producer):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=10)
    ctrl.reach(0, 0)  # the test thread becomes the producer
    other = producer(ctrl, lambda c: c.reach(0, 1), name="intruder")
    other.join(5)
    assert isinstance(other.error, SecondProducerError)
    assert "'intruder' is not the producer" in str(other.error)
    assert ctrl.status().reached == 0


def test_missing_producer_is_detected_by_timeout():
    ctrl = SegmentController(rank=1)
    ctrl.open_epoch(3)
    start = time.monotonic()
    with pytest.raises(MissingProducerError) as info:
        ctrl.wait_parked(timeout_s=SHORT)
    assert time.monotonic() - start >= SHORT
    err = info.value
    assert (err.rank, err.epoch, err.boundary) == (1, 3, 0)
    assert "no producer attached" in str(err)


def test_stalled_producer_is_reported_missing_with_its_last_boundary(producer):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=4)
    gate = threading.Event()

    def body(c):
        c.attach(0, "layer-hooks")
        c.reach(0, 0)
        c.reach(0, 1)
        gate.wait(10)  # never reaches the permit 4

    producer(ctrl, body)
    wait_until(lambda: ctrl.status().reached == 1)
    with pytest.raises(MissingProducerError, match="'layer-hooks' last published 1"):
        ctrl.wait_parked(timeout_s=SHORT)
    gate.set()


def test_producer_failure_surfaces_in_the_consumer(producer):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=4)

    def body(c):
        c.reach(0, 0)
        c.fail(0, ValueError("kernel launch failed"))

    producer(ctrl, body).join(5)
    with pytest.raises(ProducerFailed, match="kernel launch failed") as info:
        ctrl.wait_parked(timeout_s=5)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ProducerFailed):
        ctrl.advance()


def test_close_after_a_failure_makes_later_rounds_no_work_calls(producer):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=4)
    producer(ctrl, lambda c: (c.reach(0, 0), c.fail(0, ValueError("boom")))).join(5)
    with pytest.raises(ProducerFailed):
        ctrl.wait_parked(timeout_s=5)
    ctrl.close()  # the consumer handled the failure: it is not raised again
    assert ctrl.wait_parked(timeout_s=1).state is TaskState.IDLE
    assert ctrl.advance().state is TaskState.IDLE
    ctrl.open_epoch(1, d_enqueued=True, span=1)
    assert ctrl.status().epoch == 1


def test_a_producer_cut_off_by_close_gets_a_stale_epoch_error(producer):
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=2)
    gate = threading.Event()

    def body(c):
        c.reach(0, 0)
        gate.wait(5)  # the consumer gives up on this producer meanwhile
        c.reach(0, 1)

    thread = producer(ctrl, body)
    wait_until(lambda: ctrl.status().reached == 0)
    ctrl.close()
    gate.set()
    thread.join(5)
    assert isinstance(thread.error, StaleEpochError), thread.error


# --- rejections: boundaries and permits -------------------------------------------------------


def test_repeated_boundary_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=10)
    ctrl.reach(0, 0)
    ctrl.reach(0, 1)
    with pytest.raises(NonMonotoneBoundaryError, match=r"repeats.*boundary 1\).*reached 1"):
        ctrl.reach(0, 1)


def test_boundary_going_back_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=10)
    for i in range(3):
        ctrl.reach(0, i)
    with pytest.raises(NonMonotoneBoundaryError, match="goes back"):
        ctrl.reach(0, 1)


def test_skipped_boundary_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=10)
    ctrl.reach(0, 0)
    with pytest.raises(NonMonotoneBoundaryError, match=r"skips ids.*expected 1"):
        ctrl.reach(0, 2)


def test_boundary_beyond_the_permit_is_rejected():
    ctrl = SegmentController(rank=4)
    ctrl.open_epoch(2, d_enqueued=True, span=2)
    ctrl.reach(2, 0)
    ctrl.reach(2, 1)
    with pytest.raises(PermitExceededError) as info:
        ctrl.reach(2, 3)
    assert (info.value.rank, info.value.epoch, info.value.boundary) == (4, 2, 3)
    assert "permit is 2" in str(info.value)


def test_first_boundary_beyond_a_zero_permit_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0)
    with pytest.raises(PermitExceededError):
        ctrl.reach(0, 1)


def test_finishing_without_the_entry_boundary_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=3)
    with pytest.raises(NonMonotoneBoundaryError, match="entry boundary 0"):
        ctrl.finish(0)


def test_publication_after_finish_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=3)
    ctrl.reach(0, 0)
    ctrl.finish(0)
    with pytest.raises(NonMonotoneBoundaryError, match="after the epoch ended"):
        ctrl.reach(0, 1)


def test_advance_while_p_runs_toward_the_permit_is_rejected():
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=3)
    ctrl.reach(0, 0)
    with pytest.raises(PrematureAdvanceError, match="reached 0"):
        ctrl.advance()


def test_parked_producer_without_release_times_out(producer):
    ctrl = SegmentController(rank=6, timeout_s=SHORT)
    ctrl.open_epoch(1)
    p = producer(ctrl, lambda c: c.reach(1, 0))
    p.join(5)
    assert isinstance(p.error, PermitTimeout)
    assert (p.error.rank, p.error.epoch, p.error.boundary) == (6, 1, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_span_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        SegmentController(span=bad)


def test_every_protocol_error_names_rank_epoch_and_boundary():
    ctrl = SegmentController(rank=5)
    ctrl.open_epoch(9, d_enqueued=True, span=1)
    ctrl.reach(9, 0)
    with pytest.raises(ProtocolError) as info:
        ctrl.reach(9, 5)
    assert "rank 5, epoch 9, boundary 5" in str(info.value)


# --- properties -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(boundaries=st.integers(1, 25), spans=st.lists(st.integers(1, 5), min_size=1, max_size=30),
       d_enqueued=st.booleans())
def test_parks_follow_the_permit_arithmetic(producer, publish, boundaries, spans, d_enqueued):
    """P parks at p_0 = 0 (or K), then p_{j+1} = p_j + K_j; it finishes once p >= boundaries."""
    ctrl = SegmentController(span=spans[0])
    ctrl.open_epoch(0, d_enqueued=d_enqueued)
    published: list[tuple[int, float]] = []

    def body(c):
        for i in range(boundaries):
            published.append((i, c.status().permit))  # the permit P sees before publishing i
            c.reach(0, i)
        c.finish(0)

    p = producer(ctrl, body)
    permit = spans[0] if d_enqueued else 0
    j = 0
    while True:
        s = ctrl.wait_parked(timeout_s=5)
        if permit >= boundaries:
            assert s.done and s.reached == boundaries - 1
            break
        assert (s.state, s.reached, s.permit) == (TaskState.PARKED, permit, permit)
        k = spans[j % len(spans)]
        j += 1
        ctrl.advance(k)
        permit += k
    p.join(5)
    assert p.error is None
    assert [i for i, _ in published] == list(range(boundaries))
    assert all(i <= seen for i, seen in published)  # never published beyond the permit


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-2, 12), max_size=25), permit=st.integers(1, 10))
def test_only_the_next_id_within_the_permit_is_accepted(ids, permit):
    """Model: accept i iff i == r + 1 and i <= permit; a rejected call changes nothing."""
    ctrl = SegmentController()
    ctrl.open_epoch(0, d_enqueued=True, span=permit)
    r = -1
    for i in ids:
        before = ctrl.status()
        if i == permit and i == r + 1:
            break  # would park: covered by the threaded property above
        if i <= r:
            expected = NonMonotoneBoundaryError
        elif i > permit:
            expected = PermitExceededError
        elif i != r + 1:
            expected = NonMonotoneBoundaryError
        else:
            ctrl.reach(0, i)
            r = i
            assert ctrl.status().reached == r
            continue
        with pytest.raises(expected):
            ctrl.reach(0, i)
        assert ctrl.status() == before
