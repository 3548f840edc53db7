"""Uncompiled calls between compiled ones, over caches the compiled model keeps packed.

A user's own loop often runs the model uncompiled now and then over the cache the compiled
model filled: ``torch.compiler.set_stance("force_eager")`` while debugging, the module's
uncompiled forward, a helper called outside ``torch.compile``. The packed state holds the
tokens, so what the model's cache tensors hold is not its keys and values (a ``cat`` cache's
*handle* holds batch-row tags; a model-owned buffer was freed and reads zeros). Before,
such a call read those as keys and values, without an error; now the cache tensors are typed
(``cache_book.PackedHandle``, ``cache_book.PackedBuffer``) and plain PyTorch that reads them
gets the packed tokens dequantized, and the next compiled call packs the cache again. Each
step is compared with the uncompressed model fed the same tokens, within the preset's own
error (8-bit codes, so a cache read as tags or zeros stands far out).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

from kvarn_compile import kvarn_backend
from kvarn_compile.cache_book import PackedBuffer, PackedHandle
from kvarn_compile.testing.flows import HelperSubject
from kvarn_compile.testing.models import cache_arg, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread", "many_recompiles")

#: relative logit error allowed: 8-bit codes (the tiny model's whole-sequence error is ~1e-3)
TOL = 0.02


def _backend():
    return kvarn_backend("k4v2", key_bits=8, value_bits=8, group_size=32, compiler="eager",
                         max_cache_len=256)


def _ids(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (1, n), generator=g)


def _close(got, want, what):
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{what}: relative logit error {err:.3g}"


def _forward(model, ids, cache):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(ids, **cache_arg(model, cache), use_cache=True).logits


def test_uncompiled_forward_continues_a_dynamic_cache_the_compiled_model_packed():
    fp = tiny_model("llama")
    model, backend = copy.deepcopy(fp), _backend()
    model.compile(backend=backend)
    ids = _ids(fp.config.vocab_size, 44, 0)
    want = _forward(fp, ids, None)
    cache = DynamicCache(config=model.config)
    _forward(model, ids[:, :40], cache)
    assert all(type(layer.keys) is PackedHandle for layer in cache.layers)
    with torch.compiler.set_stance("force_eager"):
        got = _forward(model, ids[:, 40:42], cache)          # torch.cat([handle, new]) in eager
    _close(got, want[:, 40:42], "uncompiled forward over the packed cache")
    assert any("outside the compiled model read its packed KV cache" in n
               for n in backend.report.notes)
    got = _forward(model, ids[:, 42:44], cache)                 # compiled again: packed again
    _close(got, want[:, 42:44], "compiled forward after the uncompiled one")
    assert all(type(layer.keys) is PackedHandle for layer in cache.layers)


def test_a_handle_moved_in_plain_torch_stays_a_handle():
    fp = tiny_model("llama")
    model = copy.deepcopy(fp)
    model.compile(backend=_backend())
    cache = DynamicCache(config=model.config)
    _forward(model, _ids(fp.config.vocab_size, 40, 0), cache)
    h = cache.layers[0].keys
    for moved in (h[..., :30, :], h.index_select(0, torch.tensor([0])), h.repeat_interleave(2, 0),
                  copy.deepcopy(h), h.to(torch.float32), h.clone()):
        assert type(moved) is PackedHandle
    assert h.shape[-2] == 40 and h.dim() == 4            # shape queries pass through
    new = torch.randn(1, h.shape[1], 1, h.shape[3])
    assert torch.cat([h[..., :30, :], new], -2).shape[-2] == 31   # a crop view: dequantized
    with pytest.raises(RuntimeError, match=r"^kvarn_backend: copy_\(\) outside the compiled "
                                           r"model writes into a KV cache handle"):
        h[..., :1, :].copy_(new)                              # a write would land nowhere


def test_a_handle_reordered_in_plain_torch_reads_the_rows_it_names_until_a_compiled_call_reorders():
    """Beam search's reorder done in plain torch (``index_select`` on the handles), then an
    uncompiled read: it gets the packed rows the handle names, in its order. Once a compiled
    call took the reordered handle (and reordered the packed rows), the old one names nothing
    the state still holds: reading it raises a one-line error."""
    fp = tiny_model("llama")
    model = copy.deepcopy(fp)
    model.compile(backend=_backend())
    cache = DynamicCache(config=model.config)
    ids = torch.cat([_ids(fp.config.vocab_size, 40, 0), _ids(fp.config.vocab_size, 40, 1)])
    _forward(model, ids, cache)
    h = cache.layers[0].keys
    new = torch.randn(2, h.shape[1], 1, h.shape[3])
    swap = torch.tensor([1, 0])
    plain = torch.cat([h, new], -2)[..., :40, :]                # the packed rows, dequantized
    reordered = h.index_select(0, swap)
    assert type(reordered) is PackedHandle
    torch.testing.assert_close(torch.cat([reordered, new], -2)[..., :40, :],
                               plain.index_select(0, swap), rtol=0, atol=0)
    cache.reorder_cache(swap)                                   # every layer's handles, in plain torch
    stale = cache.layers[0].keys
    _forward(model, ids[:, :1].index_select(0, swap), cache)    # compiled: reorders the packed rows
    with pytest.raises(RuntimeError, match=r"^kvarn_backend: cat\(\) outside the compiled model "
                                           r"read a KV cache handle that no longer names"):
        torch.cat([stale, new], -2)


@pytest.mark.parametrize("reset", [False, True], ids=["continue", "reset"])
def test_uncompiled_helper_between_compiled_calls_over_packed_buffers(reset):
    """Caller-owned [B, H, L, D] buffers (freed after each compiled call): an uncompiled
    decoding step reads the packed tokens dequantized into them, the next compiled step
    adopts what they hold; a whole-buffer reset (``zero_()``) needs no dequantization."""
    backend = _backend()
    s = HelperSubject(backend)
    g = torch.Generator().manual_seed(0)
    caches, ref = s.caches(1), s.caches(1)
    x = torch.randn(1, 40, 64, generator=g)
    s.compiled(x, caches, 0)
    s._run(x, ref, 0)
    assert all(type(c) is PackedBuffer for c in caches)
    pos = 40
    if reset:
        for c in caches + ref:
            c.zero_()
        assert all(type(c) is torch.Tensor and not c.any() for c in caches)
        assert not any("touched its packed" in n for n in backend.report.notes)
        pos = 0
    for step, run in enumerate((s._run, s.compiled, s._run)):
        x = torch.randn(1, 1 + (step == 0) * 3, 64, generator=g)
        got, want = run(x, caches, pos), s._run(x, ref, pos)
        _close(got, want, f"step {step} at {pos} ({'uncompiled' if run is s._run else 'compiled'})")
        pos += x.shape[1]
    assert any("touched its packed KV cache" in n for n in backend.report.notes)
