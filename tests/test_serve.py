"""`vllm serve --distributed-executor-backend ainfer_pd` through real HTTP with the OpenAI client.

Stock's TP=1 server is shared by this module: it is the reference for the TP=1 server and for the
DP=2+EP server. Stock vLLM 0.26 cannot serve DP+EP on the CPU (its CPU communicator lacks
all_gatherv/reduce_scatterv and its CPU MoE ignores the expert map; our worker supplies both), so
DP2+EP is compared with stock TP=1 under the tie rule, as the parity harness allows across layouts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from ainfer_pd_testing.metrics import settled_rank_metrics
from ainfer_pd_testing.parity import ServerRunner, compare, parity_waves, run_waves
from vllm_ainfer_pd.rollout.backend_metrics import read_metrics_text, scrape
from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
from vllm_ainfer_pd.rollout.server import VllmServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

MAX_TOKENS = 24
WAVES = parity_waves(vocab_size=512)
PROMPTS = [p for wave in WAVES for p in wave]
EXTERNAL = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
CHAT = [{"role": "user", "content": "What does the scheduler commit first?"}]
# The P lane on for prompts with >= 32 uncached tokens (most prompts and turn increments here).
OURS = ["--distributed-executor-backend", "ainfer_pd",
        "--additional-config", json.dumps({"ainfer_pd": {"p_lane_min_tokens": 32}})]


def lane_metrics(url: str) -> dict[str, float]:
    """The server's `vllm_ainfer_pd_*` counters, summed over engines and ranks."""
    metrics = scrape(url)
    assert metrics is not None, "no /metrics"
    return {k: v for k, v in metrics.items() if k.startswith("vllm_ainfer_pd_")}


def assert_lane_ran_beside_d(metrics: dict[str, float]) -> None:
    """P jobs went through the background lane, with segments released right after D forwards."""
    assert metrics.get("vllm_ainfer_pd_p_jobs_done_total", 0) >= 8, metrics
    assert metrics.get("vllm_ainfer_pd_segments_after_d_total", 0) > 0, metrics
    assert metrics.get("vllm_ainfer_pd_p_jobs_failed_total", 0) == 0, metrics
    # P's thread spent part of its host time on a core, never more than all of it.
    enqueue = metrics.get("vllm_ainfer_pd_p_enqueue_seconds_total", 0)
    assert 0 < metrics.get("vllm_ainfer_pd_p_enqueue_cpu_seconds_total", 0) <= enqueue, metrics


@pytest.fixture
def server(request):
    """Start a server; stop it after the test and print its log if the test failed."""
    started = []

    def start(model, extra_args, ranks, name, env=None):
        srv = VllmServer(model, serve_args(CPU_ENGINE_ARGS) + extra_args,
                         {**cpu_env(ranks), **(env or {})}, name=name)
        started.append(srv)
        srv.start()
        return srv

    failed_before = request.session.testsfailed
    yield start
    for srv in started:
        srv.stop()
        if request.session.testsfailed > failed_before:
            print(f"--- log of {srv.log_path} ---\n{srv.log_tail(120)}")


@pytest.fixture(scope="module")
def stock(tiny_model):
    with VllmServer(tiny_model, serve_args(CPU_ENGINE_ARGS), cpu_env(1), name="stock-tp1") as srv:
        runner = ServerRunner(srv.url, tiny_model)
        try:
            yield runner, run_waves(runner, WAVES, MAX_TOKENS), _chat(runner)
        except BaseException:
            print(srv.log_tail(120))
            raise


def _chat(runner: ServerRunner):
    r = runner.client().chat.completions.create(model=runner.model, messages=CHAT, max_tokens=16,
                                              temperature=0.0, extra_body={"ignore_eos": True})
    return r.choices[0]


def _fresh_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts no earlier request cached, long enough for the lane (>= 32 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _seeded_samples(runner: ServerRunner, prompt: list[int]):
    """n=3 random samples with a request seed and the sampled tokens' logprobs (an RL rollout's
    request shape: the trainer reuses those logprobs); [(token ids, logprobs)] per sample."""
    r = runner.client().completions.create(
        model=runner.model, prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=7,
        logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    return [(list(c.token_ids), c.logprobs.token_logprobs)
            for c in sorted(r.choices, key=lambda c: c.index)]


REGEX = "[a-z]{3}-[0-9]{4}"


def _constrained(runner: ServerRunner, prompt: list[int]) -> str:
    r = runner.client().completions.create(
        model=runner.model, prompt=prompt, max_tokens=12, temperature=0.0,
        extra_body={"structured_outputs": {"regex": REGEX}})
    return r.choices[0].text


def _lane_total(url: str, model: str, counter: str = "p_jobs_done") -> float:
    return sum(r.get(f"vllm_ainfer_pd_{counter}_total", 0)
               for r in settled_rank_metrics(url, model, 1).values())


def test_serve_tp1_completions_and_chat_match_stock(stock, server, tiny_model):
    stock_runner, stock_out, stock_chat = stock
    srv = server(tiny_model, OURS, 1, "ours-tp1")
    ours = ServerRunner(srv.url, tiny_model)
    ours_out = run_waves(ours, WAVES, MAX_TOKENS)
    report = compare(PROMPTS, stock_out, ours_out, stock_runner.teacher_force)
    print(report)
    assert report.fail == 0, report

    chat = _chat(ours)
    assert chat.finish_reason == "length"
    assert chat.message.content == stock_chat.message.content
    assert "AInferPDScheduler" in srv.log_text()
    assert_lane_ran_beside_d(lane_metrics(srv.url))

    # Prompt logprobs need the logits of every prompt position, which the lane's P does not
    # compute: such prompts run inline (before, their garbage prompt logprobs crashed the
    # server's output processor), with stock's values.
    jobs_before = _lane_total(srv.url, tiny_model)
    scored = _fresh_prompts(1, (40, 90, 150))
    ours_scores, stock_scores = ours.teacher_force(scored), stock_runner.teacher_force(scored)
    assert [len(s) for s in ours_scores] == [len(p) for p in scored]
    for ours_seq, stock_seq in zip(ours_scores, stock_scores):
        assert ours_seq[0] is None and stock_seq[0] is None
        for mine, theirs in zip(ours_seq[1:], stock_seq[1:]):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine), (mine, theirs)
    assert _lane_total(srv.url, tiny_model) == jobs_before

    # Seeded random sampling with n > 1, and output constrained by a regex (the grammar applies
    # from the promoted request's first token), through the lane: the same outputs as stock.
    # The 300-token prompt's 3 samples share 2 full KV blocks (block size 128 on CPU): one sample
    # prefills 299 tokens in the lane, the others wait for those blocks and then prefill only
    # their last 43 tokens (before, each prefilled all 299); the 60-token prompt has no full
    # block to share (3 x 59).
    p_tokens_before = _lane_total(srv.url, tiny_model, "p_tokens")
    external_before = scrape(srv.url)[EXTERNAL]
    for prompt in _fresh_prompts(2, (60, 300)):
        mine, theirs = _seeded_samples(ours, prompt), _seeded_samples(stock_runner, prompt)
        assert [ids for ids, _ in mine] == [ids for ids, _ in theirs]
        for (_, my_logprobs), (_, their_logprobs) in zip(mine, theirs):
            assert len(my_logprobs) == 8
            assert all(abs(a - b) < 1e-4 for a, b in zip(my_logprobs, their_logprobs)), \
                (my_logprobs, their_logprobs)
    assert _lane_total(srv.url, tiny_model, "p_tokens") - p_tokens_before == 3 * 59 + 299 + 2 * 43
    # vLLM's own count of those prompt tokens: they came through the KV connector (the rollout
    # report shows this per source, beside the prefix cache's `local_cache_hit`).
    assert scrape(srv.url)[EXTERNAL] - external_before == 3 * 59 + 299 + 2 * 43
    assert _lane_total(srv.url, tiny_model) >= jobs_before + 2 * 3
    if os.environ.get("AINFER_PD_MRV2_CPU") == "1":
        # Model Runner V2's grammar-bitmask kernel does not run in Triton's interpreter, stock's
        # engine included ("mask has unsupported dtype"): no constrained output on the CPU there.
        return
    constrained = _fresh_prompts(3, (70, 110))
    ours_constrained = [_constrained(ours, p) for p in constrained]
    assert ours_constrained == [_constrained(stock_runner, p) for p in constrained]
    assert all(ours_constrained), ours_constrained
    assert _lane_total(srv.url, tiny_model) >= jobs_before + 2 * 3 + 2


def test_serve_dp2_expert_parallel_matches_stock_tp1_with_one_rank_idle(stock, server,
                                                                         tiny_model):
    """DP=2 + EP with every request routed to DP rank 0 (vLLM's `X-data-parallel-rank` header):
    rank 1 stays idle for the whole run and takes part in every round through vLLM's dummy
    batches, running a matched no-work epoch beside each of rank 0's. Rounds with no P on any
    rank cost no rendezvous: short prompts alone (all inline) leave the rendezvous untouched.
    EAGLE drafts inside each round (its forward runs vLLM's DP all-reduce and the MoE-free
    drafter's collectives on both ranks, the idle one's in its dummy batch); greedy outputs are
    stock's without a drafter, under the tie rule (the random EAGLE head's drafts are rejected)."""
    from vllm_ainfer_pd.models import ensure_model

    stock_runner, stock_out, _ = stock
    # P's host work beside D's step (`p_host="concurrent"`, the GPU default) across DP ranks.
    # The epoch gate off: on by default at DP > 1, it may hold every epoch of these few small
    # prompts until no row decodes, leaving no P beside D to check (its own tests are below).
    concurrent = ["--additional-config",
                  json.dumps({"ainfer_pd": {"p_lane_min_tokens": 32, "p_host": "concurrent",
                                            "epoch_gate_fill": 0.0}})]
    eagle = ["--speculative-config", json.dumps({
        "method": "eagle", "model": str(ensure_model("tiny", eagle=True)),
        "num_speculative_tokens": 3})]
    # A step budget below the queued P tokens (wave 0 queues ~700 lane tokens, prompts up to
    # 230): prompts split over epochs, and a rank must announce the tokens its next epoch takes,
    # not all it has queued (on 2 x H200 the difference failed P's DP metadata and then hung the
    # rank whose P did run).
    srv = server(tiny_model, OURS[:2] + concurrent + ["--data-parallel-size", "2",
                                                      "--enable-expert-parallel",
                                                      "--max-num-batched-tokens", "128"] + eagle,
                 2, "ours-dp2-ep")
    short = [p for p in PROMPTS if len(p) < 32]
    ServerRunner(srv.url, tiny_model).generate(short, MAX_TOKENS)  # both ranks, no P
    free = settled_rank_metrics(srv.url, tiny_model, 2)
    # Both ranks reported (each reports its in-flight gauge at its first step), with no phase.
    assert len(free) == 2 and all(r.get("vllm_ainfer_pd_rendezvous_phases_total", 0) == 0
                                  and r.get("vllm_ainfer_pd_epochs_total", 0) == 0
                                  for r in free.values()), free

    ours = ServerRunner(srv.url, tiny_model, headers={"X-data-parallel-rank": "0"})
    ours_out = run_waves(ours, WAVES, MAX_TOKENS)
    report = compare(PROMPTS, stock_out, ours_out, stock_runner.teacher_force)
    print(report)
    assert report.fail == 0, report
    log = srv.log_text()
    assert "EngineCore_DP1" in log and "Worker_DP1_EP1" in log
    ranks = list(settled_rank_metrics(srv.url, tiny_model, 2).values())
    assert_lane_ran_beside_d(lane_metrics(srv.url))
    # Rank 0 prefilled every lane prompt; idle rank 1 ran every epoch with it, matched.
    jobs = [r.get("vllm_ainfer_pd_p_jobs_done_total", 0) for r in ranks]
    epochs = [r.get("vllm_ainfer_pd_epochs_total", 0) for r in ranks]
    phases = [r.get("vllm_ainfer_pd_rendezvous_phases_total", 0) for r in ranks]
    assert len(ranks) == 2 and jobs[0] >= 8 and jobs[1] == 0, ranks
    assert epochs[0] == epochs[1] > 0 and phases[0] == phases[1] > 0, ranks
    drafted = sum(float(line.rsplit(" ", 1)[1])
                  for line in read_metrics_text(srv.url).splitlines()
                  if line.startswith("vllm:spec_decode_num_draft_tokens_total"))
    assert drafted > 0, "no EAGLE draft"

    # Stopped as a process manager stops it (SIGTERM to `vllm serve` alone) while P epochs are
    # open: every process of the server ends, none is left waiting in a rendezvous.
    _stop_with_p_in_flight(srv, tiny_model)


def _stop_with_p_in_flight(srv: VllmServer, model: str, timeout_s: float = 120.0) -> None:
    """Keep the lane busy (8 senders, each sending fresh 1,500-token prompts one after another
    until the server goes away), wait until /metrics shows a P job in flight, then SIGTERM.
    One burst of prompts is not enough: on a loaded machine its P can finish between two scrapes
    and the gauge never reads above 0."""
    client = ServerRunner(srv.url, model).client()
    stopping = threading.Event()

    def keep_sending(seed: int) -> None:
        rng = random.Random(seed)
        while not stopping.is_set():
            prompt = [rng.randrange(3, 500) for _ in range(1500)]
            try:
                client.completions.create(model=model, prompt=prompt, max_tokens=32)
            except Exception:  # the server going away mid-request is the point
                return

    for seed in range(8):
        threading.Thread(target=keep_sending, args=(1000 + seed,), daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        while lane_metrics(srv.url).get("vllm_ainfer_pd_p_jobs_inflight", 0) == 0:
            assert time.monotonic() < deadline, "no P job in flight"
            time.sleep(0.5)
        group = srv.proc.pid  # the server leads its own process group (setsid)
        os.kill(srv.proc.pid, signal.SIGTERM)
    finally:
        stopping.set()
    deadline = time.monotonic() + timeout_s
    assert srv.proc.wait(timeout_s) == 0, srv.log_tail(40)
    while True:  # its engine cores and workers
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"processes of the server alive {timeout_s:.0f} s " \
                                             f"after SIGTERM:\n{srv.log_tail(40)}"
        time.sleep(0.5)


def test_serve_dp2_epoch_gate_decides_every_round_alike_on_every_rank(stock, server, tiny_model,
                                                                     tmp_path):
    """DP=2 + EP with the epoch gate on and vLLM spreading the requests over both ranks: each
    rank records every gate decision it makes (the DP all-reduce rows it read, the rounds the
    oldest queued work waited, whether the round met to open an epoch). The two ranks' records
    are the same lines, so no rank decided a round alone; the gate held some rounds and opened
    others; greedy outputs equal stock's under the tie rule."""
    from ainfer_pd_testing.collective_log import first_divergence, read_logs
    from ainfer_pd_testing.dev_server import SERVER_ENV, collective_rpc

    stock_runner, stock_out, _ = stock
    gate = {"p_lane_min_tokens": 32, "epoch_gate_fill": 1.0, "epoch_gate_rounds": 8}
    srv = server(tiny_model, ["--distributed-executor-backend", "ainfer_pd",
                              "--additional-config", json.dumps({"ainfer_pd": gate}),
                              "--data-parallel-size", "2", "--enable-expert-parallel",
                              "--max-num-batched-tokens", "128",
                              "--worker-extension-cls", "ainfer_pd_testing.gate_log.GateLog"],
                 2, "ours-dp2-ep-gate", SERVER_ENV)
    prefix = str(tmp_path / "gate")
    collective_rpc(srv.url, "start_gate_log", prefix=prefix)  # idle: both start at one round

    ours_out = run_waves(ServerRunner(srv.url, tiny_model), WAVES, MAX_TOKENS)
    report = compare(PROMPTS, stock_out, ours_out, stock_runner.teacher_force)
    print(report)
    assert report.fail == 0, report
    ranks = list(settled_rank_metrics(srv.url, tiny_model, 2).values())
    jobs = [r.get("vllm_ainfer_pd_p_jobs_done_total", 0) for r in ranks]
    assert len(ranks) == 2 and all(j > 0 for j in jobs), ranks  # both ranks prefilled in P
    logs = read_logs(prefix, 2)
    print(f"gate decisions per rank: {[len(log) for log in logs]}; rank 0's first:", logs[0][:5])
    assert logs[0] == logs[1], first_divergence(logs) or [len(log) for log in logs]
    decisions = [line.rsplit("opens=", 1)[1] for line in logs[0]]
    assert "True" in decisions and "False" in decisions, logs[0]
    waits = [r.get("vllm_ainfer_pd_gate_waits_total", 0) for r in ranks]
    epochs = [r.get("vllm_ainfer_pd_epochs_total", 0) for r in ranks]
    assert waits[0] == waits[1] == decisions.count("False"), (waits, decisions.count("False"))
    assert epochs[0] == epochs[1] > 0, ranks


def test_serve_dp2_over_two_hosts_takes_the_cross_host_rendezvous(stock, server, tiny_model,
                                                                  tmp_path):
    """vLLM's multi-node DP launch on this machine, as two "hosts": `vllm serve` with DP rank 0 on
    host a and a `--headless` one with DP rank 1 on host b (the host identity overridden through
    VLLM_AINFER_PD_HOST_ID), the lane on. The rendezvous spans both hosts over gloo (shared memory
    would wait for a segment the other host never sees); greedy outputs equal stock's and a small
    rollout completes."""
    import subprocess

    from vllm_ainfer_pd.rollout.replayer import ReplayConfig, replay
    from vllm_ainfer_pd.rollout.server import free_port, vllm_command
    from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn

    stock_runner, stock_out, _ = stock
    lane = OURS + ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
                   "--data-parallel-address", "127.0.0.1",
                   "--data-parallel-rpc-port", str(free_port()), "--enable-expert-parallel"]
    headless_log = tmp_path / "host-b.log"
    with open(headless_log, "w") as log:
        headless = subprocess.Popen(
            vllm_command() + ["serve", tiny_model, "--headless", "--data-parallel-start-rank", "1",
                              *serve_args(CPU_ENGINE_ARGS), *lane],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **cpu_env(1), "VLLM_AINFER_PD_HOST_ID": "host-b"})
    try:
        srv = server(tiny_model, lane, 1, "ours-dp2-two-hosts",
                     env={"VLLM_AINFER_PD_HOST_ID": "host-a"})
        ours_out = run_waves(ServerRunner(srv.url, tiny_model), WAVES, MAX_TOKENS)
        report = compare(PROMPTS, stock_out, ours_out, stock_runner.teacher_force)
        print(report)
        assert report.fail == 0, report
        trace = Trace((Trajectory("a", (Turn(120, 6), Turn(40, 8, 0.1))),
                       Trajectory("b", (Turn(300, 12), Turn(60, 4, 0.0))),
                       Trajectory("c", (Turn(200, 9),), start_s=0.2)))
        result = replay(trace, ReplayConfig(srv.url, wait_scale=1.0, progress=False))
        assert len(result.records) == trace.num_requests
        assert all(r.ok for r in result.records), [r.error for r in result.records]
        assert "P lane: GlooRendezvous over 2 ranks" in srv.log_text()
        ranks = list(settled_rank_metrics(srv.url, tiny_model, 2).values())
        epochs = [r.get("vllm_ainfer_pd_epochs_total", 0) for r in ranks]
        assert len(ranks) == 2 and epochs[0] == epochs[1] > 0, ranks
    finally:
        os.killpg(headless.pid, signal.SIGTERM)
        try:
            headless.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(headless.pid, signal.SIGKILL)
        print(f"--- host b ---\n{headless_log.read_text(errors='replace')[-3000:]}")
