#!/usr/bin/env bash
# Stages vLLM 0.32.0 with its torch 2.13.0 for a GPU machine with no package index whose image
# has torch 2.11 (CUDA 13): installs requirements/gpu-0.32.txt for Python 3.12 into a folder here
# (no GPU needed, --no-deps), drops what a Hopper GPU never loads (FlashAttention-2's kernels,
# vLLM's Rust router, Triton's Blackwell assembler), packs the folder with xz (a third smaller
# than gzip: Triton's LLVM and torch's host code compress well; about 10 minutes on 2 cores) and
# splits the pack into parts small enough to travel beside the checkout, one per command.
# Output (git-ignored):
#   .gpu32/env          send it with EVERY command: install.sh and the part count
#   .gpu32/p0 ... pN    one part per command until all have arrived, back to back
# On the GPU machine each command begins with `source .gpu32/env/install.sh || exit`, which
# collects the parts that command brought, unpacks once all have, and puts the pack on
# PYTHONPATH (vLLM 0.32.0, torch 2.13.0, NCCL 2.29 ahead of the image's).
#   PART_MIB     size of a part (default 52: the checkout, about 10 MiB, travels with each)
#   WHEELS_DIR   a folder of already downloaded wheels pip may take instead of the index
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu32/' .git/info/exclude 2>/dev/null || echo '/.gpu32/' >> .git/info/exclude
cache=${AINFER_GPU32_CACHE:-$HOME/.cache/ainfer-gpu32}
pack=$cache/site.tar.xz
reqs=$root/requirements/gpu-0.32.txt
if [[ ! -f $pack || $reqs -nt $pack ]]; then
  echo "building the vLLM 0.32 GPU pack in $cache (several minutes, once)"
  rm -rf "$cache/site" && mkdir -p "$cache/site"
  plats=""
  for n in 35 34 31 28 27 24 18 17 5; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
  plats="$plats --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any"
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none $plats --target "$cache/site" \
    ${WHEELS_DIR:+--find-links "$WHEELS_DIR"} -r "$reqs" 2>&1 | { grep -v "^WARNING: " || true; }
  rm -rf "$cache/site/bin" "$cache/site/vllm/vllm-rs" \
    "$cache/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" \
    "$cache/site/triton/backends/nvidia/bin/ptxas-blackwell"
  tar -C "$cache/site" -cf - . | xz -6 -T2 > "$pack.tmp" && mv "$pack.tmp" "$pack"
fi
rm -rf .gpu32 && mkdir -p .gpu32/build
(cd .gpu32/build && split -b "${PART_MIB:-52}m" -d -a 2 "$pack" part.)
n=0
for f in .gpu32/build/part.*; do mkdir -p ".gpu32/p$n"; mv "$f" ".gpu32/p$n/"; n=$((n+1)); done
rm -rf .gpu32/build
mkdir -p .gpu32/env && echo "$n" > .gpu32/env/count
cat > .gpu32/env/install.sh <<'EOF'
# Runs ON the GPU machine, from the project's root: source .gpu32/env/install.sh || exit
state=/tmp/ainfer-gpu32
mkdir -p $state/parts
for d in .gpu32/p*; do
  [[ -d $d ]] || continue
  for f in "$d"/part.*; do [[ -f $f ]] && cp --update=none "$f" $state/parts/; done
done
if [[ ! -f $state/installed ]]; then
  want=$(cat .gpu32/env/count)
  have=$(ls $state/parts | wc -l)
  if (( have < want )); then
    echo "ainfer-gpu32: have $have of $want parts; send the next with the next command"
    return 3 2>/dev/null || exit 3
  fi
  mkdir -p $state/site
  cat $state/parts/part.* | xz -d -T0 | tar -C $state/site -xf - \
    || { echo "ainfer-gpu32: unpack failed"; return 4 2>/dev/null || exit 4; }
  rm -rf $state/parts && mkdir -p $state/parts && touch $state/installed
  echo "ainfer-gpu32: unpacked $(du -sh $state/site | cut -f1) into $state/site"
fi
export PYTHONPATH=$state/site${PYTHONPATH:+:$PYTHONPATH}
# torch 2.13 checks for the cuDNN it was built with (9.20); the image's 9.19 has every symbol.
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
EOF
echo "staged $n parts of ${PART_MIB:-52} MiB: send .gpu32/env with every command and one part"
echo "per command until installed; begin each command with: source .gpu32/env/install.sh || exit"
