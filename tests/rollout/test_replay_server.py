"""Replay against a real stock `vllm serve` of the tiny model (one server for the module)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_ainfer_pd.rollout import backend_metrics
from vllm_ainfer_pd.rollout.metrics import quantile, summarize
from vllm_ainfer_pd.rollout.replayer import (
    CLIENT_KEEPALIVE_S,
    ReplayConfig,
    ReplayError,
    replay,
)
from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn, dump_trace, increment_ids

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

WAIT_SCALE = 0.5
SMALL = Trace((
    Trajectory("a", (Turn(120, 6), Turn(30, 12, 0.4), Turn(8, 3, 0.2))),
    Trajectory("b", (Turn(300, 16), Turn(50, 4, 0.0))),
    Trajectory("c", (Turn(40, 1), Turn(200, 9, 0.6), Turn(10, 5, 0.1))),
    Trajectory("d", (Turn(64, 20),), start_s=0.3),
))


def test_a_server_whose_port_was_taken_before_it_bound_starts_on_another(tiny_server):
    """`VllmServer` picks a free port that the server binds only once its process runs; the
    fixture held that port meanwhile, so the first start exited with EADDRINUSE and the server
    answers on a new port."""
    assert tiny_server.port != tiny_server.taken_port
    assert f"--port {tiny_server.port}" in " ".join(tiny_server.command)
    assert "Address already in use" not in tiny_server.log_text()
    assert backend_metrics.scrape(tiny_server.url)


def test_replay_keeps_dependencies_sizes_and_model_outputs(tiny_server):
    before = backend_metrics.scrape(tiny_server.url)
    result = replay(SMALL, ReplayConfig(tiny_server.url, wait_scale=WAIT_SCALE, keep_ids=True,
                                        progress=False))
    counters = backend_metrics.delta(before, backend_metrics.scrape(tiny_server.url))
    recs = {(r.trajectory, r.turn): r for r in result.records}
    assert len(recs) == SMALL.num_requests and all(r.ok for r in recs.values()), \
        [r.error for r in recs.values()]
    for traj in SMALL.trajectories:
        assert recs[(traj.id, 0)].release_s == traj.start_s
        assert recs[(traj.id, 0)].submit_s >= traj.start_s - 1e-3
        for k, (turn, context) in enumerate(zip(traj.turns, traj.contexts(), strict=True)):
            r = recs[(traj.id, k)]
            # Exact sizes: the prompt is the trace's context, the output what was asked for.
            assert len(r.prompt_ids) == r.prompt_tokens == context
            assert len(r.output_ids) == r.output_tokens == turn.output_tokens
            assert r.submit_s <= r.first_token_s <= r.end_s
            if k == 0:
                continue
            prev = recs[(traj.id, k - 1)]
            # Turn k waits for turn k-1's final token plus its scaled client wait ...
            assert r.release_s == pytest.approx(prev.end_s + turn.wait_s * WAIT_SCALE)
            assert r.submit_s >= r.release_s - 1e-3
            # ... and extends the context with what the model actually generated.
            new = increment_ids(turn, f"0:{traj.id}:{k}", 3, 500)
            assert r.prompt_ids == prev.prompt_ids + prev.output_ids + new
    # The server counted the same tokens (it ran nothing else meanwhile).
    assert counters["vllm:prompt_tokens_total"] == sum(sum(t.contexts()) for t in
                                                       SMALL.trajectories)
    assert counters["vllm:generation_tokens_total"] == sum(
        turn.output_tokens for t in SMALL.trajectories for turn in t.turns)


def test_metric_arithmetic_matches_the_records(tiny_server):
    result = replay(SMALL, ReplayConfig(tiny_server.url, wait_scale=0.0, id_seed=1,
                                        progress=False))
    recs, s = result.records, summarize(result.records)
    assert s["completed"] == s["requests"] == 9 and s["failed"] == 0
    assert s["makespan_s"] == pytest.approx(max(r.end_s for r in recs))  # first release at 0
    assert s["requests_per_s"] == pytest.approx(9 / s["makespan_s"])
    assert s["request_completion_s"]["p99"] == pytest.approx(
        quantile([r.end_s - r.submit_s for r in recs], 0.99))
    assert s["ttft_s"]["p50"] == pytest.approx(
        quantile([r.first_token_s - r.submit_s for r in recs], 0.5))
    # A trajectory completes from its own start (d starts at 0.3 s), not from the replay's. (This
    # compared d's time with the p99, which failed whenever d happened to finish last.)
    completion = [max(r.end_s for r in recs if r.trajectory == t.id) - t.start_s
                  for t in SMALL.trajectories]
    assert SMALL.trajectories[3].start_s == 0.3 and min(completion) >= 0
    assert s["trajectory_completion_s"]["p50"] == pytest.approx(quantile(completion, 0.5))
    assert s["trajectory_completion_s"]["p99"] == pytest.approx(quantile(completion, 0.99))
    assert s["output_tokens"] == sum(r.requested_tokens for r in recs)
    assert s["tpot_s"]["p50"] > 0


def test_server_error_is_recorded_and_the_rest_of_the_run_completes(tiny_server):
    bad = Turn(1, 4, 0.0, input_ids=(100_000,))  # out of the tiny vocabulary (512)
    trace = Trace((Trajectory("ok", (Turn(50, 4), Turn(5, 4, 0.1))),
                   Trajectory("bad", (Turn(50, 4), Turn(1, 4, 0.1, (100_000,)), Turn(5, 2, 0.1))),
                   Trajectory("bad0", (bad,))))
    recs = {(r.trajectory, r.turn): r for r in
            replay(trace, ReplayConfig(tiny_server.url, progress=False)).records}
    assert recs[("ok", 0)].ok and recs[("ok", 1)].ok and recs[("bad", 0)].ok
    assert recs[("bad", 1)].error == "server error 400: Token id 100000 is out of vocabulary"
    assert recs[("bad", 2)].error == "skipped: turn 1 of trajectory 'bad' failed"
    assert recs[("bad0", 0)].error == recs[("bad", 1)].error
    s = summarize(list(recs.values()))
    assert (s["completed"], s["failed"], s["trajectory_completion_s"]["p50"] > 0) == (3, 3, True)


def test_http_error_status_is_recorded_with_the_servers_message(tiny_server):
    trace = Trace((Trajectory("x", (Turn(10, 2), Turn(1, 2, 0.0))),))
    recs = replay(trace, ReplayConfig(tiny_server.url, model="no-such-model",
                                      progress=False)).records
    assert recs[0].error.startswith("HTTP 404: ") and "no-such-model" in recs[0].error
    assert recs[1].error.startswith("skipped")


def test_request_past_its_timeout_is_recorded_as_timed_out(tiny_server):
    trace = Trace((Trajectory("slow", (Turn(100, 400), Turn(5, 4, 0.0))),))
    recs = replay(trace, ReplayConfig(tiny_server.url, timeout_s=0.5, progress=False)).records
    assert recs[0].error == "timed out after 0.5 s"
    assert recs[1].error.startswith("skipped")


def test_trace_longer_than_the_server_context_is_refused_before_sending(tiny_server):
    trace = Trace((Trajectory("huge", (Turn(2000, 10), Turn(100, 10, 0.0))),))
    with pytest.raises(ReplayError, match="'huge' needs 2120 tokens.*max_model_len=2048"):
        replay(trace, ReplayConfig(tiny_server.url, progress=False))


def test_cli_replay_prints_the_summary(tiny_server, tmp_path):
    dump_trace(SMALL, tmp_path / "small.jsonl")
    out = subprocess.run([sys.executable, "-m", "vllm_ainfer_pd.rollout", "replay", "--url",
                          tiny_server.url, "--trace", str(tmp_path / "small.jsonl"),
                          "--wait-scale", "0", "--no-progress", "--json-out",
                          str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"completed": 9' in out.stdout
    assert "vllm_ainfer_pd_* counters: n/a" in out.stdout  # stock exports none
    assert len(json.loads((tmp_path / "r.json").read_text())["records"]) == 9
    # vLLM's counters are the replay's own: the request that settles the lane's counters
    # afterwards (a one-token prompt per DP rank) is not in them.
    printed, _ = json.JSONDecoder().raw_decode(out.stdout)
    prompts = sum(sum(t.contexts()) for t in SMALL.trajectories)
    assert printed["counters"]["vllm:prompt_tokens_total"] == prompts, printed["counters"]


def test_the_client_drops_idle_connections_before_vllm_serve_closes_them():
    """A pooled connection reused just as the server's keep-alive closes it fails the request with
    "Server disconnected"; the replayer's keep-alive must end first, with margin for scheduling."""
    import vllm.envs

    assert CLIENT_KEEPALIVE_S <= vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE / 2, (
        CLIENT_KEEPALIVE_S, vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)


def test_unreachable_server_is_one_clear_error(dead_url):
    with pytest.raises(ReplayError, match=f"cannot reach an OpenAI-compatible server at "
                                          f"{dead_url}"):
        replay(SMALL, ReplayConfig(dead_url, progress=False))
    out = subprocess.run([sys.executable, "-m", "vllm_ainfer_pd.rollout", "replay", "--url",
                          dead_url, "--preset", "cpu"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(f"error: cannot reach an OpenAI-compatible server at {dead_url}")
