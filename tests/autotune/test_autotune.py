"""kvarn_compile.autotune: the quantization-knob rule, the kernel-choice database, cache keys.

* the admissibility rule rejects candidates that break the tolerance on tiles with strong
  outliers (T=0, G=256) with the reason, accepts the preset's setting, and picks the
  fastest admissible candidate (a fake timer makes "fastest" deterministic);
* export/import round-trips and a loaded entry replays the winner with one choice and no
  benchmark (Inductor's ``do_autotuning`` is counted);
* stale (torch/triton/kvarn-sources) and foreign (device) entries are ignored with a reason;
* the Inductor cache key (``KVarNUUIDPass.uuid``) changes when a template file changes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil

import pytest
import torch

from kvarn_compile import _torch_compat, autotune, lowering
from kvarn_compile.autotune import KnobTuning, QuantKnobs, TuneKey, select_quant_knobs, tuning
from kvarn_compile.config import get_config
from kvarn_compile.ops import append as append_ref, attention as attention_ref
from kvarn_compile.state import allocate_layer
from kvarn_compile.testing import no_graph_caches


@pytest.fixture(autouse=True)
def _isolated_autotune_db(tmp_path, monkeypatch):
    monkeypatch.setenv("KVARN_AUTOTUNE_DB", str(tmp_path / "persisted.json"))
    autotune.DB.clear()
    yield
    autotune.DB.clear()


def outlier_kv(tokens: int = 256, d: int = 64, seed: int = 0):
    """K/V rows [1, 2, tokens, d]: uneven channels, every 9th token 30x louder, a 4x drift."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, tokens, d, generator=g) * (0.5 + torch.rand(d, generator=g) * 2)
    k[..., 3] += 8.0
    v = torch.randn(1, 2, tokens, d, generator=g)
    loud = torch.ones(tokens)
    loud[::9] = 30.0
    loud[tokens // 2:] *= 4.0
    return k * loud[:, None], v * loud[:, None]


def fake_timer(knobs: QuantKnobs, fn) -> float:
    """Deterministic 'timing': cost grows with T and shrinks with larger tiles."""
    return 1e-3 * (1 + knobs.iters) * (64 / knobs.group_size) ** 0.5


# ------------------------------------------------------------------------------ the rule
def test_rule_rejects_candidates_that_break_the_tolerance_and_accepts_the_preset():
    k, v = outlier_kv()
    cfg = get_config("k4v2", group_size=64)          # reference: G=64, T=8
    cands = [(64, 0), (64, 2), (64, 4), (256, 8), (32, 8)]
    d = select_quant_knobs(k, v, cfg, cands, tolerance=0.05, timer=fake_timer)
    by = {c.knobs: c for c in d.candidates}
    ref = by[QuantKnobs(64, 8)]
    assert d.reference == QuantKnobs(64, 8) and ref.admissible and not ref.reason
    for bad in (QuantKnobs(64, 0), QuantKnobs(256, 8)):    # no normalization / huge tiles
        assert not by[bad].admissible
        assert by[bad].reason.startswith("K err") and "x 1.05" in by[bad].reason
        assert by[bad].k_err > ref.k_err * 1.05
    admissible = [c for c in d.candidates if c.admissible]
    assert d.chosen == min(admissible, key=lambda c: c.seconds).knobs == QuantKnobs(64, 2)
    winner = by[d.chosen]
    assert winner.k_err <= ref.k_err * 1.05 and winner.v_err <= ref.v_err * 1.05
    assert "tolerance 0.05" in d.summary() and len(d.lines()) == 1 + len(d.candidates)


def test_rule_with_zero_tolerance_keeps_the_preset_unless_a_candidate_is_no_worse():
    k, v = outlier_kv(seed=1)
    cfg = get_config("k4v2", group_size=64)
    d = select_quant_knobs(k, v, cfg, [(64, 0)], tolerance=0.0, timer=fake_timer)
    assert d.chosen == d.reference == QuantKnobs(64, 8)
    assert [c.knobs for c in d.rejected] == [QuantKnobs(64, 0)]


def test_rule_reports_unmeasurable_candidates_and_rejects_bad_tolerances():
    k, v = outlier_kv(tokens=100)
    cfg = get_config("k4v2", group_size=64)
    d = select_quant_knobs(k, v, cfg, [(128, 8)], tolerance=0.1, timer=fake_timer)
    (big,) = d.rejected
    assert big.reason == "needs 128 rows for one tile, only 100 available"
    assert d.chosen == QuantKnobs(64, 8)
    with pytest.raises(ValueError, match="Expected a finite tolerance"):
        select_quant_knobs(k, v, cfg, [], tolerance=-1.0)
    with pytest.raises(ValueError, match="KnobTuning.tolerance"):
        KnobTuning(tolerance=-0.1)


def test_first_tile_rows_are_the_full_precision_rows_about_to_be_frozen():
    cfg = get_config("k4v2", group_size=32)
    st = allocate_layer(cfg, batch=1, kv_heads=2, head_dim=16, max_len=200, dtype=torch.float32)
    k, v = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    append_ref.append_(st.buffers, k[:, :, :50], v[:, :, :50], torch.tensor([0]))   # sink + 18
    assert tuning.first_tile_rows(st.buffers, k[:, :, 50:60], v[:, :, 50:60],
                                    torch.tensor([50]), 0, 0) is None      # 60 < 32 + 32
    rows = tuning.first_tile_rows(st.buffers, k[:, :, 50:], v[:, :, 50:], torch.tensor([50]), 0, 0)
    assert rows is not None
    exact = st.tail_k.dtype
    torch.testing.assert_close(rows[0], k[:, :, 32:64].to(exact).float())
    torch.testing.assert_close(rows[1], v[:, :, 32:64].to(exact).float())


def test_tuned_cache_chooses_G_and_T_on_the_prefill_before_allocating():
    from transformers import LlamaConfig

    model_cfg = LlamaConfig(num_hidden_layers=1, hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, vocab_size=64)
    opts = KnobTuning(tolerance=0.05, iters=(0, 8), group_sizes=(64, 256), timer=fake_timer)
    from kvarn_compile.hf import TunedKVarNCache

    cache = TunedKVarNCache(model_cfg, max_cache_len=1024, preset="k4v2",
                            group_size=64, tune=opts)
    k, v = outlier_kv(tokens=320)                          # sink 64 + 256 measured rows
    layer = cache.layers[0]
    layer.update(k, v)
    decision = cache.decisions["layers.0"]
    assert decision.chosen == QuantKnobs(layer.config.group_size, layer.config.sinkhorn_iters)
    assert layer.state.config.group_size == decision.chosen.group_size
    assert layer.config.sink == 64                            # the preset's sink is kept
    assert QuantKnobs(64, 0) in [c.knobs for c in decision.rejected]


# ------------------------------------------------------------------------------ the DB
def _key(**changes) -> TuneKey:
    name, cap = _torch_compat.device_identity("cpu")
    base = TuneKey(op="kvarn_attention", device=name, capability=cap, dtype="torch.float32",
                   preset="k4v2", head_dim=64, kv_heads=2, q_heads=8, batch=1, query="decode",
                   length_bucket=4096)
    return dataclasses.replace(base, **changes)


def test_stale_and_foreign_entries_are_ignored_with_a_reason(tmp_path, caplog):
    db = autotune.AutotuneDB()
    db.record(_key(), {"choice": "dense"}, {"dense": 1.0, "reference": 2.0})
    data = db.to_json()
    good = data["entries"][0]
    variants = {
        "torch": dict(good, torch="2.0.0"),
        "triton": dict(good, triton="0.1"),
        "sources": dict(good, kvarn_sources="deadbeef" * 8),
        "foreign": dict(good, key=dict(good["key"], device="NVIDIA Z999", capability="sm99")),
    }
    for i, (name, entry) in enumerate(variants.items()):
        entry["key"] = dict(entry["key"], batch=10 + i)      # distinct keys
    data["entries"] += list(variants.values())
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(data))
    fresh = autotune.AutotuneDB()
    with caplog.at_level(logging.WARNING, logger="kvarn_compile.autotune"):
        report = fresh.load(path)
    assert report.loaded == 1 and len(fresh) == 1 and fresh.lookup(_key()) == {"choice": "dense"}
    reasons = dict(report.ignored)
    assert len(reasons) == 4
    assert reasons[_key(batch=10).text()].startswith("stale: recorded with torch 2.0.0")
    assert reasons[_key(batch=11).text()].startswith("stale: recorded with triton 0.1")
    assert reasons[_key(batch=12).text()].startswith("stale: recorded with kvarn sources deadbeef")
    foreign = _key(batch=13, device="NVIDIA Z999", capability="sm99").text()
    assert reasons[foreign].startswith("foreign: recorded on NVIDIA Z999 (sm99)")
    logged = caplog.text
    assert "stale: recorded with torch 2.0.0" in logged and "foreign: recorded on NVIDIA Z999" in logged
    with pytest.raises(ValueError, match="format version 1"):
        (tmp_path / "v9.json").write_text(json.dumps({"format": "kvarn-autotune", "version": 9}))
        fresh.load(tmp_path / "v9.json")


def _packed(prompt=150):
    cfg = get_config("k4v2", group_size=32)
    st = allocate_layer(cfg, batch=2, kv_heads=2, head_dim=16, max_len=200, dtype=torch.float32)
    append_ref.append_(st.buffers, torch.randn(2, 2, prompt, 16), torch.randn(2, 2, prompt, 16),
                      torch.zeros(2, dtype=torch.long))
    return st


def _attend(q, *buffers):
    return torch.ops.kvarn.attention(q, list(buffers), None, 0.3, True, 0) * 2.0


def test_export_import_round_trip_replays_the_winner_without_benchmarking(tmp_path, monkeypatch):
    """The first compile benchmarks reference vs shared; after export, clear and import, a
    second compile offers only the recorded winner and benchmarks nothing.

    The query has 24 rows (a chunk of a prompt, or speculative tokens being verified). On
    CPU the auto path lowers every static shape the C++ kernel covers straight to its
    extern call without autotuning (``lowering.attention.cpu_kernel_covers``), so the C++
    kernel is switched off here (``KVARN_CPU_KERNEL=0``) to leave choices to benchmark.
    """
    monkeypatch.setenv("KVARN_CPU_KERNEL", "0")
    lowering.register()
    calls = []
    selector = _torch_compat.inductor().AlgorithmSelectorCache
    original = selector.do_autotuning

    def counting(self, name, *args, **kwargs):
        calls.append(name)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(selector, "do_autotuning", counting)
    st, q = _packed(), torch.randn(2, 4, 24, 16)     # the last 24 of the 150 cached tokens
    expected = 2.0 * attention_ref.attention(q, st.buffers, None, 0.3, True, 0)

    def compile_once():
        torch._dynamo.reset()
        first = len(lowering.DECISIONS)
        with no_graph_caches():
            out = torch.compile(_attend, backend="inductor", fullgraph=True)(q, *st.buffers)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
        (decision,) = [d for d in lowering.DECISIONS[first:] if d.op == "kvarn_attention"]
        return decision

    first = compile_once()                       # auto: reference vs shared, benchmarked
    assert calls == ["kvarn_attention"] and len(first.offered) == 2 and not first.replayed
    assert set(first.timings_ms) == {"reference", "shared"}
    path = tmp_path / "export.json"
    assert autotune.export(path) == 1
    data = json.loads(path.read_text())
    assert data["format"] == "kvarn-autotune" and data["version"] == 1
    (entry,) = data["entries"]
    assert entry["key"]["op"] == "kvarn_attention" and entry["key"]["preset"] == "k4v2_g32_float16"
    assert entry["winner"] == {"choice": first.winner}
    assert entry["torch"] == torch.__version__ and entry["kvarn_sources"] == _torch_compat.kvarn_sources_hash()

    autotune.DB.clear()
    report = autotune.load(path)
    assert report.loaded == 1 and not report.ignored
    calls.clear()
    second = compile_once()                      # replay: one choice, nothing benchmarked
    assert calls == [] and second.replayed and second.offered == [first.winner]
    assert second.winner == first.winner


def test_cli_exports_and_imports(tmp_path, capsys):
    from kvarn_compile.cli import main

    autotune.DB.record(_key(), {"choice": "reference"}, {"reference": 1.0, "dense": 3.0})
    out = tmp_path / "tuned.json"
    assert main(["autotune", "export", str(out)]) == 0
    assert "exported 1 entry" in capsys.readouterr().out
    autotune.DB.clear()
    assert main(["autotune", "import", str(out)]) == 0
    assert "loaded 1 entry" in capsys.readouterr().out
    assert autotune.DB.lookup(_key()) == {"choice": "reference"}
    persisted = json.loads(pathlib.Path(autotune.default_db_path()).read_text())
    assert len(persisted["entries"]) == 1


# ------------------------------------------------------------------------------ cache key
def test_the_inductor_cache_key_covers_the_templates(tmp_path):
    package = pathlib.Path(_torch_compat.__file__).parent
    assert (package / "lowering" / "templates" / "kvarn_decode.py.jinja").exists()
    _torch_compat.kvarn_sources_hash.cache_clear()    # sources may change while tests run
    uuid = _torch_compat.KVarNUUIDPass().uuid()
    lowering.register()
    assert uuid.startswith(_torch_compat.kvarn_sources_hash()) and lowering.cache_salt() in \
        _torch_compat.KVarNUUIDPass().uuid()

    copy = tmp_path / "kvarn_compile"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = _torch_compat._hash_sources(copy)
    assert before == _torch_compat.kvarn_sources_hash()   # content, not the folder's path
    (copy / "notes.txt").write_text("not a source")
    assert _torch_compat._hash_sources(copy) == before
    for harness in (copy / "eval" / "report.py", copy / "testing" / "flows.py", copy / "cli.py"):
        harness.write_text(harness.read_text() + "\n# compiles nothing\n")
    assert _torch_compat._hash_sources(copy) == before
    template = copy / "lowering" / "templates" / "kvarn_decode.py.jinja"
    template.write_text(template.read_text().replace("BLOCK_N", "BLOCK_N ", 1))
    assert _torch_compat._hash_sources(copy) != before


def test_the_uuid_follows_a_template_edit_in_place(monkeypatch, tmp_path):
    """The live package: the cached hash is recomputed and the uuid changes with the file."""
    package = tmp_path / "kvarn_compile"
    shutil.copytree(pathlib.Path(_torch_compat.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(_torch_compat, "__file__", str(package / "_torch_compat.py"))
    _torch_compat.kvarn_sources_hash.cache_clear()
    try:
        uuid_before = _torch_compat.KVarNUUIDPass().uuid()
        template = package / "lowering" / "templates" / "kvarn_decode.py.jinja"
        template.write_text(template.read_text() + "\n# edited\n")
        _torch_compat.kvarn_sources_hash.cache_clear()
        assert _torch_compat.KVarNUUIDPass().uuid() != uuid_before
    finally:
        monkeypatch.undo()
        _torch_compat.kvarn_sources_hash.cache_clear()
