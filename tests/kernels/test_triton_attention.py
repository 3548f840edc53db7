"""``kvarn_attention``: ``kvarn::attention`` in one Triton launch (exact sink and tail ring,
packed tiles, their log-sum-exp merge by the program that finishes last), against the op's
reference (``ops/attention.attention``) on CPU tensors through the interpreter.

The interpreter runs the programs one after another, so the merge is always done by the
last one of each block; the counters, the partials and the rotations are the same code as
on a GPU. Grids are kept to tens of programs.
"""

import pytest
import torch

from kvarn_compile.config import get_config
from kvarn_compile.kernels import kvarn_attention
from kvarn_compile.kernels.triton import append as triton_append
from kvarn_compile.ops import append as append_ref, attention as attention_ref
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import allocate_layer, unpack

H = 2
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(lengths, g, d, dtype=torch.float32, dv=None, seed=0, outlier=0.0, **cfg):
    """A k4v2 cache whose rows were written by one append each (lengths[row] tokens);
    ``outlier``: added to one key channel of head 0 (its tiles go plain: key frames)."""
    gen = torch.Generator().manual_seed(seed)
    st = allocate_layer(get_config("k4v2", group_size=g, **cfg), batch=len(lengths), kv_heads=H,
                        head_dim=d, max_len=max(lengths) + 2 * g, dtype=dtype,
                        value_head_dim=dv)
    for row, n in enumerate(lengths):
        if not n:
            continue
        sub = [t[row:row + 1] for t in st.buffers]
        k = torch.randn(1, H, n, d, generator=gen)
        k[:, 0, :, 3] += outlier
        k = k.to(dtype)
        v = torch.randn(1, H, n, dv or d, generator=gen).to(dtype)
        append_ref.append_(sub, k, v, torch.tensor([0]))
    return st.buffers


def _run(q, buffers, mask=None, causal=True, window=0, scale=None, **kw):
    """The kernel on DEV (the interpreter on CPU), its results back on the CPU."""
    f = unpack([t.to(DEV) for t in buffers])
    d, dv = q.shape[-1], f.sink_v.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    got = kvarn_attention(q.to(DEV), f.sink_k, f.sink_v, f.tail_k, f.tail_v, f.lengths,
                          f.n_tiles, *f.k.core, *f.v.core, rotation_matrix(d, DEV),
                          rotation_matrix(dv, DEV), scale=scale, causal=causal, window=window,
                          mask=None if mask is None else mask.to(DEV), k_plain=f.k_plain, **kw)
    return tuple(t.cpu() for t in got) if isinstance(got, tuple) else got.cpu()


def _close(out, want, tol):
    assert out.shape == want.shape and out.dtype == want.dtype
    err = (out.float() - want.float()).abs().max().item()
    assert err <= tol * max(want.float().abs().max().item(), 1e-6), err


def _mask(kind, b, hq, tq, length, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind in ("bool", "row"):     # shared by the heads ("row": and the query positions)
        keep = torch.rand(b, 1, 1 if kind == "row" else tq, length, generator=gen) > 0.2
        keep[..., :1] = True
        return keep
    mask = torch.randn(b, hq, tq, length, generator=gen)     # per head, additive, some -inf
    mask[torch.rand(mask.shape, generator=gen) < 0.1] = float("-inf")
    mask[..., :1] = 0.0
    return mask.half() if kind == "half" else mask


# (G, D, Dv, cache dtype, config, precision, tolerance): exact fp32 loops (the interpreter's
# default) over several layouts, and the phased fp16 loop of a GPU
GEOMETRIES = {
    "fp32": (32, 32, None, torch.float32, {}, "ieee", 2e-5),
    "values_of_another_dim": (32, 64, 32, torch.float32, {}, "ieee", 2e-5),
    "no_sink": (32, 32, None, torch.float32, dict(sink_tokens=0), "ieee", 2e-5),
    "rotated_keys": (32, 32, None, torch.float32, dict(key_frame="rotated"), "ieee", 2e-5),
    "fp64": (32, 32, None, torch.float64, {}, "ieee", 2e-5),
    "fp16_phased": (64, 64, None, torch.float16, {}, "fp16", 4e-3),
    "bf16_tf32": (64, 64, None, torch.bfloat16, {}, "tf32", 2e-2),
    # head 0's tiles stored plain (key frames), head 1's rotated: the loops read the rotated
    # or the plain queries per tile
    "key_frames": (32, 32, None, torch.float32, dict(outlier=300.0), "ieee", 2e-5),
    "key_frames_phased": (64, 64, None, torch.float16, dict(outlier=300.0), "fp16", 4e-3),
    # a head dim between two powers of two: the phased loop scores it in two parts (64 + 32),
    # without key frames with the queries it read before the loop, with them per tile
    "d96_phased": (64, 96, None, torch.float16, dict(key_frame="rotated"), "fp16", 4e-3),
    "d96_key_frames_phased": (64, 96, None, torch.float16, dict(outlier=300.0), "fp16", 4e-3),
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("tq,causal,window,mask,splits", [
    (1, True, 0, None, 1), (1, True, 0, None, 3), (1, True, 40, "bool", 2),
    (5, True, 0, "float", 2), (3, False, 0, None, 2), (4, True, 37, "half", 4),
    (3, True, 0, "row", 2),
    # a prompt's blocks (2 x 33+ rows a kv head: several blocks of 16 or 64) in one split:
    # FUSED, one program per block for tiles, exact region and output
    (36, True, 0, "bool", 1), (34, True, 29, "float", 1), (33, False, 0, None, 1),
])
def test_one_launch_attention_matches_the_reference(geometry, tq, causal, window, mask, splits):
    g, d, dv, dtype, cfg, precision, tol = GEOMETRIES[geometry]
    # rows: several tiles and a wrapped tail, one tile and a short tail, and the sink only
    buffers = _cache([3 * g + 37, g + 9 + (g if "sink" in geometry else 0), 3], g, d, dtype, dv,
                     **cfg)
    f = unpack(buffers)
    if geometry == "rotated_keys":
        assert f.k_plain is None or not f.k_plain.any()
    if "outlier" in cfg:
        n = int(f.n_tiles[0])
        assert n > 1 and bool(f.k_plain[0, 0, :n].all()) and not bool(f.k_plain[0, 1].any())
    b, hq = f.lengths.shape[0], 2 * H
    q = torch.randn(b, hq, tq, d).to(dtype)
    m = _mask(mask, b, hq, tq, int(f.lengths.max()) + 5)
    want = attention_ref.attention(q, buffers, m, d ** -0.5, causal, window)
    out = _run(q, buffers, m, causal, window, num_splits=splits, input_precision=precision)
    _close(out, want, tol)


def test_one_launch_attention_empty_rows_calls_in_a_row_and_lse():
    """A row with no token sees nothing (0, lse -inf); a query whose window holds only the
    tail; more splits than tiles (empty splits); the same call twice gives the same bits
    (each launch has its own counters)."""
    g, d = 32, 32
    buffers = _cache([4 * g + 7, 0, g + 40], g, d)
    q = torch.randn(3, 2 * H, 2, d)
    out, lse = _run(q, buffers, window=5, num_splits=6, return_lse=True)
    _close(out, attention_ref.attention(q, buffers, None, d ** -0.5, True, 5), 2e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[2]).all()
    again = _run(q, buffers, window=5, num_splits=6)
    assert torch.equal(out, again)
    scores_out = _run(q, buffers, causal=False, scale=0.05, num_splits=1)
    _close(scores_out, attention_ref.attention(q, buffers, None, 0.05, False, 0), 2e-5)


def test_one_launch_attention_reads_no_mask_past_its_end_and_flags_it():
    """A mask shorter than a row's length (an error the checked path raises before) is never
    read past its end; the kernel records it in the device flags."""
    g, d = 32, 32
    buffers = _cache([3 * g + 20, g + 3], g, d)
    q = torch.randn(2, 2 * H, 1, d)
    flags = torch.zeros((), dtype=torch.int32, device=DEV)
    short = torch.zeros(2, 1, 1, g + 10)
    out = _run(q, buffers, short, error_flags=flags, error_bit=triton_append.ERR_MASK)
    assert int(flags) == triton_append.ERR_MASK and out.shape == (2, 2 * H, 1, d)
    flags.zero_()
    _run(q, buffers, torch.zeros(2, 1, 1, 4 * g + 30), error_flags=flags,
         error_bit=triton_append.ERR_MASK)
    assert int(flags) == 0


def test_one_launch_attention_validation():
    g, d = 32, 32
    buffers = _cache([2 * g + 5], g, d)
    f = unpack(buffers)
    q = torch.randn(1, 2 * H, 1, d)
    with pytest.raises(ValueError, match="Expected float queries"):
        _run(q.int(), buffers)
    with pytest.raises(ValueError, match="Expected a contiguous rot_v"):
        kvarn_attention(q, f.sink_k, f.sink_v, f.tail_k, f.tail_v, f.lengths, f.n_tiles,
                        *f.k.core, *f.v.core, rotation_matrix(d), rotation_matrix(16),
                        scale=0.1, causal=True, window=0)
    with pytest.raises(ValueError, match="broadcastable"):
        _run(q, buffers, torch.zeros(1, 3, 1, 100))
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        _run(q[:, :3], buffers)


@pytest.mark.parametrize("mask", [None, "bool"])
def test_one_launch_attention_prefill_block_is_causal_inside_the_tiles(mask):
    """A prompt's queries over the tiles its own append packed: the causal bound runs
    through the packed region, per query position (and a shorter row's extra queries, at
    positions before its first token, see nothing)."""
    g, d = 32, 32
    buffers = _cache([3 * g + 37, 2 * g + 5], g, d, seed=4)
    tq = 3 * g + 37
    q = torch.randn(2, 2 * H, tq, d)
    m = _mask(mask, 2, 2 * H, tq, tq)
    want = attention_ref.attention(q, buffers, m, d ** -0.5, True, 0)
    _close(_run(q, buffers, m, num_splits=2), want, 2e-5)
    _close(_run(q, buffers, m, num_splits=1), want, 2e-5)     # FUSED



@pytest.mark.parametrize("window,mask,splits", [(80, None, 1), (80, "bool", 2), (0, "float", 1),
                                                (100, None, 3)])
def test_phased_prompt_runs_whole_tiles_apart_from_edge_tiles(window, mask, splits):
    """The phased fp16 loop runs the tiles every row of a block sees whole without bounds,
    after the block's edge tiles with them (``_decode_range_phased``: a range with a gap).
    A window of 2.5-3 tiles puts an edge tile before the whole ones, the causal bound one
    after; with splits, ranges start and end anywhere around them."""
    g, d = 32, 64
    buffers = _cache([6 * g + 37, 4 * g + 5], g, d, torch.float16, seed=5)
    tq = 80
    q = torch.randn(2, 2 * H, tq, d).to(torch.float16)
    m = _mask(mask, 2, 2 * H, tq, 6 * g + 42)
    want = attention_ref.attention(q, buffers, m, d ** -0.5, True, window)
    _close(_run(q, buffers, m, window=window, num_splits=splits, input_precision="fp16"),
           want, 4e-3)

@pytest.mark.parametrize("d,block_n,tq,splits", [(96, 32, 1, 2), (96, 32, 20, 2),
                                                  (256, 64, 1, 2), (256, 128, 3, 2),
                                                  (64, 32, 20, 1), (128, 64, 20, 1),
                                                  (96, 32, 20, 1), (192, 64, 20, 1),
                                                  (256, 128, 20, 1)])
def test_phased_keys_in_parts_load_the_later_parts_late(d, block_n, tq, splits):
    """Keys of a head dim between two powers of two (96 = 64 + 32) or past 128 (256 = 128 +
    128) are scored in two parts, and a prompt's (one split, several row blocks: FUSED,
    ``KEY_PART``) in parts of at most 64 channels (64 = 32 + 32, 96 = 64 + 32, 128 = 64 +
    64, 192 and 256 in three and four of 64), its queries read per step; each later part's
    code words loaded after the parts before it were scored (``_steps_phased``: LATE), from the step's own chunk: steps of a tile and of
    part of one (block_n < G: chunk c of tile c // CH), one query and several."""
    g = 128 if d >= 192 else 64
    buffers = _cache([3 * g + 37, g + 9], g, d, torch.float16, seed=7, key_frame="rotated")
    q = torch.randn(2, 2 * H, tq, d).to(torch.float16)
    m = _mask("bool", 2, 2 * H, tq, 3 * g + 42)
    want = attention_ref.attention(q, buffers, m, d ** -0.5, True, 0)
    _close(_run(q, buffers, m, num_splits=splits, input_precision="fp16", block_n=block_n),
           want, 4e-3)


@pytest.mark.parametrize("frames", [False, True])
def test_phased_loop_scores_queries_past_the_fp16_range(frames):
    """The phased loop's fp16 score operand, fp16(q / f) * k_rs with fp16 key scales: each
    query row is divided by a power of two f >= |q| / 2^15 first, so rotated queries far
    past the fp16 range (|q_i| ~ 1e6 here, the softmax scale taking it back) score as the
    reference does, held across the loop or read per tile (key frames: head 0's tiles
    plain); fp16 queries without f are inf there, and the output NaN."""
    g, d = 64, 64
    cfg = dict(outlier=300.0) if frames else dict(key_frame="rotated")
    buffers = _cache([3 * g + 37, g + 9], g, d, torch.float32, seed=3, **cfg)
    f = unpack(buffers)
    assert f.k.core[1].dtype == torch.float16          # fp16 key scales: the fp16 operand
    if frames:
        assert bool(f.k_plain[0, 0, :int(f.n_tiles[0])].all())
    q = torch.randn(2, 2 * H, 1, d) * 1e6
    scale = d ** -0.5 * 1e-6
    want = attention_ref.attention(q, buffers, None, scale, True, 0)
    _close(_run(q, buffers, None, scale=scale, num_splits=2, input_precision="fp16"), want,
           4e-3)


def test_fused_prompt_blocks_need_no_partials(monkeypatch):
    """A prompt's launch in one split runs FUSED: one program per block writes its rows'
    output (empty rows 0 and lse -inf, the same bits twice), and no partial buffer is
    allocated for it; a short mask is flagged there too."""
    from kvarn_compile.kernels.triton import attention as triton_attention

    g, d = 32, 32
    buffers = _cache([4 * g + 7, 0, g + 40], g, d)
    q = torch.randn(3, 2 * H, 40, d)       # 80 rows a kv head: 2 blocks of 64 (5 of 16)
    sizes = []
    empty = torch.empty

    def recording_empty(*shape, **kw):
        t = empty(*shape, **kw)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr(triton_attention.torch, "empty", recording_empty)
    out, lse = _run(q, buffers, window=50, num_splits=1, return_lse=True)
    monkeypatch.undo()
    want = attention_ref.attention(q, buffers, None, d ** -0.5, True, 50)
    _close(out, want, 2e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert torch.equal(out, _run(q, buffers, window=50, num_splits=1))
    # out, lse, no partials, the scratch (q's blocks, padded to 16 rows): the partials of
    # the split path would be at least twice q (a tile split and an exact one per row)
    assert sorted(sizes)[:2] == [0, 0] and max(sizes) < 2 * q.numel(), sizes
    flags = torch.zeros((), dtype=torch.int32, device=DEV)
    _run(q[:2], _cache([3 * g + 20, g + 3], g, d), torch.zeros(2, 1, 40, g + 10),
         num_splits=1, error_flags=flags, error_bit=triton_append.ERR_MASK)
    assert int(flags) == triton_append.ERR_MASK


@pytest.mark.parametrize("per_program", [8, 12])
def test_one_launch_attention_shares_the_exact_region_between_programs(per_program, monkeypatch):
    """The sink and tail slots cut into several programs' ranges, one crossing from the sink
    into the tail ring (11 slots a program over a sink of 32): the same attention."""
    from kvarn_compile.kernels.triton import attention as triton_attention

    g, d = 32, 32
    buffers = _cache([5 * g + 7, 2 * g + 3, 9], g, d, seed=5)
    q = torch.randn(3, 2 * H, 2, d)
    m = _mask("bool", 3, 2 * H, 2, 6 * g)
    want = attention_ref.attention(q, buffers, m, d ** -0.5, True, 0)
    monkeypatch.setattr(triton_attention, "EXACT_SLOTS_PER_PROGRAM", per_program)
    f = unpack(buffers)
    assert triton_attention.exact_splits(f.sink_k.shape[2] + f.tail_k.shape[2]) >= 3
    _close(_run(q, buffers, m, num_splits=2), want, 2e-5)
