# The two commands of the README: `make test` and `make rollout`. Each sets up (or reuses) the CPU
# environment first; `make env` does only that and prints the path of its python as its last line.
SHELL := /bin/bash

.PHONY: env test test-fast rollout model

env:
	@bash scripts/setup_env.sh

test:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest tests -ra --durations=15 $(PYTEST_ARGS)

# Tests that start no vLLM engine (seconds).
test-fast:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest tests -ra -m "not engine" $(PYTEST_ARGS)

rollout:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m vllm_ainfer_pd.models --preset tiny && \
	  $$py -m vllm_ainfer_pd.rollout compare --preset cpu --out rollout-out $(ROLLOUT_ARGS)

model:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && $$py -m vllm_ainfer_pd.models --preset tiny
