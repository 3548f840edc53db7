"""``generate`` flows on one model compiled with ``kvarn_backend``, as users chain them.

Each test runs a flow that once went wrong (other tokens without an error, or a refusal
where transformers' contract promises a result) and compares every new token's logits with
the uncompressed model fed the same tokens (teacher forcing), within the preset's own error:
8-bit codes, so a cache that lost, misplaced or double-counted tokens stands far out, and the
same flow on an uncompressed model would agree to float noise.

* a second batch size on the same compiled model: Dynamo makes the batch dynamic; each batch
  size then runs its own graph with the cache packed (the report says so);
* ``cache_implementation="static"`` with a second, longer prompt;
* ``output_hidden_states=True`` after an earlier ``generate``;
* ``crop(-n)`` of a returned cache reaching into the packed tiles, then continuing; the same
  for a ``StaticCache`` (a write before the end of a static cache revises the tiles).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import StaticCache

from kvarn_compile import kvarn_backend
from kvarn_compile.hf import output_cache
from kvarn_compile.testing.models import cache_arg, static_cache_crops, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread", "many_recompiles")

#: relative logit error allowed: 8-bit codes (the tiny model's whole-sequence error is ~1e-3)
TOL = 0.02


@pytest.fixture(scope="module")
def fp():
    return tiny_model("llama")


def _compiled(fp):
    backend = kvarn_backend("k4v2", key_bits=8, value_bits=8, group_size=32, compiler="eager",
                            max_cache_len=512)
    model = copy.deepcopy(fp)
    model.compile(backend=backend)
    return model, backend


def _ids(fp, n, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, fp.config.vocab_size, (batch, n), generator=g)


def _generate(model, ids, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **kw)
    return out, torch.stack(out.logits, 1)


def _error(fp, got, sequences, start):
    """Largest relative difference of ``got`` (logits of positions start..) to ``fp``'s."""
    with torch.no_grad():
        want = fp(sequences).logits[:, start - 1:start - 1 + got.shape[1]]
    return float((got - want).abs().max() / want.abs().max())


def test_a_second_batch_size_keeps_the_cache_packed(fp):
    model, backend = _compiled(fp)
    for batch in (1, 2, 3):
        ids = _ids(fp, 40, batch, seed=batch)
        out, logits = _generate(model, ids, max_new_tokens=4)
        assert _error(fp, logits, out.sequences, 40) < TOL
        packed = [state for (name, b), state in backend.states.items() if b == batch]
        assert len(packed) == 2, (batch, list(backend.states))      # both layers, this batch
        assert all(int(s.lengths.max()) == 43 for s in packed)
    text = str(backend.report)
    assert "each batch size runs its own graph" in text
    assert "in full precision" not in text


def test_static_cache_with_a_second_prompt_length(fp):
    model, _ = _compiled(fp)
    for n in (40, 300):
        out, logits = _generate(model, _ids(fp, n, seed=n), max_new_tokens=4,
                                cache_implementation="static")
        assert _error(fp, logits, out.sequences, n) < 3 * TOL    # 300 tokens: 8 packed tiles


def test_output_hidden_states_after_an_earlier_generate(fp):
    model, _ = _compiled(fp)
    _generate(model, _ids(fp, 30), max_new_tokens=1)
    out, logits = _generate(model, _ids(fp, 40, seed=1), max_new_tokens=4,
                            output_hidden_states=True)
    assert len(out.hidden_states) == 4
    assert _error(fp, logits, out.sequences, 40) < TOL


def test_crop_into_the_packed_tiles_then_continue(fp):
    model, _ = _compiled(fp)
    out, _ = _generate(model, _ids(fp, 100), max_new_tokens=5)
    cache = output_cache(out)                    # 104 tokens: sink 32, two tiles, tail
    cache.crop(-40)                                # back into the second tile
    assert cache.get_seq_length() == 64
    more = _ids(fp, 3, seed=9)
    with torch.no_grad():
        got = model(more, **cache_arg(model, cache)).logits
    assert _error(fp, got, torch.cat([out.sequences[:, :64], more], 1), 65) < TOL


@pytest.mark.skipif(not static_cache_crops(), reason="this transformers' StaticCache has no crop "
                    "(StaticLayer.crop came in 5.24)")
def test_static_cache_cropped_then_written_again(fp):
    model, _ = _compiled(fp)
    ids = _ids(fp, 100)
    cache = StaticCache(config=model.config, max_cache_len=256)
    with torch.no_grad():
        model(ids, **cache_arg(model, cache))
        cache.crop(-40)
        more = _ids(fp, 3, seed=9)
        got = model(more, **cache_arg(model, cache)).logits
    assert _error(fp, got, torch.cat([ids[:, :60], more], 1), 61) < TOL
