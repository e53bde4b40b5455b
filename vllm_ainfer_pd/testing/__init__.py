"""Harness shared by tests, scripts and benchmarks: CPU settings, `vllm serve` lifecycle, parity."""
