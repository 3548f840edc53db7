"""The CUDA decode step (``kvarn::append_`` + ``kvarn::attention``, their CUDA kernels) never
synchronizes with the host when its host checks are off, as inside a CUDA graph capture.

There is no GPU here: the CUDA registrations' Python runs on CPU tensors, the Triton kernels
under the interpreter (tests/conftest.py), with a detector that fails on every host read of a
tensor made by kvarn's own code: ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()``
of a tensor (a data-dependent Python branch), ``nonzero``, a boolean-mask index, ``.cpu()``,
``.numpy()``. On a GPU each of these blocks the CPU until the GPU catches up, and inside a
graph capture it is an error. The unchecked step must still compute what the reference
computes (states and outputs compared step by step), and what the checked mode raises it
records in device flags, read after the step.
"""

import pathlib
import sys

import pytest
import torch
import triton
import triton.language as tl

import kvarn_compile
from kvarn_compile.config import get_config
from kvarn_compile.kernels import triton_available
from kvarn_compile.kernels.triton.append import _dominant
from kvarn_compile.ops import append as append_ref, attention as attention_ref, dispatch
from kvarn_compile.state import allocate_layer, unpack

assert triton_available(), "triton must run here (TRITON_INTERPRET=1 on CPU, or CUDA)"

PACKAGE = pathlib.Path(kvarn_compile.__file__).parent
TESTING = PACKAGE / "testing"
G, D, H = 32, 32, 2


class HostSyncError(AssertionError):
    pass


class HostSyncDetector:
    """Fails (or counts, ``strict=False``) on host reads of tensors by kvarn_compile's code.

    Only calls made from a file of the kvarn_compile package count (the Triton interpreter
    itself copies tensors to numpy: that is the stand-in for the GPU, not the step).
    """

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
               "cpu", "numpy")

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.calls: list[str] = []
        self._saved = {}

    def _ours(self) -> str | None:
        frame = sys._getframe(3)    # _ours <- _record <- the patched method <- its caller
        path = pathlib.Path(frame.f_code.co_filename)
        if PACKAGE in path.parents and TESTING not in path.parents:
            return f"{path.relative_to(PACKAGE.parent)}:{frame.f_lineno} ({frame.f_code.co_name})"
        return None

    def _record(self, what: str) -> None:
        where = self._ours()
        if where is None:
            return
        self.calls.append(f"{what} at {where}")
        if self.strict:
            raise HostSyncError(f"host synchronization: {what} at {where}")

    def __enter__(self):
        detector = self
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(t, *a, _name=name, _original=original, **kw):
                detector._record(f"Tensor.{_name}")
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__
        self._saved["__getitem__"], self._saved["__setitem__"] = getitem, setitem

        def _bool_index(index) -> bool:
            items = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

        def get(t, index):
            if _bool_index(index):
                detector._record("boolean-mask index")
            return getitem(t, index)

        def put(t, index, value):
            if _bool_index(index):
                detector._record("boolean-mask index assignment")
            return setitem(t, index, value)

        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = get, put
        self._saved_nonzero = torch.nonzero

        def nonzero(*a, **kw):
            detector._record("torch.nonzero")
            return detector._saved_nonzero(*a, **kw)

        torch.nonzero = nonzero
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = self._saved_nonzero
        return False


def _prompted(lengths, **cfg):
    st = allocate_layer(get_config("k4v2", group_size=G, **cfg), batch=len(lengths), kv_heads=H,
                        head_dim=D, max_len=192, dtype=torch.float32)
    for row, n in enumerate(lengths):
        sub = [t[row:row + 1] for t in st.buffers]
        append_ref.append_(sub, torch.randn(1, H, n, D), torch.randn(1, H, n, D), torch.tensor([0]))
    return st


def _step(buffers, k, v, q, mask=None, window=0):
    lengths = unpack(buffers).lengths.clone()
    dispatch._append_cuda(buffers, k, v, lengths, "kvarn", 8, 0, 0, False, "")
    return dispatch._attention_cuda(q, buffers, mask, D ** -0.5, True, window)


def _assert_states_match(got, want, step):
    fg, fw = unpack(got), unpack(want)
    for name in ("lengths", "committed", "n_tiles", "sink_k", "sink_v", "tail_k", "tail_v"):
        assert torch.equal(getattr(fg, name), getattr(fw, name)), f"step {step}: {name}"
    for kind in "kv":
        a, b = fg.tiles(kind), fw.tiles(kind)
        assert (a.codes != b.codes).float().mean() < 5e-3, f"step {step}: {kind} codes"
        for field in ("row_scale", "row_zero", "col_scale"):
            torch.testing.assert_close(getattr(a, field).float(), getattr(b, field).float(),
                                       rtol=2e-3, atol=1e-3, msg=f"step {step}: {kind} {field}")


@pytest.mark.parametrize("window", [0, 48])
def test_unchecked_cuda_decode_steps_do_not_sync_and_match_the_reference(monkeypatch, window):
    """Decode steps that cross tile boundaries in both rows (a tile frozen inside the step):
    no host sync, the state and output of the reference step after each."""
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "0")
    st = _prompted([2 * G + 20, 2 * G - 6])     # (sink 32, G 32): tiles freeze after 12 and 6 steps
    ref = [t.clone() for t in st.buffers]
    froze = 0
    for step in range(G // 2 + 1):
        k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
        q = torch.randn(2, 2 * H, 1, D)
        before = unpack(st.buffers).n_tiles.clone()
        with HostSyncDetector():
            out = _step(st.buffers, k, v, q, window=window)
        froze += int((unpack(st.buffers).n_tiles - before).sum())
        append_ref.append_(ref, k, v, unpack(ref).lengths.clone())
        _assert_states_match(st.buffers, ref, step)
        want = attention_ref.attention(q, ref, None, D ** -0.5, True, window)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert froze >= 2, "the steps must freeze tiles (in both rows) to test the device-side freeze"
    dispatch.raise_device_errors("cpu")                     # nothing flagged


@pytest.mark.parametrize("cfg", [dict(sink_tokens=0), dict(recent_window=G),
                                 dict(key_frame="rotated"), dict(sink_tokens=2 * G),
                                 dict(outlier=True)],
                         ids=["no-sink", "recent", "rotated-frames", "two-tile-sink",
                              "plain-frames"])
def test_unchecked_append_matches_the_reference_across_layouts_and_a_restart(monkeypatch, cfg):
    """The one-kernel append over state layouts the default does not have (no sink, a recent
    window, one key frame, a sink of two tiles, tiles stored plain: a bias-like key channel
    in kv head 0 of row 0), through tile freezes, then a row that restarts at position 0
    while the other goes on: the reference's state (key frames too) after every step."""
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "0")
    outlier = cfg.pop("outlier", False)
    st = _prompted([2 * G + 20, 2 * G - 6], **cfg)
    ref = [t.clone() for t in st.buffers]
    froze = 0
    for step in range(2 * G + 4):
        k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
        if outlier:
            k[0, 0, 0, 3] += 200.0
        pos = unpack(ref).lengths.clone()
        if step == 2 * G:
            pos[1] = 0                                      # row 1 starts a new sequence
        before = unpack(st.buffers).n_tiles.clone()
        with HostSyncDetector():
            dispatch._append_cuda(st.buffers, k, v, pos.clone(), "kvarn", 8,
                                  cfg.get("recent_window", 0), 0, False, "")
        froze += int((unpack(st.buffers).n_tiles - before).clamp(min=0).sum())
        append_ref.append_(ref, k, v, pos.clone(), "kvarn", 8, cfg.get("recent_window", 0))
        _assert_states_match(st.buffers, ref, step)
        if unpack(ref).k_plain is not None:
            assert torch.equal(unpack(st.buffers).k_plain, unpack(ref).k_plain), f"step {step}"
    assert froze >= 2, "the steps must freeze tiles"
    if outlier:
        assert int(unpack(ref).k_plain[0, 0].sum()) >= 1, "a plain tile must have been frozen"
        assert int(unpack(ref).k_plain[1].sum()) == 0, "and only where the outlier is"
    dispatch.raise_device_errors("cpu")


def test_unchecked_attention_with_a_mask_and_several_queries_does_not_sync(monkeypatch):
    """A mask over the quantized tokens (an additive bias in the kernel) and a multi-token
    query block (the causal bound inside the tiles): no sync, the reference's output."""
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "0")
    st = _prompted([3 * G + 5, 2 * G + 9])
    length = int(unpack(st.buffers).lengths.max())
    mask = torch.rand(2, 1, 4, length + 7) > 0.2
    mask[..., :1] = True
    q = torch.randn(2, 2 * H, 4, D)
    with HostSyncDetector():
        out = dispatch._attention_cuda(q, st.buffers, mask, D ** -0.5, True, 0)
    want = attention_ref.attention(q, st.buffers, mask, D ** -0.5, True, 0)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    dispatch.raise_device_errors("cpu")


def test_the_detector_catches_the_checked_path(monkeypatch):
    """The detector can fail: the checked CUDA append reads the counters on the host."""
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "1")
    st = _prompted([G + 3, 5])
    k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
    with HostSyncDetector(strict=False) as seen:
        _step(st.buffers, k, v, torch.randn(2, H, 1, D))
    assert any("tolist" in c for c in seen.calls), seen.calls
    with pytest.raises(HostSyncError), HostSyncDetector():
        _step(st.buffers, k, v, torch.randn(2, H, 1, D))
    with HostSyncDetector():   # the test's own reads do not count, only the package's
        assert torch.ones(2).sum().item() == 2


def test_unchecked_errors_leave_rows_unchanged_and_raise_after_the_step(monkeypatch):
    """A row past its capacity or written at a wrong position: unchanged, flagged, and
    ``raise_device_errors`` raises; the checked mode raises the reference's message."""
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "0")
    st = allocate_layer(get_config("k4v2", group_size=G), batch=2, kv_heads=H, head_dim=D,
                        max_len=64, dtype=torch.float32)
    for row, n in enumerate([64, 10]):
        sub = [t[row:row + 1] for t in st.buffers]
        append_ref.append_(sub, torch.randn(1, H, n, D), torch.randn(1, H, n, D), torch.tensor([0]))
    before = [t.clone() for t in st.buffers]
    k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
    with HostSyncDetector():
        dispatch._append_cuda(st.buffers, k, v, torch.tensor([64, 10]), "kvarn", 8, 0, 0, False, "")
    f, b = unpack(st.buffers), unpack(before)
    assert int(f.lengths[0]) == 64 and torch.equal(f.tail_k[0], b.tail_k[0]), "row 0 must be unchanged"
    assert int(f.lengths[1]) == 11, "row 1 continues"
    with pytest.raises(ValueError, match="capacity"):
        dispatch.raise_device_errors("cpu")
    dispatch.raise_device_errors("cpu")                     # cleared by the read
    with HostSyncDetector():
        dispatch._append_cuda(st.buffers, k, v, torch.tensor([30, 11]), "kvarn", 8, 0, 0, False, "")
    with pytest.raises(ValueError, match="position"):
        dispatch.raise_device_errors("cpu")
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "1")
    with pytest.raises(ValueError, match="allocated for 64"):
        dispatch._append_cuda(st.buffers, k, v, torch.tensor([64, 11]), "kvarn", 8, 0, 0, False, "")


def test_deferred_checks_run_decode_steps_without_syncs_and_raise_once_after(monkeypatch):
    """``dispatch.deferred_checks`` (what kvarn_backend wraps a compiled CUDA call in): with
    host checks on, its single-token appends and attentions do not sync and compute what the
    reference computes; the error flags are read at its end, where a row past its capacity
    raises the checked mode's error. Multi-token steps inside keep their host checks, and
    ``KVARN_CUDA_CHECKS=1`` keeps them for every step."""
    monkeypatch.delenv(dispatch.CUDA_CHECKS_ENV, raising=False)
    st = _prompted([2 * G + 20, 2 * G - 6])
    ref = [t.clone() for t in st.buffers]
    with dispatch.deferred_checks("graph 1"):
        for step in range(G // 2 + 1):
            k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
            q = torch.randn(2, 2 * H, 1, D)
            with HostSyncDetector():
                out = _step(st.buffers, k, v, q)
            append_ref.append_(ref, k, v, unpack(ref).lengths.clone())
            _assert_states_match(st.buffers, ref, step)
            want = attention_ref.attention(q, ref, None, D ** -0.5, True, 0)
            torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        # a prompt chunk inside the block: checked on the host, as outside it
        with pytest.raises(HostSyncError), HostSyncDetector():
            _step(st.buffers, torch.randn(2, H, 3, D), torch.randn(2, H, 3, D),
                  torch.randn(2, 2 * H, 3, D))

    full = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                          max_len=64, dtype=torch.float32)
    append_ref.append_(full.buffers, torch.randn(1, H, 64, D), torch.randn(1, H, 64, D),
                       torch.tensor([0]))
    before = [t.clone() for t in full.buffers]
    with pytest.raises(ValueError, match="graph 2.*capacity"):
        with dispatch.deferred_checks("graph 2"):
            with HostSyncDetector():
                _step(full.buffers, torch.randn(1, H, 1, D), torch.randn(1, H, 1, D),
                      torch.randn(1, 2 * H, 1, D))
    assert all(torch.equal(a, b) for a, b in zip(full.buffers, before)), "the row is unchanged"
    dispatch.raise_device_errors("cpu")                     # read and cleared at the block's end

    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "1")      # host checks forced: the reference's
    with pytest.raises(HostSyncError), HostSyncDetector(), dispatch.deferred_checks():
        _step(st.buffers, torch.randn(2, H, 1, D), torch.randn(2, H, 1, D),
              torch.randn(2, 2 * H, 1, D))


def test_deferred_checks_clear_their_flags_when_the_block_raises(monkeypatch):
    """A block that fails for its own reason raises that error, not a stale flag later."""
    monkeypatch.delenv(dispatch.CUDA_CHECKS_ENV, raising=False)
    full = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                          max_len=64, dtype=torch.float32)
    append_ref.append_(full.buffers, torch.randn(1, H, 64, D), torch.randn(1, H, 64, D),
                       torch.tensor([0]))
    with pytest.raises(KeyError, match="own"):
        with dispatch.deferred_checks():
            _step(full.buffers, torch.randn(1, H, 1, D), torch.randn(1, H, 1, D),
                  torch.randn(1, 2 * H, 1, D))
            raise KeyError("own")
    dispatch.raise_device_errors("cpu")                     # nothing left behind


def test_a_kept_cache_buffer_is_adopted_once_then_not_read_until_written(monkeypatch):
    """A model-owned cache buffer that cannot be freed (on CUDA, every one) is taken in by the
    decode step's ``adopt_`` once; after the call has seen it (``mark_seen``), the next steps
    decide from its version counter alone, without reading it (a CUDA graph can capture
    them), until something writes it again."""
    from kvarn_compile.ops.buffers import mark_seen, unchanged_since_seen

    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "0")
    st = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                        max_len=192, dtype=torch.float32)
    p = G + 40
    cache_k, cache_v = torch.zeros(1, H, 192, D), torch.zeros(1, H, 192, D)
    cache_k[:, :, :p], cache_v[:, :, :p] = torch.randn(1, H, p, D), torch.randn(1, H, p, D)

    def adopt():
        append_ref.adopt_(st.buffers, cache_k, cache_v, torch.tensor([p]), "kvarn", 8, 0, 0,
                          False, "layer", False)

    with HostSyncDetector(strict=False) as seen:
        adopt()                                   # an eager prefill wrote it: read, adopted
    assert seen.calls and int(unpack(st.buffers).lengths[0]) == p
    mark_seen(cache_k)
    mark_seen(cache_v)
    with HostSyncDetector():
        adopt()                                   # nothing written since: not read
    assert int(unpack(st.buffers).lengths[0]) == p
    cache_k[:, :, 0] += 1.0                       # written again (a reset, an eager forward)
    assert not unchanged_since_seen(cache_k)
    with HostSyncDetector(strict=False) as seen:
        adopt()
    assert seen.calls, "a written buffer must be read again"


@triton.jit
def _frame_kernel(x_ptr, out_ptr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  DOMINANCE: tl.constexpr):
    """The append kernel's key-frame choice (``_dominant``) of tile program_id(0) of x [T, G, D]."""
    t = tl.program_id(0)
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    x = tl.load(x_ptr + (t * G + offs_g)[:, None] * D + offs_d[None, :],
                mask=d_ok[None, :], other=0.0)
    plain = _dominant(tl.max(x, axis=0), tl.min(x, axis=0), tl.max(tl.abs(x), axis=0),
                      d_ok, D, BLOCK_D, DOMINANCE)
    tl.store(out_ptr + t, plain.to(tl.int32))


def test_the_append_kernel_chooses_key_frames_by_the_reference_rule():
    """``_dominant`` (the key-frame choice inside the append kernel, by rank, no sort) against
    ``choose_key_frame`` on tiles whose dominance sits around the threshold, with tied
    channel ranges, an odd head dim and padded channels."""
    from kvarn_compile.quant.quantize import DOMINANCE_THRESHOLD, choose_key_frame, key_dominance

    torch.manual_seed(0)
    for d in (32, 24, 7):
        tiles = torch.randn(64, 16, d)
        tiles[1::3] = tiles[1::3].round()                      # tied ranges
        peak = key_dominance(tiles)
        # scale one channel so the dominance lands just below / at / just above the threshold
        want_ratio = DOMINANCE_THRESHOLD * (1 + torch.linspace(-0.02, 0.02, 64))
        tiles[:, :, 0] *= (want_ratio / peak)[:, None].clamp(min=1.0)
        out = torch.empty(64, dtype=torch.int32)
        _frame_kernel[(64,)](tiles.contiguous(), out, G=16, D=d,
                            BLOCK_D=triton.next_power_of_2(d), DOMINANCE=DOMINANCE_THRESHOLD)
        want = choose_key_frame(tiles)
        assert 0 < int(want.sum()) < 64, "the tiles must straddle the threshold"
        assert torch.equal(out.bool(), want), (d, out.tolist(), want.int().tolist())


@pytest.mark.parametrize("frames,tq,masked", [(False, 1, False), (True, 1, True), (True, 5, True)],
                         ids=["decode", "frames-mask", "several-queries"])
def test_unchecked_latent_attention_does_not_sync(frames, tq, masked):
    """``kvarn::latent_attention`` on CUDA (the exact region in torch, the tiles on the Triton
    kernel, merged by lse) with its host checks off: no sync, for a decode step and a
    multi-query step with causal bounds inside the tiles, per-tile key frames and a mask;
    the reference's output."""
    from kvarn_compile.testing import latent_rows

    seq = latent_rows("k4v2", tq=tq, frames=frames, rank=64, rope=16, heads=1, group=32,
                      max_len=256)
    gen = torch.Generator().manual_seed(0)
    q, q_pe = torch.randn(2, 6, tq, 64, generator=gen), torch.randn(2, 6, tq, 16, generator=gen)
    mask = None
    if masked:
        mask = torch.rand(2, 1, tq, 170, generator=gen) > 0.2
        mask[..., :1] = True
    with HostSyncDetector():
        out = dispatch.latent_attention_cuda(q, q_pe, seq.buffers, mask, None, checked=False)
    want = attention_ref.latent_attention(q, q_pe, seq.buffers, mask, None, True, 0)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_unchecked_latent_attention_flags_a_short_mask_on_the_device(monkeypatch):
    """A mask shorter than the latent cache, host checks off (a replayed graph's step): no
    sync, ``ERR_MASK`` in the device flags, raised after the step with the checked mode's
    cause, as ``kvarn::attention`` does; a covering mask flags nothing. A decode step of the
    registered CUDA kernel inside ``deferred_checks`` runs without host checks."""
    from kvarn_compile.testing import latent_rows

    seq = latent_rows("k4v2", rank=64, rope=16, heads=1, group=32, max_len=256)   # lengths 85, 160
    q, q_pe = torch.randn(2, 6, 1, 64), torch.randn(2, 6, 1, 16)
    with HostSyncDetector():
        dispatch.latent_attention_cuda(q, q_pe, seq.buffers, torch.ones(2, 1, 1, 160, dtype=torch.bool),
                                       None, checked=False)
    dispatch.raise_device_errors("cpu")                     # covering: nothing flagged
    short = torch.ones(2, 1, 1, 120, dtype=torch.bool)
    with HostSyncDetector():
        dispatch.latent_attention_cuda(q, q_pe, seq.buffers, short, None, checked=False)
    with pytest.raises(ValueError, match="a mask shorter than the cache"):
        dispatch.raise_device_errors("cpu")
    with pytest.raises(ValueError, match="the mask covers 120 key positions"):
        dispatch.latent_attention_cuda(q, q_pe, seq.buffers, short, None, checked=True)
    monkeypatch.setenv(dispatch.CUDA_CHECKS_ENV, "auto")
    with pytest.raises(ValueError, match="mask"), dispatch.deferred_checks(device="cpu"):
        with HostSyncDetector():
            dispatch._latent_attention_cuda(q, q_pe, seq.buffers, short, None, True, 0)
