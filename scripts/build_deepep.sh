#!/usr/bin/env bash
# Builds and installs DeepEP from a source checkout you point it at, for the phase-owned DeepEP
# pair (docs/deepep.md), into the Python that runs vLLM:
#   DEEPEP_SRC=/path/to/DeepEP bash scripts/build_deepep.sh
# The DeepEP to build by default is 29d31c0, DeepEP's last 1.x commit: its `deep_ep.Buffer` has
# `enable_shrink`, which vLLM 0.26's deepep_low_latency manager passes (DeepEP v1.2.1 has no such
# parameter and fails there), and it builds against the NCCL torch 2.11 brings (2.28.9):
#   git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP
#   git checkout 29d31c095796f3c8ece47ee9cdcc167051bbeed9
# The commit vLLM 0.26's own installer pins (tools/ep_kernels/install_python_libraries.sh in
# vLLM's source distribution), d4f41e4e93 (DeepEP 2.0.0: the same 1.x `Buffer` plus DeepEP V2),
# also works where NCCL >= 2.30.4 is installed (below): DEEPEP_COMMIT=d4f41e4e93, with
# `git submodule update --init` (it needs third-party/fmt).
# A copy without git metadata names its commit in a file `.deepep-commit` at its top.
# Options (environment): PYTHON (default: python3 on PATH), CUDA_HOME (default /usr/local/cuda),
# NVSHMEM_DIR (default: the pip package nvidia-nvshmem-cu13, which torch's CUDA 13 wheels bring;
# installed with pip if missing), NCCL_DIR (DeepEP 2.x; default: the pip package
# nvidia-nccl-cu13), TORCH_CUDA_ARCH_LIST (default 9.0: Hopper), MAX_JOBS, DEEPEP_INSTALL=0 (build
# the wheel only; its path is the last line), DEEPEP_COMMIT (the commit the checkout must be at;
# default 29d31c0, above; `any`: build whatever it is), DEEPEP_CHECK_ONLY=1 (the checks, no build).
# DeepEP 2.x also needs NCCL >= 2.30.4 when it is built and wherever it is imported (its NCCL
# backend; `import deep_ep` checks that the process loaded the NCCL it was linked with), while
# torch 2.11's wheels bring NCCL 2.28.9: install `nvidia-nccl-cu13>=2.30.4` into $PYTHON (pip
# install --no-deps; torch then loads it too), or point NCCL_DIR at one and preload its
# lib/libnccl.so.2 (LD_PRELOAD) in every vLLM process. The script stops with one line if not.
# Needs no network when the NVIDIA pip packages are installed. The build works on a copy of the
# checkout (under $DEEPEP_BUILD_DIR, default ~/.cache/vllm-ainfer-pd/deepep-build), so the
# checkout stays clean, and makes no change to DeepEP's source. It writes what it built (commit,
# versions of DeepEP, NVSHMEM and NCCL) to $DEEPEP_BUILD_DIR/build_info.json. Its last line is the
# installed deep_ep's path.
set -euo pipefail
DEFAULT_COMMIT=29d31c095796f3c8ece47ee9cdcc167051bbeed9
PIN=d4f41e4e93602a15e95f55f6ee8df8f1aaa0e4bb  # vLLM 0.26's pin, recorded in build_info.json
: "${DEEPEP_SRC:?set DEEPEP_SRC to a DeepEP source checkout (commit ${DEFAULT_COMMIT:0:7})}"
want=${DEEPEP_COMMIT:-$DEFAULT_COMMIT}
py=${PYTHON:-python3}
cuda=${CUDA_HOME:-/usr/local/cuda}
build=${DEEPEP_BUILD_DIR:-$HOME/.cache/vllm-ainfer-pd/deepep-build}
src=$(cd "$DEEPEP_SRC" && pwd)
[[ -f $src/setup.py && -d $src/deep_ep ]] \
  || { echo "DEEPEP_SRC=$DEEPEP_SRC is not a DeepEP checkout (no setup.py, deep_ep/)" >&2; exit 1; }

# The checkout's commit: its own git metadata (not that of a repository it sits in), or the file.
commit=unknown
if [[ $(git -C "$src" rev-parse --show-toplevel 2>/dev/null) == "$src" ]]; then
  commit=$(git -C "$src" rev-parse HEAD)
elif [[ -f $src/.deepep-commit ]]; then
  commit=$(tr -d '[:space:]' < "$src/.deepep-commit")
fi
if [[ $want != any && $commit != "$want"* && $want != "$commit"* ]]; then
  echo "warning: DEEPEP_SRC is at commit $commit, not ${want:0:10}; building" \
       "it anyway (DEEPEP_COMMIT=any silences this)" >&2
fi

# DeepEP 2.x keeps the 1.x API in deep_ep/buffers/legacy.py; 1.x has deep_ep/buffer.py.
if [[ -f $src/deep_ep/buffers/legacy.py ]]; then
  major=2
  version=$(sed -n "s/^__version__ = '\([0-9.]*\)'.*/\1/p" "$src/deep_ep/__init__.py" | head -n 1)
  buffer_py=$src/deep_ep/buffers/legacy.py
else
  major=1
  version=$(sed -n "s/.*version='\([0-9.]*\)'.*/\1/p" "$src/setup.py" | head -n 1)
  buffer_py=$src/deep_ep/buffer.py
fi
if ! grep -q "enable_shrink" "$buffer_py"; then
  echo "warning: this DeepEP's Buffer has no enable_shrink, which vLLM 0.26's deepep_low_latency" \
       "manager passes: the ainfer_pd backend refuses it at start" >&2
fi
[[ -x $cuda/bin/nvcc ]] || { echo "no nvcc under CUDA_HOME=$cuda" >&2; exit 1; }
"$py" -c "import torch; assert torch.version.cuda, 'torch has no CUDA'" \
  || { echo "$py has no CUDA build of torch" >&2; exit 1; }
pip_version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null \
  || echo unknown; }

# NVSHMEM: the pip package's include/ and lib/ (libnvshmem_device.a, libnvshmem_host.so.3).
if [[ -z ${NVSHMEM_DIR:-} ]]; then
  "$py" -c "import nvidia.nvshmem" 2>/dev/null || "$py" -m pip install -q nvidia-nvshmem-cu13
  NVSHMEM_DIR=$("$py" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")
fi
[[ -f $NVSHMEM_DIR/lib/libnvshmem_device.a ]] \
  || { echo "NVSHMEM_DIR=$NVSHMEM_DIR has no lib/libnvshmem_device.a" >&2; exit 1; }
# Workaround 1: with NVSHMEM_DIR set, DeepEP 1.x links `-l:libnvshmem_host.so`, but the pip
# package ships only the versioned soname. A link name beside it is enough: the extension records
# the soname, which the package provides at run time (DeepEP sets an rpath to this lib/).
if [[ ! -e $NVSHMEM_DIR/lib/libnvshmem_host.so ]]; then
  host=$(cd "$NVSHMEM_DIR/lib" && ls libnvshmem_host.so.* | head -n 1)
  ln -s "$host" "$NVSHMEM_DIR/lib/libnvshmem_host.so"
  echo "linked $NVSHMEM_DIR/lib/libnvshmem_host.so -> $host" >&2
fi

# NCCL (DeepEP 2.x): >= 2.30.4, headers and library; DeepEP records this root (EP_NCCL_ROOT_DIR,
# baked into the package) and checks at import that the process loaded this very library.
nccl_version=none preload=
if [[ $major == 2 ]]; then
  [[ -f $src/third-party/fmt/include/fmt/format.h ]] || { echo "DeepEP $version needs its" \
    "submodule third-party/fmt (git submodule update --init in the checkout)" >&2; exit 1; }
  if [[ -z ${NCCL_DIR:-} ]]; then
    NCCL_DIR=$("$py" -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null) \
      || { echo "DeepEP $version needs NCCL >= 2.30.4: no nvidia-nccl-cu13 in $py; set" \
                "NCCL_DIR" >&2; exit 1; }
  fi
  code=$(sed -n 's/^#define NCCL_VERSION_CODE \([0-9]*\).*/\1/p' "$NCCL_DIR/include/nccl.h" \
         2>/dev/null | head -n 1)
  nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' \
                 "$NCCL_DIR/include/nccl.h" 2>/dev/null | paste -sd. -)
  if [[ -z $code || $code -lt 23004 ]]; then
    echo "DeepEP $version (commit ${commit:0:10}) needs NCCL >= 2.30.4 at build and run time," \
         "but NCCL_DIR=$NCCL_DIR has ${nccl_version:-no NCCL} (torch 2.11 brings 2.28.9): pip" \
         "install 'nvidia-nccl-cu13>=2.30.4' --no-deps into $py, or set NCCL_DIR to one and" \
         "LD_PRELOAD its lib/libnccl.so.2 wherever deep_ep is imported" >&2
    exit 1
  fi
  [[ -f $NCCL_DIR/lib/libnccl.so.2 ]] \
    || { echo "NCCL_DIR=$NCCL_DIR has no lib/libnccl.so.2" >&2; exit 1; }
  export EP_NCCL_ROOT_DIR=$NCCL_DIR
  # An NCCL other than the one torch loads: a process must load it before torch does.
  loaded=$("$py" -c "import torch; print(next((l.split()[-1] for l in open('/proc/self/maps') \
           if 'libnccl.so' in l), ''))" 2>/dev/null || true)
  if [[ -z $loaded || $(realpath "$loaded") != $(realpath "$NCCL_DIR/lib/libnccl.so.2") ]]; then
    preload=$NCCL_DIR/lib/libnccl.so.2
    echo "note: torch loads ${loaded:-no NCCL}, not $preload: preload it (LD_PRELOAD=$preload)" \
         "wherever deep_ep is imported" >&2
  fi
  # DeepEP 2.x links the CUDA driver API (-lcuda); a machine without the unversioned
  # libcuda.so links against the toolkit's stub (the soname resolves to the driver at run time).
  stub=$(find -H "$cuda" -path "*/stubs/libcuda.so" -print -quit 2>/dev/null || true)
  [[ -n $stub ]] && export LIBRARY_PATH=${LIBRARY_PATH:+$LIBRARY_PATH:}$(dirname "$stub")
fi

# Workaround 2: headers the host compiler does not find. CUDA 13 keeps the CCCL headers
# (cuda/std/...) under include/cccl, which nvcc searches and g++ (building the C++ sources)
# does not; and a toolkit without the math libraries' headers (torch's CUDAContextLight.h
# includes cusparse.h) has them in torch's pip CUDA packages (nvidia/cu13/include).
extra=$cuda/include/cccl
extra+=:$("$py" -c "import nvidia.cu13 as m; print(list(m.__path__)[0] + '/include')" 2>/dev/null \
  || true)
for dir in ${extra//:/ }; do
  [[ -d $dir ]] && export CPLUS_INCLUDE_PATH=${CPLUS_INCLUDE_PATH:+$CPLUS_INCLUDE_PATH:}$dir
done
# DeepEP's IBGDA code includes rdma-core's mlx5 header even for single-host use.
if ! echo '#include <infiniband/mlx5dv.h>' | g++ -x c++ -fsyntax-only - 2>/dev/null; then
  echo "DeepEP needs rdma-core's headers (infiniband/mlx5dv.h): apt-get install libibverbs-dev" >&2
  exit 1
fi
if [[ ${DEEPEP_CHECK_ONLY:-0} == 1 ]]; then
  echo "ok: DeepEP $version, commit $commit, NVSHMEM $NVSHMEM_DIR, NCCL $nccl_version" >&2
  exit 0
fi
export NVSHMEM_DIR CUDA_HOME=$cuda PATH=$cuda/bin:$PATH
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}

rm -rf "$build"
mkdir -p "$build"
cp -r "$src/." "$build/src"
rm -rf "$build/src/build" "$build/src/dist"
echo "building DeepEP $version, commit $commit (NVSHMEM $NVSHMEM_DIR, NCCL $nccl_version," \
     "arch $TORCH_CUDA_ARCH_LIST, CUDA $cuda)" >&2
start=$(date +%s)
(cd "$build/src" && "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$build/dist" .) >&2
seconds=$(( $(date +%s) - start ))
echo "built in $seconds s" >&2
cat > "$build/build_info.json" <<EOF
{"commit": "$commit", "pinned": "$PIN", "deepep_version": "$version", "preload": "$preload",
 "nvshmem_dir": "$NVSHMEM_DIR", "nvshmem_pip": "$(pip_version nvidia-nvshmem-cu13)",
 "nccl_dir": "${NCCL_DIR:-}", "nccl_headers": "$nccl_version",
 "nccl_pip": "$(pip_version nvidia-nccl-cu13)", "arch": "$TORCH_CUDA_ARCH_LIST",
 "cuda_home": "$cuda", "build_s": $seconds}
EOF
echo "build info: $build/build_info.json" >&2
if [[ ${DEEPEP_INSTALL:-1} == 0 ]]; then
  ls "$build"/dist/deep_ep-*.whl
  exit 0
fi
"$py" -m pip install -q --no-deps --force-reinstall "$build"/dist/deep_ep-*.whl >&2
# Import from outside the source tree (its deep_ep/ would shadow the installed package).
(cd / && LD_PRELOAD=${preload:-${LD_PRELOAD:-}} "$py" -c "import deep_ep; print(deep_ep.__file__)")
