"""Model-free rank-skew stress of the turnstile (paper, RQ3).

N rank processes (4 by default; 8 works) run turnstile cycles with random delays of up to
`--max-skew-ms` injected before every P boundary, before every pre-D phase, before every D enqueue
and before every P release (post-D phase). The schedule of P epochs (`stress_plan`) is shared by
seed; some epochs leave ranks idle. After each seed the parent checks that

- every rank saw, at every pre-D phase, the (epoch, boundary, permit, state) the plan predicts, so
  all ranks saw the same epoch/boundary sequence;
- every rank enqueued D rounds and P segments in exactly the predicted order;
- no D enqueue overtook its round (happened before some rank reached that round's pre-D phase) or
  trailed it (happened after some rank left that round's post-D phase), and no P segment was
  enqueued on any rank before every rank had enqueued the D it follows.

P "device work" is emulated by a serial timeline per rank: each P op completes a random time after
its enqueue. The stress counts D acknowledgements (post-D phases) that returned while P work was
still incomplete, as the paper's delayed-P control does: the turnstile orders enqueue, it does not
fence completion (except in `global-complete` mode, where the count must be zero).

    python -m ainfer_pd_testing.stress --ranks 4 --cycles 2560 --max-skew-ms 20 --seeds 5
    python -m ainfer_pd_testing.stress --ranks 8 --cycles 10000 --max-skew-ms 50 \
        --skew-share 0.02 --seeds 10 --json benchmarks/results/cpu/turnstile_stress_8_ranks.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from ainfer_pd_testing.launch import RankGroup, init_gloo
from ainfer_pd_testing.stress_plan import (
    EpochPlan,
    Plan,
    expected_log,
    expected_records,
    make_plan,
)
from vllm_ainfer_pd.turnstile.controller import SegmentController
from vllm_ainfer_pd.turnstile.errors import EpochCancelled
from vllm_ainfer_pd.turnstile.ladder import OrderingMode
from vllm_ainfer_pd.turnstile.policy import make_policy


@dataclass(frozen=True)
class StressConfig:
    cycles: int = 2560  # turnstile rounds per seed
    max_skew_ms: float = 20.0
    rendezvous: str = "shm"  # "shm" or "gloo"
    mode: str = "fine"
    policy: str = "load"  # "fixed" (span K), "load" or "work" (spans 1, 2, 4)
    span: int = 2
    p_work_ms: float = 0.0  # mean emulated device time per P op; 0: 2 x max(max skew, 0.5 ms)
    timeout_s: float = 60.0
    progress_every: int = 0  # cycles between progress lines from rank 0; 0: none
    # The share of injection points that get a delay (uniform up to max_skew_ms); the rest get
    # none. Below 1, long runs keep delays of the full range while most rounds run at speed.
    skew_share: float = 1.0


class EmulatedPStream:
    """A serial device timeline for P: an op enqueued at t finishes at max(t, busy) + duration."""

    def __init__(self) -> None:
        self.busy_until = 0.0

    def submit(self, now: float, duration: float) -> None:
        self.busy_until = max(now, self.busy_until) + duration

    def incomplete(self, now: float) -> bool:
        return self.busy_until > now

    def fence(self, _epoch: int) -> None:
        """Block until every submitted op completed (the global-complete device fence)."""
        left = self.busy_until - time.monotonic()
        if left > 0:
            time.sleep(left)


def pause(seconds: float) -> None:
    """Injected delay; zero costs nothing (a zero sleep still yields the CPU for ~60 us here)."""
    if seconds > 0:
        time.sleep(seconds)


def _rank_main(rank: int, world: int, port: int, seeds: list[int],
               cfg: StressConfig) -> list[dict[str, Any]]:
    from vllm_ainfer_pd.turnstile.rendezvous import GlooRendezvous, ShmRendezvous

    if cfg.rendezvous == "gloo":
        init_gloo(rank, world, port, timeout_s=cfg.timeout_s)
        rdv: Any = GlooRendezvous(timeout_s=cfg.timeout_s, name="stress")
    else:
        rdv = ShmRendezvous(f"ainfer_pd_stress_{port}", rank, world, timeout_s=cfg.timeout_s)
    try:
        out = [_run_seed(rank, world, seed, cfg, rdv) for seed in seeds]
        rdv.pre_d()  # everyone is done reading the segment before its creator unlinks it
        return out
    finally:
        rdv.close()


def _run_seed(rank: int, world: int, seed: int, cfg: StressConfig, rdv: Any) -> dict[str, Any]:
    from vllm_ainfer_pd.turnstile.turnstile import Turnstile

    mode = OrderingMode.parse(cfg.mode)
    policy = make_policy(cfg.policy, k=cfg.span)
    plan = make_plan(seed, cfg.cycles, world, policy, mode)
    rng = random.Random(f"{seed}/{rank}/d")
    skew = cfg.max_skew_ms / 1000.0

    def delay(r: random.Random) -> float:
        if cfg.skew_share < 1.0 and r.random() >= cfg.skew_share:
            return 0.0
        return r.uniform(0, skew)
    p_work = (cfg.p_work_ms / 1000.0) if cfg.p_work_ms > 0 else 2 * max(skew, 5e-4)
    stream = EmulatedPStream()
    ts = Turnstile(SegmentController(rank, timeout_s=cfg.timeout_s), rdv, policy, mode,
                   stream.fence if mode.fences_device else None)
    lock = threading.Lock()
    log: list[tuple] = []
    p_times: list[float] = []
    threads: list[threading.Thread] = []
    failures: list[BaseException] = []

    def p_body(ep: EpochPlan) -> None:
        prng = random.Random(f"{seed}/{rank}/p{ep.epoch}")
        ctrl = ts.controller
        try:
            ctrl.attach(ep.epoch, "stress-P")
            for i in range(ep.boundaries):
                pause(delay(prng))  # skew before the boundary
                ctrl.reach(ep.epoch, i)
                with lock:
                    now = time.monotonic()
                    log.append(("P", ep.epoch, i))
                    p_times.append(now)
                stream.submit(now, prng.uniform(0.5, 1.5) * p_work)
            ctrl.finish(ep.epoch)
        except EpochCancelled:
            pass  # the seed ended with this epoch parked
        except BaseException as exc:
            failures.append(exc)
            ctrl.fail(ep.epoch, exc)

    def open_epoch(ep: EpochPlan | None, load: Any) -> None:
        if ep is None or rank not in ep.active:
            return
        ts.open_epoch(ep.epoch, d_enqueued=ep.d_enqueued, load=load)
        t = threading.Thread(target=p_body, args=(ep,), name=f"P{rank}e{ep.epoch}", daemon=True)
        threads.append(t)
        t.start()

    records, t_pre_in, t_d, t_post_out = [], [], [], []
    incomplete_acks = 0
    start = time.monotonic()
    for j in range(plan.cycles):
        open_epoch(plan.opening(j, d_enqueued=False), None)
        pause(delay(rng))  # skew before the pre-D phase
        t_pre_in.append(time.monotonic())
        rec = ts.pre_d()
        records.append((rec.epoch, rec.reached, rec.permit, rec.state.value))
        pause(delay(rng))  # skew before the D enqueue
        with lock:
            t_d.append(time.monotonic())
            log.append(("D", j))
        pause(delay(rng))  # skew before the P release
        ts.post_d(plan.loads[j])
        now = time.monotonic()
        t_post_out.append(now)
        incomplete_acks += stream.incomplete(now)
        open_epoch(plan.opening(j + 1, d_enqueued=True), plan.loads[j])
        if cfg.progress_every and rank == 0 and (j + 1) % cfg.progress_every == 0:
            took = time.monotonic() - start
            print(f"[stress] seed {seed}: {j + 1}/{plan.cycles} cycles, "
                  f"{1000 * took / (j + 1):.2f} ms/cycle", flush=True)
    ts.controller.wait_parked()  # the log's tail is complete once P stopped
    ts.controller.cancel("stress seed over")
    for t in threads:
        t.join(cfg.timeout_s)
    if failures:
        raise failures[0]
    return {"seed": seed, "records": records, "log": log, "p_times": p_times,
            "t_pre_in": t_pre_in, "t_d": t_d, "t_post_out": t_post_out,
            "incomplete_acks": incomplete_acks, "elapsed_s": time.monotonic() - start}


# --- parent: checks and CLI -------------------------------------------------------------------


def check_seed(plan: Plan, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare every rank with the plan and with each other; return counts (0 = pass)."""
    world = len(per_rank)
    bad_records = bad_logs = overtook = trailed = p_early = 0
    first_problem = ""
    for r, res in enumerate(per_rank):
        want = expected_records(plan, r)
        diff = [j for j, (a, b) in enumerate(zip(res["records"], want, strict=True)) if a != b]
        bad_records += len(diff)
        if diff and not first_problem:
            j = diff[0]
            first_problem = f"rank {r} round {j}: saw {res['records'][j]}, plan {want[j]}"
        if res["log"] != expected_log(plan, r):
            bad_logs += 1
            first_problem = first_problem or f"rank {r}: enqueue order differs from the plan"
    for j in range(plan.cycles):
        all_in = max(res["t_pre_in"][j] for res in per_rank)
        first_out = min(res["t_post_out"][j] for res in per_rank)
        for res in per_rank:
            overtook += res["t_d"][j] < all_in
            trailed += res["t_d"][j] > first_out
    d_done = [max(res["t_d"][j] for res in per_rank) for j in range(plan.cycles)]
    for res in per_rank:
        last_d, k = -1, 0
        for ev in res["log"]:
            if ev[0] == "D":
                last_d = ev[1]
                continue
            if last_d >= 0 and res["p_times"][k] < d_done[last_d]:
                p_early += 1
            k += 1
    digests = {hashlib.sha256(repr(res["records"]).encode()).hexdigest()[:12]
               for res in per_rank}
    return {"seed": per_rank[0]["seed"], "cycles": plan.cycles, "world": world,
            "epochs": len(plan.epochs), "bad_records": bad_records, "bad_logs": bad_logs,
            "d_overtook": overtook, "d_trailed": trailed, "p_before_all_d": p_early,
            "incomplete_acks": sum(res["incomplete_acks"] for res in per_rank),
            "acks": plan.cycles * world, "distinct_record_digests": len(digests),
            "elapsed_s": max(res["elapsed_s"] for res in per_rank),
            "first_problem": first_problem}


def passed(row: dict[str, Any]) -> bool:
    return not (row["bad_records"] or row["bad_logs"] or row["d_overtook"] or row["d_trailed"]
                or row["p_before_all_d"])


def run(world: int, seeds: list[int], cfg: StressConfig, *, log: Any = print) -> dict[str, Any]:
    """Run and check the seeds one launch of rank processes each (so an interrupted long run
    keeps the verdicts of its finished seeds); return the checked summary."""
    log(f"[stress] ranks={world} seeds={seeds} {asdict(cfg)}")
    budget = cfg.timeout_s + cfg.cycles * (4 * cfg.skew_share * cfg.max_skew_ms / 1000 + 0.05)
    policy = make_policy(cfg.policy, k=cfg.span)
    rows = []
    for seed in seeds:
        with RankGroup(_rank_main, world, args=([seed], cfg)) as ranks:
            per_rank = ranks.wait(budget)
        plan = make_plan(seed, cfg.cycles, world, policy, OrderingMode.parse(cfg.mode))
        row = check_seed(plan, [per_rank[r][0] for r in range(world)])
        rows.append(row)
        log(f"[stress] seed {seed}: {row['cycles']} cycles, {row['epochs']} epochs, "
            f"{row['elapsed_s']:.1f} s ({1000 * row['elapsed_s'] / row['cycles']:.2f} ms/cycle): "
            f"{'PASS' if passed(row) else 'FAIL ' + row['first_problem']}; "
            f"record/log mismatches {row['bad_records']}/{row['bad_logs']}, "
            f"D overtook/trailed {row['d_overtook']}/{row['d_trailed']}, "
            f"P before all D {row['p_before_all_d']}; D acks with P incomplete "
            f"{row['incomplete_acks']}/{row['acks']}")
    ok = all(passed(r) for r in rows)
    cycles = sum(r["cycles"] for r in rows)
    log(f"[stress] {'PASS' if ok else 'FAIL'}: {cycles} cycles over {len(seeds)} seeds on "
        f"{world} ranks; D acknowledgements with P incomplete: "
        f"{sum(r['incomplete_acks'] for r in rows)}/{sum(r['acks'] for r in rows)}")
    return {"ok": ok, "ranks": world, "config": asdict(cfg), "seeds": rows,
            "total_cycles": cycles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=StressConfig.cycles, help="per seed")
    ap.add_argument("--max-skew-ms", type=float, default=StressConfig.max_skew_ms)
    ap.add_argument("--skew-share", type=float, default=StressConfig.skew_share,
                    help="share of injection points delayed (uniform up to --max-skew-ms)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--rendezvous", choices=("shm", "gloo"), default=StressConfig.rendezvous)
    ap.add_argument("--mode", choices=[m.value for m in OrderingMode], default="fine")
    ap.add_argument("--policy", choices=("fixed", "load", "work"), default=StressConfig.policy)
    ap.add_argument("--span", type=int, default=StressConfig.span)
    ap.add_argument("--progress-every", type=int, default=None,
                    help="cycles between progress lines (default: cycles / 8)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    every = args.progress_every if args.progress_every is not None else max(args.cycles // 8, 1)
    if not 0.0 < args.skew_share <= 1.0:
        ap.error(f"--skew-share must be in (0, 1], got {args.skew_share!r}")
    cfg = StressConfig(args.cycles, args.max_skew_ms, args.rendezvous, args.mode, args.policy,
                       args.span, progress_every=every, skew_share=args.skew_share)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    summary = run(args.ranks, seeds, cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
