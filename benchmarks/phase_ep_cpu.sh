#!/usr/bin/env bash
# Phase-owned expert-parallel state at TP=2 x DP=2 + EP on the CPU (4 ranks on the cores; ~16 min
# on 2 busy cores, too long for `make test`, whose DP=2 + EP case is tests/test_phase_ep.py):
# greedy parity of `pd` (P's host work beside D's step) with `normal` in the same layout and with
# stock TP=1 (benchmarks/serve_parity_cpu.py), then, per rank, P's calls on its own EP and DP
# communicators. At TP=2 x DP=2 P's EP group spans D's TP groups, so those collectives take D's
# stream too (docs/deepep.md): every rank counts the same own collectives, all of them routed.
#
#   bash benchmarks/phase_ep_cpu.sh [OUT]   (default benchmarks/results/cpu/parity_tp2_dp2_ep_phase_owned.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/cpu/parity_tp2_dp2_ep_phase_owned.json}
py=$(bash scripts/setup_env.sh | tail -n 1)
"$py" benchmarks/serve_parity_cpu.py --tp 2 --dp 2 --p-host concurrent --out "$out" > /dev/null
"$py" - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ranks = r["pd"]["lane_by_rank"]
own = {k: v.get("vllm_ainfer_pd_p_collectives_own_total", 0) for k, v in ranks.items()}
routed = {k: v.get("vllm_ainfer_pd_p_collectives_routed_total", 0) for k, v in ranks.items()}
print(f"pd vs normal {r['pd_vs_normal']}, vs stock TP=1 {r['pd_vs_stock_tp1']}")
print(f"P collectives per rank: own {own}, routed {routed}")
ok = r["ok"] and len(set(own.values())) == 1 and min(own.values()) > 0 \
    and all(routed[k] >= own[k] for k in own)
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
