#!/usr/bin/env bash
# Builds and installs DeepEP (tag v1.2.1) from a source checkout you point it at, for the
# phase-owned DeepEP pair (docs/deepep.md), into the Python that runs vLLM:
#   DEEPEP_SRC=/path/to/DeepEP bash scripts/build_deepep.sh
# Options (environment): PYTHON (default: python3 on PATH), CUDA_HOME (default /usr/local/cuda),
# NVSHMEM_DIR (default: the pip package nvidia-nvshmem-cu13, which torch's CUDA 13 wheels bring;
# installed with pip if missing), TORCH_CUDA_ARCH_LIST (default 9.0: Hopper), MAX_JOBS,
# DEEPEP_INSTALL=0 (build the wheel only; its path is the last line).
# Needs no network when nvidia-nvshmem-cu13 is installed. The build works on a copy of the checkout
# (under $DEEPEP_BUILD_DIR, default ~/.cache/vllm-ainfer-pd/deepep-build), so the checkout stays
# clean, and makes no change to DeepEP's source. Its last line is the installed deep_ep's path.
set -euo pipefail
: "${DEEPEP_SRC:?set DEEPEP_SRC to a DeepEP source checkout (tag v1.2.1)}"
py=${PYTHON:-python3}
cuda=${CUDA_HOME:-/usr/local/cuda}
build=${DEEPEP_BUILD_DIR:-$HOME/.cache/vllm-ainfer-pd/deepep-build}
[[ -f $DEEPEP_SRC/setup.py && -f $DEEPEP_SRC/deep_ep/buffer.py ]] \
  || { echo "DEEPEP_SRC=$DEEPEP_SRC is not a DeepEP checkout (no setup.py, deep_ep/buffer.py)" >&2; exit 1; }
version=$(sed -n "s/.*version='\([0-9.]*\)'.*/\1/p" "$DEEPEP_SRC/setup.py" | head -n 1)
if [[ $version != 1.2.1 ]]; then
  echo "warning: DEEPEP_SRC is DeepEP $version; the phase-owned pair is written against 1.2.1" >&2
fi
[[ -x $cuda/bin/nvcc ]] || { echo "no nvcc under CUDA_HOME=$cuda" >&2; exit 1; }
"$py" -c "import torch; assert torch.version.cuda, 'torch has no CUDA'" \
  || { echo "$py has no CUDA build of torch" >&2; exit 1; }

# NVSHMEM: the pip package's include/ and lib/ (libnvshmem_device.a, libnvshmem_host.so.3).
if [[ -z ${NVSHMEM_DIR:-} ]]; then
  "$py" -c "import nvidia.nvshmem" 2>/dev/null || "$py" -m pip install -q nvidia-nvshmem-cu13
  NVSHMEM_DIR=$("$py" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")
fi
[[ -f $NVSHMEM_DIR/lib/libnvshmem_device.a ]] \
  || { echo "NVSHMEM_DIR=$NVSHMEM_DIR has no lib/libnvshmem_device.a" >&2; exit 1; }
# Workaround 1: with NVSHMEM_DIR set, DeepEP links `-l:libnvshmem_host.so`, but the pip package
# ships only the versioned soname. A link name beside it is enough: the extension records the
# soname, which the package provides at run time (DeepEP sets an rpath to this lib/).
if [[ ! -e $NVSHMEM_DIR/lib/libnvshmem_host.so ]]; then
  host=$(cd "$NVSHMEM_DIR/lib" && ls libnvshmem_host.so.* | head -n 1)
  ln -s "$host" "$NVSHMEM_DIR/lib/libnvshmem_host.so"
  echo "linked $NVSHMEM_DIR/lib/libnvshmem_host.so -> $host" >&2
fi
# Workaround 2: headers the host compiler does not find. CUDA 13 keeps the CCCL headers
# (cuda/std/...) under include/cccl, which nvcc searches and g++ (building deep_ep.cpp) does not;
# and a toolkit without the math libraries' headers (torch's CUDAContextLight.h includes
# cusparse.h) has them in torch's pip CUDA packages (nvidia/cu13/include).
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
export NVSHMEM_DIR CUDA_HOME=$cuda PATH=$cuda/bin:$PATH
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}

rm -rf "$build"
mkdir -p "$build"
cp -r "$DEEPEP_SRC/." "$build/src"
rm -rf "$build/src/build" "$build/src/dist"
echo "building DeepEP $version (NVSHMEM $NVSHMEM_DIR, arch $TORCH_CUDA_ARCH_LIST, CUDA $cuda)" >&2
start=$(date +%s)
(cd "$build/src" && "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$build/dist" .) >&2
echo "built in $(( $(date +%s) - start )) s" >&2
if [[ ${DEEPEP_INSTALL:-1} == 0 ]]; then
  ls "$build"/dist/deep_ep-*.whl
  exit 0
fi
"$py" -m pip install -q --no-deps --force-reinstall "$build"/dist/deep_ep-*.whl >&2
# Import from outside the source tree (its deep_ep/ would shadow the installed package).
(cd / && "$py" -c "import deep_ep, deep_ep_cpp; print(deep_ep.__file__)")
