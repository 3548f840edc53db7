"""``benchmarks/gpu/run.sh``, the GPU check run on a lent machine as it is, rehearsed here: on a
machine without CUDA each GPU step says it skipped, and the summary it leaves under $OUT is
valid JSON naming every step (what comes back when the real run is cut short); the prompt
benchmark's parts run on CPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_steps_and_leaves_a_summary(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
               KVARN_GPU_STEPS="cuda_graph e2e_decode", KVARN_GPU_CHECK_SECONDS="120")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = summary["steps"]
    assert set(steps) == {"triton_tests", "cuda_graph", "bench_decode_attention", "e2e_decode",
                          "gpu_tests", "attention_tests", "bench_prefill_attention"}
    assert steps["cuda_graph"]["rc"] == 0 and steps["e2e_decode"]["rc"] == 0
    assert steps["gpu_tests"]["skipped"] == "not in KVARN_GPU_STEPS"
    assert json.loads((tmp_path / "env.json").read_text())["kvarn_import"] == "ok"
    # at most 8 files come back from the lent machine
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8


def test_the_prompt_benchmark_runs_its_parts_on_cpu(monkeypatch):
    """``bench_prefill_attention_gpu.run_case`` end to end on CPU tensors (the Triton parts
    under the interpreter; 4 query heads on 1 kv head, three of the template's prompt
    configs, timed once): every part reports, none fails, and the configs compute the same
    attention, so the one call a lent GPU gets does not lose this step to a bug in the
    script."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))     # (restored after the test)
    import bench_decode_attention_gpu as decode_bench
    import bench_prefill_attention_gpu as prefill_bench
    from kvarn_compile.config import get_config

    monkeypatch.setenv("KVARN_TRITON_CPU", "1")   # the compiled op's Triton lowering too
    for module in (decode_bench, prefill_bench):
        monkeypatch.setattr(module, "GQA_Q_HEADS", 4)
        monkeypatch.setattr(module, "KV_HEADS", 1)
    monkeypatch.setattr(prefill_bench, "PROMPT_CONFIGS", prefill_bench.PROMPT_CONFIGS[:3])
    calls = []

    def once(fn):
        calls.append(fn())
        return {"ms_median": 1.0 + len(calls), "timer": "once"}

    with torch.no_grad():
        row = prefill_bench.run_case(get_config("k4v2"), 128 + 128 + 20, device="cpu", timer=once)
    assert not [k for k in row if k.endswith("error")], row
    configs = row["template_configs"]
    assert len(configs) == len(prefill_bench.PROMPT_CONFIGS), configs
    for cfg in configs:
        assert "error" not in cfg and cfg["max_rel_diff_vs_first"] < 1e-3, cfg
    assert row["packed_tiles"] == 1 and row["quantize_prompt"]["tiles"] == 2
    assert row["kvarn_over_sdpa"] > 0 and "lowering" in row["kvarn"]


def test_the_decode_benchmark_runs_its_parts_on_cpu(monkeypatch):
    """``bench_decode_attention_gpu.run_case``, the GPU check's first step, end to end on CPU
    tensors the same way (three of its template configs): every part reports, none fails."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))     # (restored after the test)
    import bench_decode_attention_gpu as decode_bench
    from kvarn_compile.config import get_config

    monkeypatch.setenv("KVARN_TRITON_CPU", "1")
    monkeypatch.setattr(decode_bench, "GQA_Q_HEADS", 4)
    monkeypatch.setattr(decode_bench, "KV_HEADS", 1)
    monkeypatch.setattr(decode_bench, "SWEEP", decode_bench.SWEEP[:3])
    monkeypatch.setattr(decode_bench, "_bench_ms",
                        lambda fn: (fn(), {"ms_median": 1.0, "timer": "once"})[1])
    with torch.no_grad():
        row = decode_bench.run_case(get_config("k4v2"), 1, 128 + 2 * 128 + 100, device="cpu")
    assert not [k for k in row if k.endswith("error")], row
    assert len(row["template_sweep"]) == 3 and not [r for r in row["template_sweep"] if "error" in r]
    assert {"speedup_vs_sdpa_fp16", "speedup_vs_flex"} <= set(row["kvarn"])
    assert row["scales"]["dual_over_single"] > 0 and row["tile_quantize"]["ms_median"] > 0
