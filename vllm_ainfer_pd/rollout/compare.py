"""Comparison driver: the same trace against stock `vllm serve` and the ainfer_pd backend.

Every backend gets identical flags (engine arguments and layout) except its own: stock none,
`ainfer_pd` `--distributed-executor-backend ainfer_pd`, and each `--variant name=JSON` the
ainfer_pd backend plus `--additional-config JSON`. Each server starts once and answers one short
warm-up trajectory (first-request costs stay out of the numbers); then the trace is replayed
`reps` times per backend, interleaved across backends or one backend after another.

Repetition r draws its increment ids from seed r, identical across backends, so every backend does
the same work while no repetition can reuse another's prefix cache. A server that fails to start is
reported as failed and the comparison goes on with the others.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ainfer_pd.rollout import backend_metrics, report
from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
from vllm_ainfer_pd.rollout.metrics import summarize
from vllm_ainfer_pd.rollout.replayer import ReplayConfig, ReplayError, replay
from vllm_ainfer_pd.rollout.server import ServerError, VllmServer
from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn, dump_trace

AINFER = ["--distributed-executor-backend", "ainfer_pd"]
CACHED_SUFFIX = "_cached"  # the name suffix of a cached replay's pseudo-backend (CompareConfig)
WARMUP = Trace((Trajectory("warmup", (Turn(64, 8), Turn(16, 8, 0.0))),))


@dataclass(frozen=True)
class CompareConfig:
    """`model`: a model folder. `platform`: "cpu" adds CPU_ENGINE_ARGS and cpu_env(tp * dp) to
    every server; "gpu" adds `--seed 0` (and `--load-format dummy` for a config-only model).
    `extra_args`: more `vllm serve` flags for every backend. `variants`: (name, additional-config
    JSON) pairs run on the ainfer_pd backend. `schedule`: "interleaved" keeps every server up and
    alternates their order per repetition (CPU); "sequential" runs one server at a time (GPU,
    where one server holds the devices' memory). `extra_backends`: (name, flags) pairs, any server
    (e.g. stock on vLLM's multiprocess executor, to separate executor cost from scheduling).
    `cached_replay`: after each repetition, replay the same prompts again on the same server and
    report it as backend `<name>_cached`. Each prompt then finds its prefix in the cache (as far as
    greedy outputs repeat), so prefill costs next to nothing: its makespan bounds what any way of
    scheduling prefill beside the same decode could reach."""

    model: str
    out: Path
    platform: str = "cpu"
    reps: int = 3
    wait_scale: float = 1.0
    tp: int = 1
    dp: int = 1
    enable_expert_parallel: bool = False
    extra_args: tuple[str, ...] = ()
    schedule: str = "interleaved"
    variants: tuple[tuple[str, str], ...] = ()
    extra_backends: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Run just these backends, in this order (e.g. one GPU's share; see `merge`). The order is the
    # one a sequential schedule runs them in, so a second call can reverse it.
    only: tuple[str, ...] = ()
    concurrency: int = 256
    timeout_s: float = 600.0
    cached_replay: bool = False
    progress: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"platform={self.platform!r} must be 'cpu' or 'gpu'")
        if self.schedule not in ("interleaved", "sequential"):
            raise ValueError(f"schedule={self.schedule!r} must be 'interleaved' or 'sequential'")
        if self.reps < 1:
            raise ValueError(f"reps={self.reps} must be >= 1")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp={self.tp} and dp={self.dp} must be >= 1")
        names = ["stock", "ainfer_pd"] + [n for n, _ in self.variants + self.extra_backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique, got {names}")
        replays = {n + CACHED_SUFFIX for n in names}
        if self.cached_replay and (clash := sorted(set(names) & replays)):
            raise ValueError(f"cached_replay names its replays <backend>{CACHED_SUFFIX}; "
                             f"backend names {clash} clash with them")
        unknown = sorted(set(self.only) - set(names))
        if unknown:
            raise ValueError(f"only={list(self.only)}: no backend named {unknown}; "
                             f"backends: {names}")
        for name, raw in self.variants:
            try:
                json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"variant {name!r}: additional config {raw!r} is not JSON "
                                 f"({e.msg})") from None

    def backends(self) -> dict[str, list[str]]:
        out = {"stock": [], "ainfer_pd": list(AINFER)}
        for name, raw in self.variants:
            out[name] = [*AINFER, "--additional-config", raw]
        for name, flags in self.extra_backends:
            out[name] = list(flags)
        return {n: out[n] for n in self.only} if self.only else out

    def common_args(self) -> list[str]:
        args = ["--tensor-parallel-size", str(self.tp)] if self.tp > 1 else []
        args += ["--data-parallel-size", str(self.dp)] if self.dp > 1 else []
        if self.enable_expert_parallel:
            args.append("--enable-expert-parallel")
        if self.platform == "cpu":
            args = serve_args(CPU_ENGINE_ARGS) + args
        else:
            args = ["--seed", "0", *(["--load-format", "dummy"] if _config_only(self.model)
                                     else [])] + args
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        return cpu_env(self.tp * self.dp) if self.platform == "cpu" else {}


def _config_only(model: str) -> bool:
    """A generated model written without weights (models/generate.py, weights="dummy")."""
    info = Path(model) / "ainfer_pd_preset.json"
    return info.is_file() and json.loads(info.read_text())["preset"].get("weights") == "dummy"


def _log(msg: str) -> None:
    print(f"[rollout] {msg}", file=sys.stderr, flush=True)


class _Backend:
    """One backend's server and results: {"args", "runs", "error"} in `result`, and in `cached`
    the same for its cached replays (CompareConfig.cached_replay)."""

    def __init__(self, cfg: CompareConfig, name: str, args: list[str]):
        self.cfg, self.name = cfg, name
        self.result: dict[str, Any] = {"args": args, "runs": [], "error": None}
        self.cached: dict[str, Any] = {"args": [*args, "(each repetition's prompts again, cached)"],
                                       "runs": [], "error": None}
        self.server = VllmServer(cfg.model, cfg.common_args() + args, cfg.env(),
                                 name=f"rollout-{name}")

    @property
    def ok(self) -> bool:
        return self.result["error"] is None

    def start(self) -> None:
        """Start and warm up; a failure is recorded, not raised."""
        t = time.monotonic()
        try:
            self.server.start()
            _log(f"{self.name}: server up at {self.server.url} in {time.monotonic() - t:.0f} s")
            replay(WARMUP, ReplayConfig(self.server.url, id_seed=-1, progress=False))
            backend_metrics.settle(self.server.url, self.cfg.dp)
        except (ServerError, ReplayError, OSError) as e:
            self.result["error"] = str(e).splitlines()[0]
            _log(f"{self.name}: server failed to start: {self.result['error']} "
                 f"(log: {self.server.log_path})")

    def replay(self, trace: Trace, rep: int) -> None:
        """Repetition `rep`, then (with cached_replay) its prompts again on the warm cache."""
        self._replay(trace, rep, self.name, self.result)
        if self.cfg.cached_replay and self.ok:
            self._replay(trace, rep, self.name + CACHED_SUFFIX, self.cached)
            if self.cached["error"]:  # the server went away: no more repetitions either
                self.result["error"] = self.cached["error"]

    def _replay(self, trace: Trace, rep: int, name: str, result: dict[str, Any]) -> None:
        cfg = self.cfg
        try:
            before = backend_metrics.scrape(self.server.url)
            res = replay(trace, ReplayConfig(self.server.url, wait_scale=cfg.wait_scale,
                                             concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                                             id_seed=rep, progress=cfg.progress))
        except ReplayError as e:  # the server went away; its later repetitions are skipped
            result["error"] = str(e)
            _log(f"{name}: {e}")
            return
        try:
            after = backend_metrics.after_run(self.server.url, self.cfg.dp)
        except OSError as e:  # a settling request failed: the server went away
            result["error"] = f"reading the counters after repetition {rep}: {e}"
            _log(f"{name}: {result['error']}")
            return
        counters = backend_metrics.delta(before, after)
        summary = summarize(res.records)
        result["runs"].append(_run(name, rep, res.records, summary, counters))
        _write_records(cfg.out / "records" / f"{name}-{rep}.jsonl", res.records)
        _log(f"{name} rep {rep}: makespan {summary['makespan_s']:.2f} s, "
             f"{summary['completed']}/{summary['requests']} completed")

    def stop(self) -> None:
        self.server.stop()
        if self.server.log_path.exists():
            shutil.copy(self.server.log_path, self.cfg.out / f"server-{self.name}.log")


def _run_sequential(backends: list[_Backend], trace: Trace, reps: int) -> None:
    for b in backends:
        try:
            b.start()
            for rep in range(reps):
                if b.ok:
                    b.replay(trace, rep)
        finally:
            b.stop()


def _run_interleaved(backends: list[_Backend], trace: Trace, reps: int) -> None:
    """All servers up at once; repetition r runs the backends forward for even r, backward for
    odd r (A B, B A, A B, ...), so a drift in machine load hits every backend alike. An idle vLLM
    server takes no CPU, so the waiting servers do not perturb the measured one."""
    try:
        threads = [threading.Thread(target=b.start) for b in backends]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rep in range(reps):
            for b in backends if rep % 2 == 0 else backends[::-1]:
                if b.ok:
                    b.replay(trace, rep)
    finally:
        for b in backends:
            b.stop()


def _run(name: str, rep: int, records: list, summary: dict, counters: dict) -> dict[str, Any]:
    by_traj: dict[str, list] = {}
    for r in records:
        by_traj.setdefault(r.trajectory, []).append(r)
    traj = [max(r.end_s for r in rs) - min(r.release_s for r in rs)
            for rs in by_traj.values() if all(r.ok for r in rs)]
    return {"backend": name, "rep": rep, "summary": summary, "counters": counters,
            "errors": sorted({r.error for r in records if r.error})[:5],
            "request_completion_s": [r.end_s - r.submit_s for r in records if r.ok],
            "trajectory_completion_s": traj}


def _write_records(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(vars(r)) + "\n" for r in records))


def compare(cfg: CompareConfig, trace: Trace) -> tuple[dict[str, Any], list[Path]]:
    """Run every backend in turn; write and return the report and the paths written."""
    if cfg.platform == "cpu":  # fail before minutes of server start-up, not after
        trace.check_fits(CPU_ENGINE_ARGS["max_model_len"])
    cfg.out.mkdir(parents=True, exist_ok=True)
    dump_trace(trace, cfg.out / "trace.jsonl")
    runners = [_Backend(cfg, name, args) for name, args in cfg.backends().items()]
    interrupted = None
    try:
        if cfg.schedule == "interleaved":
            _run_interleaved(runners, trace, cfg.reps)
            order = "all servers up at once; backend order alternates between repetitions"
        else:
            _run_sequential(runners, trace, cfg.reps)
            order = "one server at a time, in this order: " + " -> ".join(b.name for b in runners)
    except KeyboardInterrupt as e:  # e.g. a wall-clock limit's SIGINT: report what finished
        interrupted = e
        order = "interrupted before the end; the runs that finished"
    backends = {b.name: b.result for b in runners}
    if cfg.cached_replay:
        backends |= {b.name + CACHED_SUFFIX: b.cached for b in runners}
    meta = {**cfg.meta, "model": cfg.model, "platform": cfg.platform, "reps": cfg.reps,
            "wait_scale": cfg.wait_scale,
            "layout": f"tp={cfg.tp} dp={cfg.dp} ep={'on' if cfg.enable_expert_parallel else 'off'}",
            "common_flags": " ".join(cfg.common_args()),
            "schedule": f"{cfg.schedule} ({order}; each server started once)",
            "trace": {"trajectories": len(trace.trajectories), "requests": trace.num_requests,
                      "input_tokens": sum(sum(t.contexts()) for t in trace.trajectories),
                      "output_tokens": sum(u.output_tokens for t in trace.trajectories
                                           for u in t.turns),
                      **{k: v for k, v in trace.meta.items() if isinstance(v, (str, int))}}}
    rep = report.build(meta, backends)
    paths = report.write(rep, cfg.out)
    if interrupted is not None:
        raise interrupted
    return rep, paths
