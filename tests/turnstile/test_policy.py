"""Segment policies choose only K, monotonically in load, and reject bad inputs by name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ainfer_pd.turnstile import (
    FixedSpan,
    Load,
    LoadSelectedSpan,
    WorkPerRoundSpan,
    make_policy,
)

occupancy = st.floats(0.0, 1.0)
pressure = st.floats(0.0, 50.0)


def test_fixed_span_ignores_load():
    assert FixedSpan(3).span() == 3
    assert FixedSpan(3).span(Load(1.0, 9.0)) == 3


@pytest.mark.parametrize("bad", [0, -2, 1.5, math.inf, True, "2"])
def test_fixed_span_rejects_a_bad_k_by_value(bad):
    with pytest.raises(ValueError, match="k must"):
        FixedSpan(bad)


def test_high_d_occupancy_selects_the_smallest_span():
    policy = LoadSelectedSpan((4, 1, 2))
    assert policy.spans == (1, 2, 4)
    assert policy.span(Load(d_occupancy=0.8, p_pressure=10.0)) == 1


def test_high_p_pressure_with_idle_d_selects_the_largest_span():
    assert LoadSelectedSpan((1, 2, 4)).span(Load(0.0, 1.0)) == 4


def test_no_p_pressure_selects_the_smallest_span():
    assert LoadSelectedSpan((1, 2, 4)).span(Load(0.0, 0.0)) == 1


def test_middle_load_selects_a_middle_span():
    assert LoadSelectedSpan((1, 2, 4)).span(Load(0.0, 0.5)) == 2


@given(d1=occupancy, d2=occupancy, p=pressure)
def test_span_never_grows_with_d_occupancy(d1, d2, p):
    policy = LoadSelectedSpan((1, 2, 3, 4, 8))
    lo, hi = sorted((d1, d2))
    assert policy.span(Load(hi, p)) <= policy.span(Load(lo, p))


@given(d=occupancy, p1=pressure, p2=pressure)
def test_span_never_shrinks_with_p_pressure(d, p1, p2):
    policy = LoadSelectedSpan((1, 2, 3, 4, 8))
    lo, hi = sorted((p1, p2))
    assert policy.span(Load(d, lo)) <= policy.span(Load(d, hi))


@given(d=occupancy, p=pressure, spans=st.sets(st.integers(1, 64), min_size=1, max_size=6))
def test_selected_span_is_always_one_of_the_validated_spans(d, p, spans):
    assert LoadSelectedSpan(tuple(spans)).span(Load(d, p)) in spans


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"spans": ()}, "at least one span"),
    ({"spans": (1, 0)}, "got 0"),
    ({"spans": (1, 2.5)}, "got 2.5"),
    ({"spans": (2, 2)}, r"distinct, got \(2, 2\)"),
    ({"spans": (1, math.inf)}, "finite, got inf"),
    ({"d_high": 0.0}, "d_high must be in"),
    ({"d_high": 1.5}, "got 1.5"),
    ({"p_high": -1.0}, "p_high must be > 0, got -1.0"),
    ({"p_high": math.nan}, "p_high must be a finite number, got nan"),
])
@pytest.mark.parametrize("cls", [LoadSelectedSpan, WorkPerRoundSpan])  # the work rule inherits
def test_load_selected_span_rejects_bad_settings_by_value(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"d_occupancy": 1.2}, r"d_occupancy must be in \[0, 1\], got 1.2"),
    ({"d_occupancy": -0.1}, "got -0.1"),
    ({"p_pressure": -3.0}, "p_pressure must be finite and >= 0, got -3.0"),
    ({"p_pressure": math.inf}, "p_pressure must be a finite number, got inf"),
    ({"epoch_size": -0.5}, "epoch_size must be finite and >= 0, got -0.5"),
    ({"epoch_size": math.nan}, "epoch_size must be a finite number, got nan"),
    ({"d_occupancy": "full"}, "got 'full'"),
])
def test_load_rejects_bad_figures_by_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Load(**kwargs)


@pytest.mark.parametrize("policy", [LoadSelectedSpan, WorkPerRoundSpan])
def test_load_policies_need_a_load_and_say_which(policy):
    with pytest.raises(ValueError, match=f"{policy.__name__} needs a Load"):
        policy().span(None)


def test_make_policy_names_the_unknown_kind():
    assert make_policy("fixed", k=2) == FixedSpan(2)
    assert make_policy("load", spans=(2, 1)).spans == (1, 2)
    assert make_policy("work", spans=(4, 1)) == WorkPerRoundSpan((1, 4))
    with pytest.raises(ValueError, match="'adaptive'"):
        make_policy("adaptive")


# ---- WorkPerRoundSpan: the load rule's K, raised to about the same P work per round ----------

WORK_SPANS = (1, 2, 4, 8, 16, 25)  # load_spans(25): a 24-layer model's boundaries
epoch_size = st.floats(0.0, 4.0)


def test_work_span_sizes_k_by_the_epoch_where_p_pressure_is_low():
    policy = WorkPerRoundSpan(WORK_SPANS, share=0.125)
    # No queue: the load rule gives K=1. 0.125 x 25 boundaries = 3.1 full-epoch boundaries per
    # round: K = 2 for a full epoch (13 segments), 4 for half of one.
    assert policy.span(Load(d_occupancy=0.1, epoch_size=1.0)) == 2
    assert policy.span(Load(d_occupancy=0.1, epoch_size=0.5)) == 4
    # A short continuation prompt's epoch goes in one release.
    assert policy.span(Load(d_occupancy=0.1, epoch_size=0.1)) == 25


def test_work_span_keeps_the_load_rules_larger_k_for_a_deep_queue():
    load = Load(d_occupancy=0.1, p_pressure=3.0, epoch_size=1.0)
    assert WorkPerRoundSpan(WORK_SPANS).span(load) == LoadSelectedSpan(WORK_SPANS).span(load) == 16


def test_work_span_runs_the_whole_forward_when_d_has_no_rows():
    assert WorkPerRoundSpan(WORK_SPANS).span(Load(d_occupancy=0.0, epoch_size=1.0)) == 25


def test_work_span_falls_back_to_the_smallest_span_for_a_huge_epoch_on_a_busy_d():
    assert WorkPerRoundSpan(WORK_SPANS).span(Load(0.9, p_pressure=5.0, epoch_size=40.0)) == 1


@given(d=occupancy, p=pressure, e1=epoch_size, e2=epoch_size)
def test_work_span_never_grows_with_the_epoch_size(d, p, e1, e2):
    policy = WorkPerRoundSpan(WORK_SPANS)
    lo, hi = sorted((e1, e2))
    assert policy.span(Load(d, p, epoch_size=hi)) <= policy.span(Load(d, p, epoch_size=lo))


@given(d1=occupancy, d2=occupancy, p1=pressure, p2=pressure, e=epoch_size)
def test_work_span_is_monotone_in_d_occupancy_and_p_pressure(d1, d2, p1, p2, e):
    policy = WorkPerRoundSpan(WORK_SPANS)
    (dl, dh), (pl, ph) = sorted((d1, d2)), sorted((p1, p2))
    assert policy.span(Load(dh, pl, e)) <= policy.span(Load(dl, pl, e))
    assert policy.span(Load(dl, pl, e)) <= policy.span(Load(dl, ph, e))


@given(d=st.floats(0.001, 1.0), p=pressure, e=st.floats(0.001, 4.0))
def test_work_span_is_the_load_rules_k_or_a_span_within_its_share(d, p, e):
    policy = WorkPerRoundSpan(WORK_SPANS, share=0.25)
    load = Load(d, p, epoch_size=e)
    k = policy.span(load)
    assert k in WORK_SPANS
    assert k >= LoadSelectedSpan(WORK_SPANS).span(load)
    assert k in (WORK_SPANS[0], LoadSelectedSpan(WORK_SPANS).span(load)) or k * e <= 0.25 * 25


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"share": 0.0}, r"share must be in \(0, 1\], got 0.0"),
    ({"share": 1.5}, "got 1.5"),
    ({"share": math.inf}, "share must be a finite number, got inf"),
])
def test_work_span_rejects_bad_settings_by_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkPerRoundSpan(**kwargs)
