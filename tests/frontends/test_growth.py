"""Packed states that grow with the sequence (caches the model does not preallocate).

A ``cat`` cache (transformers' DynamicCache) gets a *growable* state: it holds only what its
tokens need (a short sink, a tail that has not wrapped, the tiles so far) and
``LayerState.reserve`` grows it before each call, in whole tiles past the sink. Asserted:

* the sizes follow the tokens, and a growing state is the preallocated state of the same
  tokens: the same packed tiles bit for bit and the same attention output, however the
  tokens arrive (the kernels read S and W off the shapes, so short buffers must keep every
  position in place);
* through ``kvarn_backend`` (rewritten graphs as they are, and Inductor) and
  ``inductor_pass``: the tokens of the eager KVarN model, bytes that grow with the sequence
  and stay below the preallocated state (and below fp16 once past the high-precision sink
  and tail), no graph compiled for growth, a new sequence shrinks the states again;
* a compile that specialized the growing axis is refused instead of miscompiled.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

import kvarn_compile
import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config, kvarn_backend
from kvarn_compile.hf import KVarNCache, kv_geometry, use_kvarn_attention
from kvarn_compile.state import (
    GROW_AXIS_FIELDS, MIN_GROWN_SLOTS, allocate_layer, fp16_cache_bytes, tiles_for, unpack,
)
from kvarn_compile.testing import cache_arg, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

G, D, H = 32, 32, 2
CFG = get_config("k4v2", group_size=G)


def _kv(batch, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(D, generator=g) * 3 + 0.1
    return [torch.randn(batch, H, tokens, D, generator=g) * scale for _ in range(2)]


# ------------------------------------------------------------------------------ the state
def _step(st, full, pos, n, seed):
    """reserve, append n tokens (the C++/reference op) to the growable and the preallocated
    state, trim; the new position."""
    k, v = _kv(st.batch, n, seed)
    start = torch.full((st.batch,), pos)
    st.reserve(pos + n, fresh=pos == 0)
    for s in (st, full):
        torch.ops.kvarn.append_(s.buffers, k, v, start, "kvarn", 8, 0, 0, False, "")
    st.trim()
    return pos + n


def test_sizes_follow_the_tokens_and_bytes_never_exceed_fp16():
    """S = W = G = 32: a sink of exactly the tokens, then a tail of exactly the tokens after
    it, then after the first frozen tile a tail rounded up (to 16 slots, or to the whole ring
    once fp16's bytes allow that). At every
    length the state holds no more than fp16 K/V of the same tokens, but for its four int64
    counters (32 bytes per row), and less once a tile is frozen."""
    st = allocate_layer(CFG, batch=1, kv_heads=H, head_dim=D, max_len=400, dtype=torch.float32,
                        grow_from=5)
    assert st.growable and st.grown == (5, 0, 0) and int(st.capacity[0]) == 5
    full = allocate_layer(CFG, batch=1, kv_heads=H, head_dim=D, max_len=400, dtype=torch.float32)
    expected = {                   # tokens -> (sink, tail, tiles) slots
        1: (1, 0, 0), 17: (17, 0, 0), 32: (32, 0, 0), 33: (32, 1, 0), 63: (32, 31, 0),
        64: (32, 0, 1), 65: (32, 16, 1), 80: (32, 32, 1), 96: (32, 32, 2),
        399: (32, 32, 11), 400: (32, 32, 11),
    }
    counters = 4 * 8
    pos, seen = 0, {}
    while pos < 400:
        pos = _step(st, full, pos, 1, seed=pos)
        seen[pos] = st.grown
        fp16 = fp16_cache_bytes(batch=1, kv_heads=H, head_dim=D, tokens=pos)
        assert st.nbytes <= fp16 + counters, (pos, st.grown)
        if pos >= 32 + 32:        # a tile is frozen
            assert st.nbytes < fp16, (pos, st.grown)
        assert int(st.capacity[0]) >= pos
    assert {t: seen[t] for t in expected} == expected
    assert int(st.capacity[0]) == 400 == st.max_len           # sink and tiles whole
    assert st.nbytes == full.nbytes and not full.growable and not full.reserve(10)  # whole again
    # a new sequence takes exactly what it needs (nothing held must survive)
    version = st.version
    assert st.reserve(20, fresh=True) and st.grown == (20, 0, 0) and st.version == version + 1
    assert not st.reserve(20, fresh=True)                    # nothing more to give back
    # a short max_len (one tile slot at most, or none: max_len shorter than sink + one tile)
    # grows too, and its byte accounting still works
    for max_len, whole in ((G + G + 5, (32, 32, 1)), (40, (32, 32, 0))):
        short = allocate_layer(CFG, batch=1, kv_heads=H, head_dim=D, max_len=max_len,
                               dtype=torch.float32, grow_from=1)
        full_short = allocate_layer(CFG, batch=1, kv_heads=H, head_dim=D, max_len=max_len,
                                    dtype=torch.float32)
        assert short.growable and short.grown == (1, 0, 0) and full_short.grown == whole
        pos = 0
        while pos < max_len:
            pos = _step(short, full_short, pos, 1, seed=pos)
            fp16 = fp16_cache_bytes(batch=1, kv_heads=H, head_dim=D, tokens=pos)
            assert short.nbytes <= fp16 + counters, (max_len, pos, short.grown)
        assert short.tile_bytes() == full_short.tile_bytes() > 0
        assert short.used_bytes()["tiles"] == short.tiles_held() * short.tile_bytes()


def test_rows_of_unequal_lengths_keep_every_tail_token():
    """Rows on both sides of a tile boundary: the tail is sized for the row with the most
    tokens after its frozen tiles (appends carry a start position per row)."""
    st = allocate_layer(CFG, batch=2, kv_heads=H, head_dim=D, max_len=400, dtype=torch.float32,
                        grow_from=0)
    full = allocate_layer(CFG, batch=2, kv_heads=H, head_dim=D, max_len=400, dtype=torch.float32)
    # row 1 starts over after 40 tokens: then row 0 runs 40 tokens ahead of it
    calls = [(40, [0, 0]), (20, [40, 0]), (20, [60, 20])] + [(1, [80 + i, 40 + i]) for i in range(40)]
    for i, (n, starts) in enumerate(calls):
        k, v = _kv(2, n, seed=i)
        ends = [p + n for p in starts]
        st.reserve(max(ends), fresh=max(starts) == 0, shortest=min(ends))
        for s in (st, full):
            torch.ops.kvarn.append_(s.buffers, k, v, torch.tensor(starts), "kvarn", 8, 0, 0, False, "")
        st.trim()
        q = torch.randn(2, 2 * H, 1, D, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(torch.ops.kvarn.attention(q, st.buffers, None, D ** -0.5, True, 0),
                                   torch.ops.kvarn.attention(q, full.buffers, None, D ** -0.5, True, 0),
                                   atol=1e-6, rtol=1e-6)
    assert unpack(st.buffers).lengths.tolist() == [120, 80]
    # the shorter row's tail tokens (after its 1 tile) outnumber the longer row's (after 2)
    assert st.grown[1] >= 80 - 32 - 32


def test_tiles_grow_in_steps_of_a_sixteenth_past_sixteen_tiles():
    st = allocate_layer(CFG, batch=1, kv_heads=1, head_dim=D, max_len=G * 200, dtype=torch.float32,
                        grow_from=0)
    copies, last = 0, st.max_tiles
    for tokens in range(1, G * 200, 7):
        st.reserve(tokens)
        if st.max_tiles > last:
            copies += 1
            assert st.max_tiles - last >= max(1, last // 16) or \
                st.max_tiles == tiles_for(CFG, max_len=st.max_len)
            last = st.max_tiles
    # one copy per tile up to 32 tiles, then about log_{17/16}(199 / 32) = 30: not 199
    assert last == 199 and copies <= 32 + 36


@pytest.mark.parametrize("chunks", [[3] * 40, [1] * 30 + [40, 7, 64, 1, 1, 33], [150, 1, 1, 2]],
                         ids=["short-chunks", "mixed", "long-prompt"])
@pytest.mark.parametrize("ops", ["reference", "kernels"])
def test_a_growing_state_is_the_preallocated_state(chunks, ops):
    """Same tiles bit for bit, same attention at every step (the reference ops, and the ops
    as dispatched on this device: the C++ kernels on CPU)."""
    if ops == "reference":
        from kvarn_compile.ops import append as append_ref, attention as attention_ref
        append, attention = append_ref.append_, attention_ref.attention
    else:
        def append(buffers, k, v, start):
            torch.ops.kvarn.append_(buffers, k, v, start, "kvarn", 8, 0, 0, False, "")
        attention = torch.ops.kvarn.attention
    total = sum(chunks)
    grow = allocate_layer(CFG, batch=2, kv_heads=H, head_dim=D, max_len=total, dtype=torch.float32,
                          grow_from=chunks[0])
    full = allocate_layer(CFG, batch=2, kv_heads=H, head_dim=D, max_len=total, dtype=torch.float32)
    pos = 0
    sizes = set()
    for i, n in enumerate(chunks):
        k, v = _kv(2, n, seed=i)
        grow.reserve(pos + n, fresh=pos == 0)
        sizes.add(grow.grown)
        start = torch.tensor([pos, pos])
        append(grow.buffers, k, v, start)
        append(full.buffers, k, v, start)
        pos += n
        q = torch.randn(2, 2 * H, 1, D, generator=torch.Generator().manual_seed(100 + i))
        a = attention(q, grow.buffers, None, D ** -0.5, True, 0)
        b = attention(q, full.buffers, None, D ** -0.5, True, 0)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    fg, ff = unpack(grow.buffers), unpack(full.buffers)
    assert torch.equal(fg.n_tiles, ff.n_tiles) and torch.equal(fg.lengths, ff.lengths)
    n = int(ff.n_tiles.max())
    for kind in "kv":
        for a, b in zip(fg.tiles(kind).core, ff.tiles(kind).core):
            assert torch.equal(a[:, :, :n], b[:, :, :n])
    if len(chunks) > 4:
        assert len(sizes) > 3              # it did grow along the way


# ------------------------------------------------------------------------------ compiled
def _llama():
    return tiny_model("llama", "sdpa")


def _eager_tokens(model, ids, new, max_len):
    eager = copy.deepcopy(model)
    use_kvarn_attention(eager)
    cache = KVarNCache(eager.config, max_cache_len=max_len, preset="k4v2", group_size=G)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eager.generate(ids, max_new_tokens=new, do_sample=False, **cache_arg(eager, cache),
                              output_logits=True, return_dict_in_generate=True)


def _decode(model, ids, new):
    """Greedy steps over a DynamicCache; (tokens, logits, bytes after every call)."""
    cache = tf.DynamicCache(config=model.config)
    out, logits, sizes = [], [], []
    x = ids
    with torch.no_grad():
        for _ in range(new):
            step = model(input_ids=x, **cache_arg(model, cache), use_cache=True).logits[:, -1]
            logits.append(step)
            x = step.argmax(-1, keepdim=True)
            out.append(int(x))
            sizes.append(model._kvarn_bytes())
    return out, logits, sizes


def _never_above_fp16(sizes, lengths, layers, heads, dim):
    for length, held in zip(lengths, sizes):
        fp16 = layers * fp16_cache_bytes(batch=1, kv_heads=heads, head_dim=dim, tokens=length)
        assert held <= fp16 + layers * 4 * 8, (length, held, fp16)
        if length >= 2 * G:
            assert held < fp16, (length, held, fp16)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_kvarn_backend_cat_cache_grows_with_the_sequence(compiler, fresh_dynamo):
    model = _llama()
    max_len, prompt, new = 512, 5, 110
    ids = torch.randint(2, 128, (1, prompt), generator=torch.Generator().manual_seed(3))
    want = _eager_tokens(model, ids, new, max_len)
    backend = kvarn_backend("k4v2", group_size=G, max_cache_len=max_len, compiler=compiler)
    model.compile(backend=backend)
    model._kvarn_bytes = lambda: backend.nbytes
    tokens, logits, sizes = _decode(model, ids, new)
    assert tokens == want.sequences[0, prompt:].tolist()
    for a, b in zip(logits, want.logits):
        assert (a - b).abs().max() <= 5e-3 * b.abs().max()
    # bytes follow the sequence, far below the state preallocated for max_len, and never
    # above an fp16 cache of the same tokens (but for 4 int64 counters per layer), below it
    # once a tile is frozen (S + G = 64 tokens)
    heads, dim = kv_geometry(model)
    layers = model.config.num_hidden_layers
    prealloc = layers * allocate_layer(CFG, batch=1, kv_heads=heads, head_dim=dim, max_len=max_len,
                                       dtype=torch.float32, device="meta").nbytes
    assert sizes[0] < sizes[-1] < prealloc / 2
    _never_above_fp16(sizes, range(prompt + 1, prompt + new + 1), layers, heads, dim)
    assert all(st.growable and st.version > 2 for st in backend.states.values())
    assert backend.report.graphs == 3            # prefill, first decode, dynamic decode
    assert "packed KV states" in str(backend.report)
    # a new, short sequence on the same compiled model: the states shrink again
    big = backend.nbytes
    tokens2, _, sizes2 = _decode(model, ids[:, :3], 4)
    assert sizes2[-1] < big / 2 and backend.report.graphs <= 5


def test_inductor_pass_cat_cache_grows_with_the_sequence(fresh_dynamo):
    model = _llama()
    max_len, prompt, new = 512, 40, 60
    ids = torch.randint(2, 128, (1, prompt), generator=torch.Generator().manual_seed(4))
    want = _eager_tokens(model, ids, new, max_len)
    kv = kvarn_compile.inductor_pass("k4v2", group_size=G, max_cache_len=max_len)
    model.compile(options={"pre_grad_custom_pass": kv})
    model._kvarn_bytes = lambda: kv.nbytes
    tokens, _, sizes = _decode(model, ids, new)
    assert tokens == want.sequences[0, prompt:].tolist()
    assert sizes[0] < sizes[-1]
    heads, dim = kv_geometry(model)
    _never_above_fp16(sizes, range(prompt + 1, prompt + new + 1), model.config.num_hidden_layers,
                      heads, dim)
    assert all(st.growable and st.version > 0 for st in kv.states.values())
    full = allocate_layer(CFG, batch=1, kv_heads=2, head_dim=D, max_len=max_len,
                          dtype=torch.float32, device="meta").nbytes
    assert all(st.nbytes < full / 2 for st in kv.states.values())
    kv.close()


def test_a_specialized_growing_axis_is_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kvarn_compile._torch_compat import check_dynamic_dim2, fakify_static

    st = allocate_layer(CFG, batch=1, kv_heads=H, head_dim=D, max_len=400, dtype=torch.float32,
                        grow_from=100)
    grown = [b for b, name in zip(st.buffers, st.fields.layout.names) if name in GROW_AXIS_FIELDS]
    with FakeTensorMode(shape_env=ShapeEnv()):
        fakes = fakify_static(st.buffers, grown)
    dims = [f.shape[2] for f in fakes if f.dim() > 2]
    assert sum(isinstance(d, torch.SymInt) for d in dims) == len(grown)
    assert all(isinstance(f.shape[0], int) for f in fakes if f.dim() > 2)
    check_dynamic_dim2(fakes)                   # still symbolic: fine
    tile = next(f for f, name in zip(fakes, st.fields.layout.names) if name == "k_codes")
    assert bool(tile.shape[2] == st.max_tiles)  # a guard that pins the axis to its size
    with pytest.raises(RuntimeError, match="specialized the growing axis"):
        check_dynamic_dim2(fakes)
    # an empty (or one-slot) axis is a constant from the start: refused too (the backend
    # compiles such buffers through 2-slot stand-ins, see backend._stand_ins)
    empty = allocate_layer(CFG, batch=1, kv_heads=H, head_dim=D, max_len=400, dtype=torch.float32,
                           grow_from=5)
    assert empty.grown == (5, 0, 0)
    grown = [b for b, name in zip(empty.buffers, empty.fields.layout.names) if name in GROW_AXIS_FIELDS]
    with FakeTensorMode(shape_env=ShapeEnv()):
        fakes = fakify_static(empty.buffers, grown)
    with pytest.raises(RuntimeError, match="compiled as the constant 0"):
        check_dynamic_dim2(fakes)
