"""`python -m vllm_ainfer_pd.turnstile`: the rendezvous micro-benchmark (see `bench.py`)."""

from __future__ import annotations

import sys

from vllm_ainfer_pd.turnstile.bench import main

if __name__ == "__main__":
    sys.exit(main())
