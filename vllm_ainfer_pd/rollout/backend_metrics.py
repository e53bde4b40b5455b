"""The server's own counters over one replay, read from its Prometheus `/metrics` before and after.

Two families: the ainfer_pd backend's (`vllm_ainfer_pd_*`: D wait, P wait-for-permit, segments per
epoch, rendezvous time; present only when that backend exports them) and a few of vLLM's engine
counters that every backend has (preemptions, prompt tokens computed vs served from the prefix
cache, and with speculative decoding its draft and accepted tokens). Series are summed over their
labels (engines, ranks): the paper reports rank-aggregated totals. The one exception is
`vllm:prompt_tokens_by_source_total`, kept per `source`: vLLM counts the P lane's prompt tokens
as `external_kv_transfer` (they arrive through the KV connector) and so within
`vllm:prompt_tokens_cached_total`; `local_cache_hit` is the prefix cache alone. Counters and
histogram sums/counts are reported as after - before; gauges as after. Nothing is invented: a
metric the server does not export is absent from the result.
"""

from __future__ import annotations

import json
import time
import urllib.request

PREFIX = "vllm_ainfer_pd_"
ENGINE = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total",
          "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total",
          # with speculative decoding: a drafter never sees a lane prompt's tokens before its last
          "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
          "vllm:spec_decode_num_accepted_tokens_total")
BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # kept per source label
_ACCUMULATING = ("_total", "_sum", "_count")


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}, for PREFIX and ENGINE names
    (histogram buckets and `_created` timestamps left out), and BY_SOURCE per source, named
    `BY_SOURCE{source="..."}`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == BY_SOURCE and 'source="' in line:
            name += '{source="' + line.split('source="', 1)[1].split('"', 1)[0] + '"}'
        elif not (name.startswith(PREFIX) or name in ENGINE):
            continue
        if name.endswith(("_bucket", "_created")):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """`parse` of the server's /metrics; None if the endpoint cannot be read."""
    try:
        return parse(read_metrics_text(url, timeout_s))
    except OSError:
        return None


def by_rank(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {rank label: {PREFIX sample name: value}} (summed over other labels)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX) or "{" not in line or "_created" in line:
            continue
        series, value = line.rsplit(" ", 1)
        name, labels = series.split("{", 1)
        if 'rank="' not in labels:
            continue
        rank = labels.split('rank="', 1)[1].split('"', 1)[0]
        out.setdefault(rank, {})
        out[rank][name] = out[rank].get(name, 0.0) + float(value)
    return out


def settle(url: str, dp_size: int, model: str | None = None, timeout_s: float = 30.0) -> str:
    """/metrics' text once every DP rank has reported all its lane counters.

    A rank's lane counters reach `/metrics` with its next real forward (vllm_ainfer_pd.metrics),
    so what a rank counted in dummy steps or after its last forward (an epoch its last post-D
    opened) is missing when a run ends. One request of a one-token prompt per DP rank (routed by
    vLLM's `X-data-parallel-rank` header; it leaves the lane nothing to prefill, whatever
    `p_lane_min_tokens` is) gives each rank that forward and adds no lane work; then
    /metrics is read every 2 s until two reads agree on the lane's series (or `timeout_s`).
    `model`: the served model's id (default: the first `GET /v1/models` lists)."""
    if model is None:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as r:
            model = json.loads(r.read())["data"][0]["id"]
    for dp_rank in range(dp_size):
        request = urllib.request.Request(
            url.rstrip("/") + "/v1/completions", method="POST",
            data=json.dumps({"model": model, "prompt": [1], "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json", "X-data-parallel-rank": str(dp_rank)})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            r.read()
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        text = read_metrics_text(url)
        lane = by_rank(text)
        if lane == previous or time.monotonic() > deadline:
            return text
        previous = lane
        time.sleep(2.0)


def after_run(url: str, dp_size: int) -> dict[str, float] | None:
    """`parse` of /metrics at the end of a run: vLLM's engine counters as the run left them (the
    settling requests' tokens not counted), the lane's once `settle`d."""
    engine = scrape(url)
    if engine is None:
        return None
    lane = parse(settle(url, dp_size))
    return {**{k: v for k, v in engine.items() if not k.startswith(PREFIX)},
            **{k: v for k, v in lane.items() if k.startswith(PREFIX)}}


def read_metrics_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        return r.read().decode(errors="replace")


def delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What the replay added: after - before for counters, after for gauges; `<hist>_mean` for
    every histogram with both a sum and a count that moved."""
    if after is None:
        return {}
    before = before or {}
    out = {name: value - before.get(name, 0.0)
           if name.split("{", 1)[0].endswith(_ACCUMULATING) else value
           for name, value in after.items()}
    for name in list(out):
        if name.endswith("_sum") and out.get(name[:-4] + "_count"):
            out[name[:-4] + "_mean"] = out[name] / out[name[:-4] + "_count"]
    # The lane's headline ratios (over all ranks): mean D wait per D iteration that released P
    # work (one segment each; in the global modes one per epoch, holding the whole epoch),
    # segments per P epoch, and P tokens per epoch (how full the lane keeps its forwards, against
    # the step token budget: part-empty epochs slowed a rollout's opening burst on GPU).
    segments, epochs = out.get(PREFIX + "segments_total"), out.get(PREFIX + "epochs_total")
    if segments:
        out[PREFIX + "mean_d_wait_ms"] = (
            1e3 * out.get(PREFIX + "d_wait_seconds_total", 0) / segments)
    if epochs:
        out[PREFIX + "segments_per_epoch"] = out.get(PREFIX + "segments_total", 0) / epochs
        out[PREFIX + "p_tokens_per_epoch"] = out.get(PREFIX + "p_tokens_total", 0) / epochs
    return out


def backend_only(counters: dict[str, float]) -> dict[str, float]:
    """The `vllm_ainfer_pd_*` part of `delta`'s result (empty: the backend exports none)."""
    return {k: v for k, v in counters.items() if k.startswith(PREFIX)}
