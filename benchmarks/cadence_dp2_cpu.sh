#!/usr/bin/env bash
# vLLM's own answer to the prefill stall at DP > 1 beside ours, on the CPU at DP=2 + EP: `pd`
# (the lane), `normal` (same backend, lane off), and `normal` with vLLM's prefill cadence
# (--prefill-schedule-interval N: new prefills only every Nth engine step, the same steps on every
# DP rank; it acts only in vLLM's data-parallel engine) for N in 2, 4, 8. Stock vLLM 0.26 cannot
# serve DP + EP on the CPU, so `normal` is the baseline. One server at a time (five DP=2 servers
# do not fit in memory together), the same trace and repetitions for each.
#
#   bash benchmarks/cadence_dp2_cpu.sh [OUT]     (default benchmarks/results/cpu/cadence_dp2_ep)
#
# REPS (default 3) and WAIT_SCALE (default 1.0) override the repetitions and the client waits.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/cpu/cadence_dp2_ep}
py=$(bash scripts/setup_env.sh | tail -n 1)
"$py" -m vllm_ainfer_pd.models --preset tiny > /dev/null
normal='{"ainfer_pd": {"mode": "normal"}}'
cadence() {  # the `normal` backend with vLLM's prefill cadence N
  echo "normal_c$1=--distributed-executor-backend ainfer_pd --additional-config '$normal' --prefill-schedule-interval $1"
}
"$py" -m vllm_ainfer_pd.rollout compare --preset cpu --dp 2 --enable-expert-parallel \
  --reps "${REPS:-3}" --wait-scale "${WAIT_SCALE:-1.0}" --schedule sequential --no-progress \
  --variant "normal=$normal" \
  --backend "$(cadence 2)" --backend "$(cadence 4)" --backend "$(cadence 8)" \
  --only normal,ainfer_pd,normal_c2,normal_c4,normal_c8 --out "$out"
