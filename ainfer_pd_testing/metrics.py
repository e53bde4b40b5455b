"""Reading a served engine's per-rank lane counters once they are complete."""

from __future__ import annotations

import time

from ainfer_pd_testing.parity import ServerRunner
from vllm_ainfer_pd.rollout.backend_metrics import by_rank, read_metrics_text


def settled_rank_metrics(url: str, model: str, dp_size: int, timeout_s: float = 30.0):
    """Per-rank lane counters once every DP rank has reported all it did, in rank order (the
    order of /metrics follows which rank reported first).

    A rank's counters reach `/metrics` with its next real forward (vllm_ainfer_pd.metrics), so
    what a rank did in dummy steps or after its last forward is not there yet when a run ends.
    One short inline request per DP rank (routed by vLLM's `X-data-parallel-rank` header; too
    short for the P lane) gives each rank that forward; then wait for the frontend to record it.
    """
    client = ServerRunner(url, model).client()
    for dp_rank in range(dp_size):
        client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2,
                                  extra_headers={"X-data-parallel-rank": str(dp_rank)})
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        ranks = by_rank(read_metrics_text(url))
        if ranks == previous or time.monotonic() > deadline:
            return dict(sorted(ranks.items(), key=lambda item: int(item[0])))
        previous = ranks
        time.sleep(2.0)


def kv_usage(text: str) -> dict[str, float]:
    """`vllm:kv_cache_usage_perc` per engine (DP rank) from `/metrics`' text: 0.0 where no block
    is held (prefix-cached blocks that no request holds count as free)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out
