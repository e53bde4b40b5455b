"""Reading a served engine's per-rank lane counters once they are complete."""

from __future__ import annotations

from vllm_ainfer_pd.rollout.backend_metrics import by_rank, settle


def settled_rank_metrics(url: str, model: str, dp_size: int, timeout_s: float = 30.0):
    """Per-rank lane counters once every DP rank has reported all it did (`settle`), in rank
    order (the order of /metrics follows which rank reported first)."""
    ranks = by_rank(settle(url, dp_size, model, timeout_s))
    return dict(sorted(ranks.items(), key=lambda item: int(item[0])))


def kv_usage(text: str) -> dict[str, float]:
    """`vllm:kv_cache_usage_perc` per engine (DP rank) from `/metrics`' text: 0.0 where no block
    is held (prefix-cached blocks that no request holds count as free)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out
