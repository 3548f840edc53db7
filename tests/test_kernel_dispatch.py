"""The kernel implementations of the kvarn ops against the pure-torch reference: the CUDA
path (Triton kernels + LSE merge) run on CPU tensors under TRITON_INTERPRET=1, and the
C++ CPU tile kernel that the op dispatches to on CPU."""

import pytest
import torch

from kvarn_compile.config import get_config
from kvarn_compile.kernels import cpu_attention, triton_available
from kvarn_compile.ops import kernel_impl as triton_impl
from kvarn_compile.ops import reference
from kvarn_compile.state import allocate_layer

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton cannot run here (no CUDA, no TRITON_INTERPRET=1)")

G, D, H = 32, 32, 2


def _filled(lengths, preset="k4v2", **kw):
    st = allocate_layer(get_config(preset, group_size=G, **kw), batch=len(lengths), kv_heads=H,
                        head_dim=D, max_len=256, dtype=torch.float32)
    for row, n in enumerate(lengths):
        k, v = torch.randn(1, H, n, D), torch.randn(1, H, n, D)
        sub = [t[row:row + 1] for t in st.buffers]
        reference.append_(sub, k, v, torch.tensor([0]))
    return st


@pytest.mark.parametrize("kernel", [pytest.param("triton", marks=needs_triton), "cpu"])
@pytest.mark.parametrize("lengths", [[150, 97], [129, 40], [20, 200]])
@pytest.mark.parametrize("group_q", [1, 3])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("preset", ["k4v2", "k2v2", "k4v4"])
def test_attention_kernel_path_matches_reference(kernel, lengths, group_q, window, preset):
    if kernel == "cpu" and not cpu_attention.available():
        pytest.skip("the C++ CPU kernel could not be built here")
    if kernel == "triton" and preset != "k4v2":
        pytest.skip("bit widths are covered by tests/test_kernels.py")
    st = _filled(lengths, preset)
    q = torch.randn(len(lengths), H * group_q, 1, D)
    assert triton_impl.kernel_applies(q, st.buffers, None)
    ref = reference.attention(q, st.buffers, None, D ** -0.5, True, window)
    out = triton_impl.attention(q, st.buffers, None, D ** -0.5, True, window, kernel=kernel)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_cpu_op_dispatches_to_the_kernel_and_matches_the_reference(monkeypatch):
    if not cpu_attention.available():
        pytest.skip("the C++ CPU kernel could not be built here")
    st = _filled([200, 90])
    q = torch.randn(2, 2 * H, 1, D)
    calls = []
    real = cpu_attention.tile_attention
    monkeypatch.setattr(cpu_attention, "tile_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = torch.ops.kvarn.attention(q, st.buffers, None, 0.2, True, 0)
    assert calls, "the CPU op did not use the C++ tile kernel"
    torch.testing.assert_close(out, reference.attention(q, st.buffers, None, 0.2, True, 0), atol=2e-5, rtol=2e-5)
    monkeypatch.setenv("KVARN_CPU_KERNEL", "0")
    calls.clear()
    torch.ops.kvarn.attention(q, st.buffers, None, 0.2, True, 0)
    assert not calls


@needs_triton
def test_attention_with_an_all_attend_mask_uses_the_kernel_and_a_masking_one_falls_back():
    st = _filled([170, 170])
    q = torch.randn(2, H, 1, D)
    full = torch.ones(2, 1, 1, 256, dtype=torch.bool)
    assert triton_impl.kernel_applies(q, st.buffers, full)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, full, 0.2, True, 0),
                               reference.attention(q, st.buffers, full, 0.2, True, 0), atol=2e-5, rtol=2e-5)
    hole = full.clone()
    hole[..., 40] = False                  # hides a quantized position: kernel must not be used
    assert not triton_impl.kernel_applies(q, st.buffers, hole)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, hole, 0.2, True, 0),
                               reference.attention(q, st.buffers, hole, 0.2, True, 0))


def test_prefill_chunk_overlapping_tiles_falls_back():
    st = _filled([100])
    q = torch.randn(1, H, 100, D)          # queries inside the quantized region need causality
    assert not triton_impl.kernel_applies(q, st.buffers, None)


@needs_triton
def test_freeze_kernel_writes_the_reference_tiles():
    k, v = torch.randn(1, H, 3 * G, D), torch.randn(1, H, 3 * G, D)
    ref = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                         max_len=128, dtype=torch.float32)
    reference.append_(ref.buffers, k, v, torch.tensor([0]))
    got = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                         max_len=128, dtype=torch.float32)
    tk, tv = k[0, :, G:3 * G].half().float(), v[0, :, G:3 * G].half().float()   # tiles 0..1 (after the sink)
    assert triton_impl.freeze_tiles(got.buffers, 0, tk, tv, 0, "kvarn", 8)
    for name in ("k_codes", "v_codes"):
        a, b = getattr(ref, name)[:, :, :2].int(), getattr(got, name)[:, :, :2].int()
        assert (a != b).float().mean() < 0.005, name        # rounding ties only
