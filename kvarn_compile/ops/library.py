"""Every ``torch.ops.kvarn.*`` op: its schema and its fake kernel.

This module is the one place that declares ops. The default implementation of each op is
one call of its pure-torch reference (:mod:`.append`, :mod:`.attention`, :mod:`.keyed`,
:mod:`.context_parallel`), on any device; device kernels register
against these ops in :mod:`.dispatch` (C++ on CPU, Triton on CUDA) and fall back to the
reference wherever they would not compute exactly the same thing. The fake kernels compute
shapes and check devices (they also serve the Meta dispatch key), so the ops trace under
torch.compile and FakeTensor.

Packed-state ops (``buffers``: a layer's flat state, see :mod:`kvarn_compile.state`)::

    kvarn::append_(Tensor(a!)[] buffers, Tensor k, Tensor v, Tensor start_pos, str method,
                   int iters, int recent, int hold, bool check_finite, str name) -> ()
    kvarn::commit_(Tensor(a!)[] buffers, Tensor upto, str method, int iters, int recent,
                   bool check_finite, str name) -> ()
    kvarn::attention(Tensor q, Tensor[] buffers, Tensor? mask, float scale, bool causal,
                     int window) -> Tensor
    kvarn::attention_weights(<the six arguments of attention>, SymInt keys) -> Tensor
        # the softmax weights attention applies, fp32 [B, Hq, Tq, keys] (output_attentions)
    kvarn::reorder_(Tensor(a!)[] buffers, Tensor rows, str name) -> ()     # beam search
    kvarn::latent_attention(Tensor q, Tensor q_pe, Tensor[] buffers, Tensor? mask, float scale,
                            bool causal, int window) -> Tensor
        # multi-head latent attention, absorbed form, over a latent state (the latent as
        # its keys, the RoPE key as its values): softmax(q·latentᵀ + q_pe·ropeᵀ)·latent

Adoption (before ``append_``, where the graph no longer reads the model's own
preallocated cache): a prompt that a non-compiled forward wrote to that cache is taken
over into the packed state (transformers' eager prefill under ``generate(compile_config=)``)::

    kvarn::adopt_(Tensor(a!)[] buffers, Tensor cache_k, Tensor cache_v, Tensor start_pos,
                  str method, int iters, int recent, int hold, bool check_finite, str name,
                  bool fresh) -> ()
    kvarn::append_from_(..., the ten arguments of append_, Tensor cache_k, Tensor cache_v,
                        bool fresh) -> ()          # adopt_ + append_ in one call

Keyed forms for graphs that cannot take the packed state as an input (the Inductor
pre-grad pass, :mod:`kvarn_compile.pre_grad_pass`): the state is found at run time in
:mod:`kvarn_compile.ops.keyed` by a constant key, and the append returns an empty token
tensor the attention takes, so the compiler keeps the append and orders it first. To the
compiler these ops are functional (the state is invisible to it)::

    kvarn::append_keyed(Tensor k, Tensor v, Tensor start_pos, Tensor? cache_k,
                        Tensor? cache_v, str key, int max_len, str method, int iters,
                        int recent, int hold, bool check_finite, bool release) -> Tensor
    kvarn::attention_keyed(Tensor q, Tensor token, Tensor? mask, str key, float scale,
                           bool causal, int window) -> Tensor
    kvarn::reorder_keyed(Tensor k, Tensor rows, str key) -> Tensor

Context-parallel forms (``kvarn_compile.ops.context_parallel``: the state holds this rank's
range of tiles; ``group`` is a registered process group's key; the attention runs one
``all_gather``). The backend puts them in place of the plain ops when asked to::

    kvarn::cp_append_(<the ten arguments of append_>, str group) -> ()
    kvarn::cp_append_from_(<the thirteen arguments of append_from_>, str group) -> ()
    kvarn::cp_attention(<the six arguments of attention>, str group) -> Tensor

Helpers the rewrite and the lowering insert::

    kvarn::positions_start(Tensor positions, int batch) -> Tensor   # checked contiguous run
    kvarn::tile_partials_(Tensor q_rot, Tensor? q_plain, <8 tile tensors>, Tensor? k_plain,
                          Tensor n_tiles, Tensor kv_lo, Tensor kv_hi, Tensor? bias,
                          Tensor(a!) lse_part, float scale, int split_max) -> Tensor
                          # the tile region, lowered to templates
    kvarn::tile_partials_triton_(<same>) -> Tensor   # CUDA only: the standalone Triton kernel
    kvarn::latent_tile_partials_(Tensor q_rot, Tensor? q_plain, Tensor q_pe_rot,
                                 <8 tile tensors>, <4 fp8 factors: Tensor?>, Tensor? tile_ids,
                                 Tensor? tile_count, Tensor n_tiles, Tensor kv_lo, Tensor kv_hi,
                                 Tensor? bias, Tensor(a!) lse_part, float scale,
                                 int split_max) -> Tensor
                          # the tile region of latent_attention, per key frame, lowered to a template
    kvarn::tune_observe_(Tensor(a!) token, Tensor[] buffers, Tensor k, Tensor v,
                         Tensor start_pos, str tuner, str site, int recent, int hold) -> ()
                         # implemented by kvarn_compile.autotune.tuning (knob tuning)
"""

from __future__ import annotations

import torch

from kvarn_compile.ops import append as append_ref, attention as attention_ref, context_parallel, keyed
from kvarn_compile.state import field_indices

__all__ = ["append_", "commit_", "attention", "attention_weights", "latent_attention", "adopt_", "append_from_", "append_keyed",
           "attention_keyed", "reorder_", "reorder_keyed", "cp_append_", "cp_append_from_", "cp_attention", "positions_start", "tile_partials_", "register_plain_kernel",
           "tile_partials_triton_", "latent_tile_partials_", "tune_observe_"]


def _check_devices(op: str, buffers: list[torch.Tensor], **tensors: torch.Tensor | None) -> None:
    """The data-free part of the eager checks, for the fake kernels.

    A fake kernel also serves the Meta dispatch key, so without this an op called with a
    meta tensor next to a real cache would silently do nothing instead of failing like the
    eager kernel does.
    """
    device = buffers[0].device
    for label, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"KVarN {op}: expected {label} on {device} like the cache, but got "
                             f"{t.device}. Move the cache or the model.")


# ------------------------------------------------------------------------------ packed state
@torch.library.custom_op("kvarn::append_", mutates_args=("buffers",))
def append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            start_pos: torch.Tensor, method: str, iters: int, recent: int,
            hold: int, check_finite: bool, name: str) -> None:
    """Quantize-on-append: write K/V [B, H, T, D] at start_pos [B] (see ops.append)."""
    append_ref.append_(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name)


@append_.register_fake
def _append_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
    _check_devices("append", buffers, keys=k, values=v)
    return None


@torch.library.custom_op("kvarn::commit_", mutates_args=("buffers",))
def commit_(buffers: list[torch.Tensor], upto: torch.Tensor, method: str, iters: int,
            recent: int, check_finite: bool, name: str) -> None:
    """Commit tokens < upto[b] and freeze every tile that became complete."""
    append_ref.commit_(buffers, upto, method, iters, recent, check_finite, name)


@commit_.register_fake
def _commit_fake(buffers, upto, method, iters, recent, check_finite, name):
    return None


@torch.library.custom_op("kvarn::attention", mutates_args=())
def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int) -> torch.Tensor:
    """Fused dual-scale dequant attention of q [B, Hq, Tq, D] over the packed cache."""
    return attention_ref.attention(q, buffers, mask, scale, causal, window).contiguous()


def _out_shape(q: torch.Tensor, buffers: list[torch.Tensor]) -> tuple[int, ...]:
    """[B, Hq, Tq, Dv]: the queries' shape with the values' head dim."""
    return (*q.shape[:-1], buffers[field_indices(buffers)["sink_v"]].shape[-1])


@attention.register_fake
def _attention_fake(q, buffers, mask, scale, causal, window):
    _check_devices("attention", buffers, queries=q)
    return q.new_empty(_out_shape(q, buffers))   # contiguous, whatever q's strides (as the kernels)


@torch.library.custom_op("kvarn::attention_weights", mutates_args=())
def attention_weights(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
                      scale: float, causal: bool, window: int, keys: int) -> torch.Tensor:
    """The softmax weights fp32 [B, Hq, Tq, keys] ``attention`` (same arguments) applies, at
    key positions 0..keys-1 (a model that returns its attention weights)."""
    return attention_ref.attention_weights(q, buffers, mask, scale, causal, window, keys)


@attention_weights.register_fake
def _attention_weights_fake(q, buffers, mask, scale, causal, window, keys):
    _check_devices("attention_weights", buffers, queries=q)
    return q.new_empty((*q.shape[:-1], keys), dtype=torch.float32)


@torch.library.custom_op("kvarn::latent_attention", mutates_args=())
def latent_attention(q: torch.Tensor, q_pe: torch.Tensor, buffers: list[torch.Tensor],
                     mask: torch.Tensor | None, scale: float, causal: bool, window: int) -> torch.Tensor:
    """Absorbed multi-head latent attention of q [B, Hq, Tq, D] (latent space) and q_pe
    [B, Hq, Tq, Dv] (RoPE part) over a latent state: [B, Hq, Tq, D]."""
    return attention_ref.latent_attention(q, q_pe, buffers, mask, scale, causal, window).contiguous()


@latent_attention.register_fake
def _latent_attention_fake(q, q_pe, buffers, mask, scale, causal, window):
    _check_devices("latent_attention", buffers, queries=q, rope_queries=q_pe)
    return q.new_empty(q.shape)


@torch.library.custom_op("kvarn::reorder_", mutates_args=("buffers",))
def reorder_(buffers: list[torch.Tensor], rows: torch.Tensor, name: str) -> None:
    """Reorder the state's batch rows: row i becomes old row ``rows[i]`` (beam search).

    ``rows``: the per-row tags the compiled graph read from the past handle a cat cache
    handed back (each handle's row i holds i; ``index_select(0, beam_idx)`` on it gives
    ``beam_idx``). Identity tags do nothing; anything but row tags raises ValueError.
    """
    append_ref.reorder_(buffers, rows, name)


@reorder_.register_fake
def _reorder_fake(buffers, rows, name):
    return None


# ------------------------------------------------------------------------------ adoption
def _append_op(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
    # through the op, so the device's kernel (e.g. the CUDA tile quantizer) runs
    torch.ops.kvarn.append_.default(buffers, k, v, start_pos, method, iters, recent, hold,
                                    check_finite, name)


@torch.library.custom_op("kvarn::adopt_", mutates_args=("buffers",))
def adopt_(buffers: list[torch.Tensor], cache_k: torch.Tensor, cache_v: torch.Tensor,
           start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
           check_finite: bool, name: str, fresh: bool) -> None:
    """Before ``append_``: take over a prompt a non-compiled forward wrote to the model's
    cache (see ``append_ref.adopt_``). A no-op (one storage-size check) once the cache is released."""
    append_ref.adopt_(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
                     check_finite, name, fresh, append=_append_op)


@adopt_.register_fake
def _adopt_fake(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
                check_finite, name, fresh):
    return None


@torch.library.custom_op("kvarn::append_from_", mutates_args=("buffers",))
def append_from_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
                 check_finite: bool, name: str, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 fresh: bool) -> None:
    """``adopt_`` then ``append_`` in one call (one dispatch per step instead of two); the
    first ten arguments are ``append_``'s."""
    append_ref.adopt_(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
                     check_finite, name, fresh, append=_append_op)
    _append_op(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name)


@append_from_.register_fake
def _append_from_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite,
                      name, cache_k, cache_v, fresh):
    _check_devices("append", buffers, keys=k, values=v)
    return None


# ------------------------------------------------------------------------------ context parallel
@torch.library.custom_op("kvarn::cp_append_", mutates_args=("buffers",))
def cp_append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
               start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
               check_finite: bool, name: str, group: str) -> None:
    """``append_`` of a context-parallel state: this rank stores the tiles it owns."""
    context_parallel.append_(buffers, k, v, start_pos, method, iters, recent, hold,
                             check_finite, name, group)


@cp_append_.register_fake
def _cp_append_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name,
                    group):
    _check_devices("append", buffers, keys=k, values=v)
    return None


def _cp_append_op(group: str):
    def append(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
        torch.ops.kvarn.cp_append_.default(buffers, k, v, start_pos, method, iters, recent, hold,
                                           check_finite, name, group)
    return append


@torch.library.custom_op("kvarn::cp_append_from_", mutates_args=("buffers",))
def cp_append_from_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
                    check_finite: bool, name: str, cache_k: torch.Tensor, cache_v: torch.Tensor,
                    fresh: bool, group: str) -> None:
    """``append_from_`` of a context-parallel state (the adopted prompt is appended the same way)."""
    append = _cp_append_op(group)
    append_ref.adopt_(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
                     check_finite, name, fresh, append=append)
    append(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name)


@cp_append_from_.register_fake
def _cp_append_from_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite,
                         name, cache_k, cache_v, fresh, group):
    _check_devices("append", buffers, keys=k, values=v)
    return None


@torch.library.custom_op("kvarn::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
                 scale: float, causal: bool, window: int, group: str) -> torch.Tensor:
    """``attention`` of a context-parallel state: one ``all_gather`` of the tile partials."""
    return context_parallel.attention(q, buffers, mask, scale, causal, window, group).contiguous()


@cp_attention.register_fake
def _cp_attention_fake(q, buffers, mask, scale, causal, window, group):
    _check_devices("attention", buffers, queries=q)
    return q.new_empty(_out_shape(q, buffers))


# ------------------------------------------------------------------------------ keyed forms
@torch.library.custom_op("kvarn::append_keyed", mutates_args=())
def append_keyed(k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor,
                 cache_k: torch.Tensor | None, cache_v: torch.Tensor | None, key: str,
                 max_len: int, method: str, iters: int, recent: int, hold: int,
                 check_finite: bool, release: bool) -> torch.Tensor:
    """``append_`` into the keyed state ``key`` (allocated on first use for ``max_len``
    tokens; for a ``cat`` cache, where ``cache_k``/``cache_v`` are None, a growable state
    whose tile slots grow with the sequence up to ``max_len``); returns an empty token for
    the site's ``attention_keyed`` ([0, Dv]: it tells the attention's fake its output's head dim).

    ``cache_k``/``cache_v``: the model's own cache tensors, which the graph no longer
    reads. A prompt a non-compiled forward wrote there is adopted first (see
    ``append_ref.adopt_``); with ``release`` their storage is then freed (counted in the
    store), on every call that passes tensors that still hold storage.
    """
    return keyed.append_keyed(k, v, start_pos, cache_k, cache_v, key, max_len, method, iters, recent,
                              hold, check_finite, release, append=_append_op)


@append_keyed.register_fake
def _append_keyed_fake(k, v, start_pos, cache_k, cache_v, key, max_len, method, iters, recent,
                       hold, check_finite, release):
    return v.new_empty((0, v.shape[-1]))


@torch.library.custom_op("kvarn::attention_keyed", mutates_args=())
def attention_keyed(q: torch.Tensor, token: torch.Tensor, mask: torch.Tensor | None, key: str,
                    scale: float, causal: bool, window: int) -> torch.Tensor:
    """``attention`` over the keyed state ``key``; ``token`` comes from its append."""
    buffers = keyed.state_for_attention(key, q.shape[0])
    return torch.ops.kvarn.attention.default(q, buffers, mask, scale, causal, window)


@attention_keyed.register_fake
def _attention_keyed_fake(q, token, mask, key, scale, causal, window):
    return q.new_empty((*q.shape[:-1], token.shape[-1]))


@torch.library.custom_op("kvarn::reorder_keyed", mutates_args=())
def reorder_keyed(k: torch.Tensor, rows: torch.Tensor, key: str) -> torch.Tensor:
    """``reorder_`` of the keyed state ``key`` (if allocated); returns a copy of ``k``
    that the site's ``append_keyed`` takes, which orders the append after the reorder."""
    keyed.reorder_keyed(k.shape[0], rows, key)
    return k.clone()


@reorder_keyed.register_fake
def _reorder_keyed_fake(k, rows, key):
    return torch.empty_like(k)


# ------------------------------------------------------------------------------ helpers
@torch.library.custom_op("kvarn::positions_start", mutates_args=())
def positions_start(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """int64 [batch] filled with positions[0], after checking that the positions are one
    contiguous run ``p, p+1, ..., p+T-1``: model code writes its cache at a positions
    tensor (``cache_position``, ``input_pos``), and the packed cache appends runs, so a
    tree-attention write raises instead of landing tokens in the wrong place."""
    return append_ref.positions_start(positions, batch)


@positions_start.register_fake
def _positions_start_fake(positions, batch):
    return positions.new_empty((batch,), dtype=torch.int64)


@torch.library.custom_op("kvarn::tile_partials_", mutates_args=("lse_part",))
def tile_partials_(q_rot: torch.Tensor, q_plain: torch.Tensor | None, k_codes: torch.Tensor,
                   k_row_scale: torch.Tensor, k_row_zero: torch.Tensor, k_col_scale: torch.Tensor,
                   v_codes: torch.Tensor, v_row_scale: torch.Tensor, v_row_zero: torch.Tensor,
                   v_col_scale: torch.Tensor, k_plain: torch.Tensor | None, n_tiles: torch.Tensor,
                   kv_lo: torch.Tensor, kv_hi: torch.Tensor, bias: torch.Tensor | None,
                   lse_part: torch.Tensor, scale: float, split_max: int) -> torch.Tensor:
    """Per-split partials over the packed tiles (``attention_ref.tile_partials``): writes the
    per-split lse into ``lse_part`` [B, Hq, Tq, SPLIT_MAX] (filled with -inf by the caller)
    and returns the normalized o_part [B, Hq, Tq, SPLIT_MAX, Dv]. It exists for the
    lowering (``lowering/tiles.py``), whose Triton templates compete for it. ``q_plain``
    and ``k_plain`` (per-tile key frames) come together or not at all."""
    o, lse = attention_ref.tile_partials(q_rot, q_plain, k_codes, k_row_scale, k_row_zero,
                                     k_col_scale, v_codes, v_row_scale, v_row_zero, v_col_scale,
                                     k_plain, n_tiles, kv_lo, kv_hi, bias, scale, split_max)
    lse_part.copy_(lse)
    return o


def _tile_partials_fake(q_rot, q_plain, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes,
                        v_row_scale, v_row_zero, v_col_scale, k_plain, n_tiles, kv_lo, kv_hi,
                        bias, lse_part, scale, split_max):
    b, hq, tq = q_rot.shape[:3]
    return q_rot.new_empty(b, hq, tq, split_max, v_col_scale.shape[-1], dtype=torch.float32)


tile_partials_.register_fake(_tile_partials_fake)


@torch.library.custom_op("kvarn::tile_partials_triton_", mutates_args=("lse_part",))
def tile_partials_triton_(q_rot: torch.Tensor, q_plain: torch.Tensor | None,
                          k_codes: torch.Tensor, k_row_scale: torch.Tensor,
                          k_row_zero: torch.Tensor, k_col_scale: torch.Tensor,
                          v_codes: torch.Tensor, v_row_scale: torch.Tensor,
                          v_row_zero: torch.Tensor, v_col_scale: torch.Tensor,
                          k_plain: torch.Tensor | None, n_tiles: torch.Tensor,
                          kv_lo: torch.Tensor, kv_hi: torch.Tensor, bias: torch.Tensor | None,
                          lse_part: torch.Tensor, scale: float, split_max: int) -> torch.Tensor:
    """``tile_partials_`` through the standalone Triton decode kernel (CUDA kernel in
    :mod:`.dispatch`; one query token, no bias). Its oracle is ``tile_partials_``."""
    raise NotImplementedError(
        f"kvarn::tile_partials_triton_ runs a Triton kernel and has a CUDA kernel only, but got "
        f"tensors on {q_rot.device}. Use kvarn::tile_partials_ (any device).")


tile_partials_triton_.register_fake(_tile_partials_fake)


@torch.library.custom_op("kvarn::latent_tile_partials_", mutates_args=("lse_part",))
def latent_tile_partials_(q_rot: torch.Tensor, q_plain: torch.Tensor | None, q_pe_rot: torch.Tensor,
                          k_codes: torch.Tensor, k_row_scale: torch.Tensor,
                          k_row_zero: torch.Tensor, k_col_scale: torch.Tensor,
                          v_codes: torch.Tensor, v_row_scale: torch.Tensor,
                          v_row_zero: torch.Tensor, v_col_scale: torch.Tensor,
                          k_row_factor: torch.Tensor | None, k_col_factor: torch.Tensor | None,
                          v_row_factor: torch.Tensor | None, v_col_factor: torch.Tensor | None,
                          tile_ids: torch.Tensor | None, tile_count: torch.Tensor | None,
                          n_tiles: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
                          bias: torch.Tensor | None, lse_part: torch.Tensor, scale: float,
                          split_max: int) -> torch.Tensor:
    """Per-frame, per-split partials of ``latent_attention``'s packed tiles
    (``attention_ref.latent_tile_partials``): writes the lse into ``lse_part``
    [B, Hq, Tq, NF, SPLIT_MAX] (filled with -inf by the caller) and returns the normalized
    o_part [B, Hq, Tq, NF, SPLIT_MAX, D]; NF = 2 with per-tile key frames (``q_plain``,
    ``tile_ids`` and ``tile_count`` come together or not at all), else 1. It exists for the
    lowering (``lowering/latent.py``), whose Triton template competes for it."""
    o, lse = attention_ref.latent_tile_partials(
        q_rot, q_plain, q_pe_rot, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes,
        v_row_scale, v_row_zero, v_col_scale, k_row_factor, k_col_factor, v_row_factor,
        v_col_factor, tile_ids, tile_count, n_tiles, kv_lo, kv_hi, bias, scale, split_max)
    lse_part.copy_(lse)
    return o


@latent_tile_partials_.register_fake
def _latent_tile_partials_fake(q_rot, q_plain, q_pe_rot, k_codes, k_row_scale, k_row_zero,
                               k_col_scale, v_codes, v_row_scale, v_row_zero, v_col_scale,
                               k_row_factor, k_col_factor, v_row_factor, v_col_factor, tile_ids,
                               tile_count, n_tiles, kv_lo, kv_hi, bias, lse_part, scale, split_max):
    b, hq, tq, d = q_rot.shape
    nf = 1 if tile_ids is None else 2
    return q_rot.new_empty(b, hq, tq, nf, split_max, d, dtype=torch.float32)


@torch.library.custom_op("kvarn::tune_observe_", mutates_args=("token",))
def tune_observe_(token: torch.Tensor, buffers: list[torch.Tensor], k: torch.Tensor,
                  v: torch.Tensor, start_pos: torch.Tensor, tuner: str, site: str, recent: int,
                  hold: int) -> None:
    """Hand the full-precision rows of a layer's first tile to its knob tuner, once.

    Its kernels are registered by :mod:`kvarn_compile.autotune.tuning` (which also inserts
    the op into graphs), so the default only explains what is missing."""
    raise NotImplementedError(
        f"kvarn::tune_observe_ has no kernel for {k.device.type} tensors; its CPU and CUDA "
        "kernels are registered by importing kvarn_compile.autotune.tuning.")


@tune_observe_.register_fake
def _tune_observe_fake(token, buffers, k, v, start_pos, tuner, site, recent, hold):
    return None


# ------------------------------------------------------------------------------ dispatch cost
# The mutating ops run inside compiled decode steps, once or twice per layer per token.
# torch.library.custom_op gives each a Python ADInplaceOrView kernel that re-binds every
# argument against the schema to bump the version counters of the mutated buffers: ~50 us
# per call on a 2-core CPU, a few ms per decode step of a 30-layer model. The packed
# buffers belong to kvarn and are never saved for a backward pass, so that key falls
# through to the device kernels. (The Autograd kernel stays: it runs the kernels below
# autograd, so K/V that require grad never give the packed buffers an autograd history,
# and a backward through an op with outputs says it has no autograd formula.)
#: the cache ops: mutate the packed buffers, return nothing
_CACHE_OPS = ("append_", "commit_", "reorder_", "adopt_", "append_from_", "cp_append_",
              "cp_append_from_")
_NO_VERSION_BUMP = torch.library.Library("kvarn", "IMPL")
for _name in _CACHE_OPS + ("tile_partials_", "tile_partials_triton_", "latent_tile_partials_",
                           "tune_observe_"):
    _NO_VERSION_BUMP.impl(_name, torch.library.fallthrough_kernel, "ADInplaceOrView",
                          allow_override=True)   # the default since torch 2.12


def register_plain_kernel(name: str, fn, dispatch_key: str) -> None:
    """Register ``fn`` as the ``dispatch_key`` kernel of the cache op ``name`` without
    custom_op's per-device Python wrapper (for ops that return nothing, whose aliasing
    check has nothing to check; the hot per-token ops)."""
    if name not in _CACHE_OPS:
        raise ValueError(f"Expected one of the cache ops {_CACHE_OPS}, but got {name!r}.")
    _NO_VERSION_BUMP.impl(name, fn, dispatch_key, allow_override=True)
