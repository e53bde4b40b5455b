"""benchmarks/physical_floor.py against a hand computation: a 2-request trace, a tiny config."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn, dump_trace

_spec = importlib.util.spec_from_file_location(
    "physical_floor", Path(__file__).parents[1] / "benchmarks" / "physical_floor.py")
pf = sys.modules["physical_floor"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pf)

CONFIG = {"hidden_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 3, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 5, "vocab_size": 7}
# Turn 0: prompt 3 (all new), 2 outputs. Turn 1: prompt 3 + 2 + 2 = 7, 2 new, 1 output.
TRACE = Trace((Trajectory("t0", (Turn(3, 2), Turn(2, 1, 0.5))),))

# Per layer: q 4*2*3 + k 4*1*3 + v 4*1*3 + o 2*3*4 = 72, router 4*4 = 16; one expert 3*4*5 = 60.
# Active = 2 layers * (88 + 2 experts * 60) = 416; lm_head 4*7 = 28; attention 4*2*3*2 = 48/key.
P_FLOPS = ((2 * 416 * 3 + 2 * 28 + 48 * (1 + 2 + 3))  # positions 0..2 see 1..3 keys
           + (2 * 416 * 2 + 2 * 28 + 48 * (6 + 7)))  # positions 5, 6 see 6, 7 keys
# Batch 2: 3 outputs / 2 = 1.5 steps; experts touched 4 * (1 - (1 - 2/4)**2) = 3 per layer.
# Dense per replica 2 * 88 + 28 = 204; 2 bytes each. KV 2*2*1*3*2 = 24 bytes per token read:
# request 0 reads 3 then 4, request 1 reads 7.
D_WEIGHTS_DP1 = 1.5 * 2 * (204 + 2 * 3 * 60)
D_WEIGHTS_DP2 = 1.5 * 2 * (2 * 204 + 2 * 3 * 60)
D_KV = 24 * (3 + 4 + 7)


def test_requests_take_context_increment_and_outputs_from_the_trace():
    assert pf.requests(TRACE) == [(3, 3, 2), (7, 2, 1)]


def test_prefill_flops_and_decode_bytes_match_the_hand_computation():
    assert P_FLOPS == 5184
    r = pf.floor(TRACE, pf.MoEShape.from_hf(CONFIG), tp=1, dp=1, dtype_bytes=2, decode_batch=2,
                 peak_tflops=1e-9, hbm_tbps=1e-9, makespan_s=10000.0)
    assert r["p_flops"] == P_FLOPS
    assert r["experts_touched_per_layer"] == pytest.approx(3.0)
    assert r["d_weight_bytes"] == pytest.approx(D_WEIGHTS_DP1)
    assert r["d_kv_bytes"] == D_KV
    d_bytes = D_WEIGHTS_DP1 + D_KV  # 2028
    assert r["p_s"] == pytest.approx(P_FLOPS / 1000) and r["d_s"] == pytest.approx(d_bytes / 1000)
    assert r["floor_overlap_s"] == pytest.approx(P_FLOPS / 1000)
    assert r["floor_serial_s"] == pytest.approx((P_FLOPS + d_bytes) / 1000)
    assert r["ratio_overlap"] == pytest.approx(10000.0 / (P_FLOPS / 1000))
    assert r["counts"] == {"trajectories": 1, "requests": 2, "new_prompt_tokens": 5,
                           "prompt_tokens": 10, "output_tokens": 3}


def test_client_wait_floor_is_the_latest_release_plus_scaled_waits():
    late = Trajectory("t1", (Turn(4, 1), Turn(1, 1, 2.0), Turn(1, 1, 3.0)), start_s=1.0)
    trace = Trace((TRACE.trajectories[0], late))
    assert pf.client_wait_floor(trace, 1.0) == pytest.approx(1.0 + 5.0)  # t0: 0.5
    assert pf.client_wait_floor(trace, 0.5) == pytest.approx(1.0 + 2.5)
    r = pf.floor(trace, pf.MoEShape.from_hf(CONFIG), tp=1, dp=1, dtype_bytes=2, decode_batch=2,
                 peak_tflops=1.0, hbm_tbps=1.0, wait_scale=0.5)
    assert r["client_wait_floor_s"] == pytest.approx(3.5)
    assert r["makespan_lower_bound_s"] == pytest.approx(3.5)  # the hardware floor is ~1e-8 s
    slow = pf.floor(TRACE, pf.MoEShape.from_hf(CONFIG), tp=1, dp=1, dtype_bytes=2,
                    decode_batch=2, peak_tflops=1e-9, hbm_tbps=1e-9, wait_scale=0.5)
    assert slow["makespan_lower_bound_s"] == pytest.approx(P_FLOPS / 1000)  # hardware binds


def test_dp_replicates_dense_weights_and_splits_the_work_over_all_ranks():
    r = pf.floor(TRACE, pf.MoEShape.from_hf(CONFIG), tp=2, dp=2, dtype_bytes=2, decode_batch=2,
                 peak_tflops=1e-9, hbm_tbps=1e-9)
    assert r["d_weight_bytes"] == pytest.approx(D_WEIGHTS_DP2)
    assert r["p_s"] == pytest.approx(P_FLOPS / 1000 / 4)
    assert r["d_s"] == pytest.approx((D_WEIGHTS_DP2 + D_KV) / 1000 / 4)
    assert "ratio_overlap" not in r


def test_cli_reads_trace_and_config_files_and_writes_json(tmp_path, capsys):
    dump_trace(TRACE, tmp_path / "trace.jsonl")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    pf.main(["--trace", str(tmp_path / "trace.jsonl"), "--config", str(tmp_path / "config.json"),
             "--decode-batch", "2", "--peak-tflops", "1e-9", "--hbm-tbps", "1e-9",
             "--makespan-s", "10000", "--json-out", str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["p_flops"] == P_FLOPS and out["d_bytes"] == pytest.approx(D_WEIGHTS_DP1 + D_KV)
    assert out["inputs"]["peaks_source"] == "given"
    assert "measured / floor" in capsys.readouterr().out


def test_measure_without_cuda_fails_with_a_clear_error(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        pf.measure_peaks()
    with pytest.raises(SystemExit):
        pf.main(["--measure", "--trace-preset", "cpu", "--model-preset", "tiny"])
    assert "--measure needs a CUDA device" in capsys.readouterr().err
