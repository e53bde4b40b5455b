#!/usr/bin/env bash
# Greedy parity with the P lane on and speculative decoding, on the CPU, at TP=1, at TP=2 and at
# DP=2 with expert parallelism, for vLLM's n-gram drafter, a draft model (the tiny model drafting
# for itself) and EAGLE (a random EAGLE head): `pd` against `normal` in the same layout, both with
# the drafter, and against stock TP=1 under the tie rule (benchmarks/serve_parity_cpu.py). P's host
# work runs beside D's step (`p_host=concurrent`, the GPU default), so a drafter outside the round
# would race P's collectives. A drafter with layers of its own adds attention layers to vLLM's
# forward context, and P must stop at the target's layers alone (TP=1 shows it with the fewest
# parts; make test covers it at TP=2 with a draft model and at DP=2 with EAGLE).
#
#   bash benchmarks/spec_parity_cpu.sh [OUT_DIR]   (default benchmarks/results/cpu/spec_parity)
#
# ONLY (default "tp1:draft tp1:eagle tp2:ngram tp2:draft tp2:eagle dp2:ngram dp2:draft dp2:eagle")
# picks the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/cpu/spec_parity}
mkdir -p "$out"
py=$(bash scripts/setup_env.sh | tail -n 1)
tiny=$("$py" -c 'from vllm_ainfer_pd.models import ensure_model; print(ensure_model("tiny", 0))')
eagle=$("$py" -c 'from vllm_ainfer_pd.models import ensure_model; print(ensure_model("tiny", eagle=True))')
declare -A spec=(
  [ngram]='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
  [draft]="{\"method\": \"draft_model\", \"model\": \"$tiny\", \"num_speculative_tokens\": 2}"
  [eagle]="{\"method\": \"eagle\", \"model\": \"$eagle\", \"num_speculative_tokens\": 3}"
)
for run in ${ONLY:-tp1:draft tp1:eagle tp2:ngram tp2:draft tp2:eagle dp2:ngram dp2:draft dp2:eagle}; do
  layout=${run%%:*} method=${run#*:}
  case $layout in tp1) flags=(--tp 1 --dp 1) ;; tp2) flags=(--tp 2 --dp 1) ;; *) flags=(--tp 1 --dp 2) ;; esac
  echo "== $run" >&2
  "$py" benchmarks/serve_parity_cpu.py "${flags[@]}" --p-host concurrent \
    --speculative-config "${spec[$method]}" --out "$out/${layout}_${method}.json" > /dev/null \
    || echo "== $run failed" >&2
done
"$py" - "$out" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    rows.append(f"| {f.stem} | {r['pd_vs_normal']} | {r['pd_vs_stock_tp1']} | {r['ok']} |")
print("| run | pd vs normal | pd vs stock TP=1 | ok |\n|---|---|---|---|\n" + "\n".join(rows))
PY
