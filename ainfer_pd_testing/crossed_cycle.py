"""Crossed-cycle reproduction, model-free on CPU over gloo (paper, Figure 2 and RQ3).

Topology ATP2/ADP2 on 4 ranks: D issues a DP-attention collective on {0,2} or {1,3}; P issues a
full-TP all-reduce on {0,1,2,3}. The route registry confirms the pair is crossed.

Resource model. On CPU, gloo runs collectives of different groups concurrently, so a true hang
needs the GPU's constraint: each rank owns one *device queue*, a single thread that runs the
collectives submitted to it one at a time, in submission order, each occupying the queue until all
of its peers have joined (a kernel resident on the GPU, spinning for its peers, holding the SMs the
other kernel would need). Host threads only enqueue, like CUDA launches. If rank 0's queue runs D
on {0,2} first while rank 2's runs P first, each waits for the other: the cycle.

Per rank, the D thread (main) enqueues one D collective per round and a P thread enqueues one P
all-reduce per boundary, both with injected random skew. Modes:

- `naive`: each thread enqueues whenever it is ready (separate communicators, no order).
- `turnstile`: the same work ordered by `Turnstile` (wait for P's stop, pre_d, D, post_d, release
  K boundaries), so every rank's queue holds the same sequence.

A watchdog in the parent reads every rank's state from shared memory; when nothing progresses for
`--stall-s` it prints the wait graph (rank -> collective it is blocked in -> peers it waits for,
and the cycle), aborts the ranks and reports the hang. Ranks poll their pending gloo work, so
every process exits; the launcher kills any that do not.

    python -m ainfer_pd_testing.crossed_cycle --mode naive --seeds 10
    python -m ainfer_pd_testing.crossed_cycle --mode turnstile --seeds 10
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from ainfer_pd_testing.launch import RankGroup, context, init_gloo
from vllm_ainfer_pd.turnstile.controller import SegmentController, TaskState
from vllm_ainfer_pd.turnstile.policy import FixedSpan
from vllm_ainfer_pd.turnstile.route import StreamRoute

WORLD = 4
P_GROUP = (0, 1, 2, 3)
D_GROUPS = ((0, 2), (1, 3))
KINDS = ("D", "P")

# Per-rank fields of the shared state array the watchdog reads.
PROGRESS, BUSY, KIND, SEQ, SEED, STEPS = range(6)
FIELDS = 6


@dataclass(frozen=True)
class Config:
    rounds: int = 6  # D iterations per seed
    boundaries: int = 6  # P collectives (safe boundaries) per seed
    span: int = 1  # K, turnstile mode
    skew_ms: float = 4.0  # max random delay before each enqueue
    stall_s: float = 1.5  # no progress for this long = hang
    timeout_s: float = 20.0  # backstop for every wait inside a rank


def d_group_of(rank: int) -> tuple[int, ...]:
    return D_GROUPS[rank % 2]


class DeviceQueue:
    """One rank's device: runs submitted collectives one at a time, in submission order."""

    def __init__(self, rank: int, state: Any, abort: Any, groups: dict[str, Any]) -> None:
        self.rank = rank
        self._state, self._abort, self._groups = state, abort, groups
        self._q: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self.submitted: list[tuple[str, int]] = []
        self.failure: str | None = None
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"device{rank}", daemon=True)
        self._thread.start()

    def submit(self, kind: str, seq: int) -> None:
        """Enqueue without waiting (a kernel launch)."""
        with self._lock:
            self.submitted.append((kind, seq))
            self._pending += 1
        self._q.put((kind, seq))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted collective completed; False on abort, failure or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._pending == 0:
                    return True
            if self.failure or self._abort.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def _run(self) -> None:
        import torch
        import torch.distributed as dist

        base = self.rank * FIELDS
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, seq = item
            self._state[base + KIND] = KINDS.index(kind)
            self._state[base + SEQ] = seq
            self._state[base + BUSY] = 1
            work = dist.all_reduce(torch.ones(1), group=self._groups[kind], async_op=True)
            while not work.is_completed():  # resident: hold the device until the peers join
                if self._abort.is_set():
                    self.failure = "aborted by the watchdog"
                    return
                time.sleep(0.0005)
            try:
                work.wait()
            except RuntimeError as exc:
                self.failure = f"{kind} #{seq} failed: {exc}"
                return
            self._state[base + BUSY] = 0
            self._state[base + PROGRESS] += 1
            with self._lock:
                self._pending -= 1


def _rank_main(rank: int, world: int, port: int, mode: str, seeds: list[int], cfg: Config,
               state: Any, abort: Any) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from vllm_ainfer_pd.turnstile.rendezvous import GlooRendezvous
    from vllm_ainfer_pd.turnstile.turnstile import Turnstile

    init_gloo(rank, world, port, timeout_s=cfg.timeout_s)
    p_group = dist.new_group(list(P_GROUP))
    d_groups = {g: dist.new_group(list(g)) for g in D_GROUPS}  # every rank builds every group
    ctrl_group = dist.new_group(list(range(world)))
    device = DeviceQueue(rank, state, abort, {"P": p_group, "D": d_groups[d_group_of(rank)]})
    turnstile = None
    if mode == "turnstile":
        turnstile = Turnstile(SegmentController(rank, timeout_s=cfg.timeout_s),
                              GlooRendezvous(ctrl_group, timeout_s=cfg.timeout_s, name="cc"),
                              FixedSpan(cfg.span))
    results = []
    for seed in seeds:
        state[rank * FIELDS + SEED] = seed
        res = _run_seed(rank, seed, cfg, device, turnstile, state)
        results.append(res)
        if not res["ok"]:
            break  # the groups hold an abandoned collective: the parent relaunches
    return results


def _run_seed(rank: int, seed: int, cfg: Config, device: DeviceQueue, turnstile: Any,
              state: Any) -> dict[str, Any]:
    rng = random.Random(seed * 1000 + rank)
    p_rng = random.Random(seed * 1000 + 100 + rank)
    skew = cfg.skew_ms / 1000.0
    start = time.monotonic()
    first = len(device.submitted)
    steps = rank * FIELDS + STEPS
    p_error: list[BaseException] = []

    def p_thread() -> None:
        try:
            for i in range(cfg.boundaries):
                time.sleep(p_rng.uniform(0, skew))
                if turnstile is not None:
                    turnstile.controller.reach(seed, i)  # stop at the permit endpoint
                device.submit("P", i)
                state[steps] += 1
            if turnstile is not None:
                turnstile.controller.finish(seed)
        except BaseException as exc:  # reported with the seed's result
            p_error.append(exc)
            if turnstile is not None:
                turnstile.controller.fail(seed, exc)

    time.sleep(rng.uniform(0, 2 * skew))  # rank skew at the start of the seed
    if turnstile is not None:
        turnstile.open_epoch(seed)  # permit 0: round 0's D goes before P enters the device
    p = threading.Thread(target=p_thread, name=f"P{rank}", daemon=True)
    p.start()
    error = None
    try:
        rounds = _drive_d(rng, skew, cfg, device, turnstile, state, steps)
    except Exception as exc:  # a rendezvous or controller error: reported, not raised
        rounds, error = -1, f"{type(exc).__name__}: {exc}"
    p.join(cfg.timeout_s if error is None else 0.1)
    ok = error is None and not p_error and device.drain(cfg.timeout_s)
    if p_error and error is None:
        error = f"P thread: {p_error[0]!r}"
    return {"seed": seed, "ok": ok, "rounds": rounds, "error": error or device.failure,
            "order": device.submitted[first:], "elapsed_s": time.monotonic() - start}


def _drive_d(rng: random.Random, skew: float, cfg: Config, device: DeviceQueue,
             turnstile: Any, state: Any, steps: int) -> int:
    if turnstile is None:
        for j in range(cfg.rounds):
            time.sleep(rng.uniform(0, skew))
            device.submit("D", j)
            state[steps] += 1
        return cfg.rounds
    j, done = 0, False
    while j < cfg.rounds or not done:  # every rank ends in the same round: same permits
        time.sleep(rng.uniform(0, skew))
        record = turnstile.pre_d()
        done = record.state is TaskState.DONE
        time.sleep(rng.uniform(0, skew))
        if j < cfg.rounds:
            device.submit("D", j)
        turnstile.post_d()
        state[steps] += 1
        j += 1
    return j


# --- parent: watchdog and driver --------------------------------------------------------------


def wait_graph(state: Any, world: int = WORLD) -> tuple[list[str], list[int] | None]:
    """Describe who waits for whom from the ranks' shared state; return lines and a cycle."""
    now = [[state[r * FIELDS + f] for f in range(FIELDS)] for r in range(world)]

    def activity(r: int) -> str:
        if not now[r][BUSY]:
            return "no collective resident (host waiting)"
        kind = KINDS[int(now[r][KIND])]
        group = P_GROUP if kind == "P" else d_group_of(r)
        return f"{kind} all_reduce #{int(now[r][SEQ])} on {set(group)}"

    edges: dict[int, list[int]] = {}
    lines = []
    for r in range(world):
        if not now[r][BUSY]:
            lines.append(f"  rank {r}: {activity(r)}")
            continue
        kind = KINDS[int(now[r][KIND])]
        group = P_GROUP if kind == "P" else d_group_of(r)
        same = (1, now[r][KIND], now[r][SEQ])
        waits = [q for q in group if q != r and tuple(now[q][BUSY:SEQ + 1]) != same]
        edges[r] = waits
        peers = ", ".join(f"rank {q} ({activity(q)})" for q in waits) or "nobody"
        lines.append(f"  rank {r}: blocked in {activity(r)} -> waits for {peers}")
    return lines, _find_cycle(edges)


def _find_cycle(edges: dict[int, list[int]]) -> list[int] | None:
    for start in sorted(edges):
        path, node = [start], start
        seen = {start}
        while edges.get(node):
            node = edges[node][0]
            if node in seen:
                return [*path[path.index(node):], node]
            seen.add(node)
            path.append(node)
    return None


def run(mode: str, seeds: list[int], cfg: Config, *, log: Any = print) -> dict[str, Any]:
    """Run every seed in `mode`; relaunch the ranks after each diagnosed hang. Returns a summary
    with per-seed outcomes ("completed", "hang" with its wait graph, or "error")."""
    if mode not in ("naive", "turnstile"):
        raise ValueError(f"mode must be 'naive' or 'turnstile', got {mode!r}")
    crossed = StreamRoute().register("p_full_tp_all_reduce", P_GROUP, D_GROUPS)
    log(f"[crossed-cycle] mode={mode} seeds={len(seeds)} P {set(P_GROUP)} vs D "
        f"{[set(g) for g in D_GROUPS]}: crossed={crossed}; {asdict(cfg)}")
    outcomes: dict[int, dict[str, Any]] = {}
    pending = list(seeds)
    while pending:
        outcomes.update(_launch(mode, pending, cfg, log))
        pending = [s for s in pending if s not in outcomes]
    hung = [s for s in seeds if outcomes[s]["outcome"] == "hang"]
    completed = [s for s in seeds if outcomes[s]["outcome"] == "completed"]
    summary = {"mode": mode, "seeds": len(seeds), "completed": len(completed), "hung": len(hung),
               "errors": len(seeds) - len(completed) - len(hung), "config": asdict(cfg),
               "per_seed": [outcomes[s] for s in seeds]}
    log(f"[crossed-cycle] mode={mode}: {len(completed)}/{len(seeds)} seeds completed, "
        f"{len(hung)} hung (diagnosed by the watchdog), {summary['errors']} errors")
    return summary


def _launch(mode: str, seeds: list[int], cfg: Config, log: Any) -> dict[int, dict[str, Any]]:
    ctx = context()
    state = ctx.Array("d", WORLD * FIELDS, lock=False)
    abort = ctx.Event()
    out: dict[int, dict[str, Any]] = {}
    with RankGroup(_rank_main, WORLD, args=(mode, seeds, cfg, state, abort)) as ranks:
        last, last_change, hang = None, time.monotonic(), None
        while not ranks.poll(0.05):
            snap = (tuple(state[r * FIELDS + PROGRESS] for r in range(WORLD)),
                    tuple(state[r * FIELDS + STEPS] for r in range(WORLD)))
            if snap != last:
                last, last_change = snap, time.monotonic()
            elif time.monotonic() - last_change > cfg.stall_s and hang is None:
                seed = int(state[SEED])
                lines, cycle = wait_graph(state)
                hang = {"seed": seed, "outcome": "hang", "wait_graph": lines, "cycle": cycle}
                log(f"[crossed-cycle] seed {seed}: HANG - no progress for {cfg.stall_s:.2g} s. "
                    "Wait graph (rank -> collective it is blocked in -> peers it waits for):")
                for line in lines:
                    log(line)
                log(f"  cycle: {' -> '.join(map(str, cycle)) if cycle else 'none found'}")
                abort.set()  # ranks abandon their pending collectives and report
            if hang is not None and time.monotonic() - last_change > cfg.stall_s + 10:
                break  # the launcher kills whoever did not exit
        per_rank = ranks.results
        errors = ranks.errors
    for rank, tb in sorted(errors.items()):
        log(f"[crossed-cycle] rank {rank} raised:\n{tb}")
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for results in per_rank.values():
        for res in results:
            by_seed.setdefault(res["seed"], []).append(res)
    for seed in seeds:
        got = by_seed.get(seed, [])
        if hang is not None and seed == hang["seed"]:
            out[seed] = hang
            break
        if len(got) == WORLD and all(r["ok"] for r in got):
            orders = {tuple(map(tuple, r["order"])) for r in got}
            out[seed] = {"seed": seed, "outcome": "completed", "rounds": got[0]["rounds"],
                         "same_order_on_all_ranks": len(orders) == 1,
                         "elapsed_s": max(r["elapsed_s"] for r in got)}
            log(f"[crossed-cycle] seed {seed}: completed {got[0]['rounds']} rounds in "
                f"{out[seed]['elapsed_s']:.2f} s; same device order on all ranks: "
                f"{len(orders) == 1}")
            continue
        if got or errors:
            reasons = sorted({str(r["error"]) for r in got if not r["ok"]}) or ["rank crashed"]
            out[seed] = {"seed": seed, "outcome": "error", "errors": reasons}
            log(f"[crossed-cycle] seed {seed}: ERROR {reasons}")
        break
    if not out:  # nothing attributable (e.g. every rank died at start-up): do not loop forever
        out[seeds[0]] = {"seed": seeds[0], "outcome": "error", "errors": ["no rank reported"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("naive", "turnstile", "both"), default="both")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=Config.rounds)
    ap.add_argument("--boundaries", type=int, default=Config.boundaries)
    ap.add_argument("--span", type=int, default=Config.span)
    ap.add_argument("--skew-ms", type=float, default=Config.skew_ms)
    ap.add_argument("--stall-s", type=float, default=Config.stall_s)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    cfg = Config(args.rounds, args.boundaries, args.span, args.skew_ms, args.stall_s)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    modes = ("naive", "turnstile") if args.mode == "both" else (args.mode,)
    summaries = {m: run(m, seeds, cfg) for m in modes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    checks = []
    if "naive" in summaries:  # the reproduction must show the cycle
        checks.append(("naive hangs at least once", summaries["naive"]["hung"] > 0))
    if "turnstile" in summaries:
        checks.append(("turnstile completes every seed",
                       summaries["turnstile"]["completed"] == len(seeds)))
    ok = all(passed for _, passed in checks)
    print(f"[crossed-cycle] expectation {'met' if ok else 'NOT met'}: "
          + "; ".join(f"{what}: {'yes' if passed else 'NO'}" for what, passed in checks))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
