"""key_frame="auto" end to end: a Qwen2-style model whose k_proj bias gives its keys huge
channels, compiled with kvarn_backend, against the eager model on a KVarNCache.

The per-tile frame choice itself is tested in tests/quant/test_quantize.py (quantizer),
tests/ops/test_append.py and tests/ops/test_attention.py (packed state, fused attention) and
tests/kernels/test_triton.py (Triton decode kernel).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

from kvarn_compile import kvarn_backend
from kvarn_compile.hf import KVarNCache, use_kvarn_attention
from kvarn_compile.testing import cache_arg

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(preset="k4v2", group_size=32, key_frame="auto")
MAX_LEN = 192
PROMPT = 90          # sink 32 + 1 tile + 26 tail; decoding freezes the next tile at 127
NEW = 40


def _biased_qwen2():
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.15,
                         attn_implementation="sdpa")
    model = tf.Qwen2ForCausalLM(cfg).eval()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():        # layer 0: a huge bias in two channels of every kv head
        bias = model.model.layers[0].self_attn.k_proj.bias.view(2, head_dim)
        bias[:, 3] += 150.0
        bias[:, 20] -= 120.0
    return model


def _generate(model, ids, cache=None):
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if cache is not None:
        kw.update(cache_arg(model, cache))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kw)


def test_compiled_auto_frames_equal_eager_and_store_the_biased_layer_plain():
    model = _biased_qwen2()
    ids = torch.randint(2, 128, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    eager = copy.deepcopy(model)
    use_kvarn_attention(eager)
    want = _generate(eager, ids, KVarNCache(eager.config, max_cache_len=MAX_LEN, **CFG))

    backend = kvarn_backend(**CFG, compiler="eager", max_cache_len=MAX_LEN)
    model.compile(backend=backend)
    got = _generate(model, ids)
    assert got.sequences.tolist() == want.sequences.tolist()
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert all(s.rewritten for s in backend.report.sites), str(backend.report)
    frames = {name: st.k_plain for (name, _), st in backend.states.items()}
    assert len(frames) == 2 and all(f is not None for f in frames.values())
    first, second = sorted(frames)
    assert frames[first][0, :, :2].all()          # layer 0: bias outliers -> plain tiles
    assert not frames[second].any()               # layer 1: natural keys -> rotated
