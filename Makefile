# The two commands of the README: `make test` and `make rollout`. Each sets up (or reuses) the CPU
# environment first (vLLM 0.32.0; VLLM_VERSION=0.26.0 picks 0.26's); `make env` does only that and
# prints the path of its python as its last line.
SHELL := /bin/bash

.PHONY: env test test-fast test-vllm026 test-mrv2 rollout model vllm-tests vllm-tests-032

# What `make test-vllm026` runs on vLLM 0.26.0 beside the whole suite on 0.32.0: the start-up
# check of 0.26's symbols, the tests 0.32 skips (routed experts; the DP=2 + EP pause test, whose
# reference needs a weight reload that reproduces a checkpoint), greedy parity at TP=1 and at
# TP=2 with drafting, and an asymmetric P failure at TP=2 (about 6 minutes).
SLICE_026 = tests/test_vllm_glue.py tests/test_config_and_plugin.py tests/test_routed_experts.py \
  "tests/test_rl_frameworks.py::test_serve_dp2_ep_pause_keep_wait_abort_over_http_with_p_on_one_rank" \
  tests/test_parity_offline.py::test_offline_tp1_matches_stock \
  tests/test_parity_offline.py::test_offline_tp2_drafting_stays_inside_the_round \
  tests/test_asymmetric_failures.py

# What `make test-mrv2` runs on vLLM 0.32.0's Model Runner V2 (on the CPU its Triton kernels run in
# Triton's interpreter: ainfer_pd_testing/model_runner_v2.py): the start-up check's acceptance and
# refusals, greedy parity at TP=1 and at TP=2 with drafting, served DP=2 + EP with one rank idle
# (the lane's rows beside V2's DP sync), and routed experts, which 0.32 returns from V2 only
# (about 6 minutes). `AINFER_PD_TEST_RUNNER=v2 make test` runs the whole suite on V2.
SLICE_MRV2 = tests/test_config_and_plugin.py::test_model_runner_v2_runs_the_lane_from_vllm_032_and_is_refused_before \
  tests/test_parity_offline.py::test_offline_tp1_matches_stock \
  tests/test_parity_offline.py::test_offline_tp2_drafting_stays_inside_the_round \
  tests/test_serve.py::test_serve_dp2_expert_parallel_matches_stock_tp1_with_one_rank_idle \
  tests/test_routed_experts.py

env:
	@bash scripts/setup_env.sh

# Two passes (tests/conftest.py says which test goes where): two at a time (pytest-xdist), one
# worker taking the multi-rank engines one after another while the other takes the single-rank
# modules, then the tests that need the machine to themselves (`exclusive`) one at a time. An
# engine's start is mostly one process importing vLLM on one core, so two fit the 2 cores. A pass
# that selects nothing (exit 5, e.g. under PYTEST_ARGS=-k ...) is not a failure.
test:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  { $$py -m pytest tests -ra --durations=10 -n 2 -m "not exclusive" \
	      $(PYTEST_ARGS); shared=$$?; \
	    $$py -m pytest tests -ra --durations=10 -m exclusive $(PYTEST_ARGS); alone=$$?; \
	    for rc in $$shared $$alone; do [[ $$rc == 0 || $$rc == 5 ]] || exit 1; done; }

# Tests that start no vLLM engine and no vLLM subprocess (under a minute).
test-fast:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest tests -ra -m "not engine and not slow" $(PYTEST_ARGS)

# The slice above on vLLM 0.26.0, in that release's own environment (built beside 0.32's on
# first use). `VLLM_VERSION=0.26.0 make test` runs the whole suite there.
test-vllm026:
	@py=$$(VLLM_VERSION=0.26.0 bash scripts/setup_env.sh | tail -n 1) && \
	  $$py -m pytest $(SLICE_026) -ra --durations=10 $(PYTEST_ARGS)

test-mrv2:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  AINFER_PD_TEST_RUNNER=v2 $$py -m pytest $(SLICE_MRV2) -ra --durations=10 $(PYTEST_ARGS)

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
	@py=$$(VLLM_VERSION=0.26.0 bash scripts/setup_env.sh | tail -n 1) && \
	  $$py benchmarks/vllm_tests.py $(VLLM_TESTS_ARGS)

# vLLM 0.32.0's own tests over the core modules (benchmarks/vllm_tests.py --core), stock vs
# ainfer_pd, with 0.26's pass rate on the same modules beside them.
vllm-tests-032:
	@py=$$(bash scripts/setup_env.sh | tail -n 1) && \
	  $$py benchmarks/vllm_tests.py --core --out benchmarks/results/vllm_tests/vllm-0.32.0 \
	    --beside benchmarks/results/vllm_tests/results.json $(VLLM_TESTS_ARGS)
