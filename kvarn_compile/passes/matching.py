"""Pairing an attention with the cache writes feeding its K and V, and the checks a pair passes.

:func:`_pair` traces each operand back to its cache (:func:`~kvarn_compile.passes.reads.trace_kv`),
takes the one recognized write into that cache (``CACHE_WRITES``), refuses sliding-window
caches, resolves the write against the layout the read found and checks heads, batch rows,
positions, dtypes and the mask, and that nothing else uses the cache (:func:`_check_readers`).
:func:`_read_kind` decides which positions the attention reads and kvarn::attention's causal
flag. The result is a :class:`_Match`; a failed check raises
:class:`~kvarn_compile.passes.fx_utils.Unsupported` with the reason the report shows, naming
the node where the chain from the cache broke.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from kvarn_compile.passes.attention_forms import AttentionSite, decompressed_latent
from kvarn_compile.passes.cache_writes import CacheWrite, resolve_write
from kvarn_compile.passes.fx_utils import (
    Unsupported, _noop_cast, concrete, describe, example, is_op, is_size_query, same_size,
)
from kvarn_compile.passes.reads import ChainBroken, KVRead, trace_kv
from kvarn_compile.passes.stacked_caches import LAYER_VIEW, is_layer_view
from kvarn_compile.passes.window_caches import refuse_sliding_window


@dataclasses.dataclass
class _Match:
    site: AttentionSite
    wk: CacheWrite
    wv: CacheWrite
    rk: KVRead
    rv: KVRead
    #: the cache axes holding batch, heads, positions, head dim (identity: [B, H, S, D])
    perm: tuple[int, int, int, int] = (0, 1, 2, 3)
    batch: int = 1
    #: how the attention reads the positions: "full" (the whole preallocated cache), "exact"
    #: (exactly the positions written so far), "prefix" (positions [0, lk) of a longer cache)
    read_kind: str = "full"
    lk: Any = None              # the key length the model's attention sees (int, SymInt or node)
    causal: bool = True         # kvarn::attention's causal flag (see _pair)
    #: a window read (cache[:, :, lo:end]): its first position (an int or the node computing
    #: it); kvarn::attention then reads [0, lk) with positions before ``lo`` masked out
    lo: Any = None


def _inplace_writes(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` (or of views of it) that write it in place."""
    out, frontier, seen = [], [node], {node}
    while frontier:
        x = frontier.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            if u.args and u.args[0] is x and (
                    is_op(u, "setitem", "index_put_") or (u.op == "call_method" and str(u.target).endswith("_"))):
                out.append(u)
            elif u.args and u.args[0] is x and (is_op(u, "getitem", "narrow") or _noop_cast(u)
                                                or (u.op == "call_method" and u.target in _VIEWS)):
                frontier.append(u)
    return out


#: view methods a write may go through (mistral-inference: cache.view(-1, H, D).index_copy_)
_VIEWS = ("view", "view_as", "reshape", "flatten", "unflatten", "transpose", "permute", "select",
          "squeeze", "unsqueeze", "swapaxes", "movedim", "as_strided", "expand", "unfold")


def _cache_upstream(node: fx.Node, writes: dict[fx.Node, list[CacheWrite]]) -> fx.Node | None:
    """A cache write that ``node`` is computed from (a recognized write's cache, or a tensor
    written in place), searched through ``node``'s inputs; None when there is none."""
    frontier, seen = [node], {node}
    while frontier and len(seen) < 400:
        x = frontier.pop(0)
        if x in writes:
            return writes[x][0].write_nodes[0]
        if x.op in ("placeholder", "call_function", "call_method"):
            found = _inplace_writes(x)
            if found:
                return found[0]
        for a in x.all_input_nodes:
            if a not in seen:
                seen.add(a)
                frontier.append(a)
    return None


#: tensors a graph makes itself (scratch buffers, not caches the model keeps between steps)
_FRESH = {"new_empty", "new_zeros", "new_full", "empty", "zeros", "full", "empty_like", "zeros_like"}


def _made_here(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_function", "call_method") and name in _FRESH


_NO_CACHE = ("its keys/values do not come from a recognized KV-cache update "
             "(attention without a cache, e.g. an encoder or a cache-less forward)")


def _trace(operand: Any, labels: list[str], which: str,
           writes: dict[fx.Node, list[CacheWrite]]) -> tuple[KVRead, CacheWrite]:
    """The read of ``operand`` back to its cache and the one write into that cache, or
    Unsupported with a reason that names the node where the chain from the cache broke."""
    try:
        read = trace_kv(operand, labels)
    except ChainBroken as err:
        refuse_sliding_window(err.node)     # keys a window cache keeps the newest W of
        write = _cache_upstream(err.node, writes)
        if write is None:
            raise Unsupported(_NO_CACHE) from None
        raise Unsupported(f"its {which} come from the KV cache written by {describe(write)}, but "
                          f"reach the attention through {describe(err.node)}, which {err.why}; "
                          "the pass does not follow that step") from None
    src = read.source
    refuse_sliding_window(src)              # a window cache (slice of the newest W, or roll)
    found = writes.get(src)
    if found:
        if len(found) > 1:
            raise Unsupported("the cache is written more than once in one step")
        return read, found[0]
    unknown = _inplace_writes(src)
    if unknown and _made_here(src):
        # a scratch tensor of this step filled in place (new_empty + copy_): its values come
        # from whatever the writes copy in, e.g. a projection of what a cache holds
        fed = [a for w in unknown for a in w.args[1:] if isinstance(a, fx.Node)]
        cache = next((c for c in map(lambda a: _cache_upstream(a, writes), fed) if c is not None), None)
        if cache is None:
            raise Unsupported(_NO_CACHE)
        raise Unsupported(f"its {which} are assembled in a tensor made in this step ({describe(src)}, "
                          f"filled by {describe(unknown[0])}) from what the KV cache written by "
                          f"{describe(cache)} holds, not read from that cache (e.g. a multi-head "
                          "latent attention cache decompressed on read); the pass rewrites "
                          "attention over cached keys and values themselves")
    if unknown:
        raise Unsupported(f"its {which[:-2] if which == 'values' else which[:-1]} cache is written by "
                          f"{describe(unknown[0])}, which the pass does not recognize as a KV-cache "
                          "update")
    write = _cache_upstream(src, writes) if src.op != "placeholder" else None
    if write is not None:
        raise Unsupported(f"its {which} come from the KV cache written by {describe(write)}, but "
                          f"reach the attention through {describe(src)}, which is not a view the "
                          "pass follows (transpose, slice, GQA expand/repeat, no-op cast)")
    raise Unsupported(_NO_CACHE)


def _same_positions(wk: CacheWrite, wv: CacheWrite) -> None:
    """The two writes (keys and values, or a latent and its RoPE key) start at one position."""
    if wk.start_kind != wv.start_kind or (
            wk.start_kind == "int" and not same_size(wk.start, wv.start)):
        raise Unsupported("keys and values are written at positions the pass cannot prove equal")
    if wk.start_kind == "positions" and wk.start is not wv.start:
        # two reads of one positions tensor (torchtune: k_cache[:, :, self.cache_pos[:T]] = k
        # and v_cache[:, :, self.cache_pos[:T]] = v, then self.cache_pos.add_(T))
        why = _different_values(wk.start, wv.start)
        if why is not None:
            raise Unsupported(f"keys and values are written at positions the pass cannot prove equal{why}")


def _pair(site: AttentionSite, writes: dict[fx.Node, list[CacheWrite]]) -> _Match:
    if site.latent is None:
        # keys and values decompressed from a latent cache on read (transformers'
        # DeepSeek-V2/V3 family): paired as the absorbed form over that cache
        site = decompressed_latent(site) or site
    if site.latent is not None:
        return _pair_latent(site, writes)
    rk, wk = _trace(site.k, site.k_labels, "keys", writes)
    rv, wv = _trace(site.v, site.v_labels, "values", writes)
    refuse_sliding_window(rk.source)
    if (wk.cache is None) != (wv.cache is None):
        raise Unsupported(f"keys and values use different cache updates ({wk.spelling} / {wv.spelling})")
    if rk.source is rv.source:
        raise Unsupported("keys and values share one cache tensor")
    if rk.axes != rv.axes:
        raise Unsupported("the key and value caches have different layouts")
    axes = rk.axes
    perm = (axes["b"], axes["h"], axes["s"], axes["d"])
    for w in (wk, wv):
        reason = resolve_write(w, axes["s"], axes["b"])
        if reason is not None:
            raise Unsupported(reason)
    if wk.cache is None and axes["b"] != 0:
        raise Unsupported("a torch.cat cache whose batch axis is not the first")
    for w in (wk, wv):
        if is_layer_view(w.cache) and "stacked" not in w.spelling:
            w.spelling += f" (layer {w.cache.meta[LAYER_VIEW][1]} of a cache stacked over layers)"
    _same_positions(wk, wv)
    qv, kraw, vraw = example(site.q), example(wk.new), example(wv.new)
    if qv is None or kraw is None or vraw is None or kraw.dim() != 4 or qv.dim() != 4 \
            or vraw.dim() != 4 \
            or tuple(kraw.shape[a] for a in perm[:3]) != tuple(vraw.shape[a] for a in perm[:3]):
        raise Unsupported("the new keys/values are not [batch, kv_heads, tokens, head_dim] of one "
                          "batch, head and token count")
    # (a size Dynamo made symbolic but knows the value of counts as that value)
    kn = [concrete(kraw.shape[a]) for a in perm]       # [B, H, T, D]
    dv = concrete(vraw.shape[perm[3]])                 # Dv (multi-head latent attention: not D)
    qs = [concrete(x) for x in ([qv.shape[a] for a in site.q_perm] if site.q_perm
                                  else list(qv.shape))]
    if any(not isinstance(x, int) for x in (kn[0], kn[1], kn[3], qs[1], dv)):
        raise Unsupported("dynamic batch, head or head_dim sizes (e.g. the same compiled model ran "
                          "with a second batch size); this graph runs in full precision - compile "
                          "a fresh model per batch size to keep the cache compressed")
    if qs[-1] != kn[-1] or qs[1] % kn[1]:
        raise Unsupported(f"query heads {qs[1]} / head_dim {qs[-1]} do not fit "
                          f"kv heads {kn[1]} / head_dim {kn[-1]}")
    if rk.repeat != rv.repeat or qs[1] % (kn[1] * rk.repeat):
        raise Unsupported(f"the keys are expanded to {kn[1] * rk.repeat} heads and the values to "
                          f"{kn[1] * rv.repeat}, for {qs[1]} query heads")
    if kn[-1] % 16 or dv % 16:
        raise Unsupported(f"head_dim {kn[-1]} (keys) / {dv} (values) is not a multiple of 16")
    out = example(site.out)
    if out is not None and all(isinstance(x, int) for x in (*out.shape, *qs)) \
            and out.numel() != qs[0] * qs[1] * qs[2] * dv:
        raise Unsupported(f"the attention output {tuple(out.shape)} is not [batch, query heads, "
                          f"queries, {dv}] (the values' head dim)")
    if out is None or out.dtype != qv.dtype:
        raise Unsupported(f"the attention output is {getattr(out, 'dtype', None)}, the queries "
                          f"{qv.dtype} (kvarn::attention returns the queries' dtype)")
    batch = kn[0]
    if not same_size(qs[0], batch):
        raise Unsupported(f"the queries have batch {qs[0]} and the new keys {batch}")
    for w, read in ((wk, rk), (wv, rv)):
        rows = read.batch if read.batch is not None else example(read.source).shape[axes["b"]]
        if not same_size(rows, batch):
            raise Unsupported(f"the attention reads {rows} batch rows of the cache and the update "
                              f"writes {batch}")
        _check_readers(site, w, read)
    tq = qs[2]
    if _known_different(kn[2], tq):
        raise Unsupported(f"the cache update writes {kn[2]} tokens for {tq} queries: not a "
                          "self-attention cache that grows with the queries (e.g. cross-attention "
                          "over an encoder's K/V, written once); it keeps its full-precision cache")
    m = _Match(site, wk, wv, rk, rv, perm, batch)
    _read_kind(m, tq, kn[2])
    _check_mask_shape(m, tq)
    return m


def _check_mask_shape(m: _Match, tq: Any) -> None:
    """The site's mask (if any) is [batch|1, heads|1, queries|1, the key length read]."""
    if m.site.mask is not None:
        ms = m.site.mask.shape()
        cols = m.lk if m.lo is None else example(m.lk) - example(m.lo)
        if ms is None or not 2 <= len(ms) <= 4 or not same_size(ms[-1], cols) \
                or not (same_size(ms[-2], tq) or same_size(ms[-2], 1)):
            raise Unsupported("the attention mask is not [batch|1, heads|1, queries, cache length]")


def _pair_latent(site: AttentionSite, writes: dict[fx.Node, list[CacheWrite]]) -> _Match:
    """:func:`_pair` for absorbed multi-head latent attention (``site.latent``): the latent
    cache (read by one score product and by the ·v product) becomes the state's keys, the
    RoPE key cache its values; both hold one head ([B, T, C] written in place, or
    [B, 1, T, C] written in place or grown by ``torch.cat``). Decides which query axis is
    heads and which queries (``LatentParts.resolve``)."""
    lat = site.latent
    ra, wa = _trace(site.k, site.k_labels, "latent keys", writes)
    rp, wp = _trace(lat.k_pe, lat.k_pe_labels, "RoPE keys", writes)
    rv, wv = _trace(site.v, site.v_labels, "values", writes)
    if rv.source is rp.source and rv.source is not ra.source:      # the second product reads the latent
        site.q, site.k, site.k_labels, lat.q_pe, lat.k_pe, lat.k_pe_labels = (
            lat.q_pe, lat.k_pe, lat.k_pe_labels, site.q, site.k, site.k_labels)
        lat.q_roles, lat.pe_roles = lat.pe_roles, lat.q_roles
        ra, wa, rp, wp = rp, wp, ra, wa
    if rv.source is not ra.source or wv is not wa:
        raise Unsupported("the ·v product reads neither cache the two score products read (in "
                          "absorbed multi-head latent attention the values are the latent)")
    if site.decompression is not None and site.decompression.stop is not None:
        # the attention reads a prefix of what it decompressed: that prefix of the caches
        if any(r.stop is not None or r.start is not None for r in (ra, rp, rv)):
            raise Unsupported("the attention reads a part of a part of the latent cache")
        ra.stop = rp.stop = rv.stop = site.decompression.stop
    if ra.source is rp.source:
        raise Unsupported("the latent and the RoPE key share one cache tensor")
    if ra.axes != rp.axes or ra.axes != rv.axes:
        raise Unsupported("the latent and RoPE key caches have different layouts")
    axes = ra.axes
    perm = (axes["b"], axes["h"], axes["s"], axes["d"])
    if (wa.cache is None) != (wp.cache is None):
        raise Unsupported(f"the latent and the RoPE key use different cache updates "
                          f"({wa.spelling} / {wp.spelling})")
    if wa.cache is None and (axes["h"] == 3 or axes["b"] != 0):
        raise Unsupported("a torch.cat latent cache without a heads axis, or whose batch axis "
                          "is not the first (the pass packs [B, 1, T, C] cat caches and "
                          "[B, T, C] caches written in place)")
    for w in (wa, wp):
        reason = resolve_write(w, axes["s"], axes["b"])
        if reason is not None:
            raise Unsupported(reason)
    _same_positions(wa, wp)
    for a, b, what in ((ra.stop, rv.stop, "up to"), (ra.start, rv.start, "from")):
        if (a is None) != (b is None) or (a is not None and not same_size(a, b)
                                          and _different_values(a, b) is not None):
            raise Unsupported(f"the scores and the ·v product read the latent {what} different positions")
    qv, pv, lraw, praw = example(site.q), example(lat.q_pe), example(wa.new), example(wp.new)
    ndim = 3 if axes["h"] == 3 else 4
    if any(x is None for x in (qv, pv, lraw, praw)) or qv.dim() != 4 or pv.dim() != 4 \
            or lraw.dim() != ndim or praw.dim() != ndim:
        raise Unsupported("the new latent / RoPE keys are not [batch, (1,) tokens, dim] like their caches")

    def sizes(x):               # [B, H, T, D] (H: 1 for a cache without a heads axis)
        return [1 if a >= x.dim() else concrete(x.shape[a]) for a in perm]

    (b, h, t, c), (bp, hp, tp, r) = sizes(lraw), sizes(praw)
    if h != 1 or hp != 1:
        raise Unsupported(f"the latent / RoPE key caches hold {h} / {hp} heads (absorbed "
                          "multi-head latent attention caches one for every query head)")
    if not same_size(bp, b) or not same_size(tp, t):
        raise Unsupported("the latent and the RoPE key are written for different rows or tokens")
    if any(not isinstance(x, int) for x in (b, c, r)):
        raise Unsupported("dynamic batch or latent sizes (e.g. the same compiled model ran "
                          "with a second batch size); this graph runs in full precision - compile "
                          "a fresh model per batch size to keep the cache compressed")
    # which of the queries' two free axes holds the heads: the other one has the tokens
    # written; where both do, the axis a mask broadcasts over (size 1) is the heads
    size = {role: concrete(qv.shape[i]) for i, role in enumerate(lat.q_roles)}
    tokens = [x for x in "xy" if same_size(size[x], t)]
    if lat.heads is not None:       # a product with a heads axis says which one it is
        tokens = ["y" if lat.heads == "x" else "x"]
    if len(tokens) == 2 and site.mask is not None:
        mv = example(site.mask.node)
        ms = (1,) * (4 - mv.dim()) + tuple(mv.shape) if mv is not None and mv.dim() <= 4 else None
        ones = [x for x in "xy" if ms is not None and ms[lat.score_roles.index(x)] == 1]
        tokens = [x for x in "xy" if x not in ones] if len(ones) == 1 else tokens
    if len(tokens) != 1:
        raise Unsupported(f"cannot tell the query heads from the queries (query axes of sizes "
                          f"{size['x']} and {size['y']} for {t} tokens written)")
    perms = lat.resolve("y" if tokens[0] == "x" else "x")
    site.q_perm, site.out_perm, lat.pe_perm = perms["q_perm"], perms["out_perm"], perms["pe_perm"]
    if site.mask is not None:
        site.mask.perm = perms["mask_perm"]
    qs = [concrete(qv.shape[a]) for a in site.q_perm]
    ps = [concrete(pv.shape[a]) for a in perms["pe_perm"]]
    dec = site.decompression          # (the queries' no-RoPE part, absorbed when rewritten)
    if qs[-1] != (c if dec is None else dec.nope) or ps[-1] != r or not same_size(qs[0], b) \
            or not same_size(ps[0], b) or ps[1] != qs[1] or not isinstance(qs[1], int) \
            or (dec is not None and dec.heads != qs[1]):
        raise Unsupported(f"the latent queries {qs} / RoPE queries {ps} do not fit a latent of "
                          f"{c} and a RoPE key of {r} channels")
    if c % 16 or r % 16:
        raise Unsupported(f"latent dim {c} / RoPE key dim {r} is not a multiple of 16")
    out = example(site.out)
    if out is None or out.dtype != qv.dtype or pv.dtype != qv.dtype:
        raise Unsupported(f"the attention output is {getattr(out, 'dtype', None)}, the queries "
                          f"{qv.dtype} / {pv.dtype} (kvarn::latent_attention returns the queries' dtype)")
    for w, read in ((wa, ra), (wp, rp)):
        rows = read.batch if read.batch is not None else example(read.source).shape[axes["b"]]
        if not same_size(rows, b):
            raise Unsupported(f"the attention reads {rows} batch rows of the cache and the update "
                              f"writes {b}")
    site.nodes = list(dict.fromkeys(site.nodes + rv.nodes))       # the ·v product's read goes too
    _check_readers(site, wa, ra)
    _check_readers(site, wp, rp)
    tq = qs[2]
    if _known_different(t, tq):
        raise Unsupported(f"the cache update writes {t} tokens for {tq} queries")
    m = _Match(site, wa, wp, ra, rp, perm, b)
    _read_kind(m, tq, t)
    _check_mask_shape(m, tq)
    return m


def _read_kind(m: _Match, tq: Any, t: Any) -> None:
    """Which positions the model's attention reads, and kvarn::attention's causal flag:

    * a cat cache, read whole: exactly the positions written; the model's own semantics;
    * the whole preallocated cache ("full"): unwritten slots are read too, so the model
      must hide them with a mask or is_causal; it is read causally, which hides nothing a
      causal mask shows;
    * positions [0, start + T) of a preallocated cache, the same end as the write
      (``cache[:bsz, :start_pos + seqlen]``, llama): exactly the positions written ("exact");
    * another prefix [0, n) (``k[..., :input_pos_maxp1, :]``, litgpt): like "full" with n
      slots; a mask is required (kvarn::attention raises if its n columns do not cover the
      positions held), unwritten slots are hidden causally.
    """
    site, w, r = m.site, m.wk, m.rk
    stop = r.stop
    if not same_size(stop, m.rv.stop) and not (stop is None and m.rv.stop is None):
        raise Unsupported("the keys and values are read up to different positions")
    if (r.start is None) != (m.rv.start is None) or (
            r.start is not None and not same_size(r.start, m.rv.start)
            and _different_values(r.start, m.rv.start) is not None):
        raise Unsupported("the keys and values are read from different positions")
    if w.cache is None:
        if stop is not None or r.start is not None:
            raise Unsupported("the attention reads part of a torch.cat cache")
        m.read_kind, m.causal, m.lk = "exact", site.is_causal, _key_len(site)
        return
    cap = example(w.cache).shape[m.perm[2]]
    if stop is None or same_size(stop, cap):
        m.read_kind, m.lk = "full", cap
    elif w.end is not None and same_size(stop, w.end):
        m.read_kind, m.lk = "exact", stop
    elif (w.start_kind == "positions" and isinstance(stop, int) and stop > 1 and same_size(stop, t)
          and site.is_causal and site.mask is None and same_size(tq, t)
          and site.form == "scaled_dot_product_attention"):
        # transformers sdpa_attention_forward, prefill of an empty StaticCache (Qwen2, Qwen3):
        #   key = key[:, :, :q_length, :]; sdpa(q, key, value, attn_mask=None, is_causal=True)
        # transformers only emits it when the mask was skipped because the cache is empty
        # (q_offset == 0, a Python int Dynamo guards on); then the first q_length slots are
        # exactly the tokens this step wrote, so attending the whole packed cache is the same.
        m.read_kind, m.lk = "full", stop
    else:
        m.read_kind, m.lk = "prefix", stop
    m.lo = r.start
    if m.lo is not None and site.mask is None and site.is_causal:
        # sdpa's is_causal aligns its mask to the top-left corner of the window read
        raise Unsupported(f"the attention reads a window [{getattr(m.lo, 'name', m.lo)}, ...) of "
                          "the cache with is_causal=True and no mask (causal from the window's "
                          "first position); the pass needs an explicit mask for a window read")
    if m.read_kind == "exact":
        m.causal = site.is_causal
        return
    if m.read_kind == "prefix" and site.mask is None:
        raise Unsupported(f"the attention reads positions [0, {getattr(stop, 'name', stop)}) of the "
                          "cache without a mask; the pass cannot tell which of them are written")
    if site.mask is None and not site.is_causal:
        raise Unsupported("no mask over a preallocated cache: the model attends unwritten slots")
    m.causal = True


#: View steps that never copy, even on the stride-0 handle a cat cache becomes: a shape
#: query on the end of a chain of these is answered from the handle (or the kept buffer).
_SHAPE_VIEWS = ("transpose", "permute", "getitem", "unsqueeze", "expand", "mT")


def _view_path(node: fx.Node, root: fx.Node) -> list[fx.Node] | None:
    """The view steps from ``root`` (excluded) to ``node`` (included) when each takes the
    previous one as its first argument and is a copy-free view (:data:`_SHAPE_VIEWS`, no-op
    casts); None otherwise."""
    path = []
    while node is not root:
        if not (isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node)
                and (is_op(node, *_SHAPE_VIEWS) or _noop_cast(node)
                     or (node.op == "call_function" and node.target is getattr
                         and node.args[1] == "mT"))):
            return None
        path.append(node)
        node = node.args[0]
    return path[::-1]


def _check_readers(site: AttentionSite, w: CacheWrite, read: KVRead) -> None:
    """The cache is used by this write and this read only (and, for a graph input, handed
    back unchanged as an output, e.g. ``self.cache_k = self.cache_k.to(x)``); the read's
    intermediate values (expanded heads, transposes) are used by the read only."""
    allowed = set(w.write_nodes) | set(read.nodes) | set(site.nodes)
    handed_back = w.cache is not None and w.cache.op == "placeholder"
    root = w.cache if w.cache is not None else w.full
    for node in read.nodes + [n for n in w.write_nodes if n.users and w.cache is not None]:
        for u in node.users:
            if u.op == "output" and handed_back and _noop_cast(node):
                continue                        # self.cache_k = self.cache_k.to(x): the input itself
            if is_size_query(u, node) and _view_path(node, root) is not None:
                continue                        # b, s, h, d = keys.shape: answered without the data
            if u not in allowed:
                raise Unsupported(f"the cache as the attention reads it ({describe(node)}) is also "
                                  f"used by {u.name} ({describe(u)})")
    frontier, seen = [root], {root}
    while frontier:
        x = frontier.pop()
        for u in x.users:
            if u in seen:
                continue
            if u in allowed:
                if u.args and u.args[0] is x and (_noop_cast(u) or is_op(u, "getitem")):
                    seen.add(u)
                    frontier.append(u)          # a view in the read: check its other users
                continue
            if u.op == "output":
                if w.cache is None or (root.op == "placeholder" and (x is root or _noop_cast(x))):
                    continue
                raise Unsupported("the graph returns the cache tensor itself")
            if is_size_query(u, x):
                continue                        # the shape only: the handle or buffer keeps it
            if u.args and u.args[0] is x and (_noop_cast(u) or is_op(u, "getitem")) \
                    and w.cache is not None:
                seen.add(u)
                frontier.append(u)
                continue
            raise Unsupported(f"the cache is also read by {u.name} ({describe(u)}); "
                              "rewriting would change what that reader sees")


def _key_len(site: AttentionSite) -> Any:
    """The number of keys of the attention's K operand (its positions axis)."""
    return example(site.k).shape[site.k_labels.index("s")]


def _known_different(a: Any, b: Any) -> bool:
    """``a != b`` provable at compile time (ints, or symbols whose value ranges exclude it:
    Dynamo specializes sizes 0 and 1, so a symbolic size is never 1)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a != b))
    except Exception:  # noqa: BLE001 - unknown: not provably different
        return False


#: ops whose result is a function of their arguments only (no randomness, no state)
_RANDOM = ("rand", "normal", "bernoulli", "multinomial", "dropout", "uniform", "poisson", "exponential")


def _different_values(a: Any, b: Any, depth: int = 8) -> str | None:
    """None when ``a`` and ``b`` provably hold one value: one node, or the same pure op on
    arguments that hold one value, with no in-place write to a tensor they read between the
    two; else a reason suffix ("" when nothing more specific can be said)."""
    leaves: set[fx.Node] = set()
    if not _same_expr(a, b, depth, leaves):
        return ""
    order = {n: i for i, n in enumerate(a.graph.nodes)}
    lo, hi = sorted((order[a], order[b]))
    for leaf in leaves:
        for w in _inplace_writes(leaf):
            if lo < order.get(w, -1) < hi:
                return (f" (the positions tensor is changed in place by {describe(w)} between "
                        "the two writes)")
    return None


def _same_expr(a: Any, b: Any, depth: int, leaves: set) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_expr(x, y, depth, leaves) for x, y in zip(a, b))
    if isinstance(a, slice) and isinstance(b, slice):
        return all(_same_expr(x, y, depth, leaves) for x, y in
                   ((a.start, b.start), (a.stop, b.stop), (a.step, b.step)))
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            return False
        return type(a) is type(b) and a == b
    if a is b:
        if a.op in ("placeholder", "get_attr") or isinstance(example(a), torch.Tensor):
            leaves.add(a)
        return True
    if depth == 0 or a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method"):
        return False
    name = str(getattr(a.target, "__name__", a.target))
    if name.endswith("_") or name == "setitem" or any(r in name for r in _RANDOM):
        return False
    if sorted(a.kwargs) != sorted(b.kwargs):
        return False
    return _same_expr(a.args, b.args, depth - 1, leaves) and all(
        _same_expr(a.kwargs[k], b.kwargs[k], depth - 1, leaves) for k in a.kwargs)
