"""CPU kernel: a whole KVarN decode attention step over the packed cache, in C++.

One call attends the queries over the exact sink, the packed tiles and the exact tail with
one online softmax (no separate torch pass, no log-sum-exp merge in Python):

* exact regions (sink, tail ring): fp16/bf16/fp32 rows read directly, scores with the
  un-rotated q; their output accumulates in the plain frame;
* packed tiles: the key row scale is folded into q, the key column scale into the scores,
  the value row scale into the softmax weights and the value column scale into the output
  (the dual-scale fold of ``ops/attention.py``); codes are unpacked in registers inside
  the score and value loops (16 lanes, register-blocked over up to 4 query rows), never
  into a dequantized K/V; their output accumulates in the rotated frame;
* q is rotated, and the rotated part of the output rotated back, inside the call; scales
  are read in their storage dtype (fp16/bf16/fp32), never converted buffer-wide.

Many queries (a prefill chunk, ``decode_attention(..., many=True)``): tasks over (batch row,
kv head, block of queries); each tile is dequantized once per task into an fp32 block that
stays in cache and all the task's query rows go through it with GEMM micro-kernels (scores
and p.V), one online softmax per row; causal, window and mask visibility per element
where a block is not wholly visible, so queries inside the quantized region are exact.

Work is split over (batch row, kv head, range of units) where a unit is the sink, one
tile or the tail; the ranges are merged by log-sum-exp in C++. Causal, sliding-window and
mask visibility is applied per position in every region, so the result matches the
reference wherever the dispatcher sends it.

:func:`tile_attention` is the tiles-only entry (rotated frame, returns the lse too);
:func:`decode_attention` the fused one. Both take ``k_plain`` (uint8 [B, H, N], 1 = that
tile's keys are stored in the plain, un-rotated frame: its scores use the un-rotated q).

Keys and values may have different head dims (multi-head latent attention decompressed:
D = 192 for q and K, Dv = 128 for V and the output): scores run over D with the D-sized
rotation, values and the output over Dv, the tile output rotated back with the Dv-sized one.

:func:`latent_attention_state` is ``kvarn::latent_attention`` (multi-head latent attention in
its absorbed form over a latent state: the latent as the keys, the shared RoPE key as the
values; ``csrc/latent_attention.cpp``): the structure of the many-queries path, one
dequantized tile block serving the scores and, read as values, the output.

:func:`append_decode` is the decode-step append fast path (``csrc/append.cpp``);
:func:`register_native_ops` makes it the native AutogradCPU kernel of the append ops
(``csrc/ops.cpp``: no Python on a compiled decode step's append).

The C++ sources are ``kernels/csrc/attention.cpp`` and ``append.cpp``; ``kernels/cpu/build.py``
compiles them on first use with ``torch.utils.cpp_extension.load`` (needs a C++ compiler
and ninja; about a minute, then cached). If it cannot be built, :func:`available` is False
(with a warning naming the build error) and the ops use the pure-torch reference.
``KVARN_CPU_KERNEL=require`` makes a failed build an error instead (the test suite sets it,
so CI fails when the shipped fast path does not build); ``KVARN_CPU_KERNEL=0`` turns the
kernel off.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvarn_compile.kernels.cpu.build import KernelBuildError, build_extension, load, mode, usable

__all__ = ["available", "build", "tile_attention", "decode_attention", "append_decode", "bits_of",
           "attention_state", "latent_attention_state", "register_native_ops", "note_released",
           "state_members", "SUPPORTED_BITS", "LATENT_TASK_ROWS", "KernelBuildError"]

log = logging.getLogger(__name__)

#: (key bits, value bits) the kernel reads (3-bit codes go through a byte-unpack path).
SUPPORTED_BITS = {(kb, vb) for kb in (2, 3, 4, 8) for vb in (2, 3, 4, 8)}
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def _module():
    return load("attention")


def build():
    """Build (or load the cached build of) the extension; raises :class:`KernelBuildError`
    with the compiler's message when it cannot be built."""
    return build_extension(_module, "attention kernel")


@functools.lru_cache(maxsize=1)
def _built() -> bool:
    return usable(build, log)


def available() -> bool:
    """True when the C++ kernel builds (or is already built) on this machine and is not
    turned off (``KVARN_CPU_KERNEL=0``). With ``KVARN_CPU_KERNEL=require`` a failed build
    raises :class:`KernelBuildError` instead of returning False."""
    return mode() != "0" and _built()


@functools.lru_cache(maxsize=16)
def _rotations(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    from kvarn_compile.quant.rotation import rotation_matrix

    h = rotation_matrix(d, "cpu")
    return h.contiguous(), h.T.contiguous()


def bits_of(k: list[torch.Tensor], v: list[torch.Tensor]) -> tuple[int, int]:
    """(key bits, value bits) of tile buffers k/v = [codes, row_scale, row_zero, col_scale]:
    a K code row packs G tokens (G = k col_scale's last dim), a V code row Dv channels (Dv =
    v col_scale's last dim, the values' head dim, which may differ from the keys' D)."""
    return 8 * k[0].shape[-1] // k[3].shape[-1], 8 * v[0].shape[-1] // v[3].shape[-1]


def _bits(k: list[torch.Tensor], v: list[torch.Tensor]) -> tuple[int, int]:
    kb, vb = bits_of(k, v)
    if (kb, vb) not in SUPPORTED_BITS:
        raise NotImplementedError(f"kvarn CPU kernel: expected bit widths in {sorted(SUPPORTED_BITS)}, "
                                  f"but got k{kb} v{vb}.")
    return kb, vb


def supports(d: int, scale_dtype: torch.dtype, exact_dtype: torch.dtype = torch.float16,
             value_head_dim: int | None = None) -> bool:
    """True when the kernel reads this key head dim ``d``, value head dim (``value_head_dim``,
    default ``d``; any other multiple of 16 too), scale dtype (fp8: no) and sink/tail dtype."""
    dv = d if value_head_dim is None else value_head_dim
    return (d % 16 == 0 and d > 0 and dv % 16 == 0 and dv > 0 and scale_dtype in _SCALE_DTYPES
            and exact_dtype in _SCALE_DTYPES)


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _plain(k_plain: torch.Tensor | None) -> torch.Tensor | None:
    if k_plain is None:
        return None
    return _c(k_plain if k_plain.dtype == torch.uint8 else k_plain.to(torch.uint8))


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous fp32 tensor (no dispatch when it already is one: per layer and token)."""
    return _c(x if x.dtype == torch.float32 else x.float())


def tile_attention(q_rot: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
                   n_tiles: torch.Tensor, *, scale: float, kv_start: torch.Tensor | None = None,
                   k_plain: torch.Tensor | None = None, q: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_rot fp32 [B, Hq, Tq, Dv], lse [B, Hq, Tq]) over the packed tiles.

    k = [codes, row_scale, row_zero, col_scale], v likewise (layouts of ``state.py``); q_rot
    [B, Hq, Tq, D] in the keys' rotated frame, out_rot in the values' (Dv-sized) one.
    kv_start [B, Tq]: first visible token index of the tile region per query.
    k_plain uint8 [B, H, N]: 1 where that tile's keys are stored un-rotated; their scores
    use the un-rotated ``q`` (q_rot @ H.T when not given). Values are always rotated.
    Rows with no visible quantized token get out = 0 and lse = -inf.
    """
    d = q_rot.shape[-1]
    kb, vb = _bits(k, v)
    if k_plain is not None and q is None:
        q = q_rot.float() @ _rotations(d)[1]
    start = _c(kv_start.to(torch.int64)) if kv_start is not None else None
    out, lse = _module().kvarn_attention(
        _c(q.float()) if q is not None else None, _c(q_rot.float()), None, None,
        None, None, None, None,
        _c(k[0]), _c(k[1]), _c(k[2]), _c(k[3]), _c(v[0]), _c(v[1]), _c(v[2]), _c(v[3]),
        None, _c(n_tiles.to(torch.int64)), start, _plain(k_plain), None,
        float(scale), False, 0, kb, vb, 0)
    return out, lse


#: Query rows (query heads x query tokens) per task of the multi-query path: its scores,
#: accumulators and one dequantized tile stay in L2 (~250 KB at D = 64, G = 128).
CHUNK_TASK_ROWS = 128


def decode_attention(q: torch.Tensor, sink: tuple[torch.Tensor, torch.Tensor],
                     k: list[torch.Tensor], v: list[torch.Tensor],
                     tail: tuple[torch.Tensor, torch.Tensor], lengths: torch.Tensor,
                     n_tiles: torch.Tensor, *, scale: float, causal: bool = True, window: int = 0,
                     mask: torch.Tensor | None = None, k_plain: torch.Tensor | None = None,
                     many: bool = False) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] (the last Tq tokens of each row) over the whole packed
    cache in one C++ call: fp32 output [B, Hq, Tq, Dv], un-rotated (Dv: the values' head
    dim, v col_scale's last dim; D unless the state was allocated with another).

    sink = (sink_k, sink_v) [B, H, S, D | Dv], tail = (tail_k, tail_v) [B, H, W, D | Dv]
    (ring buffer), k/v the tile buffers, as in ``state.py``; semantics of causal / window / mask
    as in ``ops.attention.attention`` (mask: bool or additive float, broadcastable to
    [B, Hq, Tq, M], indexed by absolute key position). k_plain as in :func:`tile_attention`.

    ``many``: the multi-query path (a prefill chunk): tasks of :data:`CHUNK_TASK_ROWS`
    query rows of one (batch row, kv head), each tile dequantized once per task into an
    fp32 block that all its rows read through GEMM micro-kernels; exact for any causal,
    window or mask visibility, including queries inside the quantized region. Without it
    the decode step's loop (codes unpacked in registers per 4 rows, splits over tiles).
    """
    bsz, hq, tq, d = q.shape
    kb, vb = _bits(k, v)
    dv = v[3].shape[-1]
    rot, rot_t = _rotations(d)
    if dv != d:                       # values (and the output) in their own Dv-sized frame
        rot_t = _rotations(dv)[1]
    m = None
    if mask is not None:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.float32)
        m = m.expand(bsz, hq, tq, m.shape[-1])
    out, _ = _module().kvarn_attention(
        _f32(q), None, rot, rot_t, _c(sink[0]), _c(sink[1]), _c(tail[0]), _c(tail[1]),
        _c(k[0]), _c(k[1]), _c(k[2]), _c(k[3]), _c(v[0]), _c(v[1]), _c(v[2]), _c(v[3]),
        _c(lengths), _c(n_tiles), None, _plain(k_plain), m,
        float(scale), bool(causal), int(window), kb, vb, CHUNK_TASK_ROWS if many else 0)
    return out


def attention_state(q: torch.Tensor, buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
                    mask: torch.Tensor | None, *, scale: float, causal: bool, window: int,
                    max_decode_queries: int) -> torch.Tensor | None:
    """:func:`decode_attention` from a state's flat buffer list (``state.py``), in one C++
    call that also reads the members, the bit widths and the mask and does the reference's
    checks (queries that match the cache, a mask as long as it: ``ValueError``). Output in
    q's dtype, [B, Hq, Tq, Dv]; the multi-query path for more than ``max_decode_queries``
    queries. None where the kernel does not read this state (fp8 scales, other bit widths,
    dtypes or head dims)."""
    d, dv = q.shape[-1], buffers[1].shape[-1]
    rot, rot_t = _rotations(d)
    if dv != d:                       # values (and the output) in their own Dv-sized frame
        rot_t = _rotations(dv)[1]
    return _module().kvarn_attention_state(q, buffers, mask, rot, rot_t, float(scale), bool(causal),
                                           int(window), CHUNK_TASK_ROWS, int(max_decode_queries))


#: Query rows (query heads x query tokens) per task of the latent kernel: its two fp32
#: accumulators [D, rows], three query blocks [rows, D + Dv] and one dequantized tile
#: [D + Dv, G] stay in L2 (~1 MB at DeepSeek's D = 512, Dv = 64, G = 128; 32 and 128 rows
#: ran a 64-query block over 4k tokens 10% slower on one thread).
LATENT_TASK_ROWS = 64


def latent_attention_state(q: torch.Tensor, q_pe: torch.Tensor,
                           buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
                           mask: torch.Tensor | None, *, scale: float, causal: bool,
                           window: int) -> torch.Tensor | None:
    """``kvarn::latent_attention`` (``ops.attention.latent_attention``) of q [B, Hq, Tq, D]
    and q_pe [B, Hq, Tq, Dv] over a latent state (the latent as its keys, the RoPE key as
    its values) in one C++ call (``csrc/latent_attention.cpp``), which also reads the
    members, bit widths and mask from the flat buffer list and does the reference's checks
    (queries and RoPE queries that match the state, a mask as long as it: ``ValueError``).

    Per (batch row, kv head, block of queries, range of tiles) task, each key tile is
    dequantized once into an fp32 block [D + Dv, G] with its value (RoPE) tile: the block
    gives all the task's query rows their scores (GEMM against the rotated [q | q_pe], the
    un-rotated q for a plain key tile) and, read as values, their output (GEMM with the
    softmax weights); the exact sink and tail are scored with the un-rotated [q | q_pe].
    One online softmax per row; the ranges are merged by log-sum-exp and the rotated part
    rotated back once. Everything the reference supports: fp8 scales, per-tile key frames,
    masks, causal, windows, rows of different lengths, queries that see nothing (zeros).
    Output [B, Hq, Tq, D] in q's dtype; None where the kernel does not read the state
    (other bit widths, storage dtypes or layouts): run the reference then.
    """
    d, dv = buffers[0].shape[-1], buffers[1].shape[-1]     # sink_k, sink_v: the state's dims
    if d < 2 or dv < 2 or d % 2 or dv % 2:                  # (no rotation of that size)
        return None
    rot, rot_t = _rotations(d)
    return _module().kvarn_latent_attention_state(q, q_pe, buffers, mask, rot, rot_t, _rotations(dv)[0],
                                                  float(scale), bool(causal), int(window),
                                                  LATENT_TASK_ROWS)


def state_members() -> list[str]:
    """The base members of a state, in the order the C++ kernels index its flat buffer list
    (``csrc/kvarn_common.h``; ``state.BASE_FIELDS`` must be the same, tested)."""
    return list(_module().kvarn_state_members())


def register_native_ops(valid_methods: tuple[str, ...]) -> None:
    """Register the decode-step append as the native AutogradCPU kernel of ``kvarn::append_``
    and ``kvarn::append_from_`` (``csrc/ops.cpp``; once per process): a compiled decode step
    then appends without Python where the Python CPU kernel would run this very append, and
    reaches that kernel everywhere else. ``valid_methods``: the op methods the runtime reads
    (any other one goes to Python, which raises)."""
    _module().kvarn_register_native_ops(list(valid_methods))


def note_released(tensor: torch.Tensor) -> None:
    """Tell the native kernels that ``tensor``'s storage was just released (its version
    counter now): a released model cache untouched since has nothing to adopt. Nothing when
    the extension is not loaded (the Python kernels keep their own record)."""
    if _module.cache_info().currsize:
        _module().kvarn_note_released(tensor)


def append_decode(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                  start_pos: torch.Tensor, recent: int, hold: int) -> bool:
    """The decode-step append in one C++ call; True when done, False (nothing written) when
    the reference must run: a new sequence, a rollback, uncommitted tokens, a tile that
    completes, a full tail, the capacity or an fp16 overflow (the reference raises there)."""
    from kvarn_compile.state import field_indices

    at = field_indices(buffers)       # (no StateFields: this runs per layer and token)
    b = buffers
    return bool(_module().kvarn_append_decode(
        k, v, b[at["sink_k"]], b[at["sink_v"]], b[at["tail_k"]], b[at["tail_v"]],
        b[at["lengths"]], b[at["committed"]], b[at["n_tiles"]], b[at["capacity"]], start_pos,
        b[at["k_col_scale"]].shape[-1], int(recent), int(hold)))
