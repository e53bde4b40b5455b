"""Greedy parity of `vllm serve` layouts on the CPU with the P lane on, against the matched
baseline.

    python benchmarks/serve_parity_cpu.py --tp 2 --dp 2 \
        --out benchmarks/results/cpu/parity_tp2_dp2_ep.json
    python benchmarks/serve_parity_cpu.py --tp 2 --dp 2 --hosts 2 \
        --out benchmarks/results/cpu/parity_tp2_dp2_ep_two_hosts.json

Serves the parity waves (tests/test_parity_offline.py) with `mode=pd` (lane on for prompts of >= 32
uncached tokens) and with `mode=normal` in the same layout (`--data-parallel-size N
--enable-expert-parallel` when DP > 1: stock vLLM cannot serve DP+EP on the CPU, so `normal` is the
baseline there), one server at a time; stock TP=1 offline is the teacher forcer for the tie rule.
Records per-rank lane counters from `/metrics` and checks that every rank ran the same segments.

`--hosts 2` serves `pd` as vLLM's multi-node DP launch on this machine: DP ranks 0 .. dp/2 - 1
behind the API server as "host a", a `--headless` launch of the others as "host b" (the host
identity overridden through VLLM_AINFER_PD_HOST_ID). With TP >= 2 each host holds several ranks,
so the lane takes `HierarchicalRendezvous` (shared memory within a host, gloo between the two);
the run checks it did, then replays a short rollout through the same server.

`--fail-at "<epoch>@<rank>:c<index>"` (or `:b<boundary>`) makes one world rank's P fail there
while its peers' P goes on (`ainfer_pd_testing.faults`): the run then also requires that the
failed epoch's jobs recomputed with the same tokens, and that every rank's log of the
collectives it issued is one sequence (`ainfer_pd_testing.collective_log`).

    python benchmarks/serve_parity_cpu.py --tp 2 --dp 2 --fail-at 0@1:c5 \
        --out benchmarks/results/cpu/parity_tp2_dp2_ep_one_rank_fails.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout, run as `python benchmarks/serve_parity_cpu.py` with or without the package installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve_waves(model: str, tp: int, dp: int, lane: dict, waves, max_tokens: int,
                speculative_config: dict | None = None, hosts: int = 1, fail_at: str = ""):
    from ainfer_pd_testing.metrics import settled_rank_metrics
    from ainfer_pd_testing.parity import ServerRunner, run_waves
    from vllm_ainfer_pd.rollout.backend_metrics import parse, read_metrics_text
    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
    from vllm_ainfer_pd.rollout.server import VllmServer

    args = serve_args(CPU_ENGINE_ARGS) + [
        "--distributed-executor-backend", "ainfer_pd", "--tensor-parallel-size", str(tp),
        "--additional-config", json.dumps({"ainfer_pd": lane})]
    if dp > 1:
        args += ["--data-parallel-size", str(dp), "--enable-expert-parallel"]
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(speculative_config)]
    extra: dict = {}
    faults_env: dict = {}
    if fail_at:
        from ainfer_pd_testing.dev_server import SERVER_ENV
        from ainfer_pd_testing.faults import WITH_LOG

        args += ["--worker-extension-cls", WITH_LOG]
        faults_env = SERVER_ENV
        log_prefix = tempfile.mkdtemp(prefix="collectives-") + "/rank"
    start = time.time()
    with TwoHosts(model, args, tp, dp) if hosts == 2 else _nothing() as host_b:
        env = {**(two_host_cpu_env(tp * dp // 2) if hosts == 2 else cpu_env(tp * dp)),
               **_step_limit(tp, dp), **faults_env}
        if host_b is not None:
            args = args + host_b.front_args
            env = {**env, HOST_ID_ENV: "host-a"}
        with VllmServer(model, args, env, name=f"parity-{lane['mode']}",
                        startup_timeout_s=_request_timeout_s(tp, dp)) as srv:
            up = time.time() - start
            if fail_at:
                extra = _inject(srv.url, fail_at, log_prefix)
            out = run_waves(ServerRunner(srv.url, model, timeout_s=_request_timeout_s(tp, dp)),
                            waves, max_tokens)
            if host_b is not None:
                extra = {"rendezvous": rendezvous_named(srv.log_text()),
                         "rollout": short_rollout(srv.url)}
            lanes = settled_rank_metrics(srv.url, model, dp)  # every rank's last epochs reported
            text = read_metrics_text(srv.url)
            if fail_at:
                extra["collective_logs"] = _compare_logs(log_prefix, tp, dp)
                extra["fault_logged"] = "injected fault" in srv.log_text()
    spec = {k: v for k, v in parse(text).items() if k.startswith("vllm:spec_decode")}
    return out, {"startup_s": round(up, 1), "lane_by_rank": lanes, **extra,
                 **({"spec_decode": spec} if speculative_config is not None else {})}


HOST_ID_ENV = "VLLM_AINFER_PD_HOST_ID"


def _inject(url: str, fail_at: str, log_prefix: str) -> dict:
    """Start every rank's collective log and arm the fault, before the first wave."""
    from ainfer_pd_testing.dev_server import collective_rpc
    from ainfer_pd_testing.faults import inject_over_http

    collective_rpc(url, "start_collective_log", prefix=log_prefix)
    return {"fail_at": fail_at, "armed_on": inject_over_http(url, fail_at=fail_at)}


def _compare_logs(log_prefix: str, tp: int, dp: int) -> dict:
    """Each rank's log of its collectives (phase, collective, group, in issue order; shapes differ
    between DP replicas): the TP ranks of a replica issue one sequence, and every rank issues one
    sequence on the groups that span replicas (EP, DP). A replica's TP collectives need not match
    another's: vLLM's dummy batch of an idle replica, for one, samples nothing."""
    from ainfer_pd_testing.collective_log import first_divergence, read_logs

    logs = [[" ".join(e.split()[:3]) for e in x] for x in read_logs(log_prefix, tp * dp)]
    replicas = [logs[r * tp:(r + 1) * tp] for r in range(dp)]
    spanning = [[e for e in x if e.split()[2].split(":")[0] != "tp"] for x in logs]
    in_replicas = [first_divergence(r) for r in replicas]
    across = first_divergence(spanning)
    # first_divergence lets a shorter log be a prefix of the others: the lengths must match too.
    same_lengths = all(len({len(x) for x in g}) == 1 for g in (*replicas, spanning))
    return {"entries": [len(x) for x in logs],
            "p_entries": [sum(e.startswith("P ") for e in x) for x in logs],
            "spanning_entries": [len(x) for x in spanning],
            "first_divergence_in_a_replica": in_replicas,
            "first_divergence_across_replicas": across,
            "one_sequence": same_lengths and across is None and not any(in_replicas)}


def _request_timeout_s(tp: int, dp: int) -> float:
    """How long the server's start or a request may take. With 4 ranks on 2 cores each step takes
    seconds: vLLM's CPU shared-memory all-gather of a TP group spins while it waits for its peer,
    and on these cores the spinning rank of one DP replica shares a core with the rank the other
    replica's spinner waits for (seen as 4 to over 10 minutes of start-up, and several minutes
    per wave, for the TP=2 x DP=2 two-host launch while its ranks were pinned)."""
    return 1800.0 if tp * dp >= 4 else 300.0


def _step_limit(tp: int, dp: int) -> dict[str, str]:
    """vLLM ends the engine when one `execute_model` call takes longer than
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (default 300 s); a step of 4 ranks on 2 cores took longer
    (the two-host launch's first step, RESULTS.md), so a step gets a request's limit."""
    return {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(int(_request_timeout_s(tp, dp)))}


def two_host_cpu_env(ranks: int) -> dict[str, str]:
    """The CPU settings of one of the two "hosts": its ranks unpinned, one OpenMP thread each.
    Pinned one core per rank (`cpu_env`, each host pinning its own ranks to cores 0 and 1), a TP
    rank spinning in vLLM's CPU shared-memory TP all-reduce took 84-89% of a core while the rank
    it waited for, pinned beside another spinner, got 9-10%, and a wave took minutes. Unpinned,
    the kernel moves a starved rank to the other core."""
    from vllm_ainfer_pd.rollout.cpu_engine import cpu_env

    return {**cpu_env(ranks), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def _nothing():
    yield None


class TwoHosts:
    """The second "host" of a multi-node DP launch on this machine: a `--headless` `vllm serve`
    with the upper half of the DP ranks, its host identity "host-b"; `front_args` are what the
    API server's launch adds (the lower half, the DP address and RPC port)."""

    def __init__(self, model: str, args: list[str], tp: int, dp: int) -> None:
        from vllm_ainfer_pd.rollout.server import free_port

        if dp < 2 or dp % 2:
            raise SystemExit(f"--hosts 2 needs an even --dp >= 2, got {dp}")
        self.model, self.tp, self.local = model, tp, dp // 2
        common = ["--data-parallel-size-local", str(self.local), "--data-parallel-address",
                  "127.0.0.1", "--data-parallel-rpc-port", str(free_port())]
        self.front_args = common
        self.args = args + common + ["--headless", "--data-parallel-start-rank", str(self.local)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="host-b-", suffix=".log",
                                               delete=False)

    def __enter__(self) -> TwoHosts:
        from vllm_ainfer_pd.rollout.server import vllm_command

        self.proc = subprocess.Popen(
            vllm_command() + ["serve", self.model, *self.args], stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **two_host_cpu_env(self.tp * self.local),
                 **_step_limit(self.tp, 2 * self.local), HOST_ID_ENV: "host-b"})
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if exc[0] is not None:
            self.log.seek(0)
            print(f"--- host b ---\n{self.log.read()[-3000:]}", file=sys.stderr)


def rendezvous_named(log: str) -> str:
    """The rendezvous the lane's workers behind the API server logged ("P lane: <kind> over
    <n> ranks")."""
    lines = [x for x in log.splitlines() if "P lane: " in x and " ranks" in x]
    return lines[-1].split("P lane: ", 1)[1].strip() if lines else "not logged"


def short_rollout(url: str) -> dict:
    """A three-trajectory rollout through `url`: every request must complete."""
    from vllm_ainfer_pd.rollout.replayer import ReplayConfig, replay
    from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn

    trace = Trace((Trajectory("a", (Turn(120, 6), Turn(40, 8, 0.1))),
                   Trajectory("b", (Turn(300, 12), Turn(60, 4, 0.0))),
                   Trajectory("c", (Turn(200, 9),), start_s=0.2)))
    result = replay(trace, ReplayConfig(url, wait_scale=1.0, timeout_s=1800.0, progress=False))
    return {"requests": trace.num_requests, "ok": sum(r.ok for r in result.records),
            "errors": [r.error for r in result.records if not r.ok]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--p-host", default="auto", help="the lane's p_host (docs/worker.md)")
    parser.add_argument("--segment-policy", default=None,
                        help="the lane's segment_policy (default: the backend's, docs/worker.md)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="JSON for both servers, e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 3}' (the teacher forcer has none)")
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                        help="2: serve pd as two \"hosts\" on this machine (module docstring)")
    parser.add_argument("--fail-at", default="",
                        help="one rank's P fails there, e.g. 0@1:c5 (module docstring)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from ainfer_pd_testing.parity import compare, offline_llm, parity_waves, run_waves
    from vllm_ainfer_pd.models import ensure_model
    from vllm_ainfer_pd.vllm_glue.shapes import installed_release

    model = str(ensure_model("tiny", 0))
    waves = parity_waves(vocab_size=512)
    prompts = [p for w in waves for p in w]
    result: dict = {"vllm": installed_release(),
                    "layout": {"tp": args.tp, "dp": args.dp, "expert_parallel": args.dp > 1},
                    "p_host": args.p_host, "segment_policy": args.segment_policy,
                    "speculative_config": args.speculative_config, "hosts": args.hosts,
                    "fail_at": args.fail_at}
    lane = {"p_lane_min_tokens": 32, "p_host": args.p_host}
    if args.segment_policy is not None:
        lane["segment_policy"] = args.segment_policy
    outs = {}
    for mode in ("pd", "normal"):
        print(f"[serve-parity] mode={mode} TP={args.tp} DP={args.dp}", file=sys.stderr, flush=True)
        outs[mode], result[mode] = serve_waves(model, args.tp, args.dp, {"mode": mode, **lane},
                                               waves, args.max_tokens, args.speculative_config,
                                               args.hosts if mode == "pd" else 1,
                                               args.fail_at if mode == "pd" else "")
    with offline_llm(model, 1) as stock:
        report = compare(prompts, outs["normal"], outs["pd"], stock.teacher_force)
        vs_stock = compare(prompts, run_waves(stock, waves, args.max_tokens), outs["pd"],
                           stock.teacher_force)
    result["pd_vs_normal"] = {"exact": report.exact, "tie": report.tie, "fail": report.fail}
    result["pd_vs_stock_tp1"] = {"exact": vs_stock.exact, "tie": vs_stock.tie,
                                 "fail": vs_stock.fail}
    lanes = result["pd"]["lane_by_rank"]
    segments = {r: v.get("vllm_ainfer_pd_segments_total", 0) for r, v in lanes.items()}
    result["segments_equal_on_all_ranks"] = len(set(segments.values())) == 1
    # Failed P jobs recompute inline with the right tokens: parity alone would not show a lane
    # whose every epoch fails.
    result["p_jobs_failed"] = sum(v.get("vllm_ainfer_pd_p_jobs_failed_total", 0)
                                  for v in lanes.values())
    # Without a fault no job may fail; with one, the failed rank's jobs (and its TP peers', which
    # share their KV) must have failed and recomputed, and every rank's collectives be one order.
    failed_ok = result["p_jobs_failed"] > 0 if args.fail_at else result["p_jobs_failed"] == 0
    if args.fail_at:
        logs = result["pd"]["collective_logs"]
        failed_ok = (failed_ok and result["pd"]["fault_logged"] and min(logs["p_entries"]) > 0
                     and logs["one_sequence"])
    result["ok"] = (report.fail == 0 and vs_stock.fail == 0 and failed_ok
                    and result["segments_equal_on_all_ranks"]
                    and len(lanes) == args.tp * args.dp and min(segments.values()) > 0)
    if args.hosts == 2:
        rollout = result["pd"]["rollout"]
        want = "HierarchicalRendezvous" if args.tp > 1 else "GlooRendezvous"
        result["ok"] = (result["ok"] and result["pd"]["rendezvous"].startswith(want)
                        and rollout["ok"] == rollout["requests"])
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
