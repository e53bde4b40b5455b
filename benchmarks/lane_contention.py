"""D's and P's rates beside each other in the real lane, each relative to running alone, for each
issue pattern of P's kernels (`p_stream_marks`, and `p_sm_count`: P on a green context of that
many SMs): how much device time running P beside D buys.

    python benchmarks/lane_contention.py --platform gpu --model .gpu/gpu-model \
        --out benchmarks/results/gpu/lane_contention
    python benchmarks/lane_contention.py --out /tmp/contention    # CPU, tiny model

One `vllm serve` (the `ainfer_pd` backend, P lane on) per pattern, each through three windows of
`--window-s` seconds, measured from the server's own counters:

- **D alone**: `--decoders` clients, each sending short fresh prompts (inline: below
  `p_lane_min_tokens`) that decode `--decode-tokens` tokens, one after another; D's rate is
  generated tokens per second (`vllm:generation_tokens_total`). `--decode-context N` puts one
  shared N-token prefix before every decoder's prompt: cached after its first request, so the
  prompts stay inline, while every decode row attends over N more tokens (a rollout's decoders
  read long contexts);
- **both**: the decoders, and `--p-clients` clients each sending fresh `--p-tokens`-token prompts
  (through the lane) with `max_tokens=1`, one after another; both rates;
- **P alone**: the prompt clients only; P's rate is lane tokens per second
  (`vllm_ainfer_pd_p_tokens_total`).

Reported per pattern: D beside / D alone, P beside / P alone, and their sum (above 1: the device
ran the two phases faster together than one after the other; 1: D paid for all of P's device time
it overlapped, the scale model's `contention` 1.0). On the GPU the lane also times P's device work
with CUDA events (`overlap_timing`): the share of P's device time during which D ran.
On the CPU the numbers only show that the windows and counters work: P and D share the cores.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_ainfer_pd.rollout.backend_metrics import scrape  # noqa: E402
from vllm_ainfer_pd.rollout.compare import CompareConfig  # noqa: E402
from vllm_ainfer_pd.rollout.server import VllmServer  # noqa: E402

GENERATED = "vllm:generation_tokens_total"
LANE_TOKENS = "vllm_ainfer_pd_p_tokens_total"
P_DEVICE = "vllm_ainfer_pd_p_device_seconds_total"
P_OVERLAP = "vllm_ainfer_pd_p_overlap_seconds_total"


class Clients:
    """`n` client threads, each sending fresh prompts of `length` tokens one after another until
    stopped; a failed request stops the run (the window's rates would mean nothing)."""

    def __init__(self, url: str, model: str, n: int, length: int, max_tokens: int, seed: int,
                 vocab: int, prefix: list[int] | None = None) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
        self.model, self.length, self.max_tokens, self.vocab = model, length, max_tokens, vocab
        self.prefix = prefix or []
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(seed * 1000 + i,), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping.is_set():
            prompt = self.prefix + [rng.randrange(3, self.vocab) for _ in range(self.length)]
            try:
                self.client.completions.create(model=self.model, prompt=prompt,
                                               max_tokens=self.max_tokens, temperature=0.0,
                                               extra_body={"ignore_eos": True})
            except Exception as exc:  # noqa: BLE001 - reported by `stop`
                self.errors.append(repr(exc))
                return

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=600)
        if self.errors:
            raise RuntimeError(f"a client's request failed: {self.errors[0]}")


def window(url: str, seconds: float) -> dict[str, float]:
    """Counter changes per second over `seconds`."""
    before, start = scrape(url), time.monotonic()
    time.sleep(seconds)
    after, end = scrape(url), time.monotonic()
    if before is None or after is None:
        raise RuntimeError(f"{url}/metrics could not be read")
    names = (GENERATED, LANE_TOKENS, P_DEVICE, P_OVERLAP)
    out = {n: (after.get(n, 0.0) - before.get(n, 0.0)) / (end - start) for n in names}
    out["seconds"] = end - start
    return out


def measure(cfg: CompareConfig, pattern: str, args: argparse.Namespace, vocab: int) -> dict:
    lane = {"p_stream_marks": pattern, "p_lane_min_tokens": args.p_lane_min_tokens,
            "p_sm_count": args.p_sm_count, "overlap_timing": args.platform == "gpu"}
    flags = cfg.common_args() + ["--distributed-executor-backend", "ainfer_pd",
                                 "--additional-config", json.dumps({"ainfer_pd": lane})]
    print(f"[contention] {pattern}: starting the server", file=sys.stderr, flush=True)
    prefix = [random.Random(7).randrange(3, vocab) for _ in range(args.decode_context)]
    with VllmServer(cfg.model, flags, cfg.env(), name=f"contention-{pattern}") as srv:
        if prefix:  # prefill the shared prefix once, so the decoders' prompts find it cached
            from openai import OpenAI

            OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=600).completions.create(
                model=cfg.model, prompt=prefix, max_tokens=1)
        def clients(kind: str, seed: int) -> Clients:
            if kind == "d":
                return Clients(srv.url, cfg.model, args.decoders, 16, args.decode_tokens, seed,
                               vocab, prefix)
            return Clients(srv.url, cfg.model, args.p_clients, args.p_tokens, 1, seed, vocab)

        result = {}
        for rep in range(args.reps):
            d = clients("d", 10 + rep)
            time.sleep(args.warmup_s)
            d_alone = window(srv.url, args.window_s)
            p = clients("p", 20 + rep)
            time.sleep(args.warmup_s)
            both = window(srv.url, args.window_s)
            d.stop()  # the decoders' last requests end within --decode-tokens steps
            time.sleep(args.warmup_s)
            p_alone = window(srv.url, args.window_s)
            p.stop()
            # Each prompt client's request also generates its one token: not D's decode work.
            d_both = both[GENERATED] - both[LANE_TOKENS] / args.p_tokens
            rates = {"d_beside": d_both / d_alone[GENERATED],
                     "p_beside": both[LANE_TOKENS] / p_alone[LANE_TOKENS]}
            rates["sum"] = rates["d_beside"] + rates["p_beside"]
            if both[P_DEVICE]:
                rates["p_device_overlapped"] = both[P_OVERLAP] / both[P_DEVICE]
            print(f"[contention] {pattern} rep {rep + 1}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in rates.items()), file=sys.stderr, flush=True)
            result.setdefault("reps", []).append(
                {"rates": rates, "d_alone": d_alone, "both": both, "p_alone": p_alone})
        keys = set.intersection(*(set(r["rates"]) for r in result["reps"]))
        result["median"] = {k: statistics.median(r["rates"][k] for r in result["reps"])
                            for k in sorted(keys)}
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--model", default=None, help="model folder (default: the tiny preset)")
    p.add_argument("--patterns", default="segment,layer", help="p_stream_marks values")
    p.add_argument("--decoders", type=int, default=None, help="default: 64 GPU, 8 CPU")
    p.add_argument("--decode-tokens", type=int, default=None, help="default: 512 GPU, 64 CPU")
    p.add_argument("--decode-context", type=int, default=0,
                   help="a shared, cached prefix of this many tokens before each decoder's prompt")
    p.add_argument("--p-sm-count", type=int, default=0,
                   help="p_sm_count for every pattern: P's stream on a green context of this "
                        "many SMs (0: all SMs); reported as <pattern>@<N>sm")
    p.add_argument("--p-clients", type=int, default=4)
    p.add_argument("--p-tokens", type=int, default=None, help="default: 4,096 GPU, 512 CPU")
    p.add_argument("--p-lane-min-tokens", type=int, default=256)
    p.add_argument("--window-s", type=float, default=None, help="default: 15 GPU, 20 CPU")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    gpu = args.platform == "gpu"
    for name, on_gpu, on_cpu in (("decoders", 64, 8), ("decode_tokens", 512, 64),
                                 ("p_tokens", 4096, 512), ("window_s", 15.0, 20.0)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    if args.p_tokens < args.p_lane_min_tokens or 16 >= args.p_lane_min_tokens:
        p.error(f"--p-tokens={args.p_tokens} must reach --p-lane-min-tokens="
                f"{args.p_lane_min_tokens}, and the decoders' 16-token prompts must not")
    if args.decode_context < 0:
        p.error(f"--decode-context={args.decode_context} must be >= 0")
    if args.model is None:
        from vllm_ainfer_pd.models import ensure_model

        args.model = str(ensure_model("tiny", 0))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    cfg = CompareConfig(model=args.model, out=args.out, platform=args.platform)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for pattern in args.patterns.split(","):
        name = f"{pattern}@{args.p_sm_count}sm" if args.p_sm_count else pattern
        results[name] = measure(cfg, pattern, args, vocab)
        # Written after each pattern: a run stopped at its time limit keeps the ones it measured.
        (args.out / "contention.json").write_text(json.dumps(
            {"settings": settings, "results": results}, indent=1) + "\n")
    lines = [f"# D and P beside each other in the lane ({args.platform})", "",
             f"`{' '.join(sys.argv)}`; median over {args.reps} repetitions per pattern "
             "(`contention.json` has each).", "",
             "| `p_stream_marks` | D beside / alone | P beside / alone | sum | P device time "
             "overlapped by D |", "|---|---|---|---|---|"]
    for pattern, r in results.items():
        m = r["median"]
        overlapped = f"{m['p_device_overlapped']:.2f}" if "p_device_overlapped" in m else "-"
        lines.append(f"| `{pattern}` | {m['d_beside']:.3f} | {m['p_beside']:.3f} | "
                     f"{m['sum']:.3f} | {overlapped} |")
    (args.out / "contention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
