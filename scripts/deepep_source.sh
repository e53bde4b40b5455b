#!/usr/bin/env bash
# Writes a DeepEP source tree at one commit, with its third-party/fmt submodule, into a folder,
# for scripts/build_deepep.sh where there is no network (e.g. .gpu/deepep-src, carried to a GPU
# machine):
#   bash scripts/deepep_source.sh DEEPEP_GIT_DIR OUT [COMMIT] [FMT_GIT_DIR]
# DEEPEP_GIT_DIR: a clone or mirror of github.com/deepseek-ai/DeepEP. COMMIT: default 29d31c0 (the
# last 1.x commit, with enable_shrink and no NCCL backend: build_deepep.sh's default); vLLM 0.26's
# pin is d4f41e4e93 (needs NCCL >= 2.30.4).
# FMT_GIT_DIR: a clone or mirror of github.com/fmtlib/fmt, for a commit that has the submodule
# (DeepEP 2.x); the submodule's commit is read from DeepEP's tree. OUT gets a file
# `.deepep-commit` naming the commit, which build_deepep.sh reads; the README's figures are left
# out. DeepEP's code stays out of this repository: OUT belongs in an ignored folder.
set -euo pipefail
git_dir=${1:?usage: deepep_source.sh DEEPEP_GIT_DIR OUT [COMMIT] [FMT_GIT_DIR]}
out=${2:?usage: deepep_source.sh DEEPEP_GIT_DIR OUT [COMMIT] [FMT_GIT_DIR]}
commit=${3:-29d31c095796f3c8ece47ee9cdcc167051bbeed9}
fmt=${4:-}
full=$(git -C "$git_dir" rev-parse --verify "$commit^{commit}")
rm -rf "$out"
mkdir -p "$out"
git -C "$git_dir" archive "$full" | tar -x -C "$out"
rm -rf "$out/figures"
fmt_commit=$(git -C "$git_dir" ls-tree "$full" third-party/fmt | awk '$2 == "commit" {print $3}')
if [[ -n $fmt_commit ]]; then
  [[ -n $fmt ]] || { echo "DeepEP ${full:0:10} has the submodule third-party/fmt at" \
                          "${fmt_commit:0:10}: pass a clone of fmtlib/fmt as FMT_GIT_DIR" >&2
                     exit 1; }
  mkdir -p "$out/third-party/fmt"
  git -C "$fmt" archive "$fmt_commit" | tar -x -C "$out/third-party/fmt"
fi
echo "$full" > "$out/.deepep-commit"
echo "$out: DeepEP $full${fmt_commit:+ with fmt $fmt_commit} ($(du -sh "$out" | cut -f1))"
