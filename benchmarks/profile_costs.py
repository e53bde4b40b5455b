"""Cost profiles for the scale model (docs/scale-model.md): measured forwards of one engine.

    # drive a real vLLM engine through LLM(...) with chosen batch shapes, write the profile
    python benchmarks/profile_costs.py measure --model tiny --platform cpu \\
        --out benchmarks/results/scale/profile_cpu_tiny.json
    python benchmarks/profile_costs.py measure --model .gpu/gpu-model --platform gpu \\
        --lane-from benchmarks/results/gpu/rollout_tp1_w01 --out profile_gpu.json
    # the first GPU profiles, derived from the measured rollouts in benchmarks/results/gpu
    python benchmarks/profile_costs.py derive --out-dir benchmarks/results/scale

`measure` times, on one engine with prefix caching:
- decode steps: `rows` requests whose prompts share a cached prefix of `context` tokens (so their
  prefill costs one token each) decode `--decode-tokens` tokens; a step is the time of that
  generate minus the time of the same generate with one token, over the extra steps;
- prefill forwards: one prompt of `tokens` new tokens after a cached prefix of `start` tokens, one
  output token, less the time of a generate that computes one cached token (the per-call cost
  outside the forward), plus one 1-row decode step (that call's own forward).
Each point records its batch (`rows`, the rows' summed `context`, prefill `chunks`) and seconds.

`derive` reads the stock and `normal` replays' per-request records of the `gpu` and `gpu-mla`
presets (1 x H200): a request whose whole decode ran with no other request waiting for its first
token gives one decode step (its TPOT) at the mean rows and summed context over its decode; each
replay's opening burst (64 first turns at t=0, vLLM's 8,192-token chunks first come, first served)
gives one average prefill step (its duration over its chunks, with the decode rows that ran beside
it); the decode-only run of the `gpu` preset gives a 64-row step. The lane's constants come from
the `pd` replays' counters (`--lane-from`, medians): P's device time overlapped by D, P's host time
per boundary interval and per segment (solved from `fine` and `global-enqueue`, which release
~9 and 1 segments per epoch), and D's host slack (P's host time per segment minus D's mean wait).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPU = ROOT / "benchmarks" / "results" / "gpu"
# NVLink 4 moves ~450 GB/s each way, of which NCCL's all-gather reaches ~360 GB/s; a ring hop
# costs ~2 us within a node; 400 Gb/s InfiniBand per GPU (~40 GB/s after protocol) and ~10 us per
# hop across nodes. `collective_latency_us` is fitted (`refit --dp-records`).
H200 = {"name": "H200", "peak_tflops": 796.2, "hbm_tbps": 4.29, "link_gbps": 360.0,
        "hop_latency_us": 2.0, "collective_latency_us": 10.0, "inter_node_gbps": 40.0,
        "inter_node_hop_us": 10.0, "gpus_per_node": 8}
GPU_ENGINE = {"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "block_size": 16,
              "async_scheduling": True, "client_overhead_s": 0.0,
              "client_overhead_per_token_s": 3.0e-6, "normal_step_overhead": 0.003}
# vLLM serve's defaults on this CPU machine (< 70 GiB of memory: 2,048-token steps) with the
# rollout's CPU engine arguments (max_num_seqs 16; the CPU attention backend's 128-token blocks).
CPU_ENGINE = {"max_num_batched_tokens": 2048, "max_num_seqs": 16, "block_size": 128,
              "async_scheduling": False, "client_overhead_s": 0.005,
              "client_overhead_per_token_s": 3.0e-6, "normal_step_overhead": 0.003,
              "cudagraph_capture_size": 0}
# CPU ranks exchange expert-parallel activations through shared memory (vLLM's CPU collectives),
# a few GB/s, with tens of microseconds per call; ranks share the cores (`cores`).
CPU_HARDWARE = {"name": "CPU", "link_gbps": 5.0, "hop_latency_us": 20.0,
                "collective_latency_us": 100.0, "inter_node_gbps": 5.0, "inter_node_hop_us": 20.0,
                "gpus_per_node": 64}
# The lane's rendezvous per rank count (one rendezvous, seconds): 1 rank from the lane's own
# counter on 1 x H200 (rendezvous_seconds / rounds / 2), 2-8 from rendezvous_h200_host.json (shm
# medians, plus the same per-call cost), 16 (two hosts) gloo between host leaders.
RENDEZVOUS = {"1": 2.0e-5, "2": 2.0e-5, "4": 2.2e-5, "8": 3.1e-5, "16": 3.1e-4}


# -- derive ------------------------------------------------------------------------------------

def _records(folder: Path, backends: tuple[str, ...]) -> list[tuple[str, list[dict]]]:
    out = []
    for tar_path in sorted(folder.glob("**/records.tar.gz")):
        with tarfile.open(tar_path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                name = Path(m.name).stem
                if m.isfile() and name.rsplit("-", 1)[0] in backends:
                    text = tar.extractfile(m).read().decode()
                    out.append((f"{tar_path.parent.name}/{name}",
                                [json.loads(x) for x in text.splitlines() if x.strip()]))
    return out


def decode_points(label: str, recs: list[dict], min_tokens: int = 16) -> list[dict]:
    """One point per request whose decode saw no prefill anywhere (no request between its
    submission and its first token): its TPOT at the mean rows and summed context."""
    import numpy as np

    recs = [r for r in recs if r["error"] is None]
    sub = np.array([r["submit_s"] for r in recs])
    first = np.array([r["first_token_s"] for r in recs])
    end = np.array([r["end_s"] for r in recs])
    prompt = np.array([r["prompt_tokens"] for r in recs], dtype=float)
    out_n = np.array([r["output_tokens"] for r in recs], dtype=float)
    points = []
    for r in recs:
        if r["output_tokens"] < min_tokens:
            continue
        ts = np.linspace(r["first_token_s"], r["end_s"], 40)[:-1]
        pre = ((sub[None, :] <= ts[:, None]) & (ts[:, None] < first[None, :])).any()
        if pre:
            continue
        dec = (first[None, :] <= ts[:, None]) & (ts[:, None] < end[None, :])
        frac = np.clip((ts[:, None] - first[None, :]) / np.maximum(end - first, 1e-9)[None, :],
                       0, 1)
        ctx = (prompt[None, :] + frac * out_n[None, :]) * dec
        tpot = (r["end_s"] - r["first_token_s"]) / (r["output_tokens"] - 1)
        points.append({"rows": round(float(dec.sum(1).mean()), 2),
                       "context": round(float(ctx.sum(1).mean())), "chunks": [], "samples": 0,
                       "seconds": round(tpot, 6),
                       "source": f"{label}: {r['trajectory']}/{r['turn']} decode, no prefill"})
    return points


def burst_point(label: str, recs: list[dict], budget: int) -> dict:
    """The opening burst as one average step: its first turns' prompt tokens in `budget`-token
    chunks (first come, first served), the decode rows beside them, its duration per chunk."""
    import numpy as np

    firsts = sorted((r for r in recs if r["turn"] == 0 and r["error"] is None),
                    key=lambda r: r["submit_s"])
    t0 = min(r["submit_s"] for r in firsts)
    t1 = max(r["first_token_s"] for r in firsts)
    tokens = sum(r["prompt_tokens"] for r in firsts)
    steps = math.ceil(tokens / budget)
    pairs = sum(r["prompt_tokens"] * (r["prompt_tokens"] + 1) / 2 for r in firsts)
    ts = np.linspace(t0, t1, 200)
    rows = [sum(1 for r in recs if r["first_token_s"] <= t < r["end_s"]) for t in ts]
    ctx = [sum(r["prompt_tokens"] for r in recs if r["first_token_s"] <= t < r["end_s"])
           for t in ts]
    n = tokens / steps
    # One chunk of n tokens whose (query, key) pairs are the burst's per step: n (2s + n + 1) / 2.
    start = max(0.0, (2 * pairs / steps / n - n - 1) / 2)
    return {"rows": round(float(np.mean(rows)), 2), "context": round(float(np.mean(ctx))),
            "chunks": [[round(n), round(start)]], "samples": round(len(firsts) / steps, 2),
            "seconds": round((t1 - t0) / steps, 6),
            "source": f"{label}: opening burst, {tokens} tokens in {steps} chunks"}


def request_overhead(recs: list[dict]) -> float:
    """Seconds per prompt token that a request spends outside the engine: the replay's last
    request runs alone (t46's last turn, 10,806 tokens, all but its last block cached), so its TTFT
    is two engine steps (async scheduling) plus the server's handling of its prompt."""
    last = max((r for r in recs if r["error"] is None), key=lambda r: r["end_s"])
    tpot = (last["end_s"] - last["first_token_s"]) / max(1, last["output_tokens"] - 1)
    return (last["first_token_s"] - last["submit_s"] - 2 * tpot) / last["prompt_tokens"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def lane_constants(folders: list[Path], boundaries: int) -> dict:
    """Medians over the pd replays (the default `fine` ordering) and the global-enqueue ones."""
    fine: dict[str, list[float]] = {}
    genq: dict[str, list[float]] = {}
    for folder in folders:
        for rp in sorted(folder.glob("**/report.json")):
            if "merged" in rp.parts:
                continue
            rep = json.loads(rp.read_text())
            for name, b in rep["backends"].items():
                # Server names of the default (`fine`) lane and of global-enqueue in the GPU and
                # CPU comparisons.
                target = {"pd": fine, "pd_inflight16": fine, "ainfer_pd": fine, "fine": fine,
                          "pd_genq": genq, "global-enqueue": genq}.get(name)
                if target is None:
                    continue
                for run in b["runs"]:
                    c = run["counters"]
                    for k, v in c.items():
                        target.setdefault(k, []).append(v)

    def per(d: dict, num: str, den: str) -> float:
        """Median ratio over replays; 0 where the counter was not exported (the CPU lane has no
        device timing)."""
        m = _median([a / b for a, b in zip(d.get(num, []), d.get(den, []), strict=False)
                     if b])
        return 0.0 if math.isnan(m) else m

    host_epoch_fine = per(fine, "vllm_ainfer_pd_p_enqueue_seconds_total",
                          "vllm_ainfer_pd_epochs_total")
    seg_per_epoch = per(fine, "vllm_ainfer_pd_segments_total", "vllm_ainfer_pd_epochs_total")
    host_epoch_genq = per(genq, "vllm_ainfer_pd_p_enqueue_seconds_total",
                          "vllm_ainfer_pd_epochs_total")
    # host per epoch = B * per_interval + segments * per_segment, at ~9 and at 1 segment(s).
    per_segment = (max(0.0, (host_epoch_fine - host_epoch_genq) / (seg_per_epoch - 1))
                   if seg_per_epoch > 1 else 0.0)
    per_interval = max(0.0, host_epoch_genq - per_segment) / boundaries
    host_seg = per(fine, "vllm_ainfer_pd_p_enqueue_seconds_total", "vllm_ainfer_pd_segments_total")
    wait_seg = per(fine, "vllm_ainfer_pd_d_wait_seconds_total", "vllm_ainfer_pd_segments_total")
    return {
        "overlap": round(per(fine, "vllm_ainfer_pd_p_overlap_seconds_total",
                             "vllm_ainfer_pd_p_device_seconds_total"), 4),
        "p_host_per_interval_s": round(per_interval, 6),
        "p_host_per_segment_s": round(per_segment, 6),
        "d_host_slack_s": round(max(0.0, host_seg - wait_seg), 6),
        "rendezvous_s": RENDEZVOUS,
        "measured": {"fine_replays": len(fine.get("vllm_ainfer_pd_epochs_total", [])),
                     "genq_replays": len(genq.get("vllm_ainfer_pd_epochs_total", [])),
                     "host_per_epoch_fine_s": round(host_epoch_fine, 5),
                     "host_per_epoch_genq_s": round(host_epoch_genq, 5),
                     "segments_per_epoch": round(seg_per_epoch, 3),
                     "d_wait_per_segment_s": round(wait_seg, 6),
                     "p_host_per_segment_s": round(host_seg, 6)},
    }


def derive(out_dir: Path) -> list[Path]:
    from benchmarks.scale.profile import Profile, fit_routing, save_profile
    from benchmarks.scale.shape import ModelShape
    from vllm_ainfer_pd.models.generate import PRESETS

    written = []
    device_rate = 0.0
    specs = {
        "gpu": ([GPU / "rollout_tp1_w01"], [GPU / "rollout_tp1_w01"], "gpu"),
        "gpu-mla": ([GPU / "rollout_tp1_mla"], [GPU / "rollout_tp1_mla"], "gpu-mla"),
    }
    for name, (rec_dirs, lane_dirs, preset) in specs.items():
        shape = ModelShape.from_hf(name, PRESETS[preset].hf_config())
        points, overheads = [], []
        for folder in rec_dirs:
            for label, recs in _records(folder, ("stock", "normal", "pd")):
                overheads.append(request_overhead(recs))
                if label.rsplit("-", 1)[0].endswith("pd"):
                    continue
                points += decode_points(label, recs)
                points.append(burst_point(label, recs, GPU_ENGINE["max_num_batched_tokens"]))
        if name == "gpu":
            for part in ("decodeg_a", "decodeg_b"):
                rep = json.loads((GPU / "decode_only_gpu_preset" / part / "report.json")
                                 .read_text())
                tpot = rep["backends"]["stock"]["aggregate"]["tpot_s.p50"]["median"]
                # 64 rows of 16-token prompts decoding 1,024 tokens: mean context 16 + 512.
                points.append({"rows": 64, "context": 64 * 528, "chunks": [], "samples": 0,
                               "seconds": tpot, "source": f"decode_only_gpu_preset/{part}: "
                                                          "stock TPOT p50, 64 rows"})
        engine = dict(GPU_ENGINE)
        engine["client_overhead_per_token_s"] = round(_median(overheads), 8)
        lane = lane_constants(lane_dirs, shape.layers + 1)
        measured = lane.pop("measured")
        # No forward above the CUDA-graph capture size is small enough in these records to show
        # its host time; the lane's P forward is one (no graphs), and global-enqueue releases it
        # whole: its host time per epoch is that floor.
        engine["h_eager_s"] = measured["host_per_epoch_genq_s"]
        lane.update(contention=CONTENTION, async_hide=ASYNC_HIDE)
        rel_dirs = [str(d.relative_to(ROOT)) for d in rec_dirs]
        raw = {"name": name, "shape": shape.to_dict(),
               "source": ("derived by benchmarks/profile_costs.py derive from the 1 x H200 "
                          f"rollouts' records and counters ({', '.join(rel_dirs)}"
                          "; decode-only run for the gpu preset); lane measured: "
                          + json.dumps(measured)),
               "hardware": H200, "engine": engine, "lane": lane, "points": points}
        prof = Profile.from_dict(raw)
        if name == "gpu":
            device_rate = prof.costs.s_per_byte
        else:
            # The same H200 reads memory at the rate the gpu preset's steps show; what differs
            # on the dummy-weight MLA model is how many experts its router spreads tokens over
            # (its steps grow far less with rows than uniform routing would make them).
            routed, fixed = fit_routing(shape, prof.points, device_rate, prof.capture,
                                        engine["h_eager_s"])
            raw["shape"] = routed.to_dict()
            raw["fit"] = {k: v for k, v in fixed.to_dict().items() if not k.startswith("eff_")}
            prof = Profile.from_dict(raw)
        path = out_dir / f"profile_{name.replace('-', '_')}_derived.json"
        save_profile(prof, path)
        written.append(path)
    return written


# The two constants fitted to the rollouts (docs/scale-model.md), one value for every GPU profile:
# the fraction of P's device time overlapped by D that D's round still pays (1: the device gives
# no more work per second with both running), and the fraction of D's device step that hides
# D's host wait for P under async scheduling.
CONTENTION = 1.0
ASYNC_HIDE = 0.25


# -- measure -----------------------------------------------------------------------------------

class Stepper:
    """One in-process vLLM engine, stepped by hand: each `LLMEngine.step()` runs one engine step
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so wall time between calls is what a step costs,
    scheduling and output processing included, as in a served step."""

    def __init__(self, llm, vocab: int) -> None:
        import random

        self.engine = llm.llm_engine
        self.vocab = vocab
        self.next_id = 0
        # Random ids: no two prompts share a block by accident (a periodic sequence would hit the
        # prefix cache and time a prefill that never ran).
        self.rng = random.Random(1234)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab - 1) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams

        self.next_id += 1
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)
        rid = f"p{self.next_id}"
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        return rid

    def step(self) -> set[str]:
        # vLLM may suffix the id it keeps internally ("p12-80eb8d27"); ours have no dash.
        return {o.request_id.split("-")[0] for o in self.engine.step() if o.finished}

    def until_done(self, req_ids: set[str], limit: int = 2000) -> int:
        steps = 0
        left = set(req_ids)
        while left:
            left -= self.step()
            steps += 1
            if steps >= limit:
                raise RuntimeError(f"requests {sorted(left)} not done after {limit} steps")
        return steps

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def timed(self, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t) / n

    def start_rows(self, rows: int, ctx: int, budget: int, decode: int) -> list[str]:
        """`rows` requests with their own `ctx`-token prompts, prefilled (not timed) and
        decoding when this returns, with room for `decode` more tokens each."""
        prefill_steps = -(-rows * ctx // budget) + 3
        ids = [self.add(self.ids(ctx), decode + prefill_steps) for _ in range(rows)]
        for _ in range(prefill_steps):
            self.step()
        return ids


def measure(args: argparse.Namespace) -> Path:
    import os

    from benchmarks.scale.profile import Profile, save_profile
    from benchmarks.scale.shape import ModelShape
    from vllm_ainfer_pd.models.generate import PRESETS, ensure_model

    cpu = args.platform == "cpu"
    model = str(ensure_model(args.model)) if args.model in PRESETS else args.model
    cfg = json.loads((Path(model) / "config.json").read_text())
    name = args.name or (args.model if args.model in PRESETS else Path(model).name)
    shape = ModelShape.from_hf(name, cfg, weight_bytes=4.0 if cpu else 2.0)
    engine = dict(CPU_ENGINE if cpu else GPU_ENGINE)
    if cpu:
        from dataclasses import replace

        from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, apply_cpu_env

        apply_cpu_env(1)
        shape = replace(shape, kv_bytes=4.0, act_bytes=4.0)
        engine_args = {**CPU_ENGINE_ARGS}
    else:
        engine_args = {"seed": 0, "load_format": "dummy", "gpu_memory_utilization": 0.88}
    if args.budget:
        engine["max_num_batched_tokens"] = args.budget
    # The served step budget (vllm serve's default), whatever LLM(...) would pick.
    engine_args.update(max_num_batched_tokens=engine["max_num_batched_tokens"],
                       enable_prefix_caching=True,
                       max_num_seqs=max(engine["max_num_seqs"], max(args.rows) + 2))
    if args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=model, **engine_args)
    st = Stepper(llm, shape.vocab)
    # Warm-up: every kind of step once (CUDA graphs, compiled shapes, the allocator).
    st.until_done({st.add(st.ids(64), 8), st.add(st.ids(600), 8)})
    points: list[dict] = []
    t_begin = time.time()
    for ctx in args.contexts:
        for rows in args.rows:
            ids = st.start_rows(rows, ctx, engine["max_num_batched_tokens"],
                                args.decode_tokens + 400)
            sec = st.timed(args.decode_tokens)
            points.append({"rows": rows, "context": rows * (ctx + args.decode_tokens // 2 + 8),
                           "chunks": [], "samples": 0, "seconds": round(sec, 7),
                           "source": f"measured: decode, {rows} rows at context {ctx}"})
            print(f"[profile] decode rows={rows} ctx={ctx}: {1e3 * sec:.3f} ms", file=sys.stderr)
            if rows in args.mixed_rows and ctx == args.contexts[0]:
                for start in args.starts:
                    for n in args.prefill:
                        prefix = st.ids(start) if start else []
                        if start:  # the cached prefix: its own request first
                            st.until_done({st.add(prefix + st.ids(1), 1)})
                        secs, k = [], 0
                        for _ in range(args.reps):
                            base = st.timed(4)
                            t = time.perf_counter()
                            k = st.until_done({st.add(prefix + st.ids(n), 1)})
                            # The steps it took, less the pure decode steps among them.
                            secs.append(time.perf_counter() - t - (k - 1) * base)
                        sec = min(secs)
                        points.append({"rows": rows, "context": rows * (ctx + args.decode_tokens),
                                       "chunks": [[n, start]], "samples": 1,
                                       "seconds": round(sec, 7),
                                       "source": f"measured: {rows} decode rows + prefill of {n} "
                                                 f"after {start} cached"})
                        print(f"[profile] mixed rows={rows} n={n} start={start}: "
                              f"{1e3 * sec:.3f} ms ({k} steps)", file=sys.stderr)
            st.engine.abort_request(ids)
            st.drain()
    for start in args.starts:
        for n in args.prefill:
            prefix = st.ids(start) if start else []
            if start:
                st.until_done({st.add(prefix + st.ids(1), 1)})
            times = []
            for _ in range(args.reps):
                # Nothing else runs: a step() with no forward (async scheduling's first call)
                # costs next to nothing, so the whole time is the prefill's forward.
                t = time.perf_counter()
                st.until_done({st.add(prefix + st.ids(n), 1)})
                times.append(time.perf_counter() - t)
            sec = min(times)
            points.append({"rows": 0, "context": 0, "chunks": [[n, start]], "samples": 1,
                           "seconds": round(sec, 7),
                           "source": f"measured: prefill of {n} after {start} cached"})
            print(f"[profile] prefill n={n} start={start}: {1e3 * sec:.3f} ms", file=sys.stderr)
    hardware = {**CPU_HARDWARE, "cores": os.cpu_count() or 1} if cpu else dict(H200)
    lane: dict = {"rendezvous_s": RENDEZVOUS}
    if cpu:
        lane.update(handoff=True)
    if args.lane_from:
        lane.update(lane_constants([Path(p) for p in args.lane_from], shape.layers + 1))
        lane.pop("measured", None)
        lane.update(contention=CONTENTION, async_hide=ASYNC_HIDE)
    raw = {"name": name, "shape": shape.to_dict(),
           "source": f"measured by benchmarks/profile_costs.py measure on {args.platform} "
                     f"({time.strftime('%Y-%m-%d')}, {time.time() - t_begin:.0f} s), model "
                     f"{args.model}, engine args {json.dumps(engine_args)}",
           "hardware": hardware, "engine": engine, "lane": lane, "points": points}
    prof = Profile.from_dict(raw)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(prof, out)
    return out


def refit(args: argparse.Namespace) -> Path:
    """A measured profile completed from the rollouts: the lane's constants and the server's
    per-token request cost from `--records-from`'s replays, and (MLA) the routing spread at the
    memory rate of `--device-rate-from`'s profile."""
    from benchmarks.scale.profile import (
        Profile,
        fit_routing,
        load_profile,
        save_profile,
    )

    raw = json.loads(Path(args.profile).read_text())
    raw.pop("fitted", None)
    if not raw["hardware"].get("cores"):
        # A GPU profile: the link constants are this script's (a profile written before they
        # changed keeps only its measured peaks).
        raw["hardware"] = {**H200, "peak_tflops": raw["hardware"]["peak_tflops"],
                           "hbm_tbps": raw["hardware"]["hbm_tbps"]}
    else:
        raw["hardware"] = {**CPU_HARDWARE, "cores": raw["hardware"]["cores"]}
        raw["engine"]["cudagraph_capture_size"] = 0  # eager on the CPU: no graph modes
    prof = Profile.from_dict(raw)
    folder = Path(args.records_from).resolve()
    overheads = [request_overhead(recs) for _, recs in _records(folder, ("stock", "normal", "pd"))]
    if args.with_rollout_points:
        # The rollouts' own steps beside the timed ones: clean decode windows and the opening
        # bursts (prefill chunks that cut prompts, so with cached context, as in a rollout).
        added = []
        for label, recs in _records(folder, ("stock", "normal")):
            added += decode_points(label, recs)
            added.append(burst_point(label, recs, raw["engine"]["max_num_batched_tokens"]))
        raw["points"] = list(raw["points"]) + added
        raw["source"] += f"; plus {len(added)} steps from the stock and normal replays' records"
    raw["engine"]["client_overhead_per_token_s"] = round(_median(overheads), 8)
    lane = lane_constants([Path(d).resolve() for d in (args.lane_from or [folder])],
                          prof.shape.layers + 1)
    lane.pop("measured")
    raw["lane"].update(lane, contention=CONTENTION, async_hide=ASYNC_HIDE)
    raw["source"] += (f"; lane constants and request cost from {folder.relative_to(ROOT)}")
    if args.device_rate_from:
        device = load_profile(args.device_rate_from)
        rate = device.costs.s_per_byte
        # The same machine: its collectives' fitted latency too.
        raw["hardware"]["collective_latency_us"] = device.hardware["collective_latency_us"]
        routed, fixed = fit_routing(prof.shape, prof.points, rate, prof.capture)
        raw["shape"] = routed.to_dict()
        raw["fit"] = {k: v for k, v in fixed.to_dict().items() if not k.startswith("eff_")}
        raw["source"] += (f"; memory rate and collective latency held at "
                          f"{args.device_rate_from}'s, routing spread fitted: "
                          f"{routed.routing_experts or routed.experts} experts")
    if args.frontend_from:
        a = frontend_overhead(Profile.from_dict(raw), Path(args.frontend_from).resolve())
        raw["engine"]["client_overhead_s"] = round(a, 6)
        raw["source"] += (f"; API server time per request {1e3 * a:.2f} ms fitted to the TTFT p99 "
                          f"of {Path(args.frontend_from).resolve().relative_to(ROOT)}")
    if args.dp_records:
        latency = dp_collective_latency(Profile.from_dict(raw), Path(args.dp_records).resolve())
        raw["hardware"]["collective_latency_us"] = round(latency, 2)
        raw["source"] += (f"; collective latency {latency:.1f} us fitted to the DP=2 decode steps "
                          f"of {Path(args.dp_records).resolve().relative_to(ROOT)}")
    out = Path(args.out or args.profile)
    save_profile(Profile.from_dict(raw), out)
    return out


def frontend_overhead(prof, folder: Path) -> float:
    """The API server's time per request (seconds, served one at a time) that makes the model's
    TTFT p99 of the decode-only run in `folder` (64 requests at once, one engine step of prefill)
    match stock's measured median: the last request waits for the 63 before it."""
    from dataclasses import replace

    from benchmarks.scale.costs import Layout
    from benchmarks.scale.engines import EngineSpec
    from benchmarks.scale.sim import simulate
    from vllm_ainfer_pd.rollout.trace import load_trace

    trace = load_trace(folder / "trace.jsonl")
    target = _median([json.loads((d / "report.json").read_text())["backends"]["stock"]
                      ["aggregate"]["ttft_s.p99"]["median"] for d in sorted(folder.iterdir())
                      if (d / "report.json").is_file()])
    lo, hi = 0.0, 0.01
    for _ in range(30):
        mid = (lo + hi) / 2
        p = replace(prof, engine={**prof.engine, "client_overhead_s": mid})
        got = simulate(trace, p, Layout(), EngineSpec("stock")).summary["ttft_s"]["p99"]
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2


def dp_collective_latency(prof, folder: Path) -> float:
    """The fixed latency per expert-parallel collective (microseconds) that makes the model's DP=2
    decode steps match those of the records in `folder` (served at DP=2 with expert
    parallelism): decode windows as in `decode_points`, rows split evenly over the two ranks,
    the median over windows of (measured - modelled without that latency) over the step's
    collectives."""
    from dataclasses import replace

    from benchmarks.scale.costs import CostModel, Layout
    from benchmarks.scale.shape import Batch

    hw = dict(prof.hardware, collective_latency_us=0.0)
    cm = CostModel(replace(prof, hardware=hw), Layout(dp=2, ep=True))
    per = []
    for path in sorted(folder.glob("*.jsonl")):
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        for p in decode_points(path.stem, recs):
            rows, ctx = p["rows"], p["context"]
            halves = [Batch(rows=rows / 2, context=ctx / 2)] * 2
            gap = p["seconds"] - cm.lockstep(halves)
            per.append(gap / (2 * prof.shape.moe_layers) * 1e6)
    return max(0.0, _median(per))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("derive", help="GPU profiles from the measured rollouts")
    d.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "scale")
    m = sub.add_parser("measure", help="drive an engine through LLM(...) and write a profile")
    m.add_argument("--model", default="tiny", help="a models preset or a model folder")
    m.add_argument("--name", default=None)
    m.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    m.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    m.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    m.add_argument("--mixed-rows", type=int, nargs="*", default=[4, 16],
                   help="decode rows beside which each prefill is also timed (first context)")
    m.add_argument("--prefill", type=int, nargs="+", default=[128, 512, 2048])
    m.add_argument("--starts", type=int, nargs="+", default=[0, 1024])
    m.add_argument("--decode-tokens", type=int, default=24)
    m.add_argument("--reps", type=int, default=2)
    m.add_argument("--max-model-len", type=int, default=None)
    m.add_argument("--budget", type=int, default=None,
                   help="the served step budget to record (default: vllm serve's on the platform)")
    m.add_argument("--lane-from", nargs="*", default=None,
                   help="rollout result folders whose pd counters give the lane's constants")
    m.add_argument("--out", required=True)
    r = sub.add_parser("refit", help="complete a measured profile from the rollouts")
    r.add_argument("--profile", required=True)
    r.add_argument("--records-from", required=True, help="a rollout result folder")
    r.add_argument("--device-rate-from", default=None,
                   help="hold the memory rate of this profile (same device, other model)")
    r.add_argument("--lane-from", nargs="*", default=None,
                   help="rollout result folders for the lane's constants (default: --records-from)")
    r.add_argument("--with-rollout-points", action="store_true",
                   help="also fit the decode windows and bursts of --records-from's replays")
    r.add_argument("--frontend-from", default=None,
                   help="the decode-only results folder: fit the API server's time per request")
    r.add_argument("--dp-records", default=None,
                   help="a folder of DP=2 + EP records: fit the collectives' fixed latency")
    r.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cmd == "derive":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for path in derive(args.out_dir):
            print(f"wrote {path}")
    elif args.cmd == "refit":
        print(f"wrote {refit(args)}")
    else:
        print(f"wrote {measure(args)}")


if __name__ == "__main__":
    main()
