"""`python -m vllm_ainfer_pd.vllm_glue`: every vLLM symbol the backend patches or relies on,
checked against the installed vLLM (whatever its version), one line each; exit status 1 if any
differs. The backend runs on a vLLM whose symbols all match (`check_vllm`) and refuses one
that differs, naming the first difference."""

from __future__ import annotations

import sys

import vllm

from vllm_ainfer_pd.vllm_glue import shape_report


def main() -> int:
    report = shape_report()
    for patch, problem in report:
        where = f" [{patch.platform}]" if patch.platform else ""
        print(f"{'ok  ' if problem is None else 'DIFF'} {patch.target}{where}"
              + (f": {problem}" if problem else ""))
    differ = sum(problem is not None for _, problem in report)
    print(f"vLLM {vllm.__version__}: {len(report) - differ} of {len(report)} symbols match, "
          f"{differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
