"""Metric arithmetic on hand-made records, the report built from them, and /metrics parsing."""

from __future__ import annotations

import json
import math

import pytest

from vllm_ainfer_pd.rollout import backend_metrics, report
from vllm_ainfer_pd.rollout.metrics import quantile, summarize, ttft_by_turn_kind
from vllm_ainfer_pd.rollout.replayer import RequestRecord


def rec(traj, turn, release, submit, first, end, n_out, error=None):
    return RequestRecord(traj, turn, release, n_out, 10, submit, first, end, n_out, error)


# Two trajectories: a (two turns, 1 s wait between) and b (one turn), then a failed one c.
RECORDS = [
    rec("a", 0, 0.0, 0.0, 0.5, 2.5, 5),   # completion 2.5, ttft 0.5, tpot 0.5
    rec("a", 1, 3.5, 3.6, 4.0, 6.0, 3),   # completion 2.4, ttft 0.4, tpot 1.0
    rec("b", 0, 0.0, 0.1, 0.3, 1.1, 1),   # completion 1.0, ttft 0.2, no tpot (one token)
    rec("c", 0, 0.0, 0.0, math.nan, math.nan, 4, error="HTTP 400: bad"),
]


def test_summary_follows_the_paper_definitions():
    s = summarize(RECORDS)
    assert (s["requests"], s["completed"], s["failed"], s["trajectories"]) == (4, 3, 1, 3)
    assert s["makespan_s"] == pytest.approx(6.0)  # first release 0 -> last final token 6.0
    assert s["requests_per_s"] == pytest.approx(3 / 6.0)
    assert s["request_completion_s"]["p50"] == pytest.approx(2.4)
    assert s["request_completion_s"]["mean"] == pytest.approx((2.5 + 2.4 + 1.0) / 3)
    # Trajectory completion includes the client wait; c failed and is left out.
    assert s["trajectory_completion_s"]["p50"] == pytest.approx((6.0 + 1.1) / 2)
    assert s["trajectory_completion_s"]["p99"] == pytest.approx(1.1 + 0.99 * (6.0 - 1.1))
    assert s["ttft_s"]["p50"] == pytest.approx(0.4)
    assert s["tpot_s"]["mean"] == pytest.approx(0.75)
    assert (s["input_tokens"], s["output_tokens"]) == (30, 9)


def test_ttft_is_split_by_the_new_tokens_a_turn_brings():
    def turn(traj, n, prompt, out, ttft, end):
        return RequestRecord(traj, n, 0.0, out, prompt, 1.0, 1.0 + ttft, end, out)

    records = [
        turn("a", 0, 100, 10, 0.5, 3.0),
        turn("a", 1, 110 + 600, 5, 0.3, 9.0),  # 600 new tokens: lane-sized at 512
        turn("a", 2, 715 + 511, 5, 0.1, 8.0),  # 511 new tokens: inline-sized
        turn("b", 0, 50, 5, 0.7, 2.0),
        RequestRecord("c", 0, 0.0, 4, 10, 0.0, math.nan, math.nan, 0, "HTTP 400: bad"),
    ]
    split = ttft_by_turn_kind(records, lane_min_tokens=512)
    by_kind = {k: (d["n"], d["p50"]) for k, d in split["ttft_s"].items()}
    assert by_kind["first turns"] == (2, pytest.approx(0.6))  # the failed c is left out
    assert by_kind["later, lane-sized"] == (1, pytest.approx(0.3))
    assert by_kind["later, inline-sized"] == (1, pytest.approx(0.1))
    assert split["last_trajectory"] == "a"
    # Where the last trajectory's time went, on RECORDS: a's TTFT 0.5 + 0.4, decode 2.0 + 2.0,
    # the client wait 3.6 - 2.5; its longest turn 5 tokens, 2.0 s from first to final token.
    assert ttft_by_turn_kind(RECORDS, lane_min_tokens=512)["last_chain"] == {
        "start_s": 0.0, "ttft_s": pytest.approx(0.9), "decode_s": pytest.approx(4.0),
        "wait_s": pytest.approx(1.1), "longest_tokens": 5, "longest_s_per_token": 0.5}
    # The burst: a's and b's first turns, 150 prompt tokens, submitted at 1.0, the last first
    # token (b's) at 1.7.
    assert split["burst"] == {"prompt_tokens": 150, "done_s": pytest.approx(0.7),
                              "tokens_per_s": pytest.approx(150 / 0.7)}
    assert ttft_by_turn_kind(records[4:], lane_min_tokens=512)["burst"] is None  # none ok
    with pytest.raises(ValueError, match="lane_min_tokens=0"):
        ttft_by_turn_kind(records, lane_min_tokens=0)


def test_ttft_cli_reads_records_files_and_names_a_bad_one(tmp_path, capsys):
    from vllm_ainfer_pd.rollout.__main__ import main

    good = tmp_path / "pd-0.jsonl"
    good.write_text("".join(json.dumps(vars(r)) + "\n" for r in RECORDS))
    main(["ttft", str(good)])
    out = capsys.readouterr().out
    assert "first turns: n=2 p50=0.350" in out and "later, lane-sized: n=0" in out
    assert "later, inline-sized: n=1 p50=0.400" in out
    assert "burst: 20 prompt tokens, last first token at 0.50 s (0.0k tokens/s)" in out
    assert ("ended last: a (from 0.00 s: TTFT 0.90 s, decode 4.00 s, waits 1.10 s; longest turn "
            "5 tokens at 500.00 ms per token)") in out
    # The records.tar.gz benchmarks/gpu_run.sh brings back: every .jsonl in it, by name.
    import tarfile

    packed = tmp_path / "records.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(good, arcname="records/pd-0.jsonl")
    main(["ttft", str(packed)])
    assert f"{packed}:records/pd-0.jsonl: first turns: n=2 p50=0.350" in capsys.readouterr().out
    bad = tmp_path / "report.json"
    bad.write_text('{"meta": {}}\n')
    with pytest.raises(SystemExit) as e:
        main(["ttft", str(bad)])
    assert e.value.code == 2 and f"{bad}: not a records file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["ttft", str(tmp_path / "missing.tar.gz")])
    assert e.value.code == 2 and "missing.tar.gz: cannot read records" in capsys.readouterr().err


def test_quantile_interpolates_like_numpy():
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([1, 2, 3, 4], 0.99) == pytest.approx(3.97)
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError, match="q=1.5"):
        quantile([1], 1.5)


PROM_BEFORE = """# TYPE vllm_ainfer_pd_d_wait_seconds histogram
vllm_ainfer_pd_d_wait_seconds_sum{rank="0"} 1.0
vllm_ainfer_pd_d_wait_seconds_sum{rank="1"} 1.0
vllm_ainfer_pd_d_wait_seconds_count{rank="0"} 4
vllm_ainfer_pd_d_wait_seconds_count{rank="1"} 4
vllm_ainfer_pd_d_wait_seconds_bucket{rank="0",le="0.1"} 4
vllm:num_preemptions_total{engine="0"} 2
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 10.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 7.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_cache_hit"} 1.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 9.0
"""
PROM_AFTER = PROM_BEFORE.replace("_sum{rank=\"0\"} 1.0", "_sum{rank=\"0\"} 3.0").replace(
    "_count{rank=\"0\"} 4", "_count{rank=\"0\"} 8").replace("} 10.0", "} 25.0").replace(
    'source="external_kv_transfer"} 9.0', 'source="external_kv_transfer"} 30.0')


def test_backend_counters_are_deltas_summed_over_ranks():
    d = backend_metrics.delta(backend_metrics.parse(PROM_BEFORE),
                              backend_metrics.parse(PROM_AFTER))
    assert d["vllm_ainfer_pd_d_wait_seconds_sum"] == pytest.approx(2.0)
    assert d["vllm_ainfer_pd_d_wait_seconds_count"] == pytest.approx(4)
    assert d["vllm_ainfer_pd_d_wait_seconds_mean"] == pytest.approx(0.5)
    assert d["vllm:num_preemptions_total"] == 0
    # the name `vllm serve` exports with speculative decoding (seen in parity_dp2_ep_ngram.json)
    assert d["vllm:spec_decode_num_accepted_tokens_total"] == pytest.approx(15.0)
    # per source (the lane's tokens are vLLM's `external_kv_transfer`), summed over engines
    assert d['vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'] == 21.0
    assert d['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 0
    before = backend_metrics.parse(PROM_BEFORE)
    assert before['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 8.0
    assert "vllm:kv_cache_usage_perc" not in d  # not one of the engine counters read
    assert not any(k.endswith("_bucket") for k in d)
    assert backend_metrics.delta(None, None) == {}


def test_lane_headline_ratios_are_derived_from_the_real_counter_names():
    before = ('vllm_ainfer_pd_d_wait_seconds_total{engine="0",rank="0"} 1.0\n'
              'vllm_ainfer_pd_rounds_total{engine="0",rank="0"} 10\n'
              'vllm_ainfer_pd_segments_total{engine="0",rank="0"} 10\n'
              'vllm_ainfer_pd_epochs_total{engine="0",rank="0"} 2\n')
    after = ('vllm_ainfer_pd_d_wait_seconds_total{engine="0",rank="0"} 1.5\n'
             'vllm_ainfer_pd_d_wait_seconds_total{engine="0",rank="1"} 0.5\n'
             'vllm_ainfer_pd_rounds_total{engine="0",rank="0"} 20\n'
             'vllm_ainfer_pd_rounds_total{engine="0",rank="1"} 10\n'
             'vllm_ainfer_pd_segments_total{engine="0",rank="0"} 25\n'
             'vllm_ainfer_pd_epochs_total{engine="0",rank="0"} 5\n'
             'vllm_ainfer_pd_p_tokens_total{engine="0",rank="0"} 3000\n')
    d = backend_metrics.delta(backend_metrics.parse(before), backend_metrics.parse(after))
    assert d["vllm_ainfer_pd_mean_d_wait_ms"] == pytest.approx(1e3 * 1.0 / 15)
    assert d["vllm_ainfer_pd_segments_per_epoch"] == pytest.approx(15 / 3)
    assert d["vllm_ainfer_pd_p_tokens_per_epoch"] == pytest.approx(3000 / 3)


def _run(backend, rep, makespan, counters):
    s = summarize(RECORDS)
    s["makespan_s"] = makespan
    return {"backend": backend, "rep": rep, "summary": s, "counters": counters,
            "request_completion_s": [2.5, 2.4, 1.0], "trajectory_completion_s": [6.0, 1.1]}


def test_report_has_medians_iqr_ratios_and_absent_counters(tmp_path):
    backends = {
        "stock": {"args": [], "error": None,
                  "runs": [_run("stock", i, m, {}) for i, m in enumerate([10, 12, 11])]},
        "ainfer_pd": {"args": ["--distributed-executor-backend", "ainfer_pd"], "error": None,
                      "runs": [_run("ainfer_pd", i, m, {}) for i, m in enumerate([8, 9, 10])]},
    }
    rep = report.build({"reps": 3}, backends)
    paths = report.write(rep, tmp_path)
    assert {p.name for p in paths} == {"report.json", "report.md", "ccdf.png", "makespan.png"}
    md = (tmp_path / "report.md").read_text()
    assert "| makespan (s) | 11.0 [10.5, 11.5] | 9.00 [8.50, 9.50] | 0.818 |" in md
    assert "n/a -- no server exported them" in md
    data = json.loads((tmp_path / "report.json").read_text())  # strict JSON: NaN became null
    assert data["backends"]["ainfer_pd"]["aggregate"]["makespan_s"]["median"] == 9.0
    assert all((tmp_path / n).stat().st_size > 10_000 for n in ("ccdf.png", "makespan.png"))


def test_report_shows_the_lanes_prompt_tokens_apart_from_prefix_cache_hits():
    """vLLM counts the lane's tokens as `external_kv_transfer` and within its cached tokens; the
    report gives them their own row and takes the hit rate from the prefix cache alone (the
    counts of the checked-in CPU rollout: both backends hit the prefix cache equally)."""
    src = 'vllm:prompt_tokens_by_source_total{source="%s"}'

    def counters(compute, hits, lane):
        return {"vllm:prompt_tokens_total": compute + hits + lane, src % "local_compute": compute,
                src % "local_cache_hit": hits, src % "external_kv_transfer": lane,
                "vllm:prompt_tokens_cached_total": hits + lane}

    backends = {
        "stock": {"args": [], "error": None,
                  "runs": [_run("stock", 0, 10, counters(9546, 11904, 0))]},
        "ainfer_pd": {"args": [], "error": None,
                      "runs": [_run("ainfer_pd", 0, 9, counters(7702, 11904, 1844))]},
    }
    md = report.markdown(report.build({}, backends))
    assert "| prefilled by the P lane | 0 | 1844 |" in md
    assert "| prefix-cache hits | 11904 | 11904 |" in md
    assert "| vLLM's `cached` (prefix-cache hits + P lane) | 11904 | 13748 |" in md
    assert "| prefix-cache hit rate (hits / prompt tokens) | 55.5% | 55.5% |" in md
    # a server without the per-source counter: no table, nothing estimated in its place
    for b in backends.values():
        b["runs"][0]["counters"] = {"vllm:prompt_tokens_total": 100.0}
    assert "prefilled by the P lane" not in report.markdown(report.build({}, backends))


def test_merge_joins_parts_run_on_different_devices(tmp_path):
    def part(name, makespans):
        runs = [_run(name, i, m, {}) for i, m in enumerate(makespans)]
        built = report.build({"reps": 3, "schedule": f"sequential ({name})"},
                             {name: {"args": [], "error": None, "runs": runs}})
        report.write(built, tmp_path / name)  # through JSON, as `merge` reads it
        return json.loads((tmp_path / name / "report.json").read_text())

    merged = report.merge([part("stock", [10, 12, 11]), part("ainfer_pd", [8, 9, 10])])
    assert list(merged["backends"]) == ["stock", "ainfer_pd"]
    assert merged["backends"]["ainfer_pd"]["aggregate"]["makespan_s"]["median"] == 9.0
    assert "part 1 (ainfer_pd): sequential (ainfer_pd)" in merged["meta"]["schedule"]
    assert "| makespan (s) | 11.0 [10.5, 11.5] | 9.00 [8.50, 9.50] | 0.818 |" in \
        report.markdown(merged)
    with pytest.raises(ValueError, match="'stock' appears in more than one report"):
        report.merge([part("stock", [1, 2, 3]), part("stock", [1, 2, 3])])


def test_by_rank_splits_lane_series_by_rank_and_sums_engines():
    text = ('vllm_ainfer_pd_segments_total{engine="0",rank="0"} 5.0\n'
            'vllm_ainfer_pd_segments_total{engine="1",rank="1"} 7.0\n'
            'vllm_ainfer_pd_segments_created{engine="1",rank="1"} 1.7e9\n'
            'vllm:prompt_tokens_total{engine="0"} 3\n')
    assert backend_metrics.by_rank(text) == {"0": {"vllm_ainfer_pd_segments_total": 5.0},
                                             "1": {"vllm_ainfer_pd_segments_total": 7.0}}
