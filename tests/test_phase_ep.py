"""Phase-owned expert-parallel state in a served DP=2 + EP engine on the CPU (docs/deepep.md).

With the lane on at DP > 1 with expert parallelism, each worker builds P's own EP and DP
communicators (vLLM's stateless `allgather_reducescatter` backend); P's MoE dispatch and combine
run on them, on P's stream, not routed onto D's. One `pd` server (P's host work beside D's step,
`p_host="concurrent"`, so P's collectives run while D's do) is compared under the tie rule with
a `mode=normal` server in the same layout and with stock vLLM TP=1 (stock cannot serve DP + EP on
the CPU), and shared by the four tests, in order:

1. parity; per rank, every P collective took P's own path (`p_collectives_own`, none routed);
   per-rank logs of every collective (thread, collective, group) show P's dispatch and combine on
   P's groups (`ep:1`, `dp:1`) and D's on vLLM's (`ep:0`, `dp:0`);
2. a P epoch that fails on every rank after layer 0's dispatch and combine ran on P's groups:
   both ranks rebuild P's groups once (`ep:2`) before the next epoch, and the next epochs' tokens
   are right;
3. an abort storm (clients give up on lane prompts mid-P): nothing left in flight, no KV block
   held, and later prompts still right;
4. P failing on one rank alone while the other's goes on (as an out-of-memory at one rank's own
   batch shape would): the failed rank matches its peer's collectives on no-work tokens, both
   ranks' logs of every collective since the server started are one sequence, the next epochs
   are right and no KV block stays held.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from ainfer_pd_testing import faults
from ainfer_pd_testing.collective_log import first_divergence, read_logs
from ainfer_pd_testing.dev_server import SERVER_ENV, collective_rpc
from ainfer_pd_testing.metrics import kv_usage, settled_rank_metrics
from ainfer_pd_testing.parity import (
    ServerRunner,
    compare,
    offline_llm,
    parity_waves,
    run_waves,
)
from vllm_ainfer_pd.rollout.backend_metrics import read_metrics_text
from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
from vllm_ainfer_pd.rollout.server import VllmServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

MAX_TOKENS = 16
WAVES = parity_waves(vocab_size=512)[:2]
LAYOUT = ["--data-parallel-size", "2", "--enable-expert-parallel"]
LANE = {"p_lane_min_tokens": 32, "p_host": "concurrent"}


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


AFTER_FAILURE = [_prompts(11, (90, 140, 60, 200))]
AFTER_STORM = [_prompts(12, (120, 70, 180))]
STORM = _prompts(13, (900, 600) * 6)
# Prompts no earlier request cached, one set per step of the one-rank failures.
ONE_RANK = {f"one_rank_{k}": parity_waves(vocab_size=512, seed=k + 1) for k in range(3)}


def _serve(model: str, lane: dict, name: str, extra: list[str] = (), env: dict | None = None):
    args = serve_args(CPU_ENGINE_ARGS) + LAYOUT + [
        "--distributed-executor-backend", "ainfer_pd",
        "--additional-config", json.dumps({"ainfer_pd": lane}), *extra]
    return VllmServer(model, args, {**cpu_env(2), **(env or {})}, name=name)


class _Stock:
    """Stock vLLM TP=1 in this process, started at the first comparison (one DP=2 server at a
    time fits this machine's memory): the second baseline's tokens, and the tie rule's teacher
    forcing (the parity harness allows a teacher of another layout)."""

    def __init__(self, model: str) -> None:
        self.model, self._runner, self._context = model, None, None

    def _started(self):
        if self._runner is None:
            self._context = offline_llm(self.model, 1)
            self._runner = self._context.__enter__()
        return self._runner

    def outputs(self, waves):
        return run_waves(self._started(), waves, MAX_TOKENS)

    def teacher_force(self, seqs):
        return self._started().teacher_force(seqs)

    def close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)


@pytest.fixture(scope="module")
def normal(tiny_model):
    """`mode=normal` in the same layout: the reference tokens (its server stopped after)."""
    with _serve(tiny_model, {"mode": "normal"}, "normal-dp2-ep") as srv:
        runner = ServerRunner(srv.url, tiny_model)
        outs = {name: run_waves(runner, waves, MAX_TOKENS) for name, waves in
                (("waves", WAVES), ("after_failure", AFTER_FAILURE), ("after_storm", AFTER_STORM),
                 *ONE_RANK.items())}
    stock = _Stock(tiny_model)
    yield stock, outs
    stock.close()


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    srv = _serve(tiny_model, LANE, "pd-dp2-ep-phase-owned",
                 ["--worker-extension-cls", faults.WITH_LOG], SERVER_ENV)
    prefix = str(tmp_path_factory.mktemp("collectives") / "log")
    try:
        srv.start()
        collective_rpc(srv.url, "start_collective_log", prefix=prefix)
        yield srv, prefix
    except BaseException:
        print(srv.log_tail(150))
        raise
    finally:
        srv.stop()


def _parity(normal, outs_key: str, ours: list[list[int]], waves) -> None:
    """`ours` against `normal`'s tokens and against stock's, each under the tie rule."""
    stock, outs = normal
    prompts = [p for w in waves for p in w]
    for name, theirs in (("normal", outs[outs_key]), ("stock TP=1", stock.outputs(waves))):
        report = compare(prompts, theirs, ours, stock.teacher_force)
        print(f"{outs_key} vs {name}: {report}")
        assert report.fail == 0, (name, report)


def _rank_metrics(srv: VllmServer, model: str) -> list[dict[str, float]]:
    """Each DP rank's lane counters, in rank order, once both have reported what they did."""
    return list(settled_rank_metrics(srv.url, model, 2).values())


def _engine_gauges(srv: VllmServer) -> dict[str, float]:
    """vLLM's running requests and KV-cache usage, summed over the DP engines."""
    out = {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}
    for line in read_metrics_text(srv.url).splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _count(ranks: list[dict[str, float]], counter: str) -> list[float]:
    return [r.get(f"vllm_ainfer_pd_{counter}_total", 0) for r in ranks]


# The EP group's dispatch (vLLM 0.26: `dispatch_router_logits`, then `combine`; 0.32: `dispatch`,
# its combine a DP reduce-scatter) and the DP collectives inside them.
MOE = ("dispatch_router_logits", "dispatch", "combine", "all_gatherv", "reduce_scatterv")


def _moe_groups(logs: list[list[str]], phase: str) -> set[str]:
    """The groups of a phase's MoE collectives (the EP call and the DP one inside it)."""
    return {line.split()[2] for log in logs for line in log
            if line.startswith(phase + " ") and line.split()[1] in MOE}


def test_p_moe_collectives_run_on_p_own_communicators_with_normal_s_tokens(normal, pd,
                                                                          tiny_model):
    srv, prefix = pd
    ours = run_waves(ServerRunner(srv.url, tiny_model), WAVES, MAX_TOKENS)
    _parity(normal, "waves", ours, WAVES)
    assert "phase-owned expert parallelism (allgather_reducescatter)" in srv.log_text()
    ranks = _rank_metrics(srv, tiny_model)
    own, routed = _count(ranks, "p_collectives_own"), _count(ranks, "p_collectives_routed")
    epochs = _count(ranks, "epochs")
    print(f"epochs {epochs}, P collectives own {own}, routed {routed}")
    assert len(ranks) == 2 and epochs[0] == epochs[1] > 0, ranks
    # Both ranks ran every epoch's MoE collectives on P's own groups; at TP=1 nothing is routed.
    assert own[0] == own[1] > 0 and routed == [0, 0], ranks
    logs = read_logs(prefix, 2)
    assert _moe_groups(logs, "P") == {"ep:1", "dp:1"}, _moe_groups(logs, "P")
    assert _moe_groups(logs, "D") == {"ep:0", "dp:0"}, _moe_groups(logs, "D")


def test_a_p_epoch_failing_after_its_moe_collectives_rebuilds_p_groups_on_both_ranks(
        normal, pd, tiny_model):
    srv, prefix = pd
    before = _rank_metrics(srv, tiny_model)
    next_epoch = int(_count(before, "epochs")[0])
    # Boundary 2 is layer 1's attention: layer 0's dispatch and combine ran on P's groups.
    assert faults.inject_over_http(srv.url, fail_at=f"{next_epoch}:b2") == [{"rank": 0}]
    ours = run_waves(ServerRunner(srv.url, tiny_model), AFTER_FAILURE, MAX_TOKENS)
    _parity(normal, "after_failure", ours, AFTER_FAILURE)
    log = srv.log_text()
    assert "fails on rank 0 at boundary 2" in log and "fails on rank 1 at boundary 2" in log, \
        log[-3000:]
    after = _rank_metrics(srv, tiny_model)
    assert _count(after, "phase_ep_rebuilds") == [1, 1], after
    epochs = _count(after, "epochs")
    assert epochs[0] == epochs[1] > next_epoch + 1, after  # epochs after the failed one
    assert sum(_count(after, "p_jobs_failed")) >= 1, after
    # The epochs after the rebuild ran their MoE collectives on the new groups.
    assert "ep:2" in _moe_groups(read_logs(prefix, 2), "P")


def test_an_abort_storm_leaves_nothing_in_flight_and_later_epochs_are_right(normal, pd,
                                                                            tiny_model):
    srv, _ = pd
    client = ServerRunner(srv.url, tiny_model).client()
    rng = random.Random(0)
    gave_up = []

    def send(prompt: list[int], patience_s: float) -> None:
        try:
            client.with_options(timeout=patience_s, max_retries=0).completions.create(
                model=tiny_model, prompt=prompt, max_tokens=8)
        except Exception:  # noqa: BLE001 - a client giving up mid-P is the point
            gave_up.append(prompt)

    # P sleeps 0.25 s at each boundary during the storm, so an epoch lasts a second or more on
    # any machine: a client that gives up 0.4-1.2 s after sending finds its prompt in P or
    # queued for it (on a fast machine an unslowed P finished before the clients gave up, and
    # the storm cancelled nothing). A few clients wait for their tokens.
    assert faults.inject_over_http(srv.url, slow_boundary_s=0.25) == [{"rank": 0}]
    threads = [threading.Thread(target=send, args=(p, rng.choice((0.4, 0.8, 1.2, 60.0))))
               for p in STORM]
    for t in threads:
        t.start()
        time.sleep(rng.uniform(0, 0.2))
    for t in threads:
        t.join(300)
    assert faults.inject_over_http(srv.url) == [{"rank": 0}]  # P at full speed again
    assert gave_up, "no client gave up: the storm aborted nothing"
    deadline = time.monotonic() + 120
    while True:
        ranks = _rank_metrics(srv, tiny_model)
        gauges = _engine_gauges(srv)
        # Nothing in flight in the lane, no request left, no KV block held (prefix-cached blocks
        # count as free).
        idle = (all(r.get("vllm_ainfer_pd_p_jobs_inflight", 0) == 0 for r in ranks)
                and not any(gauges.values()))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert idle, (ranks, gauges)
    print(f"storm: {len(gave_up)} of {len(STORM)} clients gave up; P jobs cancelled "
          f"{_count(ranks, 'p_jobs_cancelled')}, done {_count(ranks, 'p_jobs_done')} per rank")
    assert sum(_count(ranks, "p_jobs_cancelled")) > 0, ranks
    ours = run_waves(ServerRunner(srv.url, tiny_model), AFTER_STORM, MAX_TOKENS)
    _parity(normal, "after_storm", ours, AFTER_STORM)


def test_p_failing_on_one_rank_alone_is_matched_by_it_and_later_epochs_are_right(
        normal, pd, tiny_model):
    """Rank 1's P fails alone twice while rank 0's goes on. First while it prepares its batch:
    rank 0's P runs its MoE collectives anyway, and rank 1 must match them with no-work tokens
    (without that, rank 0 waits in them for ever and the engine ends at the rendezvous
    timeout). Then inside its forward, before its collective 3 (an MoE dispatch or combine at
    its own batch shape), with rank 0's P going on: rank 1 replays the rest on no-work tokens.
    Its replay stood in for collectives rank 0's experts computed with, so rank 0's jobs of that
    epoch fail too (kept, their KV would differ: seen as 2 of 16 prompts off stock's tokens).
    Each time the failed jobs recompute inline and the tokens are right; every failed epoch
    retires P's state, rebuilt by both ranks in the same round (docs/deepep.md, "Lifecycle")."""
    srv, prefix = pd
    ours = ServerRunner(srv.url, tiny_model)

    def wave_is_right(key: str) -> list[dict[str, float]]:
        _parity(normal, key, run_waves(ours, ONE_RANK[key], MAX_TOKENS), ONE_RANK[key])
        return _rank_metrics(srv, tiny_model)

    ranks = _rank_metrics(srv, tiny_model)
    rebuilds = _count(ranks, "phase_ep_rebuilds")
    assert rebuilds[0] == rebuilds[1], ranks
    n = int(_count(ranks, "epochs")[0])  # the next epoch, numbered by the epochs both opened
    assert faults.inject_over_http(srv.url, fail_epoch=f"{n}@1") == [{"rank": 0}]
    ranks = wave_is_right("one_rank_0")
    log = srv.log_text()
    assert f"P epoch {n} on rank 1 failed" in log and "fails on rank 1 while" in log, log[-4000:]
    assert f"P epoch {n} on rank 0 failed" not in log, log[-4000:]
    epochs = _count(ranks, "epochs")
    assert epochs[0] == epochs[1] > n + 1, ranks  # epochs after the failed one
    assert _count(ranks, "phase_ep_rebuilds") == [rebuilds[0] + 1] * 2, ranks

    m = int(epochs[0])
    assert faults.inject_over_http(srv.url, fail_at=f"{m}@1:c3") == [{"rank": 0}]
    ranks = wave_is_right("one_rank_1")
    log = srv.log_text()
    assert f"P epoch {m} on rank 1 failed" in log and "before its collective 3" in log, \
        log[-4000:]
    assert f"P epoch {m} on rank 0 failed: \"a peer's P failed" in log, log[-4000:]
    epochs = _count(ranks, "epochs")
    assert epochs[0] == epochs[1] > m + 1, ranks
    assert _count(ranks, "phase_ep_rebuilds") == [rebuilds[0] + 2] * 2, ranks
    assert all(r.get("vllm_ainfer_pd_p_jobs_inflight", 0) == 0 for r in ranks), ranks
    # Every collective both ranks issued since the server started, in one order (shapes aside:
    # the DP ranks' batches differ).
    logs = [[" ".join(e.split()[:3]) for e in rank] for rank in read_logs(prefix, 2)]
    assert any(e.startswith("P dispatch") for e in logs[0]), logs[0][:40]
    assert len(logs[0]) == len(logs[1]) and first_divergence(logs) is None, \
        first_divergence(logs)

    # A wave with no fault is right, and once it drained no KV block is held on either rank
    # (the failed jobs' blocks freed, none leaked).
    done = sum(_count(ranks, "p_jobs_done"))
    ranks = wave_is_right("one_rank_2")
    assert sum(_count(ranks, "p_jobs_done")) > done, ranks
    assert kv_usage(read_metrics_text(srv.url)) == {"0": 0.0, "1": 0.0}
