"""The scale model (benchmarks/scale/): a hand-computed case, the calibration read from
the checked-in profiles, the router against the measured prefix-cache hits, and the CLI. No vLLM
engine starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.scale import EngineSpec, Layout, load_profile, simulate
from benchmarks.scale.__main__ import main
from benchmarks.scale.engines import RankState, Req, plan_step
from benchmarks.scale.profile import Costs, Profile
from benchmarks.scale.shape import ModelShape
from benchmarks.scale.validate import load_runs
from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn

ROOT = Path(__file__).resolve().parents[1]
SCALE = ROOT / "benchmarks" / "results" / "scale"


def unit_profile() -> Profile:
    """Every forward costs exactly 1 s (no bytes, no FLOPs, free collectives); the lane's P host
    work is 0.5 s per boundary interval and D waits for all of it; a 1-layer model (2 boundaries)
    released one interval per round."""
    shape = ModelShape(name="unit", hidden=8, layers=1, heads=1, vocab=16, experts=2, top_k=1,
                       moe_inter=8, kv_heads=1, head_dim=8)
    return Profile(
        name="unit", shape=shape, source="test",
        hardware={"link_gbps": math.inf, "collective_latency_us": 0.0, "hop_latency_us": 0.0},
        engine={"max_num_batched_tokens": 100, "max_num_seqs": 16, "block_size": 16,
                "async_scheduling": False, "client_overhead_s": 0.0,
                "client_overhead_per_token_s": 0.0, "normal_step_overhead": 0.0,
                "cudagraph_capture_size": 0},
        lane={"p_host_per_interval_s": 0.5, "p_host_per_segment_s": 0.0, "d_host_slack_s": 0.0,
              "overlap": 0.0, "contention": 0.0, "p_lane_min_tokens": 64, "epoch_gate_fill": 0.0,
              "segment_policy": "fixed", "segment_span": 1,
              "rendezvous_s": {"1": 0.0, "2": 0.0}},
        fixed_costs=Costs(t0=1.0, s_per_byte=0.0, s_per_flop=0.0))


def three_requests() -> Trace:
    # Released together in this order; vLLM's balancer sends A to rank 0, B to rank 1 (its scan
    # starts one further per request) and C to rank 0 (both score 4 then; the first wins).
    return Trace((Trajectory("A", (Turn(150, 2),)), Trajectory("B", (Turn(20, 3),)),
                  Trajectory("C", (Turn(10, 1),))))


def by_id(result) -> dict[str, object]:
    return {r.trajectory: r for r in result.records}


def test_stock_two_ranks_three_requests_matches_hand_computed_makespan():
    # Step 0 (0-1 s): rank 0 prefills 100 of A's 150 tokens (the budget), rank 1 all of B: B's
    #   first token at 1.
    # Step 1 (1-2): rank 0 the rest of A (50) and all of C (10): A's and C's first tokens, C ends
    #   (1 output token); rank 1 decodes B's 2nd token.
    # Step 2 (2-3): A's 2nd token (A ends), B's 3rd (B ends). Makespan 3 s.
    res = simulate(three_requests(), unit_profile(), Layout(dp=2, ep=True), EngineSpec("stock"))
    recs = by_id(res)
    assert res.summary["makespan_s"] == 3.0
    assert [recs[t].first_token_s for t in "ABC"] == [2.0, 1.0, 2.0]
    assert [recs[t].end_s for t in "ABC"] == [3.0, 3.0, 2.0]


def test_pd_two_ranks_three_requests_matches_hand_computed_makespan():
    # A has 150 uncached tokens (>= 64): parked in the lane as 149 lane tokens (its last token
    # becomes a D row), in two epochs since an epoch takes at most the step budget (100).
    # Step 0 (0-1.5): D: rank 0 prefills C (10), rank 1 B (20); epoch 1 (100 of A's tokens)
    #   opens, the first of its 2 boundary intervals is released and D waits 0.5 s for P's host
    #   work. C ends; B's first token.
    # Step 1 (1.5-3): D: B's 2nd token (rank 0 runs a dummy forward); epoch 1's second interval.
    # Step 2 (3-4.5): D: B's 3rd token (B ends); epoch 2 (A's last 49) opens, first interval.
    # Step 3 (4.5-5): no D forward anywhere: P runs alone for 0.5 s; epoch 2 ends and A is
    #   promoted for the next step (synchronous scheduling).
    # Step 4 (5-6): A's last prompt token as a 1-token row: its first token.
    # Step 5 (6-7): A's 2nd token. Makespan 7 s.
    res = simulate(three_requests(), unit_profile(), Layout(dp=2, ep=True), EngineSpec("pd"))
    recs = by_id(res)
    assert res.summary["makespan_s"] == 7.0
    assert [recs[t].first_token_s for t in "ABC"] == [6.0, 1.5, 1.5]
    assert [recs[t].end_s for t in "ABC"] == [7.0, 4.5, 1.5]
    assert res.counters["epochs"] == 2 and res.counters["segments"] == 4
    assert res.counters["lane_tokens"] == 149


@pytest.mark.parametrize("cached, makespan, hits", [
    # none: turn 0 prefills 100 + 50 tokens (steps 0-1, first token at 2), decodes its 2nd
    #   token (step 2, ends at 3); turn 1's 252 tokens find the 144 its trajectory left
    #   (150 + 2 - 1 rounded down to blocks of 16): 108 in steps 3-4, ends at 5.
    # later: turn 1 finds all but its last partial block (240): 12 tokens in step 3, ends at 4.
    # all: turn 0 too (144 of 150): 6 tokens in step 0, its 2nd token in step 1; turn 1 in
    #   step 2, ends at 3.
    ("none", 5.0, 144), ("later", 4.0, 240), ("all", 3.0, 144 + 240)])
def test_a_cached_replay_is_a_cold_one_without_the_cached_prefill(cached, makespan, hits):
    trace = Trace((Trajectory("A", (Turn(150, 2), Turn(100, 1, 0.0))),))
    res = simulate(trace, unit_profile(), Layout(), EngineSpec("stock"), cached=cached)
    assert res.summary["makespan_s"] == makespan
    assert res.counters["cached_tokens"] == hits
    with pytest.raises(ValueError, match=r"cached='warm' is not one of none, all, later"):
        simulate(trace, unit_profile(), Layout(), EngineSpec("stock"), cached="warm")


def test_cadence_defers_prefill_to_aligned_steps_while_rows_decode():
    # vLLM's --prefill-schedule-interval at DP > 1: off-cadence steps defer every prefill while
    # the rank has a decode row and its last releasing step left nothing waiting.
    rank = RankState(0, rows=1, row_context=10)
    rank.waiting.append(Req("t", 0, 50, 4, 0.0, 0.0))
    eng = unit_profile().engine
    lane = unit_profile().lane
    off = plan_step(rank, 3, EngineSpec("cadence", cadence=4), eng, lane, dp=2)
    assert off.batch.chunks == () and rank.waiting
    on = plan_step(rank, 4, EngineSpec("cadence", cadence=4), eng, lane, dp=2)
    assert on.batch.chunks == ((50, 0),) and not rank.waiting
    # The same on one rank: vLLM's prefill balancing exists only in its DP engine core.
    rank1 = RankState(0, rows=1, row_context=10)
    rank1.waiting.append(Req("t", 0, 50, 4, 0.0, 0.0))
    assert plan_step(rank1, 3, EngineSpec("cadence", cadence=4), eng, lane, dp=1).batch.chunks


@pytest.mark.parametrize("name,preset_layers", [("profile_gpu.json", 24),
                                                 ("profile_gpu_mla.json", 24)])
def test_calibration_reads_the_measured_gpu_profiles(name, preset_layers):
    prof = load_profile(SCALE / name)
    c = prof.costs
    assert prof.shape.layers == preset_layers and prof.shape.hidden == 2048
    assert prof.capture == 512 and prof.engine["async_scheduling"] is True
    # A physically sensible H200: memory below its peak, compute below its bf16 peak.
    assert 2.0 < c.eff_tbps <= 1.05 * prof.hardware["hbm_tbps"]
    assert 100 < c.eff_tflops < prof.hardware["peak_tflops"]
    # The host floors measured beside the device: graphs off above 512 tokens cost ~50 ms.
    assert 0.02 < c.h_eager < 0.1 and 0.0 < c.h_piecewise < c.h_eager
    assert 0.0 < prof.lane["overlap"] < 1.0 and prof.lane["p_host_per_interval_s"] > 0
    raw = json.loads((SCALE / name).read_text())
    res = raw["fitted"]["residuals"]
    assert len(res) == len(prof.points) and (sum(r * r for r in res) / len(res)) ** 0.5 < 0.25


def test_calibration_reads_the_cpu_profile():
    prof = load_profile(SCALE / "profile_cpu_tiny.json")
    assert prof.capture == 0 and prof.lane["handoff"] is True
    assert prof.costs.t0 > 0 and len(prof.points) >= 10


def test_router_reproduces_the_measured_prefix_cache_hits_at_dp2():
    # The 2 x H200 DP=2+EP stock run: a continuation routed to the other rank misses its prefix
    # cache, so vLLM counted far fewer cached prompt tokens than at DP=1 (427,488 vs 651,856).
    from vllm_ainfer_pd.rollout.generator import generate

    report = json.loads((ROOT / "benchmarks/results/gpu/rollout_dp2_ep/bench2dp_a/report.json")
                        .read_text())
    measured = report["backends"]["stock"]["aggregate"]["vllm:prompt_tokens_cached_total"]
    prof = load_profile(SCALE / "profile_gpu.json")
    res = simulate(generate("gpu-quick", 0), prof, Layout(dp=2, ep=True), EngineSpec("stock"),
                   wait_scale=0.5)
    # Within 10% of stock's (normal's run counted 445,056: the balancer's choices vary by run).
    assert abs(res.counters["cached_tokens"] / measured["median"] - 1) < 0.10
    one = simulate(generate("gpu-quick", 0), prof, Layout(), EngineSpec("stock"), 0.5)
    assert one.counters["cached_tokens"] == 651856  # DP=1: every hit, exactly vLLM's count


def test_cli_simulate_and_project_run(tmp_path, capsys):
    main(["simulate", "--profile", str(SCALE / "profile_gpu.json"), "--preset", "cpu",
          "--engine", "pd", "--dp", "2", "--wait-scale", "0.1"])
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["completed"] == out["summary"]["requests"] == 48
    main(["run", "--presets", "gpu", "--dp", "1,2", "--trace-preset", "cpu",
          "--no-paper", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "projected" in text and (tmp_path / "projection.json").is_file()
    rows = json.loads((tmp_path / "projection.json").read_text())["rows"]
    assert [r["dp"] for r in rows] == [1, 2] and all(r["label"] == "projected" for r in rows)
    main(["prefill-bounds", "--out", str(tmp_path)])
    assert "projected" in capsys.readouterr().out
    bounds = json.loads((tmp_path / "prefill_bounds.json").read_text())["rows"]
    for r in bounds:  # caching more prefill never lengthens stock's rollout
        assert r["label"] == "projected"
        assert r["stock_cached"]["max"] <= r["stock_later_cached"]["min"] <= 1.0


def test_cli_bad_profile_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--profile", str(bad), "--preset", "cpu"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_every_run_listed_for_validation_has_its_report_and_profile():
    runs = load_runs(SCALE / "runs.json")
    assert len(runs.runs) > 40 and runs.excluded
    for run in runs.runs:
        report = json.loads((ROOT / "benchmarks" / "results" / run.call / "report.json")
                            .read_text())
        assert run.backend in report["backends"], (run.call, run.backend)
    for name in runs.profiles.values():
        assert (SCALE / name).is_file(), name


def test_the_models_epoch_gate_is_the_products_rule():
    """The model opens P epochs with the product's EpochGate and defaults (on at DP > 1): fewer,
    fuller epochs at DP=2 than with the gate off, and at DP=1, where the product does not use
    the gate, nothing changes."""
    from benchmarks.scale.project import replicate
    from vllm_ainfer_pd.rollout.generator import generate

    prof = load_profile(SCALE / "profile_gpu.json")
    no_gate = (("epoch_gate_fill", 0.0),)
    work = replicate(generate("gpu-quick", 0), 2)
    off = simulate(work, prof, Layout(dp=2, ep=True), EngineSpec("pd", lane=no_gate), 0.1).counters
    on = simulate(work, prof, Layout(dp=2, ep=True), EngineSpec("pd"), 0.1).counters
    assert off["gate_waits"] == 0 < on["gate_waits"]
    assert on["epochs"] < off["epochs"]
    assert (on["lane_tokens"] / on["epoch_rank_tokens"]
            > off["lane_tokens"] / off["epoch_rank_tokens"])
    one = generate("gpu-quick", 0)
    assert (simulate(one, prof, Layout(), EngineSpec("pd", lane=no_gate), 0.1).counters
            == simulate(one, prof, Layout(), EngineSpec("pd"), 0.1).counters)


def test_the_models_lane_threshold_is_the_products_by_layout():
    """Unset, the lane's threshold is the product's for the layout: 512 uncached tokens at DP=1,
    every prompt at DP > 1; a threshold set in the engine's lane wins."""
    from benchmarks.scale.sim import Simulator
    from vllm_ainfer_pd.rollout.generator import generate

    prof = load_profile(SCALE / "profile_gpu.json")
    trace = generate("gpu-quick", 0)
    assert prof.lane["p_lane_min_tokens"] is None
    for layout, spec, expected in ((Layout(), EngineSpec("pd"), 512),
                                   (Layout(dp=2, ep=True), EngineSpec("pd"), 2),
                                   (Layout(dp=2, ep=True),
                                    EngineSpec("pd", lane=(("p_lane_min_tokens", 64),)), 64)):
        sim = Simulator(trace, prof, layout, spec, 0.1)
        assert sim.lane["p_lane_min_tokens"] == expected, (layout, spec)
