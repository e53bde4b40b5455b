"""Rendezvous latency, gloo vs shared memory, for 2, 4 and 8 ranks; prints a table, saves JSON.

    python benchmarks/rendezvous_bench.py [--ranks 2 4 8] [--impl shm gloo] [--iters N]
                                          [--json benchmarks/results/cpu/rendezvous.json]

Same as `python -m vllm_ainfer_pd.turnstile`, with a default JSON path.
"""

from __future__ import annotations

import os
import sys

from vllm_ainfer_pd.turnstile.bench import main

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu",
                            "rendezvous.json")

if __name__ == "__main__":
    sys.exit(main(default_json=DEFAULT_JSON))
