"""The residency condition behind the crossed-cycle hang, on one GPU.

A collective kernel that waits for its peers spins on the SMs it holds. Two ranks that enqueue
two such collectives in opposite orders hang only if the spinning kernel leaves no room on the
GPU for the kernel it waits on (the paper saw the stall at 24 CTAs per SM and not at 23). This
script shows that condition without a second GPU: one process plays both sides.

- P's stand-in: `spin`, c CTAs per SM on P's stream, each spinning until a flag is set.
- D's stand-in: `set_flag`, one CTA on D's stream, launched after `spin` is resident.

If `spin` leaves a CTA slot free, `set_flag` runs and both end in microseconds. If c reaches the
SM's residency limit for `spin`, `set_flag` never gets a slot: a cycle (P waits for D's flag, D
waits for an SM that P holds). The watchdog sees D's event unfinished after --stall-s, prints the
wait graph and releases `spin` through a host-to-device copy on a third stream (the copy engine
needs no SM), so every trial ends cleanly. A D stream of higher priority does not help: priority
orders CTAs waiting for a slot, and no slot frees while `spin` waits.

The fix's stand-in (`routed`): the selective route enqueues P's crossing collective on D's stream,
and the turnstile makes every rank enqueue it after the same D iteration. Stream order then runs
`set_flag` before `spin` on every rank, so no CTA waits for another while holding a slot, and the
trial ends at the residency limit too.

    python3 benchmarks/residency_stall.py --out residency.json     (GPU; needs torch + triton)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

BLOCKS_PER_SM = 32  # sm_80..sm_90 hardware limit on resident CTAs per SM


@triton.jit
def spin(flag_ptr, release_ptr, seen_ptr):
    flag = tl.load(flag_ptr, volatile=True)
    release = tl.load(release_ptr, volatile=True)
    while flag + release == 0:
        flag = tl.load(flag_ptr, volatile=True)
        release = tl.load(release_ptr, volatile=True)
    tl.store(seen_ptr + tl.program_id(0), flag + 2 * release)  # 1: D's flag, 2+: released


@triton.jit
def set_flag(flag_ptr):
    tl.store(flag_ptr, 1)


def residency_limit(num_warps: int) -> int:
    """CTAs of `spin` one SM can hold, from threads and the CTA cap (its registers and shared
    memory are far below their limits)."""
    props = torch.cuda.get_device_properties(0)
    return min(BLOCKS_PER_SM, props.max_threads_per_multi_processor // (32 * num_warps))


def trial(per_sm: int, num_warps: int, d_priority: int, stall_s: float, routed: bool) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = per_sm * sms
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    release = torch.zeros(1, dtype=torch.int32, device="cuda")
    seen = torch.zeros(grid, dtype=torch.int32, device="cuda")
    one = torch.ones(1, dtype=torch.int32).pin_memory()
    p_stream = torch.cuda.Stream()
    d_stream = torch.cuda.Stream(priority=d_priority)
    release_stream = torch.cuda.Stream()
    p_done, d_done = torch.cuda.Event(), torch.cuda.Event()
    torch.cuda.synchronize()

    start = time.perf_counter()
    if routed:  # D's iteration, then P's collective behind it on the same stream
        with torch.cuda.stream(d_stream):
            set_flag[(1,)](flag, num_warps=num_warps)
            d_done.record()
            spin[(grid,)](flag, release, seen, num_warps=num_warps)
            p_done.record()
    else:
        with torch.cuda.stream(p_stream):
            spin[(grid,)](flag, release, seen, num_warps=num_warps)
            p_done.record()
        time.sleep(0.05)  # let P's CTAs take their slots first, as a collective in flight does
        start = time.perf_counter()
        with torch.cuda.stream(d_stream):
            set_flag[(1,)](flag, num_warps=num_warps)
            d_done.record()
    while not (d_done.query() and p_done.query()) and time.perf_counter() - start < stall_s:
        time.sleep(0.001)
    stalled = not (d_done.query() and p_done.query())
    if stalled:
        print(f"  STALL at {per_sm} CTAs/SM (num_warps={num_warps}): wait graph\n"
              f"    P: spin ({grid} CTAs, {per_sm}/SM on {sms} SMs) waits for D's flag\n"
              f"    D: set_flag (1 CTA, stream priority {d_stream.priority}) waits for a free CTA "
              "slot,"
              f" all held by P\n"
              f"    releasing P through the copy engine", flush=True)
        with torch.cuda.stream(release_stream):
            release.copy_(one, non_blocking=True)
    p_done.synchronize()
    d_done.synchronize()
    waited = time.perf_counter() - start
    seen = seen.cpu()
    return {
        "ctas_per_sm": per_sm, "num_warps": num_warps, "grid": grid, "sms": sms,
        "residency_limit": residency_limit(num_warps), "d_stream_priority": d_stream.priority,
        "routed": routed,
        "stalled": stalled, "seconds_to_end": round(waited, 4),
        "ctas_ended_by_d_flag": int((seen == 1).sum()),
        "ctas_ended_by_release": int((seen >= 2).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stall-s", type=float, default=2.0,
                        help="how long D's kernel may wait before the watchdog calls it a stall")
    parser.add_argument("--out", required=True, help="JSON file for the trials")
    args = parser.parse_args()
    _, highest = torch.cuda.Stream.priority_range()
    props = torch.cuda.get_device_properties(0)
    trials = []
    for num_warps in args.num_warps:
        limit = residency_limit(num_warps)
        warm = torch.ones(1, dtype=torch.int32, device="cuda")  # compile both kernels up front
        spin[(1,)](warm, warm, torch.zeros(1, dtype=torch.int32, device="cuda"),
                   num_warps=num_warps)
        set_flag[(1,)](warm, num_warps=num_warps)
        torch.cuda.synchronize()
        cases = [(limit - 1, 0, False), (limit, 0, False), (limit, highest, False),
                 (limit, 0, True)]
        for per_sm, priority, routed in cases:
            result = trial(per_sm, num_warps, priority, args.stall_s, routed)
            how = "routed onto D's stream" if routed else f"D priority {priority}"
            print(f"num_warps={num_warps} {per_sm:2d} CTAs/SM (limit {limit}), {how}: "
                  f"{'STALL' if result['stalled'] else 'no stall'}, ended in "
                  f"{result['seconds_to_end']:.4f} s", flush=True)
            trials.append(result)
    report = {"gpu": props.name, "sms": props.multi_processor_count,
              "max_threads_per_sm": props.max_threads_per_multi_processor,
              "torch": torch.__version__, "triton": triton.__version__,
              "stall_s": args.stall_s, "trials": trials}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
