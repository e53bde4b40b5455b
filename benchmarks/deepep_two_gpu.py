"""Phase-owned DeepEP on two GPUs (EP=2), model-free: P's normal mode beside D's low latency.

Two rank processes, one GPU each, hold the pair the worker builds (`vllm_ainfer_pd.deepep.
buffers`): D's low-latency buffer (created first, as vLLM creates it at model load) and P's
normal-mode buffer. Each rank runs the project's turnstile (`vllm_ainfer_pd.turnstile`: segment
controller, shared-memory rendezvous, one boundary per release) as the lane does:

- D, the main thread, once per round: pre-D rendezvous (P is stopped at a boundary), one
  low-latency dispatch + combine on D's stream, post-D rendezvous (releases P's next segment);
- P, its own thread and stream, epochs of `--layers` normal-mode dispatch + combine pairs, a
  boundary before each dispatch (P's boundary i precedes its i-th dispatch).

Every token names itself in its first columns (source rank, index); every rank generates every
rank's tokens, top-k experts and dyadic weights from the seed, so the reference all-to-all is
computed locally, exactly: D's dispatch must deliver to each local expert exactly the tokens
routed to it (from both ranks), D's weighted combine must return each token times the sum of its
top-k weights; P's dispatch must deliver each token routed to this rank once, with its local
top-k ids, and P's combine must return each token times the number of ranks it went to.

Phases (each a new launch of the two ranks, so a hang or crash in one keeps the others' results):
1. correctness: `--seeds` seeds x `--rounds` rounds (default 5 x 512 = 2,560), a random skew of
   0..`--max-skew-ms` ms before each rank's pre-D phase and before each P boundary, P's SMs 24;
2. timing, for each P SM count of `--sms` (default 12, 24, all): D's dispatch + combine time
   (CUDA events on D's stream) over `--timing-rounds` rounds with no P, then with P's epochs
   back to back; P's dispatch + combine time. No skew, no checks (they synchronise).

    python3 benchmarks/deepep_two_gpu.py --out deepep_two_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD = 2
DEVICE = "cuda"  # the reference's own device (a CPU dry run of the checks sets "cpu")


@dataclass(frozen=True)
class Setup:
    hidden: int = 2048  # a hidden size DeepEP's low-latency kernels are instantiated for
    experts: int = 64
    top_k: int = 8
    d_tokens: int = 128  # D's low-latency capacity and batch per rank
    p_tokens: int = 1024  # P's tokens per rank per dispatch (one layer of an epoch)
    layers: int = 4  # P's dispatch + combine pairs per epoch
    p_sms: int = 24
    timeout_s: float = 120.0


# ---- data and the exact reference --------------------------------------------------------------


def make_batch(setup: Setup, tokens: int, key: tuple, src: int):
    """Rank `src`'s tokens for `key`: columns 0..2 name (source rank, index // 64, index % 64),
    exact small integers in bf16; distinct experts per token; dyadic weights."""
    import torch

    seed = zlib.crc32(repr((key, src)).encode())  # the same on every rank (hash() is salted)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randint(-4, 5, (tokens, setup.hidden), generator=g, device=DEVICE)
    x = x.to(torch.bfloat16) / 4
    t = torch.arange(tokens, device=DEVICE)
    x[:, 0] = src
    x[:, 1] = (t // 64).to(torch.bfloat16)
    x[:, 2] = (t % 64).to(torch.bfloat16)
    topk = torch.rand(tokens, setup.experts, generator=g, device=DEVICE).topk(setup.top_k, 1)
    weights = 2.0 ** -torch.randint(1, 5, (tokens, setup.top_k), generator=g, device=DEVICE)
    return x, topk.indices.to(torch.int64), weights.float()


def _sorted_rows(rows):
    key = rows[:, 0].float() * 1e6 + rows[:, 1].float() * 64 + rows[:, 2].float()
    return rows[key.argsort()]


def check_low_latency(setup: Setup, rank: int, key: tuple, recv, count, combined) -> str | None:
    """D's dispatch and combine against the reference; None if exact, else what differs."""
    import torch

    local = setup.experts // WORLD
    batches = [make_batch(setup, setup.d_tokens, key, src) for src in range(WORLD)]
    for e in range(local):
        expert = rank * local + e
        want = torch.cat([x[(topk == expert).any(1)] for x, topk, _ in batches])
        got = recv[e, : int(count[e])]
        if got.shape != want.shape or not torch.equal(_sorted_rows(got), _sorted_rows(want)):
            return f"D dispatch: expert {expert} got {tuple(got.shape)}, want {tuple(want.shape)}"
    x, _, weights = batches[rank]
    reference = (x.float() * weights.sum(1, keepdim=True)).to(torch.bfloat16)
    if not torch.equal(combined, reference):
        return f"D combine differs by up to {(combined.float() - reference.float()).abs().max()}"
    return None


def check_normal(setup: Setup, rank: int, key: tuple, recv_x, recv_topk, combined) -> str | None:
    import torch

    local = setup.experts // WORLD
    offset = rank * local
    want_x, want_topk = [], []
    for src in range(WORLD):
        x, topk, _ = make_batch(setup, setup.p_tokens, key, src)
        here = ((topk >= offset) & (topk < offset + local)).any(1)
        want_x.append(x[here])
        mapped = torch.where((topk >= offset) & (topk < offset + local), topk - offset, -1)
        want_topk.append(mapped[here])
    want_x, want_topk = torch.cat(want_x), torch.cat(want_topk)
    if recv_x.shape != want_x.shape:
        return f"P dispatch received {tuple(recv_x.shape)}, want {tuple(want_x.shape)}"
    order_got = (recv_x[:, 0].float() * 1e6 + recv_x[:, 1].float() * 64
                 + recv_x[:, 2].float()).argsort()
    order_want = (want_x[:, 0].float() * 1e6 + want_x[:, 1].float() * 64
                  + want_x[:, 2].float()).argsort()
    if not torch.equal(recv_x[order_got], want_x[order_want]):
        return "P dispatch: received tokens differ"
    if not torch.equal(recv_topk[order_got], want_topk[order_want]):
        return "P dispatch: received top-k ids differ"
    x, topk, _ = make_batch(setup, setup.p_tokens, key, rank)
    ranks = torch.stack([((topk >= r * local) & (topk < (r + 1) * local)).any(1)
                         for r in range(WORLD)]).sum(0)
    reference = (x.float() * ranks[:, None]).to(torch.bfloat16)
    if not torch.equal(combined, reference):
        return "P combine: differs from each token times the ranks it went to"
    return None


# ---- one rank ----------------------------------------------------------------------------------


class PhasePair:
    """The pair on one rank, and the two phases' calls on it."""

    def __init__(self, setup: Setup, rank: int) -> None:
        import deep_ep
        import torch
        import torch.distributed as dist

        from vllm_ainfer_pd.deepep.buffers import DeepEPSizes, PhaseBuffers

        self.setup, self.rank = setup, rank
        group = dist.group.WORLD
        self.sizes = DeepEPSizes.compute(
            deep_ep, ep_size=WORLD, hidden=setup.hidden, num_experts=setup.experts,
            top_k=setup.top_k, p_sms=setup.p_sms, p_max_tokens=setup.p_tokens,
            d_max_tokens=setup.d_tokens)
        d_buffer = deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=self.sizes.d_rdma_bytes,
                                  low_latency_mode=True,
                                  num_qps_per_rank=setup.experts // WORLD,
                                  explicitly_destroy=True)
        self.buffers = PhaseBuffers(deep_ep, group, self.sizes, d_buffer)
        # P's configs carry P's SM count (DeepEP's class-wide count is left as it was).
        self.dispatch_config = self.buffers.dispatch_config
        self.combine_config = self.buffers.combine_config
        self.d_stream = torch.cuda.Stream()
        self.p_stream = torch.cuda.Stream()

    def d_round(self, key: tuple, check: bool):
        """One low-latency dispatch + combine on D's stream; (error or None, events)."""
        import torch

        s = self.setup
        with torch.cuda.stream(self.d_stream):
            x, topk, weights = make_batch(s, s.d_tokens, key, self.rank)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            buf = self.buffers.low_latency
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, s.d_tokens, s.experts,
                                                                 use_fp8=False)
            combined, _, _ = buf.low_latency_combine(recv, topk, weights, handle)
            end.record()
            if not check:
                return None, (start, end)
            self.d_stream.synchronize()
            return check_low_latency(s, self.rank, key, recv, count, combined), (start, end)

    def p_pair(self, key: tuple, check: bool):
        """One normal-mode dispatch + combine on P's stream (the caller made it current)."""
        import torch

        s = self.setup
        x, topk, weights = make_batch(s, s.p_tokens, key, self.rank)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf = self.buffers.for_p()
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, s.experts)
        recv_x, recv_topk, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
            topk_weights=weights, config=self.dispatch_config)
        combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w,
                                     config=self.combine_config)
        end.record()
        if not check:
            return None, (start, end)
        self.p_stream.synchronize()
        return check_normal(s, self.rank, key, recv_x, recv_topk, combined), (start, end)

    def close(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.buffers.destroy()
        self.buffers.low_latency.destroy()


def _rank(rank: int, world: int, port: int, setup: Setup, phase: str, seed: int, rounds: int,
          max_skew_ms: float) -> dict:
    import random

    import torch

    from ainfer_pd_testing.launch import init_gloo
    from vllm_ainfer_pd.turnstile import (
        FixedSpan,
        SegmentController,
        ShmRendezvous,
        TaskState,
        Turnstile,
    )
    from vllm_ainfer_pd.turnstile.errors import EpochCancelled

    torch.cuda.set_device(rank)
    init_gloo(rank, world, port, timeout_s=setup.timeout_s)
    pair = PhasePair(setup, rank)
    rdv = ShmRendezvous(f"ainfer_pd_deepep2_{port}", rank, world, timeout_s=setup.timeout_s)
    ts = Turnstile(SegmentController(rank, timeout_s=setup.timeout_s), rdv, FixedSpan(1))
    check = phase == "correctness"
    with_p = phase != "alone"
    skew = max_skew_ms / 1000.0
    rng = random.Random(f"{seed}/{rank}")
    errors: list[str] = []
    d_events, p_events = [], []
    epochs = {"opened": 0, "done": 0}

    def p_epoch(epoch: int) -> None:
        prng = random.Random(f"{seed}/{rank}/p{epoch}")
        torch.cuda.set_device(rank)
        try:
            ts.controller.attach(epoch, f"deepep2-P{rank}")
            with torch.cuda.stream(pair.p_stream):
                for layer in range(setup.layers):
                    if skew:
                        time.sleep(prng.uniform(0, skew))
                    ts.controller.reach(epoch, layer)  # P's boundary before its dispatch
                    err, ev = pair.p_pair(("p", seed, epoch, layer), check)
                    p_events.append(ev)
                    if err:
                        errors.append(f"epoch {epoch} layer {layer}: {err}")
            ts.controller.finish(epoch)
            epochs["done"] += 1
        except EpochCancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported; D's next pre-D phase fails
            errors.append(f"P epoch {epoch}: {exc!r}\n{traceback.format_exc(limit=3)}")
            ts.controller.fail(epoch, exc)

    threads = []
    start = time.monotonic()
    for j in range(rounds):
        if skew:
            time.sleep(rng.uniform(0, skew))
        record = ts.pre_d()
        err, ev = pair.d_round(("d", seed, j), check)
        d_events.append(ev)
        if err:
            errors.append(f"round {j}: {err}")
        ts.post_d()
        # Every rank sees the same states at the same round (P moves only on permits), so all
        # open the next epoch in the same gap, after the round's post-D phase.
        if with_p and (record.epoch is None or record.state is TaskState.DONE):
            epoch = epochs["opened"]
            epochs["opened"] += 1
            ts.open_epoch(epoch, d_enqueued=True)
            t = threading.Thread(target=p_epoch, args=(epoch,), daemon=True)
            threads.append(t)
            t.start()
    ts.controller.wait_parked()
    ts.controller.cancel("rounds over")
    for t in threads:
        t.join(setup.timeout_s)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    d_ms = [a.elapsed_time(b) for a, b in d_events]
    p_ms = [a.elapsed_time(b) for a, b in p_events]
    rdv.pre_d()  # every rank is done with the segment before its creator unlinks it
    rdv.close()
    pair.close()
    return {"rank": rank, "phase": phase, "seed": seed, "rounds": rounds, "errors": errors[:20],
            "error_count": len(errors), "epochs_opened": epochs["opened"],
            "epochs_done": epochs["done"], "p_pairs": len(p_ms), "elapsed_s": elapsed,
            "d_ms": _stats(d_ms), "p_ms": _stats(p_ms), "sizes": pair.sizes.describe()}


def _stats(ms: list[float]) -> dict:
    if not ms:
        return {}
    ms = sorted(ms[len(ms) // 10:])  # the first tenth warms up
    return {"n": len(ms), "median": statistics.median(ms), "p90": ms[int(0.9 * (len(ms) - 1))],
            "mean": statistics.fmean(ms)}


# ---- parent ------------------------------------------------------------------------------------


def launch(setup: Setup, phase: str, seed: int, rounds: int, skew_ms: float) -> dict:
    from ainfer_pd_testing.launch import RankFailed, RankGroup

    budget = setup.timeout_s + rounds * (2 * skew_ms / 1000 + 0.2)
    try:
        with RankGroup(_rank, WORLD, args=(setup, phase, seed, rounds, skew_ms)) as ranks:
            return {"ok": True, "ranks": ranks.wait(budget)}
    except RankFailed as exc:
        return {"ok": False, "error": str(exc)[-4000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="deepep_two_gpu.json")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=512, help="per seed")
    ap.add_argument("--max-skew-ms", type=float, default=20.0)
    ap.add_argument("--timing-rounds", type=int, default=400)
    ap.add_argument("--sms", default="12,24,all", help="P's SM counts for the timing phase")
    ap.add_argument("--skip", default="", help="phases to skip: correctness,timing")
    args = ap.parse_args()
    import torch

    sms_all = torch.cuda.get_device_properties(0).multi_processor_count // 2 * 2
    result: dict = {"argv": sys.argv[1:], "setup": asdict(Setup()), "correctness": [],
                    "timing": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    ok = True
    if "correctness" not in args.skip:
        for seed in range(args.seeds):
            row = launch(Setup(), "correctness", seed, args.rounds, args.max_skew_ms)
            row["seed"] = seed
            result["correctness"].append(row)
            save()
            good = row["ok"] and not any(r["error_count"] for r in row["ranks"])
            ok &= good
            detail = (f"{sum(r['p_pairs'] for r in row['ranks'])} P pairs, "
                      f"{min(r['epochs_done'] for r in row['ranks'])} P epochs, "
                      f"errors {[r['error_count'] for r in row['ranks']]}"
                      if row["ok"] else row["error"][-600:])
            print(f"[two-gpu] seed {seed}: {args.rounds} rounds, skew <= {args.max_skew_ms} ms: "
                  f"{'PASS' if good else 'FAIL'}; {detail}", flush=True)
        rounds = args.seeds * args.rounds
        print(f"[two-gpu] correctness {'PASS' if ok else 'FAIL'}: {rounds} rounds", flush=True)
    if "timing" not in args.skip:
        for sms in args.sms.split(","):
            count = sms_all if sms == "all" else int(sms)
            setup = Setup(p_sms=count)
            row = {"p_sms": count}
            for phase in ("alone", "with_p"):
                out = launch(setup, phase, 100, args.timing_rounds, 0.0)
                row[phase] = out
                line = (f"D median {max(r['d_ms'].get('median', 0) for r in out['ranks']):.3f} ms"
                        f", p90 {max(r['d_ms'].get('p90', 0) for r in out['ranks']):.3f} ms" + (
                            f"; P pair median "
                            f"{max(r['p_ms'].get('median', 0) for r in out['ranks']):.3f} ms"
                            if phase == "with_p" else "")
                        if out["ok"] else f"FAILED {out['error'][-400:]}")
                print(f"[two-gpu] P on {count} SMs, {phase}: {line}", flush=True)
            result["timing"].append(row)
            save()
    result["ok"] = ok
    save()
    print(f"[two-gpu] wrote {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
