#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the project's root (see benchmarks/results/gpu/README.md):
#   bash benchmarks/gpu_run.sh JOB...        carry .gpu/env (and .gpu/tiny, .gpu/tinygpu as needed)
# Jobs (each writes $OUT/<job>.json and logs; all logs end up in $OUT/logs.tar.gz):
#   tp1        TP=1 bf16 and float32, P lane on (one per GPU in parallel where there are 2)
#   tp1diag    the same with the P thread on its own vLLM workspace (benchmarks/gpu_lane_diag.py)
#   tp1eager   TP=1 bf16, P lane on, --enforce-eager for both engines
#   tp2        TP=2, P lane on, model $TP2_MODEL (default .gpu/tiny), extra flags $TP2_FLAGS
#   dp2        DP=2 + EP (vllm serve), P lane on, model $DP2_MODEL (default .gpu/tiny), $DP2_FLAGS
# tp2/dp2 run in $DT (default bfloat16). Every job has a wall-clock limit ($JOB_TIMEOUT_S, default
# 420 s); gpu_parity.py unwinds on its SIGTERM, stopping its `vllm serve` process groups.
# TP=2 needs TP2_FLAGS='--compilation-config {"pass_config":{"fuse_allreduce_rms":false}}' there
# (README in benchmarks/results/gpu).
set -u
source .gpu/env/install.sh || exit
export VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
d=/tmp/ainfer-ep/vllm_ainfer_pd-0.1.0.dist-info
mkdir -p $d
printf 'Metadata-Version: 2.1\nName: vllm-ainfer-pd\nVersion: 0.1.0\n' > $d/METADATA
printf '[vllm.general_plugins]\nainfer_pd = vllm_ainfer_pd.plugin:register\nainfer_pd_gpu_diag = benchmarks.gpu_lane_diag:register\n' > $d/entry_points.txt
export PYTHONPATH=$PWD:/tmp/ainfer-ep:$PYTHONPATH
OUT=${OUT:-/tmp/out}
mkdir -p $OUT /tmp/gpu-logs
LANE='{"ainfer_pd": {"p_lane_min_tokens": 32}}'
T=${JOB_TIMEOUT_S:-420}
NGPU=$(nvidia-smi -L | wc -l)

parity() {  # name gpus args...
  local name=$1 gpus=$2; shift 2
  echo "== $name (GPUs $gpus): gpu_parity.py $*"
  CUDA_VISIBLE_DEVICES=$gpus GPU_PARITY_LOG_DIR=/tmp/gpu-logs GPU_PARITY_JOB=$name timeout -k 60 $T \
    python3 benchmarks/gpu_parity.py "$@" --out $OUT/$name.json > /tmp/gpu-logs/$name.log 2>&1
  echo "== $name: rc=$?"
}

tp1() {  # $1: name suffix
  local sfx=${1:-}
  if [[ $NGPU -ge 2 ]]; then
    parity tp1_bfloat16$sfx 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" &
    parity tp1_float32$sfx 1 --model .gpu/tiny --tp 1 --dtype float32 --additional-config "$LANE" &
    wait
  else
    parity tp1_bfloat16$sfx 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE"
    parity tp1_float32$sfx 0 --model .gpu/tiny --tp 1 --dtype float32 --additional-config "$LANE"
  fi
}

start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for job in "$@"; do
  case $job in
    tp1) tp1 ;;
    tp1eager) parity tp1_bfloat16_eager 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" --enforce-eager ;;
    tp1diag) AINFER_PD_DIAG_P_WORKSPACE=1 tp1 _pws ;;
    tp2) parity tp2_${DT:-bfloat16}${TP2_SUFFIX:-} 0,1 --model ${TP2_MODEL:-.gpu/tiny} --tp 2 \
           --dtype ${DT:-bfloat16} --additional-config "$LANE" ${TP2_FLAGS:-} ;;
    dp2) parity dp2_ep_${DT:-bfloat16}${DP2_SUFFIX:-} 0,1 --model ${DP2_MODEL:-.gpu/tiny} --dp 2 \
           --dtype ${DT:-bfloat16} --additional-config "$LANE" ${DP2_FLAGS:-} ;;
    *) echo "unknown job $job" ;;
  esac
  echo "   elapsed $(( $(date +%s) - start )) s"
done
python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null
tar -C /tmp/gpu-logs -czf $OUT/logs.tar.gz . 2>/dev/null
for f in /tmp/gpu-logs/*.log; do
  echo "---- $(basename $f): last lines"
  grep -E "Error|error|Traceback|parity:|rank [0-9]+:|vllm_ainfer_pd_|P lane rank" $f | tail -25
done
