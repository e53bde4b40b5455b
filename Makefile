# The two commands of the README: `make test` and `make rollout`. Each sets up (or reuses) the CPU
# environment first; `make env` does only that and prints the path of its python as its last line.
SHELL := /bin/bash

.PHONY: env test test-fast test-vllm032 rollout model vllm-tests

env:
	@bash scripts/setup_env.sh

test:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest tests -ra --durations=15 $(PYTEST_ARGS)

# Tests that start no vLLM engine and no vLLM subprocess (under a minute).
test-fast:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest tests -ra -m "not engine and not slow" $(PYTEST_ARGS)

# The same suite on vLLM 0.32.0, in that release's own environment (built beside 0.26's on first
# use); the tests that cannot run on 0.32 skip themselves and say why (about 25 minutes).
test-vllm032:
	@py=$$(VLLM_VERSION=0.32.0 bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest tests -ra --durations=15 $(PYTEST_ARGS)

# stock vLLM vs ainfer_pd (default options: prompts of >= 512 uncached tokens take the P lane) vs
# ainfer_pd with the lane taking every prompt of >= 64 uncached tokens.
rollout:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m vllm_ainfer_pd.models --preset tiny && \
	  $$py -m vllm_ainfer_pd.rollout compare --preset cpu --out rollout-out \
	    --variant 'ainfer_pd_lane64={"ainfer_pd": {"p_lane_min_tokens": 64}}' $(ROLLOUT_ARGS)

model:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && $$py -m vllm_ainfer_pd.models --preset tiny

# vLLM 0.26.0's own tests, stock vs ainfer_pd (benchmarks/vllm_tests.py; about 2 h on 2 cores):
# writes benchmarks/results/vllm_tests/. VLLM_TESTS_ARGS='--resume' continues an interrupted run.
vllm-tests:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py benchmarks/vllm_tests.py $(VLLM_TESTS_ARGS)
