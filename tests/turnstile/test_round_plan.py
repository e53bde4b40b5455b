"""The round plan and the epoch gate: every rank's plan from every rank's payloads."""

from __future__ import annotations

import itertools

import pytest

from vllm_ainfer_pd.turnstile import Load
from vllm_ainfer_pd.turnstile.round_plan import (
    CLEAN,
    STOOD_IN,
    EpochGate,
    PostD,
    PreD,
    PState,
    RoundPlan,
    RoundPlanMismatch,
    plan_round,
)

pytestmark = pytest.mark.timeout(60)

PARKED3 = PreD(PState.PARKED, 3)


def post(*tokens: int, occupancy: float = 0.0) -> list[PostD]:
    return [PostD(t, Load(d_occupancy=occupancy)) for t in tokens]


def test_payloads_round_trip_through_rendezvous_ints():
    for pre in (PreD(), PreD(PState.STUCK, 7, failed=CLEAN, retired=True), PARKED3):
        assert PreD.decode(pre.encode()) == pre
    mine = PostD(1234, Load(0.25, 1.5, 0.125))
    assert PostD.decode(mine.encode()) == mine
    assert all(isinstance(w, int) for w in (*PARKED3.encode(), *mine.encode()))
    assert len(mine.encode()) <= 4 and len(PARKED3.encode()) <= 4  # the rendezvous' payload


def test_open_epoch_releases_while_every_rank_is_parked_at_the_same_boundary():
    plan = plan_round([PARKED3] * 2, post(0, 0, occupancy=0.5), epoch_open=True, ranks_per_dp=1)
    assert plan == RoundPlan(release=True, load=Load(d_occupancy=0.5))


def test_a_failed_rank_replays_to_the_end_and_fails_only_its_dp_replica():
    """A failed rank replays to where its peers park (so segments go on being released), and at
    the end only the DP replicas with a failed rank fail their jobs."""
    assert plan_round([PARKED3, PreD(PState.PARKED, 3, failed=CLEAN)], post(5, 0),
                      epoch_open=True, ranks_per_dp=1) == RoundPlan(release=True)
    done, failed = PreD(PState.DONE, 9), PreD(PState.DONE, 9, failed=CLEAN)
    # DP=2 x TP=2: rank 3 (DP replica 1) failed.
    plan = plan_round([done, done, done, failed], post(8, 8, 8, 8), epoch_open=True,
                      ranks_per_dp=2)
    assert plan == RoundPlan(end=True, failed=(False, True))  # no opening beside a failure
    # Failed after issuing collectives: its stand-ins fed every replica's P, so all fail.
    tainted = PreD(PState.DONE, 9, failed=STOOD_IN)
    assert plan_round([done, done, done, tainted], post(8, 8, 8, 8), epoch_open=True,
                      ranks_per_dp=2) == RoundPlan(end=True, failed=(True, True))
    # A rank that cannot replay ends the epoch at once, failed everywhere, parked P cancelled.
    stuck = PreD(PState.STUCK, 2, failed=CLEAN)
    for order in itertools.permutations([PARKED3, stuck]):
        assert plan_round(list(order), post(0, 0), epoch_open=True, ranks_per_dp=1) == \
            RoundPlan(end=True, failed=(True, True), cancel=True)


def test_all_done_ends_the_epoch_and_may_open_the_next_with_each_dp_ranks_tokens():
    done = [PreD(PState.DONE, 9)] * 4
    plan = plan_round(done, post(30, 30, 0, 0), epoch_open=True, ranks_per_dp=2)
    assert plan == RoundPlan(end=True, failed=(False, False), open=(30, 0))
    assert plan_round(done, post(0, 0, 0, 0), epoch_open=True, ranks_per_dp=2) == \
        RoundPlan(end=True, failed=(False, False))


def test_retired_state_is_rebuilt_before_any_epoch_opens():
    plan = plan_round([PreD(), PreD(retired=True)], post(8, 8), epoch_open=False, ranks_per_dp=1)
    assert plan == RoundPlan(rebuild=True)
    assert plan_round([PreD(), PreD()], post(0, 8), epoch_open=False, ranks_per_dp=1) == \
        RoundPlan(open=(0, 8))


def test_ranks_stopped_apart_are_a_mismatch_naming_every_rank():
    with pytest.raises(RoundPlanMismatch, match=r"rank 1: .*rank 0: parked at boundary 3, "
                                                r"rank 1: parked \(failed\) at boundary 4"):
        plan_round([PARKED3, PreD(PState.PARKED, 4, failed=CLEAN)], post(0, 0), epoch_open=True,
                   ranks_per_dp=1, rank=1)
    with pytest.raises(RoundPlanMismatch, match="some done while others are parked"):
        plan_round([PARKED3, PreD(PState.DONE, 9)], post(0, 0), epoch_open=True,
                   ranks_per_dp=1)


def test_every_rank_computes_the_same_plan_from_the_same_payloads():
    """The plan reads nothing but its arguments: over many payload sets, each rank's call (its
    own rank number the only difference) gives one plan."""
    states = [PreD(), PARKED3, PreD(PState.DONE, 9), PreD(PState.PARKED, 3, failed=CLEAN),
              PreD(PState.STUCK, 1, failed=CLEAN), PreD(retired=True)]
    for pre in itertools.product(states, repeat=3):
        for epoch_open in (True, False):
            plans = set()
            for rank in range(3):
                try:
                    plans.add(plan_round(list(pre), post(4, 0, 9, occupancy=0.25),
                                         epoch_open=epoch_open, ranks_per_dp=1, rank=rank))
                except RoundPlanMismatch:
                    plans.add("mismatch")
            assert len(plans) == 1, (pre, epoch_open, plans)


def test_gate_opens_when_full_after_the_deadline_or_with_no_decode():
    gate = EpochGate(fill=0.75, deadline_rounds=64)
    budget = 100
    assert not gate.opens([0, 0], [3, 3], 10, budget)  # nothing queued
    assert not gate.opens([100, 40], [3, 3], 1, budget)  # 140 of 200: below 75%
    assert gate.opens([100, 60], [3, 3], 1, budget)  # 160 of 200
    assert not gate.opens([500, 0], [3, 3], 1, budget)  # one rank's epoch takes 100 at most
    assert gate.opens([10, 0], [3, 3], 64, budget)  # the deadline
    assert gate.opens([10, 0], [0, 0], 1, budget)  # no rank decodes: nothing to wait beside
    assert EpochGate(fill=0.0).opens([1, 0], [3, 3], 0, budget)  # no gate


def test_gate_fills_over_the_ranks_in_play_only():
    """An idle rank (no lane work, no decode rows) loses nothing to an epoch: it does not count
    against the fill, so one busy rank of two opens once it alone fills its budget's share."""
    gate = EpochGate(fill=0.75, deadline_rounds=64)
    budget = 100
    assert gate.opens([80, 0], [3, 0], 1, budget)  # rank 1 idle: 80 of 100
    assert not gate.opens([70, 0], [3, 0], 1, budget)  # 70 of 100: below 75%
    assert not gate.opens([80, 0], [3, 3], 1, budget)  # rank 1 decodes: 80 of 200
    assert not gate.opens([80, 0, 0, 0], [3, 0, 0, 1], 1, budget)  # 80 of 200 (ranks 0, 3)
    assert gate.opens([80, 80, 0, 0], [0, 3, 0, 0], 1, budget)  # 160 of 200 (ranks 0, 1)


@pytest.mark.parametrize("fill, rounds, match", [(1.5, 1, "fill"), (-0.1, 1, "fill"),
                                                (0.5, -1, "deadline")])
def test_gate_rejects_bad_settings_by_name(fill, rounds, match):
    with pytest.raises(ValueError, match=match):
        EpochGate(fill, rounds)
