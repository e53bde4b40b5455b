"""Turnstile rounds with ranks as threads over a real shared-memory rendezvous.

Each rank has a D thread (the test's rank thread) and a P producer thread; both append to the rank's
enqueue log, which stands for the order in which work reaches the device.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from vllm_ainfer_pd.turnstile import (
    UNBOUNDED,
    EpochCancelled,
    FixedSpan,
    Load,
    LoadSelectedSpan,
    NullRendezvous,
    OrderingMode,
    RendezvousTimeout,
    SegmentController,
    ShmRendezvous,
    TaskState,
    Turnstile,
)

pytestmark = pytest.mark.timeout(60)


class Rank:
    """One rank: turnstile + P thread that publishes `boundaries` and logs each P enqueue."""

    def __init__(self, name, rank, world, *, policy=None, mode="fine", fence=None, timeout=10):
        self.rank = rank
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.rdv = ShmRendezvous(name, rank, world, timeout_s=timeout, create=rank == 0)
        self.ts = Turnstile(SegmentController(rank, timeout_s=10), self.rdv,
                            policy or FixedSpan(1), mode, fence)
        self.p_thread: threading.Thread | None = None
        self.p_error: BaseException | None = None

    def record(self, *event):
        with self.lock:
            self.log.append(event)

    def start_epoch(self, epoch, boundaries, *, d_enqueued=False, load=None):
        self.ts.open_epoch(epoch, d_enqueued=d_enqueued, load=load)

        def body():
            ctrl = self.ts.controller
            try:
                for i in range(boundaries):
                    ctrl.reach(epoch, i)
                    self.record("P", epoch, i)  # P's device work between boundary i and i + 1
                ctrl.finish(epoch)
            except EpochCancelled:
                pass  # the test ended before the epoch did
            except BaseException as exc:
                self.p_error = exc

        self.p_thread = threading.Thread(target=body, name=f"P{self.rank}", daemon=True)
        self.p_thread.start()

    def round(self, j, load=None):
        with self.ts.round(load) as rec:
            self.record("D", j)
        return rec

    def close(self):
        self.ts.controller.cancel("test over")
        if self.p_thread is not None:
            self.p_thread.join(10)
        self.rdv.close()


def on_threads(world, body, **rank_kw):
    """Run body(Rank) for every rank on its own thread; return the Ranks, re-raise failures."""
    name = f"ainfer_pd_ts_{uuid.uuid4().hex[:12]}"
    ranks = [Rank(name, 0, world, **rank_kw)]
    ranks += [Rank(name, r, world, **rank_kw) for r in range(1, world)]
    errors: dict[int, BaseException] = {}

    def run(rk):
        try:
            rk.result = body(rk)
            rk.ts.controller.wait_parked()  # P stopped: the log tail is deterministic
        except BaseException as exc:
            errors[rk.rank] = exc

    threads = [threading.Thread(target=run, args=(rk,), daemon=True) for rk in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rk in reversed(ranks):
        rk.close()
    for rk in ranks:
        assert rk.p_error is None, rk.p_error
    return ranks, errors


def expected_log(boundaries, spans, rounds, *, d_enqueued=False, first_span=1):
    """The interleaving the protocol must produce: P ops below the permit, then D, per round."""
    log, permit, issued = [], (first_span if d_enqueued else 0), 0
    if d_enqueued:
        log += [("P", 0, i) for i in range(min(permit, boundaries))]
        issued = min(permit, boundaries)
    for j in range(rounds):
        log.append(("D", j))
        permit += spans[j]
        upto = min(permit, boundaries)
        log += [("P", 0, i) for i in range(issued, upto)]
        issued = upto
    return log


def test_every_rank_enqueues_d_between_the_same_p_segments():
    def body(rk):
        rk.start_epoch(0, 7)
        return [rk.round(j) for j in range(9)]

    ranks, errors = on_threads(3, body, policy=FixedSpan(2))
    assert not errors, errors
    want = expected_log(7, [2] * 9, 9)
    for rk in ranks:
        assert rk.log == want
    parks = [(rec.reached, rec.permit, rec.state) for rec in ranks[0].result]
    assert parks[:4] == [(0, 0, TaskState.PARKED), (2, 2, TaskState.PARKED),
                         (4, 4, TaskState.PARKED), (6, 6, TaskState.PARKED)]
    assert all(state is TaskState.DONE for _, _, state in parks[4:])


def test_epoch_opened_after_post_d_releases_its_first_span_at_once():
    def body(rk):
        rk.round(0)  # D of round 0 enqueued and released everywhere: open with d_enqueued
        rk.start_epoch(0, 5, d_enqueued=True)
        for j in range(1, 4):
            rk.round(j)

    ranks, errors = on_threads(2, body, policy=FixedSpan(2))
    assert not errors, errors
    want = [("D", 0), ("P", 0, 0), ("P", 0, 1), ("D", 1), ("P", 0, 2), ("P", 0, 3), ("D", 2),
            ("P", 0, 4), ("D", 3)]
    assert ranks[0].log == ranks[1].log == want


def test_load_selected_span_changes_only_how_far_each_release_goes():
    loads = [Load(0.9, 2.0), Load(0.0, 2.0), Load(0.5, 0.0), Load(0.0, 0.5), Load(0.9, 0.0)]
    policy = LoadSelectedSpan((1, 2, 4))
    spans = [policy.span(ld) for ld in loads]
    assert spans == [1, 4, 1, 2, 1]

    def body(rk):
        rk.start_epoch(0, 12)
        for j, ld in enumerate(loads):
            rk.round(j, ld)

    ranks, errors = on_threads(2, body, policy=policy)
    assert not errors, errors
    assert ranks[0].log == ranks[1].log == expected_log(12, spans, len(loads))


def test_idle_rank_makes_matched_no_work_calls():
    def body(rk):
        if rk.rank != 1:
            rk.start_epoch(0, 3)
        return [rk.round(j) for j in range(4)]

    ranks, errors = on_threads(3, body)
    assert not errors, errors
    assert ranks[1].log == [("D", j) for j in range(4)]
    assert all(rec.state is TaskState.IDLE for rec in ranks[1].result)
    assert ranks[0].log == ranks[2].log == expected_log(3, [1] * 4, 4)


def test_global_enqueue_admits_d_only_after_the_whole_epoch_was_enqueued():
    def body(rk):
        rk.start_epoch(0, 6)
        return [rk.round(j) for j in range(3)]

    ranks, errors = on_threads(2, body, mode="global-enqueue")
    assert not errors, errors
    want = [("D", 0)] + [("P", 0, i) for i in range(6)] + [("D", 1), ("D", 2)]
    assert ranks[0].log == ranks[1].log == want
    assert ranks[0].result[1].state is TaskState.DONE


def test_global_complete_fences_each_finished_epoch_once_before_its_rendezvous():
    fenced: list[tuple[int, int, int]] = []

    def body(rk):
        rk.start_epoch(0, 4)
        for j in range(3):
            rk.round(j)

    def make_fence():
        def fence(epoch):  # stands for waiting on the epoch's last device event
            fenced.append((threading.current_thread().name, epoch, len(fence.rank.log)))
        return fence

    name = f"ainfer_pd_ts_{uuid.uuid4().hex[:12]}"
    ranks = []
    for r in range(2):
        f = make_fence()
        rk = Rank(name, r, 2, mode=OrderingMode.GLOBAL_COMPLETE, fence=f)
        f.rank = rk
        ranks.append(rk)
    threads = [threading.Thread(target=body, args=(rk,), name=f"D{rk.rank}") for rk in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rk in reversed(ranks):
        rk.close()
    # Once per rank, after the epoch's whole P enqueue (D0 + 4 P ops) and before D1.
    assert sorted(fenced) == [("D0", 0, 5), ("D1", 0, 5)]
    assert ranks[0].log == ranks[1].log


def test_global_complete_pre_d_requires_a_device_fence():
    """A finished epoch meets `pre_d` in global-complete mode: without a fence it is an error, not
    an unfenced round (the P lane fences where its round plan ends an epoch, and never calls
    `pre_d`)."""
    controller = SegmentController()
    turnstile = Turnstile(controller, NullRendezvous(5.0), mode="global-complete")
    turnstile.open_epoch(0, d_enqueued=True)
    controller.reach(0, 0)
    controller.finish(0)
    with pytest.raises(ValueError, match="device_fence"):
        turnstile.pre_d()


def test_ordering_modes_differ_only_in_span_and_fence():
    assert OrderingMode.parse("fine").span(FixedSpan(3)) == 3
    assert OrderingMode.parse("global-enqueue").span(FixedSpan(3)) == UNBOUNDED
    assert OrderingMode.GLOBAL_COMPLETE.span(LoadSelectedSpan()) == UNBOUNDED  # no Load needed
    assert OrderingMode.FREE.span(LoadSelectedSpan()) == UNBOUNDED
    assert [m.fences_device for m in OrderingMode] == [True, False, False, False]
    assert [m.waits_for_p for m in OrderingMode] == [True, True, True, False]
    with pytest.raises(ValueError, match=r"'coarse'.*global-complete, global-enqueue, fine, free"):
        OrderingMode.parse("coarse")


def test_failed_d_enqueue_skips_post_d_so_peers_time_out_naming_the_rank():
    def body(rk):
        rk.start_epoch(0, 3)
        with rk.ts.round():
            if rk.rank == 1:
                raise RuntimeError("D graph replay failed")
            rk.record("D", 0)

    ranks, errors = on_threads(3, body, timeout=0.5)
    assert isinstance(errors[1], RuntimeError)
    for r in (0, 2):
        err = errors[r]
        assert isinstance(err, RendezvousTimeout)
        assert (err.phase, err.round, err.missing) == ("post_d", 0, (1,))
    assert all(("P", 0, 0) not in rk.log for rk in ranks)  # nobody released P past the failure
