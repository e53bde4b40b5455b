#!/usr/bin/env bash
# Runs on a GPU machine, from the project's root (benchmarks/RESULTS.md lists what each job
# measured):
#   bash benchmarks/gpu_run.sh JOB...
# Models in .gpu/ (vllm-ainfer-pd-model --preset tiny|gpu|gpu-mla --out .gpu/tiny|gpu-model|gpu-mla).
# vLLM 0.26.0 installed, or a vLLM pack in .gpu/env or .gpu32/env (vLLM 0.32.0 with torch 2.13;
# sourced when present: a machine without a package index).
# Jobs (each writes $OUT/<job>.json and logs; all logs end up in $OUT/logs.tar.gz):
#   tp1        TP=1 bf16 and float32, P lane on (one per GPU in parallel where there are 2)
#   tp1eager   TP=1 bf16, P lane on, --enforce-eager for both engines
#   tp1spec    TP=1 bf16, P lane on, speculative decoding on both engines: vLLM's n-gram drafter,
#              then the tiny model drafting for itself (draft and acceptance counts per engine)
#   tp1eagle   the same with a random EAGLE head (models --preset tiny --eagle, made on the machine)
#   tp1eaglebi the same, bf16 with VLLM_BATCH_INVARIANT=1, then float32
#   tp1dhigh   TP=1 bf16, P lane on, D's stream at high priority (d_stream_priority="high")
#   tp1mla     TP=1 bf16, P lane on, MLA attention: the tiny-mla preset (DeepSeek-V3's layout),
#              generated on the machine; default kernels, then VLLM_BATCH_INVARIANT=1
#   tp1mlalong the same with gpu_parity.py --long-prompts (MLA's prefill kernels, cached context)
#   tp1mlatail stock vs stock, long prompts, batch-invariant: the second computes each prompt's
#              last token in a later step, as the lane does (gpu_parity.py --control tail)
#   tp1swa     TP=1 $SWA_DT (default bfloat16), P lane on, the tiny model with a 64-token sliding window on every layer
#              (one windowed KV cache group: prompts over 64 tokens prefill inline)
#   tp1pause   TP=1 $PAUSE_DT (default float32), P lane on (PAUSE_BACKEND=stock: the same on stock, a
#              control): benchmarks/gpu_pause.py -- pause_generation
#              keep (new weights) / wait / abort with P in flight, sleep(level=1) mid-rollout and
#              wake_up, each request judged against stock vLLM with the same weights (bf16 runs
#              batch-invariant, but its 64-token steps chunk prompts differently from stock's)
#   tp1fresh   TP=1 float32, gpu_pause.py with no pause and no sleep (two plain rollouts of 16
#              prompts on a new engine, 64-token steps), four ways: the lane with vLLM's defaults,
#              with async scheduling off, with --enforce-eager; mode=normal (the 1-in-16
#              divergence after a weight update, RESULTS.md; ~150 s each, so two calls:
#              FRESH_ONLY=default,sync then FRESH_ONLY=eager,normal)
#   tp1tie     TP=1 float32, stock only: benchmarks/gpu_batch_sensitivity.py on prompt 7 of
#              gpu_pause.py's prompts(4) after its weight update: stock's tokens in six batches
#              (CUDA graphs), then in eager mode with every router's top-k margin (stock's own
#              batch sensitivity after the weight update, RESULTS.md; ~3 min)
#   attn1      TP=1 bf16, P lane on, lane parity with each attention backend vLLM 0.26 offers on
#              Hopper, named (--attention-backend): FLASH_ATTN, FLASHINFER, TRITON_ATTN,
#              FLEX_ATTENTION (or the comma-separated $ATTN_BACKENDS); the tiny model, except
#              FLASHINFER on the gpu preset with dummy weights (carry .gpu/gpu-model: FlashInfer
#              refuses the tiny model's head size 32). $OUT/attn_tp1_bfloat16_<model>_<BACKEND>.json
#              each; a backend the lane refuses at start is recorded there as "refused" (rc=2).
#              ATTN_EAGER=1: both engines --enforce-eager (a quicker pass, ~1 min per backend
#              instead of ~3.5); ATTN_BI=1: vLLM's batch-invariant kernels on both engines
#              (VLLM_BATCH_INVARIANT=1; files ..._bi_...); ATTN_CONTROL=tail: stock against stock
#              computing each prompt's last token in a later step, as the lane does (no lane)
#   attn1mla   the same on MLA (the tiny-mla preset, generated here): FLASH_ATTN_MLA, FLASHMLA,
#              TRITON_MLA (or $ATTN_BACKENDS; FLASHINFER_MLA runs on compute capability 10.x
#              only in vLLM 0.26, so not on Hopper)
#   tp2        TP=2, P lane on, model $TP2_MODEL (default .gpu/tiny), extra flags $TP2_FLAGS
#   dp2        DP=2 + EP (vllm serve), P lane on, model $DP2_MODEL (default .gpu/tiny), $DP2_FLAGS
#   dp2mla     DP=2 + EP (vllm serve), P lane on, the tiny-mla preset, VLLM_BATCH_INVARIANT=1
#   deepep1    one GPU, no vLLM: benchmarks/deepep_one_gpu.py (phase-owned DeepEP sizes; both buffers
#              and what runs of them at EP=1). DeepEP is built first with scripts/build_deepep.sh
#              from $DEEPEP_SRC where `import deep_ep` fails
#   deepep1vllm one GPU, vLLM's own manager: DeepEP built here with scripts/build_deepep.sh from
#              the checkout in $DEEPEP_SRC (default .gpu/deepep-src: vLLM 0.26's pin d4f41e4e93 with
#              its third-party/fmt, made by scripts/deepep_source.sh), then
#              benchmarks/deepep_vllm_one_gpu.py (vLLM's DeepEPLLAll2AllManager builds D's buffer,
#              the lane's normal-mode buffer beside it, the guard, the sizes, P's SM count, the
#              low-latency dispatch + combine with vLLM's keywords at EP=1). d4f41e4e93 needs NCCL
#              >= 2.30.4 (torch brings 2.28.9): an nvidia-nccl-cu13 >= 2.30.4 importable as
#              nvidia.nccl (e.g. in the vLLM pack) or NCCL_DIR; without one that build stops in one
#              line and the job builds $DEEPEP_SRC_FALLBACK (default .gpu/deepep-src-1x: a 1.x commit
#              with enable_shrink, 29d31c0) if carried. Writes $OUT/deepep/build_info.json and
#              $OUT/deepep/deepep_vllm_one_gpu.json (the build logs go into logs.tar.gz)
#   deepep2    two GPUs, no vLLM: benchmarks/deepep_two_gpu.py (P's normal mode beside D's low
#              latency under the turnstile, 5 x 512 rounds with 0-20 ms skew against exact references;
#              D's time with P active vs alone, P's SMs 12/24/all); needs JOB_TIMEOUT_S=590
#   dp2deepep  DP=2 + EP (vllm serve), bf16, P lane on with phase-owned DeepEP
#              (--all2all-backend deepep_low_latency) against mode=normal with deepep_low_latency,
#              then against mode=normal with deepep_high_throughput
#   tp1bi tp2bi dp2bi   bf16 parity with VLLM_BATCH_INVARIANT=1 (tp1bi also runs TP=1 without it)
#   floor      benchmarks/physical_floor.py --measure on GPU 0 (gpu preset, gpu-quick trace)
#   bench1     TP=1 rollout: stock + normal (GPU 0) beside pd + pd_k1 (GPU 1), merged report;
#              one GPU: stock, normal, pd one after another
#   ladder1    TP=1 rollout, global-enqueue (GPU 0) beside global-complete (GPU 1)
#   bench1a bench1b bench1c   one GPU, one call each (a call runs at most 10 min): stock+normal,
#              pd+pd_handoff, pd_genq+pd_gcomp (the ladder); merged afterwards with `rollout merge`
#   decode1    decode-only overhead, tiny model: pd (no P) vs normal vs stock side by side
#   decodeg    decode-only overhead on the gpu preset through `vllm serve` (device-bound steps):
#              64 one-turn requests, 16-token prompts (no lane work), 1,024 tokens each, no waits;
#              backends $DECODEG_ONLY (default stock,normal,pd; run in that order), $DECODEG_REPS
#              repetitions (default 3), output decodeg_$DECODEG_TAG
#   profile1   pd under the gpu-quick rollout (waits x $WAIT_SCALE, default 0.1) with vLLM's torch
#              profiler over engine steps $PROFILE_DELAY.. (+$PROFILE_ITERS): benchmarks/profile_lane.py
#              reads P's kernel time overlapped by D's and P's blocking host calls; model
#              $PROFILE_MODEL (default .gpu/gpu-model; .gpu/gpu-mla for MLA)
#   residency  one GPU, no vLLM: benchmarks/residency_stall.py (the residency condition of the
#              crossed-cycle hang; also runs without the pack: python3 benchmarks/residency_stall.py)
#   tp2dp2bi   4 GPUs: TP=2 x DP=2 + EP served parity, bf16, batch-invariant kernels
#   bench4     4 GPUs: TP=2 x DP=2 + EP rollout, stock, normal, pd one after another
#   bench2     TP=2 rollout: stock, normal, pd one after another (carry .gpu/gpu-model)
#   bench2dp   DP=2 + EP rollout (2 GPUs), backends $BENCH2DP_ONLY (default stock,normal) of
#              stock, normal, pd, pd_genq, pd_whole, pd_work, pd_gate (the epoch gate as the scale
#              model's pd_gate), pd_nogate (the gate off) and stock with vLLM's prefill cadence
#              (stock_c4 ... stock_c128: --prefill-schedule-interval N); output
#              bench2dp_$BENCH2DP_TAG (default a). The gate on and off against the cadences the
#              scale model finds best at DP=2 (N=16, N=128), one call each (a call runs 10 min):
#              WAIT_SCALE=0.1 BENCH2DP_TAG=g1 BENCH2DP_ONLY=stock,pd,pd_nogate bash benchmarks/gpu_run.sh bench2dp
#              WAIT_SCALE=0.1 BENCH2DP_TAG=g2 BENCH2DP_ONLY=stock,stock_c16,stock_c128 bash benchmarks/gpu_run.sh bench2dp
#   bench1d    TP=1 rollout, pd_whole (one segment per epoch: the TTFT end of the trade-off)
#   bench1x    TP=1 rollout, backends $BENCH1X_ONLY (default stock,normal,pd) of all the variants;
#              output bench1x_$BENCH1X_TAG (default a); pair with WAIT_SCALE=0.1
#   cached1x   TP=1 rollout, backends $BENCH1X_ONLY (default stock,pd), each repetition followed by
#              its prompts again on the same server (`compare --cached-replay`: backends
#              <name>_cached, whose prefill finds its prefixes cached): the makespan no way of
#              scheduling prefill beside the same decode can beat; output cached1x_$BENCH1X_TAG;
#              pair with WAIT_SCALE=0.1
#   bench1marks TP=1 rollout, stock, pd and pd_layer (p_stream_marks="layer": a timing event on
#              P's stream after every layer), $BENCH1X_REPS repetitions each (default 3); output
#              bench1marks_$BENCH1X_TAG; pair with WAIT_SCALE=0.1
#   bench1free TP=1 rollout, stock, pd and pd_free (ordering="free": no ordering at one rank) or
#              $BENCH1X_ONLY among those and pd_free_layer; output bench1free_$BENCH1X_TAG
#   tp1free    TP=1 bf16 batch-invariant lane parity with ordering="free"
#   bench1eagle TP=1 rollout, stock and pd, both with a random EAGLE head for the gpu preset (made on
#              the machine; every draft is rejected, in both): TPOT with drafting inside the round;
#              output bench1eagle_$BENCH1X_TAG; pair with WAIT_SCALE=0.1
#   contention1 D's and P's rates beside each other in the lane, relative to each alone, for
#              p_stream_marks $CONTENTION_PATTERNS (default segment,layer; sublayer in a second
#              call: a pattern takes ~4 min; more flags in $CONTENTION_ARGS, e.g. --decode-context
#              8192 for decoders that attend over long contexts, --p-sm-count N for P on a green
#              context of N SMs): benchmarks/lane_contention.py
#              on the gpu preset (64 decoders, 4 clients of 4,096-token prompts), output contention1/
#   bench1xmla the same on the gpu-mla preset (MLA, DeepSeek-V3's layout; carry .gpu/gpu-mla),
#              backends $BENCH1X_ONLY (default stock,pd); output bench1xmla_$BENCH1X_TAG
# tp2/dp2 run in $DT (default bfloat16). Every job has a wall-clock limit ($JOB_TIMEOUT_S, default
# 420 s); gpu_parity.py unwinds on its SIGTERM, stopping its `vllm serve` process groups.
# TP=2 needs TP2_FLAGS='--compilation-config {"pass_config":{"fuse_allreduce_rms":false}}' there
# (docs/support.md).
set -u
# vLLM 0.32.0 with its torch 2.13 where its pack came along (scripts/stage_gpu_vllm032.sh), else
# vLLM 0.26.0's pack on the image's torch 2.11.
if [[ -f .gpu32/env/install.sh ]]; then source .gpu32/env/install.sh || exit
elif [[ -f .gpu/env/install.sh ]]; then source .gpu/env/install.sh || exit; fi
# The V1 runner unless the caller picks Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, vLLM 0.32 on).
export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0} PYTHONUNBUFFERED=1
# The plugin's entry point for a checkout on PYTHONPATH with no install (beside an install, Python
# reads one distribution per name).
d=/tmp/ainfer-ep/vllm_ainfer_pd-0.1.0.dist-info
mkdir -p $d
printf 'Metadata-Version: 2.1\nName: vllm-ainfer-pd\nVersion: 0.1.0\n' > $d/METADATA
printf '[vllm.general_plugins]\nainfer_pd = vllm_ainfer_pd.plugin:register\n' > $d/entry_points.txt
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

# Rollout comparisons on the `gpu` model preset (.gpu/gpu-model: config + tokenizer, weights made
# by vLLM with --load-format dummy), trace preset gpu-quick, 3 repetitions, waits x $WAIT_SCALE
# (default 0.5; there the client waits bind the makespan at >= 17.7 s, physical_floor.py --wait-scale;
# at 0.1 the hardware floor binds).
ROLLOUT="--platform gpu --model .gpu/gpu-model --preset gpu-quick --reps 3 --wait-scale ${WAIT_SCALE:-0.5} --no-progress"
V_NORMAL='normal={"ainfer_pd": {"mode": "normal"}}'
V_PD='pd={"ainfer_pd": {"segment_policy": "load", "overlap_timing": true}}'
V_PD_K1='pd_k1={"ainfer_pd": {"segment_policy": "fixed", "overlap_timing": true}}'
# load's K, raised to up to ~1/8 of a full-budget forward per round: TTFT of short lane prompts.
V_PD_WORK='pd_work={"ainfer_pd": {"segment_policy": "work", "overlap_timing": true}}'
# Prompts under 2,048 new tokens inline (vLLM's chunked prefill) instead of 512: TTFT of later turns
# against the decode steps they ride in.
V_PD_LANE2K='pd_lane2k={"ainfer_pd": {"p_lane_min_tokens": 2048, "overlap_timing": true}}'
# The cap on lane prompts in flight (max_p_inflight), which decides how fast the opening burst (64
# prompts at t=0) enters the lane. 16 is the default, so `pd` runs it (results measured before
# it became the default call it pd_inflight16); pd_inflight4 is the earlier default.
V_PD_IF8='pd_inflight8={"ainfer_pd": {"max_p_inflight": 8, "overlap_timing": true}}'
V_PD_IF4='pd_inflight4={"ainfer_pd": {"max_p_inflight": 4, "overlap_timing": true}}'
# D's stream (vLLM's compute stream) at CUDA's highest priority, P's at the default (lowest): where
# both have blocks waiting, the SMs take D's first (TPOT during the opening burst).
V_PD_DHIGH='pd_dhigh={"ainfer_pd": {"d_stream_priority": "high", "overlap_timing": true}}'
V_PD_HANDOFF='pd_handoff={"ainfer_pd": {"segment_policy": "load", "overlap_timing": true, "p_host": "handoff"}}'
V_GENQ='pd_genq={"ainfer_pd": {"ordering": "global-enqueue", "overlap_timing": true}}'
# Fine ordering, one segment per epoch (K past the last boundary): TTFT against D's protection.
V_PD_WHOLE='pd_whole={"ainfer_pd": {"segment_policy": "fixed", "segment_span": 64, "overlap_timing": true}}'
# A timing event on P's stream after every layer (p_stream_marks="layer"): how the device
# interleaves D's kernels with P's.
V_PD_LAYER='pd_layer={"ainfer_pd": {"p_stream_marks": "layer", "overlap_timing": true}}'
# The epoch gate at DP > 1 (epoch_gate_fill / epoch_gate_rounds; every prompt through the lane).
V_PD_GATE='pd_gate={"ainfer_pd": {"epoch_gate_fill": 0.8, "epoch_gate_rounds": 96, "p_lane_min_tokens": 2, "overlap_timing": true}}'
# The defaults before the epoch gate (it opened a DP round's epoch as soon as any rank had lane
# work). At DP = 1 the gate is not used, so there it runs what `pd` runs.
V_PD_NOGATE='pd_nogate={"ainfer_pd": {"epoch_gate_fill": 0.0, "overlap_timing": true}}'
V_GCOMP='pd_gcomp={"ainfer_pd": {"ordering": "global-complete", "overlap_timing": true}}'
# No ordering at one rank (ordering="free"): P runs each epoch through, D never waits for it;
# with a timing event after every layer too.
V_PD_FREE='pd_free={"ainfer_pd": {"ordering": "free", "overlap_timing": true}}'
V_PD_FREE_LAYER='pd_free_layer={"ainfer_pd": {"ordering": "free", "p_stream_marks": "layer", "overlap_timing": true}}'
TP2_COMPILE='--serve-arg=--compilation-config={"pass_config":{"fuse_allreduce_rms":false}}'

compare() {  # name gpus args...   (one `rollout compare`; SIGINT at the limit still writes a report)
  local name=$1 gpus=$2; shift 2
  echo "== $name (GPUs $gpus): rollout compare $*"
  CUDA_VISIBLE_DEVICES=$gpus timeout -s INT -k 90 $T python3 -m vllm_ainfer_pd.rollout compare \
    $ROLLOUT "$@" --out $OUT/$name > /tmp/gpu-logs/$name.log 2>&1
  echo "== $name: rc=$?"; keep_few_files $name
}

tiny_mla() {  # the tiny-mla preset (DeepSeek-V3's layout, MLA), generated here once per machine
  [[ -d /tmp/tiny-mla ]] || python3 -m vllm_ainfer_pd.models --preset tiny-mla --out /tmp/tiny-mla \
    > /tmp/gpu-logs/tiny-mla.log 2>&1
}

keep_few_files() {  # only ~8 files per call come back: server logs into logs.tar.gz, records in one
  local dir=$OUT/$1
  cp $dir/server-*.log /tmp/gpu-logs/ 2>/dev/null; rm -f $dir/server-*.log
  [[ -d $dir/records ]] && tar -C $dir -czf $dir/records.tar.gz records && rm -rf $dir/records
}

start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for job in "$@"; do
  case $job in
    tp1) tp1 ;;
    tp1dhigh) parity tp1_bfloat16_dhigh 0 --model .gpu/tiny --tp 1 --dtype bfloat16 \
                --additional-config '{"ainfer_pd": {"p_lane_min_tokens": 32, "d_stream_priority": "high"}}' ;;
    tp1spec)
      parity tp1_bfloat16_ngram 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
      parity tp1_bfloat16_draft 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" \
        --speculative-config '{"method": "draft_model", "model": ".gpu/tiny", "num_speculative_tokens": 3}' ;;
    tp1eagle|tp1eaglebi)  # tp1eaglebi: bf16 with the batch-invariant kernels, then float32
      python3 -m vllm_ainfer_pd.models --preset tiny --eagle --out /tmp/tiny-eagle > /dev/null || continue
      eagle=(0 --model .gpu/tiny --tp 1 --additional-config "$LANE"
             --speculative-config '{"method": "eagle", "model": "/tmp/tiny-eagle", "num_speculative_tokens": 3}')
      if [[ $job == tp1eagle ]]; then
        parity tp1_bfloat16_eagle "${eagle[@]}" --dtype bfloat16
      else
        VLLM_BATCH_INVARIANT=1 parity tp1_bfloat16_eagle_bi "${eagle[@]}" --dtype bfloat16
        parity tp1_float32_eagle "${eagle[@]}" --dtype float32
      fi ;;
    tp1mla|tp1mlalong|tp1mlatail)
      # MLA attention (the tiny-mla preset, DeepSeek-V3's layout, generated here): default kernels,
      # then vLLM's batch-invariant ones; tp1mlalong: --long-prompts, batch-invariant first
      tiny_mla
      mla=(0 --model /tmp/tiny-mla --tp 1 --dtype bfloat16 --additional-config "$LANE")
      if [[ $job == tp1mlatail ]]; then  # stock vs stock with each prompt's last token later
        VLLM_BATCH_INVARIANT=1 parity tp1_bfloat16_mla_long_bi_tailcontrol "${mla[@]}" --long-prompts \
          --control tail
      elif [[ $job == tp1mla ]]; then
        parity tp1_bfloat16_mla "${mla[@]}"
        VLLM_BATCH_INVARIANT=1 parity tp1_bfloat16_mla_bi "${mla[@]}"
      else
        VLLM_BATCH_INVARIANT=1 parity tp1_bfloat16_mla_long_bi "${mla[@]}" --long-prompts
        parity tp1_bfloat16_mla_long "${mla[@]}" --long-prompts
      fi ;;
    tp1swa) rm -rf /tmp/tiny-swa && cp -r .gpu/tiny /tmp/tiny-swa && python3 -c 'import json, sys
c = json.load(open(sys.argv[1])); c.update(use_sliding_window=True, sliding_window=64, max_window_layers=0)
json.dump(c, open(sys.argv[1], "w"))' /tmp/tiny-swa/config.json
            parity tp1_${SWA_DT:-bfloat16}_swa 0 --model /tmp/tiny-swa --tp 1 --dtype ${SWA_DT:-bfloat16} \
              --additional-config "$LANE" ;;
    tp1pause) dt=${PAUSE_DT:-float32} be=${PAUSE_BACKEND:-ainfer_pd}; n=pause_tp1_${dt}_$be
            echo "== $n: gpu_pause.py"
            VLLM_BATCH_INVARIANT=$([[ $dt == bfloat16 ]] && echo 1 || echo 0) timeout -k 60 $T \
              python3 benchmarks/gpu_pause.py --model .gpu/tiny --dtype $dt --backend $be \
              --out $OUT/$n.json > /tmp/gpu-logs/$n.log 2>&1
            echo "== $n: rc=$?" ;;
    tp1fresh) for v in default:ainfer_pd:{} sync:ainfer_pd:{\"async_scheduling\":false} \
                       eager:ainfer_pd:{\"enforce_eager\":true} normal:normal:{}; do
              [[ ,${FRESH_ONLY:-default,sync,eager,normal}, == *,${v%%:*},* ]] || continue
              r=${v#*:}; be=${r%%:*}; ea=${r#*:}; n=fresh_tp1_float32_${v%%:*}
              echo "== $n: gpu_pause.py --backend $be --engine-args $ea"
              timeout -k 60 $T python3 benchmarks/gpu_pause.py --model .gpu/tiny --dtype float32 \
                --modes '' --no-sleep --backend $be --engine-args "$ea" --out $OUT/$n.json \
                > /tmp/gpu-logs/$n.log 2>&1
              echo "== $n: rc=$?"
            done ;;
    tp1tie) for v in graphs:{} eager:{\"enforce_eager\":true}; do
              n=tie_tp1_float32_${v%%:*}; m=; [[ $n == *eager ]] && m=--router-margins
              echo "== $n: gpu_batch_sensitivity.py --update $m"
              timeout -k 30 $T python3 benchmarks/gpu_batch_sensitivity.py --model .gpu/tiny --update \
                $m --engine-args "${v#*:}" --out $OUT/$n.json > /tmp/gpu-logs/$n.log 2>&1
              echo "== $n: rc=$?"
            done ;;
    tp1eager) parity tp1_bfloat16_eager 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" --enforce-eager ;;
    attn1|attn1mla)
      if [[ $job == attn1 ]]; then list=${ATTN_BACKENDS:-FLASH_ATTN,FLASHINFER,TRITON_ATTN,FLEX_ATTENTION}
      else tiny_mla; list=${ATTN_BACKENDS:-FLASH_ATTN_MLA,FLASHMLA,TRITON_MLA}; fi
      eager=(); sfx=
      [[ ${ATTN_EAGER:-0} == 1 ]] && { eager=(--enforce-eager); sfx=_eager; }
      [[ ${ATTN_BI:-0} == 1 ]] && sfx=${sfx}_bi
      control=(); [[ -n ${ATTN_CONTROL:-} ]] && { control=(--control $ATTN_CONTROL); sfx=${sfx}_${ATTN_CONTROL}control; }
      for be in ${list//,/ }; do
        if [[ $job == attn1mla ]]; then model=(--model /tmp/tiny-mla); tag=tiny_mla
        elif [[ $be == FLASHINFER ]]; then model=(--model .gpu/gpu-model --load-format dummy); tag=gpu
        else model=(--model .gpu/tiny); tag=tiny; fi
        n=attn_tp1_bfloat16${sfx}_${tag}_$be
        VLLM_BATCH_INVARIANT=${ATTN_BI:-0} parity $n 0 "${model[@]}" --tp 1 --dtype bfloat16 \
          --additional-config "$LANE" --attention-backend $be "${eager[@]}" "${control[@]}"
        grep -E "^(parity|refused):" /tmp/gpu-logs/$n.log | tail -1
        echo "   elapsed $(( $(date +%s) - start )) s"
      done ;;
    tp2) parity tp2_${DT:-bfloat16}${TP2_SUFFIX:-} 0,1 --model ${TP2_MODEL:-.gpu/tiny} --tp 2 \
           --dtype ${DT:-bfloat16} --additional-config "$LANE" ${TP2_FLAGS:-} ;;
    deepep1vllm)
      d=$OUT/deepep; mkdir -p $d; info=/tmp/deepep-build/build_info.json; rm -f $info
      for src in ${DEEPEP_SRC:-.gpu/deepep-src} ${DEEPEP_SRC_FALLBACK:-.gpu/deepep-src-1x}; do
        [[ -d $src ]] || { echo "== deepep1vllm: no DeepEP checkout at $src"; continue; }
        log=/tmp/gpu-logs/build_deepep_$(basename $src).log
        echo "== deepep1vllm: build_deepep.sh from $src"
        if DEEPEP_SRC=$src PYTHON=python3 DEEPEP_COMMIT=any DEEPEP_BUILD_DIR=/tmp/deepep-build \
             bash scripts/build_deepep.sh > $log 2>&1; then
          echo "   built: $(tail -1 $log)"; break
        fi
        echo "   failed: $(grep -v '^ ' $log | tail -1)"
      done
      [[ -f $info ]] || continue
      cp $info $d/
      pre=$(python3 -c "import json; print(json.load(open('$info'))['preload'])")
      echo "== deepep1vllm: deepep_vllm_one_gpu.py (LD_PRELOAD=${pre:-none})"
      CUDA_VISIBLE_DEVICES=0 LD_PRELOAD=$pre timeout -k 30 $T python3 \
        benchmarks/deepep_vllm_one_gpu.py --build-info $info --out $d/deepep_vllm_one_gpu.json \
        > /tmp/gpu-logs/deepep1vllm.log 2>&1
      echo "== deepep1vllm: rc=$?" ;;
    deepep1|deepep2|dp2deepep)
      if ! python3 -c 'import deep_ep' 2>/dev/null; then
        [[ -n ${DEEPEP_SRC:-} ]] || { echo "== $job: no deep_ep; set DEEPEP_SRC"; continue; }
        DEEPEP_SRC=$DEEPEP_SRC PYTHON=python3 bash scripts/build_deepep.sh \
          > /tmp/gpu-logs/build_deepep.log 2>&1 || { echo "== build_deepep failed"; continue; }
      fi
      case $job in
        deepep1) echo "== deepep1: deepep_one_gpu.py"
                 CUDA_VISIBLE_DEVICES=0 timeout -k 30 $T python3 benchmarks/deepep_one_gpu.py \
                   --out $OUT/deepep_one_gpu.json > /tmp/gpu-logs/deepep1.log 2>&1
                 echo "== deepep1: rc=$?" ;;
        deepep2) echo "== deepep2: deepep_two_gpu.py"
                 CUDA_VISIBLE_DEVICES=0,1 timeout -k 30 $T python3 benchmarks/deepep_two_gpu.py \
                   --out $OUT/deepep_two_gpu.json > /tmp/gpu-logs/deepep2.log 2>&1
                 echo "== deepep2: rc=$?" ;;
        dp2deepep)
          for ref in deepep_low_latency deepep_high_throughput; do
            parity dp2_ep_deepep_vs_normal_${ref#deepep_} 0,1 --model .gpu/tiny --dp 2 \
              --dtype bfloat16 --additional-config "$LANE" \
              --ours-flags '--all2all-backend deepep_low_latency' \
              --reference-additional-config '{"ainfer_pd": {"mode": "normal"}}' \
              --reference-flags "--all2all-backend $ref"
          done ;;
      esac ;;
    dp2) parity dp2_ep_${DT:-bfloat16}${DP2_SUFFIX:-} 0,1 --model ${DP2_MODEL:-.gpu/tiny} --dp 2 \
           --dtype ${DT:-bfloat16} --additional-config "$LANE" ${DP2_FLAGS:-} ;;
    tp1bi)  # compiled P, bf16: with vLLM's batch-invariant kernels (GPU 0) and without (GPU 1)
      g=$(( NGPU > 1 ? 1 : 0 ))
      VLLM_BATCH_INVARIANT=1 parity tp1_bfloat16_bi 0 --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" &
      [[ $NGPU -ge 2 ]] || { wait; [[ -n ${SKIP_CP:-} ]] && continue; }
      parity tp1_bfloat16_cp $g --model .gpu/tiny --tp 1 --dtype bfloat16 --additional-config "$LANE" &
      wait ;;
    tp2bi) VLLM_BATCH_INVARIANT=1 parity tp2_bfloat16_bi 0,1 --model .gpu/tiny --tp 2 --dtype bfloat16 \
             --additional-config "$LANE" --compilation-config '{"pass_config":{"fuse_allreduce_rms":false}}' ;;
    dp2mla) tiny_mla; VLLM_BATCH_INVARIANT=1 parity dp2_ep_bfloat16_mla_bi 0,1 --model /tmp/tiny-mla \
              --dp 2 --dtype bfloat16 --additional-config "$LANE" ;;
    dp2bi) VLLM_BATCH_INVARIANT=1 parity dp2_ep_bfloat16_bi 0,1 --model .gpu/tiny --dp 2 --dtype bfloat16 \
             --additional-config "$LANE" ;;
    floor) CUDA_VISIBLE_DEVICES=0 python3 benchmarks/physical_floor.py --model-preset gpu \
             --trace-preset gpu-quick --wait-scale ${WAIT_SCALE:-0.5} --measure --json-out $OUT/floor.json ;;
    bench1)  # TP=1: stock + normal on GPU 0 while pd + pd_k1 run on GPU 1, then one report
      if [[ $NGPU -lt 2 ]]; then
        compare bench1 0 --variant "$V_NORMAL" --variant "$V_PD" --only stock,normal,pd; continue
      fi
      compare bench1_gpu0 0 --variant "$V_NORMAL" --only stock,normal &
      compare bench1_gpu1 1 --variant "$V_PD" --variant "$V_PD_K1" --only pd,pd_k1 &
      wait
      python3 -m vllm_ainfer_pd.rollout merge $OUT/bench1_gpu0/report.json \
        $OUT/bench1_gpu1/report.json --out $OUT/bench1 > /tmp/gpu-logs/bench1_merge.log 2>&1 ;;
    bench1pd) compare bench1_pd 0 --variant "$V_PD" --only pd ;;  # pd alone (a re-run)
    ladder1)  # TP=1 ordering ladder: global-enqueue on GPU 0, global-complete on GPU 1
      compare ladder1_gpu0 0 --variant "$V_GENQ" --only pd_genq &
      compare ladder1_gpu1 1 --variant "$V_GCOMP" --only pd_gcomp &
      wait ;;
    bench1a) compare bench1a 0 --variant "$V_NORMAL" --only stock,normal ;;
    bench1b) compare bench1b 0 --variant "$V_PD" --variant "$V_PD_HANDOFF" --only pd,pd_handoff ;;
    bench1c) compare bench1c 0 --variant "$V_GENQ" --variant "$V_GCOMP" --only ${BENCH1C_ONLY:-pd_genq,pd_gcomp} ;;
    bench1d) compare bench1d 0 --variant "$V_PD_WHOLE" --only pd_whole ;;
    bench1x) compare bench1x_${BENCH1X_TAG:-a} 0 --variant "$V_NORMAL" --variant "$V_PD" \
               --variant "$V_GENQ" --variant "$V_PD_WHOLE" --variant "$V_PD_HANDOFF" \
               --variant "$V_PD_WORK" --variant "$V_PD_LANE2K" --variant "$V_PD_IF8" --variant "$V_PD_IF4" \
               --variant "$V_PD_DHIGH" --variant "$V_PD_LAYER" --variant "$V_PD_NOGATE" \
               --only ${BENCH1X_ONLY:-stock,normal,pd} ;;
    cached1x) compare cached1x_${BENCH1X_TAG:-a} 0 --variant "$V_PD" --cached-replay \
                --only ${BENCH1X_ONLY:-stock,pd} ;;
    bench1marks) compare bench1marks_${BENCH1X_TAG:-a} 0 --variant "$V_PD" --variant "$V_PD_LAYER" \
                   --reps ${BENCH1X_REPS:-3} --only ${BENCH1X_ONLY:-stock,pd,pd_layer} ;;
    bench1free) compare bench1free_${BENCH1X_TAG:-a} 0 --variant "$V_PD" --variant "$V_PD_FREE" \
                  --variant "$V_PD_FREE_LAYER" --reps ${BENCH1X_REPS:-3} \
                  --only ${BENCH1X_ONLY:-stock,pd,pd_free} ;;
    tp1free) VLLM_BATCH_INVARIANT=1 parity tp1_bfloat16_bi_free 0 --model .gpu/tiny --tp 1 \
               --dtype bfloat16 --additional-config '{"ainfer_pd": {"p_lane_min_tokens": 32, "ordering": "free"}}' ;;
    bench1eagle) python3 -m vllm_ainfer_pd.models --preset gpu --eagle --out /tmp/gpu-eagle \
                   > /tmp/gpu-logs/gpu-eagle.log 2>&1 || { echo "== no EAGLE drafter"; continue; }
                 compare bench1eagle_${BENCH1X_TAG:-a} 0 --variant "$V_PD" --only stock,pd \
                   '--serve-arg=--speculative-config={"method": "eagle", "model": "/tmp/gpu-eagle", "num_speculative_tokens": 3}' ;;
    bench1xmla) compare bench1xmla_${BENCH1X_TAG:-a} 0 --model .gpu/gpu-mla --variant "$V_NORMAL" \
                  --variant "$V_PD" --variant "$V_GENQ" --only ${BENCH1X_ONLY:-stock,pd} ;;
    residency) CUDA_VISIBLE_DEVICES=0 timeout -k 5 $T python3 benchmarks/residency_stall.py \
                 --out $OUT/residency_stall.json > /tmp/gpu-logs/residency.log 2>&1
               echo "== residency: rc=$?"; tail -12 /tmp/gpu-logs/residency.log ;;
    contention1) CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 60 $T python3 benchmarks/lane_contention.py \
               --platform gpu --model .gpu/gpu-model --patterns ${CONTENTION_PATTERNS:-segment,layer} \
               ${CONTENTION_ARGS:-} \
               --out $OUT/contention1 > /tmp/gpu-logs/contention1.log 2>&1
             echo "== contention1: rc=$?" ;;
    decode1) CUDA_VISIBLE_DEVICES=0 timeout -k 60 $T python3 benchmarks/decode_overhead.py --gpu \
               --model .gpu/tiny --requests 128 --max-tokens 1024 --reps 7 \
               --out $OUT/decode_overhead_tp1.json > /tmp/gpu-logs/decode1.log 2>&1
             echo "== decode1: rc=$?" ;;
    decodeg) python3 -c 'import json
print(json.dumps({"meta": {"preset": "decode-only"}}))
for i in range(64):
    print(json.dumps({"id": f"d{i}", "turns": [{"input_tokens": 16, "output_tokens": 1024}]}))' \
               > /tmp/decode-only.jsonl
             CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 90 $T python3 -m vllm_ainfer_pd.rollout compare \
               --platform gpu --model .gpu/gpu-model --trace /tmp/decode-only.jsonl --reps ${DECODEG_REPS:-3} \
               --no-progress --variant "$V_NORMAL" --variant "$V_PD" \
               --only ${DECODEG_ONLY:-stock,normal,pd} --out $OUT/decodeg_${DECODEG_TAG:-a} \
               > /tmp/gpu-logs/decodeg.log 2>&1
             echo "== decodeg: rc=$?"; keep_few_files decodeg_${DECODEG_TAG:-a} ;;
    profile1)  # pd under the rollout with vLLM's torch profiler: exact overlap, P's host waits
      CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 90 $T python3 benchmarks/profile_lane.py \
        --platform gpu --model ${PROFILE_MODEL:-.gpu/gpu-model} --preset gpu-quick --wait-scale ${WAIT_SCALE:-0.1} \
        --delay-iterations ${PROFILE_DELAY:-100} --max-iterations ${PROFILE_ITERS:-300} \
        --out $OUT/profile_tp1 > /tmp/gpu-logs/profile1.log 2>&1
      echo "== profile1: rc=$?"; tail -8 /tmp/gpu-logs/profile1.log
      cp $OUT/profile_tp1/server.log /tmp/gpu-logs/profile1-server.log 2>/dev/null
      rm -f $OUT/profile_tp1/server.log
      # One trace file comes back if it is small enough; the summary always does.
      find $OUT/profile_tp1/torch_traces -type f ! -name '*.json.gz' -delete 2>/dev/null ;;
    tp2dp2bi) VLLM_BATCH_INVARIANT=1 parity tp2dp2_ep_bfloat16_bi 0,1,2,3 --model .gpu/tiny --tp 2 \
                --dp 2 --dtype bfloat16 --additional-config "$LANE" \
                --compilation-config '{"pass_config":{"fuse_allreduce_rms":false}}' ;;
    bench4) compare bench4 0,1,2,3 --tp 2 --dp 2 --enable-expert-parallel "$TP2_COMPILE" \
              --variant "$V_NORMAL" --variant "$V_PD" --only ${BENCH4_ONLY:-stock,normal,pd} ;;
    bench2dp) compare bench2dp_${BENCH2DP_TAG:-a} 0,1 --dp 2 --enable-expert-parallel \
                --variant "$V_NORMAL" --variant "$V_PD" --variant "$V_GENQ" --variant "$V_PD_WHOLE" \
                --variant "$V_PD_WORK" --variant "$V_PD_GATE" --variant "$V_PD_NOGATE" \
                --backend stock_c4='--prefill-schedule-interval 4' \
                --backend stock_c8='--prefill-schedule-interval 8' \
                --backend stock_c16='--prefill-schedule-interval 16' \
                --backend stock_c32='--prefill-schedule-interval 32' \
                --backend stock_c64='--prefill-schedule-interval 64' \
                --backend stock_c128='--prefill-schedule-interval 128' \
                --only ${BENCH2DP_ONLY:-stock,normal} ;;
    bench2) compare bench2 0,1 --tp 2 "$TP2_COMPILE" --variant "$V_NORMAL" --variant "$V_PD" \
              --only stock,normal,pd ;;
    *) echo "unknown job $job" ;;
  esac
  echo "   elapsed $(( $(date +%s) - start )) s"
done
python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null
tar -C /tmp/gpu-logs -czf $OUT/logs.tar.gz . 2>/dev/null
for f in /tmp/gpu-logs/*.log; do
  echo "---- $(basename $f): last lines"
  grep -E "Error|error|Traceback|parity:|rank [0-9]+:|vllm_ainfer_pd_|P lane rank|\[rollout\]|\[(one|two)-gpu\]|phase-owned" $f | tail -12
done
for f in $OUT/*/report.md; do echo "---- $f"; sed -n '/^| metric/,/^$/p' $f; done
