"""The op library (:mod:`kvarn_compile.ops.library`): every ``torch.ops.kvarn`` op through
``torch.library.opcheck`` on real packed states, the cache ops below autograd, and the ops
traced by torch.compile (aot_eager, Inductor) equal to eager without recompiles.
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.ops import append as append_ref, library
from kvarn_compile.testing import (
    SMALL_CAP, SMALL_D, SMALL_G, SMALL_H, assert_states_identical, packed_state, small_kv, small_presets,
)

pytestmark = pytest.mark.usefixtures("one_thread")

G, D, H, CAP = SMALL_G, SMALL_D, SMALL_H, SMALL_CAP     # the kit's small geometry
PRESETS = small_presets()
kv = small_kv


# ------------------------------------------------------------------------------ opcheck
def _opcheck(op, args, utils=("test_schema", "test_autograd_registration", "test_faketensor",
                              "test_aot_dispatch_dynamic")):
    torch.library.opcheck(op, args, test_utils=utils)


# SchemaCheckMode (opcheck's test_schema) compares every input before and after the call with
# torch.allclose, which has no CPU float8_e4m3fn kernel ("mul_cpu_reduced_float" not
# implemented), so test_schema cannot run on a cache with fp8 scales; the fp16-scale cases
# run it on the same op and schema.
def _utils(preset):
    base = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return base[1:] if preset == "k4v2-fp8" else base


def test_keys_that_require_grad_leave_no_autograd_history_in_the_packed_buffers():
    """A forward outside no_grad (a model in training mode, an unfrozen adapter): the cache
    ops run below autograd, so the packed buffers never join an autograd graph."""
    st = packed_state(PRESETS["k4v2"])
    k, v = kv(2, 90)
    k.requires_grad_(True)
    v.requires_grad_(True)
    torch.ops.kvarn.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), "kvarn", 8, 0, 0,
                            False, "")
    empty = torch.zeros(2, k.shape[1], 4, D)
    torch.ops.kvarn.append_from_(st.buffers, k[:, :, :1], v[:, :, :1], torch.full((2,), 90),
                                 "kvarn", 8, 0, 0, False, "", empty, empty, False)
    assert not any(b.requires_grad or b.grad_fn is not None for b in st.buffers)


# Every op of torch.ops.kvarn, opchecked on real packed states. The cases, by op: what each
# needs besides a packed state (a registered key, a process group, a tuner) is set up by its
# fixture-like context below and undone afterwards.
def _opcheck_append_(preset="k4v2"):
    cfg = PRESETS[preset]
    st = packed_state(cfg, spec_tokens=8)
    k, v = kv(2, 90)
    _opcheck(torch.ops.kvarn.append_.default,
             (st.buffers, k, v, torch.zeros(2, dtype=torch.long), "kvarn", 8, 0, 6, False, ""),
             _utils(preset))
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), hold=6)
    assert st.committed.tolist() == [84, 84] and st.n_tiles.tolist() == [1, 1]
    k, v = kv(2, 6)
    _opcheck(torch.ops.kvarn.append_.default,                       # draft tokens, rollback pos
             (st.buffers, k, v, torch.tensor([90, 86]), "kvarn", 8, 0, 6, False, "layers.0"),
             _utils(preset))


def _opcheck_commit_(preset="k4v2"):
    cfg = PRESETS[preset]
    st = packed_state(cfg, spec_tokens=8)
    k, v = kv(2, 90)
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), hold=6)
    k, v = kv(2, 6)
    append_ref.append_(st.buffers, k, v, torch.tensor([90, 86]), hold=6)
    assert st.lengths.tolist() == [96, 92] and st.committed.tolist() == [90, 86]
    _opcheck(torch.ops.kvarn.commit_.default,                       # commit freezes row 0's tile
             (st.buffers, st.lengths.clone(), "kvarn", 8, 0, False, ""), _utils(preset))
    torch.ops.kvarn.commit_(st.buffers, st.lengths.clone(), "kvarn", 8, 0, False, "")
    assert st.n_tiles.tolist() == [2, 1]


def _opcheck_attention(preset="k4v2"):
    st = packed_state(PRESETS[preset])
    k, v = kv(2, 100)
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    utils = _utils(preset)
    op = torch.ops.kvarn.attention.default
    _opcheck(op, (torch.randn(2, 6, 1, D), st.buffers, None, 0.2, True, 0), utils)
    _opcheck(op, (torch.randn(2, 6, 5, D), st.buffers, torch.rand(2, 1, 5, CAP) > 0.2, 0.2, True, 0),
             utils)
    _opcheck(op, (torch.randn(2, 6, 5, D), st.buffers, torch.randn(2, 6, 5, CAP), 0.2, True, 16),
             utils)
    # The op is inference-only: it has no backward formula, so with a query that requires
    # grad test_aot_dispatch_dynamic (which runs a backward) cannot pass by design; the
    # registration itself (an autograd kernel that raises on backward) is checked.
    q = torch.randn(2, 6, 1, D, requires_grad=True)
    _opcheck(op, (q, st.buffers, None, 0.2, True, 0),
             tuple(u for u in utils if u != "test_aot_dispatch_dynamic"))
    with pytest.raises(RuntimeError, match="no autograd formula|does not require grad"):
        op(q, st.buffers, None, 0.2, True, 0).sum().backward()


def _opcheck_attention_weights():
    st = packed_state(PRESETS["k4v2"])
    k, v = kv(2, 100)
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    op = torch.ops.kvarn.attention_weights.default
    _opcheck(op, (torch.randn(2, 6, 1, D), st.buffers, None, 0.2, True, 0, 100))
    _opcheck(op, (torch.randn(2, 6, 5, D), st.buffers, torch.rand(2, 1, 5, CAP) > 0.2, 0.2, True,
                  16, 120))


def _opcheck_latent_attention():
    """A latent state (the latent as keys, the RoPE key as values at LATENT_ROPE_BITS, one
    head) with per-tile key frames; decode and multi-query steps, a mask, a window."""
    from kvarn_compile.config import LATENT_ROPE_BITS, get_config

    st = packed_state(get_config("k4v2", group_size=32, value_bits=LATENT_ROPE_BITS, key_frame="auto"),
                      heads=1, head_dim=64, value_head_dim=16)
    k, v = torch.randn(2, 1, 100, 64), torch.randn(2, 1, 100, 16)
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    op = torch.ops.kvarn.latent_attention.default
    _opcheck(op, (torch.randn(2, 6, 1, 64), torch.randn(2, 6, 1, 16), st.buffers, None, 0.1, True, 0))
    _opcheck(op, (torch.randn(2, 6, 5, 64), torch.randn(2, 6, 5, 16), st.buffers,
                  torch.rand(2, 1, 5, CAP) > 0.2, 0.1, True, 16))


def _filled(tokens=(100, 70), **alloc):
    """A 2-row state holding ``tokens`` per row (rows of different lengths)."""
    st = packed_state(PRESETS["k4v2"], **alloc)
    for row, n in enumerate(tokens):
        k, v = kv(1, n)
        append_ref.append_([t[row:row + 1] for t in st.buffers], k, v, torch.zeros(1, dtype=torch.long))
    return st


def _opcheck_reorder_():
    st = _filled()
    before = st.lengths.tolist()
    _opcheck(torch.ops.kvarn.reorder_.default, (st.buffers, torch.tensor([1.0, 0.0]), "layers.0"))
    torch.ops.kvarn.reorder_(st.buffers, torch.tensor([1.0, 0.0]), "layers.0")
    assert st.lengths.tolist() == before[::-1]                       # rows swapped


def _model_cache(tokens=70, capacity=CAP):
    """A model's own full-precision cache [B, H, capacity, D] holding a prompt of ``tokens``
    that an uncompiled forward wrote (what adopt_ takes over)."""
    k, v = kv(2, tokens)
    cache_k, cache_v = torch.zeros(2, H, capacity, D), torch.zeros(2, H, capacity, D)
    cache_k[:, :, :tokens], cache_v[:, :, :tokens] = k, v
    return cache_k, cache_v


def _opcheck_adopt_():
    st = packed_state(PRESETS["k4v2"])
    cache_k, cache_v = _model_cache(70)
    start = torch.full((2,), 70)
    args = (st.buffers, cache_k, cache_v, start, "kvarn", 8, 0, 0, False, "layers.0")
    _opcheck(torch.ops.kvarn.adopt_.default, (*args, False))
    torch.ops.kvarn.adopt_(*args, False)
    assert st.lengths.tolist() == [70, 70] and st.n_tiles.tolist() == [1, 1]     # taken over


def _opcheck_append_from_():
    st = packed_state(PRESETS["k4v2"])
    cache_k, cache_v = _model_cache(70)
    k, v = kv(2, 1)
    args = (st.buffers, k, v, torch.full((2,), 70), "kvarn", 8, 0, 0, False, "layers.0",
            cache_k, cache_v, False)
    _opcheck(torch.ops.kvarn.append_from_.default, args)
    torch.ops.kvarn.append_from_(*args)
    assert st.lengths.tolist() == [71, 71]                          # the prompt, then the token


@contextlib.contextmanager
def _one_rank_group():
    """A one-rank gloo process group registered for context parallelism (its key), torn down
    and unregistered afterwards: the cp_* ops' all_gather runs for real, over one rank."""
    import torch.distributed as dist

    from kvarn_compile.ops import context_parallel as cp

    assert not dist.is_initialized(), "another test left a process group initialized"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    saved = dict(cp._GROUPS)
    try:
        yield cp.register(True)
    finally:
        cp._GROUPS.clear()
        cp._GROUPS.update(saved)
        dist.destroy_process_group()


def _cp_state(handle, tokens=100):
    from kvarn_compile.ops import context_parallel as cp

    st = cp.allocate(handle, PRESETS["k4v2"], batch=2, kv_heads=H, head_dim=D, max_len=CAP,
                     dtype=torch.float32)
    if tokens:
        k, v = kv(2, tokens)
        torch.ops.kvarn.cp_append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), "kvarn", 8, 0,
                                   0, False, "", handle.key)
    return st


def _opcheck_cp_append_():
    with _one_rank_group() as handle:
        st = _cp_state(handle, tokens=0)
        k, v = kv(2, 90)
        _opcheck(torch.ops.kvarn.cp_append_.default,
                 (st.buffers, k, v, torch.zeros(2, dtype=torch.long), "kvarn", 8, 0, 0, False,
                  "layers.0", handle.key))


def _opcheck_cp_append_from_():
    with _one_rank_group() as handle:
        st = _cp_state(handle, tokens=0)
        cache_k, cache_v = _model_cache(70)
        k, v = kv(2, 1)
        _opcheck(torch.ops.kvarn.cp_append_from_.default,
                 (st.buffers, k, v, torch.full((2,), 70), "kvarn", 8, 0, 0, False, "layers.0",
                  cache_k, cache_v, False, handle.key))


def _opcheck_cp_attention():
    with _one_rank_group() as handle:
        st = _cp_state(handle)
        op = torch.ops.kvarn.cp_attention.default
        _opcheck(op, (torch.randn(2, 6, 1, D), st.buffers, None, 0.2, True, 0, handle.key))
        _opcheck(op, (torch.randn(2, 6, 5, D), st.buffers, torch.rand(2, 1, 5, CAP) > 0.2, 0.2, True,
                      16, handle.key))


@contextlib.contextmanager
def _store():
    """A keyed state store (what an inductor_pass object owns), closed afterwards."""
    from kvarn_compile.ops.keyed import StateStore

    store = StateStore(PRESETS["k4v2"])
    try:
        yield store
    finally:
        store.close()


def _opcheck_append_keyed():
    with _store() as store:
        key = store.key("layers.0")
        k, v = kv(2, 90)
        start = torch.zeros(2, dtype=torch.long)
        # a cat cache (no model-owned tensors): a growable state
        _opcheck(torch.ops.kvarn.append_keyed.default,
                 (k, v, start, None, None, key, CAP, "kvarn", 8, 0, 0, False, False))
        # a model's own cache whose prompt is adopted, kept (release=False) or freed after
        cache_k, cache_v = _model_cache(70)
        k1, v1 = kv(2, 1)
        for release in (False, True):
            _opcheck(torch.ops.kvarn.append_keyed.default,
                     (k1, v1, torch.full((2,), 70), cache_k, cache_v, store.key("layers.1"), CAP,
                      "kvarn", 8, 0, 0, False, release))
            assert store.states[("layers.1", 2)].lengths.tolist() == [71, 71]


def _opcheck_attention_keyed():
    with _store() as store:
        key = store.key("layers.0")
        k, v = kv(2, 100)
        token = torch.ops.kvarn.append_keyed(k, v, torch.zeros(2, dtype=torch.long), None, None, key,
                                             CAP, "kvarn", 8, 0, 0, False, False)
        op = torch.ops.kvarn.attention_keyed.default
        _opcheck(op, (torch.randn(2, 6, 1, D), token, None, key, 0.2, True, 0))
        _opcheck(op, (torch.randn(2, 6, 5, D), token, torch.rand(2, 1, 5, CAP) > 0.2, key, 0.2, True,
                      16))


def _opcheck_reorder_keyed():
    with _store() as store:
        key = store.key("layers.0")
        k, v = kv(2, 90)
        torch.ops.kvarn.append_keyed(k, v, torch.zeros(2, dtype=torch.long), None, None, key, CAP,
                                     "kvarn", 8, 0, 0, False, False)
        _opcheck(torch.ops.kvarn.reorder_keyed.default, (kv(2, 1)[0], torch.tensor([1.0, 0.0]), key))


def _opcheck_positions_start():
    op = torch.ops.kvarn.positions_start.default
    _opcheck(op, (torch.arange(40, 45), 2))
    _opcheck(op, (torch.arange(7, 8), 3))
    assert op(torch.arange(40, 45), 2).tolist() == [40, 40]


def _tile_args(tq=1, frames=False, bias=False, split_max=2):
    """The arguments of kvarn::tile_partials_ over a real state's tiles (as the lowering
    passes them): the newest ``tq`` tokens query every tile of their row."""
    from kvarn_compile.quant.rotation import rotation_matrix
    from kvarn_compile.state import unpack

    st = _filled((140, 100), max_len=CAP)
    f = unpack(st.buffers)
    q = torch.randn(2, 6, tq, D)
    q_rot = q @ rotation_matrix(D)
    n_tiles = f.n_tiles.clone()
    kv_lo = torch.zeros(2, tq, dtype=torch.long)
    kv_hi = (n_tiles * G)[:, None].expand(2, tq).contiguous()
    n_max = f.k.codes.shape[2]
    lse = torch.full((2, 6, tq, split_max), float("-inf"))
    return (q_rot, q if frames else None, *f.k.core, *f.v.core, f.k_plain if frames else None,
            n_tiles, kv_lo, kv_hi, torch.randn(2, 1, tq, n_max * G) if bias else None, lse, 0.2,
            split_max)


def _opcheck_tile_partials_():
    op = torch.ops.kvarn.tile_partials_.default
    _opcheck(op, _tile_args())
    _opcheck(op, _tile_args(tq=5, frames=True, bias=True, split_max=3))


def _opcheck_tile_partials_triton_():
    """The op has a CUDA kernel only (the standalone Triton decode kernel, one query token):
    on CPU tensors its default kernel refuses (asserted). Its CUDA kernel is opchecked on CPU
    tensors too, registered as the op's CPU kernel for the duration of the check and run
    through the Triton interpreter (TRITON_INTERPRET=1, see conftest.py), and on CUDA tensors
    where a GPU is present."""
    from kvarn_compile.ops import dispatch

    op = torch.ops.kvarn.tile_partials_triton_.default
    cases = [_tile_args(tq=1, frames=True), _tile_args(tq=1)]
    with pytest.raises(NotImplementedError, match="has a CUDA kernel only"):
        op(*cases[0])
    with torch.library._scoped_library("kvarn", "IMPL") as lib:
        lib.impl("tile_partials_triton_", dispatch._tile_partials_triton_cuda, "CPU")
        for args in cases:
            _opcheck(op, args)
    if torch.cuda.is_available():
        for args in cases:
            _opcheck(op, tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))


def _latent_tile_args(tq=1, frames=False, bias=False, factors=False, split_max=2):
    """The arguments of kvarn::latent_tile_partials_ over a latent state's tiles (as the
    lowering's decomposition passes them): key frames with their per-frame tile lists,
    fp8-style per-vector factors (here on fp16 scales: opcheck's test_schema cannot compare
    fp8 tensors on CPU), a mask bias with one row for every query head."""
    from kvarn_compile.config import LATENT_ROPE_BITS, get_config
    from kvarn_compile.kernels.triton.latent_attention import frame_tile_lists
    from kvarn_compile.ops import regions
    from kvarn_compile.quant.rotation import rotation_matrix
    from kvarn_compile.state import unpack

    cfg = get_config("k4v2", group_size=32, value_bits=LATENT_ROPE_BITS,
                     key_frame="auto" if frames else "rotated")
    st = packed_state(cfg, heads=1, head_dim=64, value_head_dim=16)
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 1, 100, 64, generator=gen), torch.randn(2, 1, 100, 16, generator=gen)
    k[:, :, :40, 3] += 300.0                     # plain key frames for the first tile
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    f = unpack(st.buffers)
    q, q_pe = torch.randn(2, 6, tq, 64, generator=gen), torch.randn(2, 6, tq, 16, generator=gen)
    kv_lo, kv_hi = regions.tile_bounds(f, tq, True, 0)
    n_max = f.k.codes.shape[2]
    ids = count = None
    if frames:
        assert f.k_plain.any() and not f.k_plain.all()
        ids, count = frame_tile_lists(f.k_plain, f.n_tiles)
    fac = [torch.rand(2, 1, n_max, 1, generator=gen).half() + 0.5 if factors else None
           for _ in range(4)]
    lse = torch.full((2, 6, tq, 2 if frames else 1, split_max), float("-inf"))
    return (q @ rotation_matrix(64), q if frames else None, q_pe @ rotation_matrix(16),
            *f.k.core, *f.v.core, *fac, ids, count, f.n_tiles, kv_lo, kv_hi,
            torch.randn(2, 1, tq, n_max * 32, generator=gen) if bias else None, lse, 0.1,
            split_max)


def _opcheck_latent_tile_partials_():
    op = torch.ops.kvarn.latent_tile_partials_.default
    _opcheck(op, _latent_tile_args())
    _opcheck(op, _latent_tile_args(tq=5, frames=True, bias=True, factors=True, split_max=3))


def _opcheck_tune_observe_():
    from kvarn_compile.autotune import KnobTuning, tuning

    tuner = tuning.KnobTuner(PRESETS["k4v2"], KnobTuning(timer=lambda knobs, fn: 1e-3 * (1 + knobs.iters)))
    try:
        st = packed_state(PRESETS["k4v2"])
        k, v = kv(2, 90)                        # freezes tile 0: the tuner sees its rows
        args = (torch.zeros(1, dtype=torch.long), st.buffers, k, v, torch.zeros(2, dtype=torch.long),
                tuner.id, "layers.0", 0, 0)
        _opcheck(torch.ops.kvarn.tune_observe_.default, args)
        assert tuner.decided("layers.0")
    finally:
        tuning._TUNERS.pop(tuner.id, None)


OPCHECKS = {
    "append_": _opcheck_append_, "commit_": _opcheck_commit_, "attention": _opcheck_attention,
    "reorder_": _opcheck_reorder_, "adopt_": _opcheck_adopt_, "append_from_": _opcheck_append_from_,
    "cp_append_": _opcheck_cp_append_, "cp_append_from_": _opcheck_cp_append_from_,
    "cp_attention": _opcheck_cp_attention, "latent_attention": _opcheck_latent_attention,
    "attention_weights": _opcheck_attention_weights, "append_keyed": _opcheck_append_keyed,
    "attention_keyed": _opcheck_attention_keyed, "reorder_keyed": _opcheck_reorder_keyed,
    "positions_start": _opcheck_positions_start, "tile_partials_": _opcheck_tile_partials_,
    "tile_partials_triton_": _opcheck_tile_partials_triton_, "tune_observe_": _opcheck_tune_observe_,
    "latent_tile_partials_": _opcheck_latent_tile_partials_,
}


def _declared_ops() -> list[str]:
    """The ops declared in kvarn_compile/ops/library.py (``custom_op("kvarn::<name>"``)."""
    source = pathlib.Path(library.__file__).read_text()
    return sorted(re.findall(r'custom_op\("kvarn::(\w+)"', source))


def test_every_declared_op_is_registered_and_has_an_opcheck_case():
    import kvarn_compile.autotune.tuning  # noqa: F401  (registers tune_observe_'s kernels)

    registered = {name for name in dir(torch.ops.kvarn)
                  if isinstance(getattr(torch.ops.kvarn, name), torch._ops.OpOverloadPacket)}
    assert set(_declared_ops()) == registered
    assert set(OPCHECKS) == set(_declared_ops()), "an op without an opcheck case (add it to OPCHECKS)"


@pytest.mark.parametrize("op", _declared_ops())
def test_opcheck(op):
    import kvarn_compile.autotune.tuning  # noqa: F401  (registers tune_observe_'s kernels)

    assert op in OPCHECKS, f"kvarn::{op} has no opcheck case: add one to OPCHECKS"
    OPCHECKS[op]()


@pytest.mark.parametrize("op", ["append_", "commit_", "attention"])
def test_opcheck_with_fp8_scales(op):
    """The packed-state ops on a cache with fp8 scales (without test_schema, see _utils)."""
    OPCHECKS[op]("k4v2-fp8")


# ------------------------------------------------------------------------------ torch.compile
def _counting(backend):
    from torch._dynamo.backends.registry import lookup_backend

    inner, graphs = lookup_backend(backend), []

    def compile_fn(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return inner(gm, example_inputs, **kwargs)

    return compile_fn, graphs


def _step(buffers, k, v, start, q):
    torch.ops.kvarn.append_(buffers, k, v, start, "kvarn", 8, 0, 0, False, "layer")
    return torch.ops.kvarn.attention(q, buffers, None, 0.125, True, 0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_matches_eager_without_recompiles(backend):
    torch._dynamo.reset()
    eager, compiled = packed_state(), packed_state()
    k, v = kv(2, 60)
    for st in (eager, compiled):
        append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    compile_fn, graphs = _counting(backend)
    step = torch.compile(_step, backend=compile_fn, fullgraph=True)
    for _ in range(4):                                   # 60 -> 64 freezes a tile on the way
        k, v = kv(2, 1)
        q = torch.randn(2, 6, 1, D)
        start = eager.lengths.clone()
        want = _step(eager.buffers, k, v, start.clone(), q)
        got = step(compiled.buffers, k, v, start.clone(), q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert_states_identical(eager.buffers, compiled.buffers)
    assert compiled.n_tiles.tolist() == [1, 1]
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.kvarn.append_.default in ops or torch.ops.kvarn.append_ in ops


def test_compiled_chunks_of_varying_length_compile_once_dynamic():
    torch._dynamo.reset()
    eager, compiled = packed_state(), packed_state()
    compile_fn, graphs = _counting("aot_eager")
    step = torch.compile(_step, backend=compile_fn, fullgraph=True)
    counts = []
    for t in (20, 7, 13, 30, 1, 5, 1):
        k, v = kv(2, t)
        q = torch.randn(2, 6, t, D)
        start = eager.lengths.clone()
        want = _step(eager.buffers, k, v, start.clone(), q)
        got = step(compiled.buffers, k, v, start.clone(), q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert_states_identical(eager.buffers, compiled.buffers)
        counts.append(len(graphs))
    # the first length compiles statically, the second recompiles with a dynamic token count
    # that serves every later length; T=1 gets one graph of its own because dynamo always
    # specializes sizes 0 and 1. Nothing recompiles per step after that.
    assert counts == [1, 2, 2, 2, 3, 3, 3]
