"""Selective stream route: which P collectives cross D's groups, and where they are issued."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ainfer_pd.turnstile import StreamRoute, crosses

ATP2_ADP2_D = [{0, 2}, {1, 3}]  # D's DP-attention all-gather groups (paper, Figure 2)


def test_full_tp_all_reduce_crosses_dp_attention_groups():
    route = StreamRoute()
    assert route.register("p_tp_all_reduce", {0, 1, 2, 3}, ATP2_ADP2_D) is True
    assert route.is_crossed("p_tp_all_reduce")
    reg = route.registrations["p_tp_all_reduce"]
    assert set(reg.crossing) == {frozenset({0, 2}), frozenset({1, 3})}


def test_tp_only_layout_is_not_crossed_and_registers_nothing():
    route = StreamRoute()
    assert route.register("p_tp_all_reduce", {0, 1, 2, 3}, [{0, 1, 2, 3}]) is False
    assert not route.is_crossed("p_tp_all_reduce")
    assert route.registrations == {}


def test_groups_without_a_shared_rank_do_not_cross():
    assert not crosses({0, 1}, {2, 3})


def test_p_group_inside_a_d_group_does_not_cross():
    assert not crosses({0, 1}, {0, 1, 2, 3})


def test_one_shared_rank_crosses_because_a_ring_of_groups_can_close():
    # 0 -D-> 2 -P-> 3 -D-> 1 -P-> 0 with P groups {0,1},{2,3} and D groups {0,2},{1,3}
    route = StreamRoute()
    assert route.register("p_tp_all_reduce", {0, 1}, ATP2_ADP2_D)


@given(p=st.sets(st.integers(0, 7), min_size=1), d=st.sets(st.integers(0, 7), min_size=1))
def test_crossing_is_shared_rank_and_not_contained(p, d):
    assert crosses(p, d) == (bool(p & d) and not p <= d)


def test_unregistered_collective_stays_on_p_stream_and_is_recorded():
    route = StreamRoute()
    route.register("p_tp_all_reduce", {0, 1, 2, 3}, ATP2_ADP2_D)
    with route.route("p_ep_all_gather") as decision:
        assert (decision.crossed, decision.stream) == (False, "p")
    with route.route("p_tp_all_reduce") as decision:
        assert (decision.crossed, decision.stream) == (True, "d")
    names = [(d.name, d.stream) for d in route.decisions()]
    assert names == [("p_ep_all_gather", "p"), ("p_tp_all_reduce", "d")]
    assert route.count("p_tp_all_reduce", crossed=True) == 1
    assert route.count("p_ep_all_gather", crossed=False) == 1


def test_decisions_record_the_calling_thread_and_stay_bounded():
    route = StreamRoute(history=8)
    route.register("ar", {0, 1}, [{0}, {1}])

    def p_thread():
        for _ in range(20):
            with route.route("ar"):
                pass

    t = threading.Thread(target=p_thread, name="P-thread")
    t.start()
    t.join(10)
    log = route.decisions()
    assert len(log) == 8 and {d.thread for d in log} == {"P-thread"}
    assert [d.seq for d in log] == list(range(12, 20))
    assert route.count("ar", crossed=True) == 20


@pytest.mark.parametrize(("args", "message"), [
    (("", {0}, [{0}]), "non-empty str"),
    (("x", set(), [{0}]), "p_group must name at least one rank"),
    (("x", {0, -1}, [{0}]), "non-negative int ranks, got \\['-1'\\]"),
    (("x", {0}, [{0}, set()]), "d_groups entry must name at least one rank"),
])
def test_register_rejects_bad_groups_by_value(args, message):
    with pytest.raises(ValueError, match=message):
        StreamRoute().register(*args)


def test_reregistering_a_name_with_other_groups_is_rejected():
    route = StreamRoute()
    route.register("ar", {0, 1, 2, 3}, ATP2_ADP2_D)
    assert route.register("ar", {0, 1, 2, 3}, ATP2_ADP2_D)  # same groups: idempotent
    with pytest.raises(ValueError, match="already registered"):
        route.register("ar", {0, 1}, ATP2_ADP2_D)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_crossed_collective_runs_after_d_on_d_stream_while_other_p_work_overlaps():
    import torch

    d_stream, p_stream = torch.cuda.Stream(), torch.cuda.Stream()
    route = StreamRoute(d_stream)
    route.register("p_tp_all_reduce", {0, 1, 2, 3}, ATP2_ADP2_D)
    x = torch.ones(1 << 22, device="cuda")

    def trial():
        start, d_end, free_end, routed_end, after_end = (
            torch.cuda.Event(enable_timing=True) for _ in range(5))
        torch.cuda.synchronize()
        with torch.cuda.stream(d_stream):
            start.record()
            torch.cuda._sleep(200_000_000)  # stands for D's graph replay (~0.1 s)
            d_end.record()
        with torch.cuda.stream(p_stream):
            with route.route("p_ep_all_gather"):  # not registered: stays on P's stream
                assert torch.cuda.current_stream() == p_stream
                w = x * 3
                free_end.record()
            with route.route("p_tp_all_reduce"):  # crossed: on D's stream
                assert torch.cuda.current_stream() == d_stream
                y = x * 2  # stands for the all-reduce; reads P's input
                routed_end.record()
            assert torch.cuda.current_stream() == p_stream
            z = y + 1  # P's next op sees the routed result
            after_end.record()
        torch.cuda.synchronize()
        ms = {k: start.elapsed_time(e) for k, e in
              {"d": d_end, "free": free_end, "routed": routed_end, "after": after_end}.items()}
        return ms, w, z

    trial()  # warm-up: lazy module loading serialises a kernel's first launch
    ms, w, z = trial()
    assert ms["free"] < ms["d"]  # other P work keeps overlapping D
    assert ms["routed"] >= ms["d"]  # stream FIFO: the routed collective runs after D
    assert ms["after"] >= ms["routed"]  # D -> P edge
    assert torch.equal(z, torch.full_like(x, 3.0)) and torch.equal(w, torch.full_like(x, 3.0))
