"""``benchmarks/gpu/run.sh``, the GPU check run on a lent machine as it is, rehearsed here: on a
machine without CUDA each GPU step says it skipped, and the summary it leaves under $OUT is
valid JSON naming every step (what comes back when the real run is cut short)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

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
                          "gpu_tests", "attention_tests"}
    assert steps["cuda_graph"]["rc"] == 0 and steps["e2e_decode"]["rc"] == 0
    assert steps["gpu_tests"]["skipped"] == "not in KVARN_GPU_STEPS"
    assert json.loads((tmp_path / "env.json").read_text())["kvarn_import"] == "ok"
    # at most 8 files come back from the lent machine
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8
