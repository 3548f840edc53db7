"""Which packed state holds which KV cache: keyed on the cache itself, across every graph.

A model's cache is a tensor it owns (a preallocated buffer written in place, a transformers
``StaticCache`` layer) or a chain of ``cat`` results it passes from call to call (a
``DynamicCache``); a rewritten graph hands a ``cat`` cache back as a *handle* (a tensor of
the cache's shape holding the batch-row tags, see :mod:`kvarn_compile.passes.rewrite`).
The backend keys each packed state on that cache, never on a site name: a
:class:`CacheToken` rides on the cache's tensors (their ``__dict__``, and for handles their
storage too, so a ``crop`` view keeps it), so

* every graph that writes or reads one cache uses one state, whatever its sites are called
  (two layers calling one attention helper with their own caches get two states; a prefill
  and a decode written on different source lines share one);
* ``copy.deepcopy`` of a cache copies its packed state (prefix reuse), a new cache gets a
  fresh state, and a dropped cache gives its state back for reuse;
* a graph that reads a packed cache **without** the kvarn ops (a form the pass leaves
  unchanged, a graph break before the attention) is caught before it runs
  (:meth:`CacheBook.guard`): the cache is materialized back — dequantized into the model's
  own buffer (the next rewritten call adopts it again), or passed dequantized in place of a
  handle — and the report says so; where that is impossible it stops with a one-line error
  before anything is computed. A cache is packed everywhere or nowhere;
* plain PyTorch between compiled calls (an uncompiled forward, ``force_eager``, a helper
  run outside ``torch.compile``) is held to the same rule: between calls a handle is a
  :class:`PackedHandle` and a model-owned buffer whose tokens are packed a
  :class:`PackedBuffer`, whose ``__torch_function__`` gives such code the packed tokens
  dequantized (the next compiled call packs the cache again), or stops it with a one-line
  error. Compiled graphs see plain tensors (Dynamo traces through the type; the backend's
  runtime passes them to the compiled code untyped, :class:`plain_inputs`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvarn_compile._torch_compat import plain_tensor_functions
from kvarn_compile.ops.append import crop_, materialize
from kvarn_compile.passes.rewrite import CacheLocation
from kvarn_compile.state import LayerState, field_indices

__all__ = ["CacheBook", "CacheToken", "CallMemo", "TOKEN", "LAYER_TOKENS", "token_of", "PackedHandle",
           "PackedBuffer", "plain_inputs"]

#: the attribute naming a packed cache's :class:`CacheToken` on its tensors and storages
TOKEN = "_kvarn_cache"


class CacheToken:
    """One packed cache: the state holding its tokens, and where the model keeps it.

    The cache's tensors carry ``(token, role)`` (role ``"k"`` or ``"v"``). Deep-copying a
    tensor that carries it (``copy.deepcopy(cache)``) copies the packed state once per copy
    (both roles share the copy)."""

    def __init__(self, book: "CacheBook", state: LayerState, loc: CacheLocation, graph: int):
        self.book = book
        self.state = state
        self.kind = loc.kind
        self.site = loc.site
        self.perm = loc.perm
        self.batch = loc.batch
        self.adopts = loc.adopts
        self.graph = graph
        #: chain: the tokens the newest handle stands for
        self.length = 0
        #: chain: counts the calls that reordered the state's rows or cropped its tokens (a
        #: handle moved in plain torch before such a call no longer describes the state)
        self.edits = 0
        #: buffer: roles dequantized into the model's buffers by :meth:`CacheBook.guard`;
        #: while any is, the buffers hold the tokens and the next rewritten call adopts them
        self.materialized: set[str] = set()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # torch.save / pickle of a cache tensor: the packed state is not part of the tensor's
        # data (the tensor saves what it holds); the copy carries no token
        return _no_token, ()

    def __deepcopy__(self, memo: dict) -> "CacheToken":
        new = object.__new__(CacheToken)
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        new.materialized = set(self.materialized)
        new.state = self.book.clone(self.state, self.site)
        new.book.bind(new.state, new)
        return new


def _no_token() -> None:
    return None


class PackedHandle(torch.Tensor):
    """The type of a ``cat`` cache's handle once a compiled call returned it.

    A handle holds batch-row tags, not keys or values (the packed state holds the tokens).
    Compiled graphs only ask its shape; plain PyTorch may move it around (``crop`` slices,
    beam-search ``index_select``, ``repeat_interleave``, ``copy.deepcopy``, ``.to()``: the
    results are handles again). Plain PyTorch that combines it with real data — an uncompiled
    forward's ``torch.cat([past, new])``, its attention — gets the packed tokens dequantized
    in its place (the next compiled call packs that cache again), or, where the handle no
    longer names its packed rows, a one-line error before anything is computed."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            with plain_tensor_functions():
                return func(*args, **kwargs)
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        if any(isinstance(t, torch.Tensor) and not isinstance(t, PackedHandle)
               and t.is_floating_point() for t in flat):
            # real data meets a handle: the handle's tokens, dequantized, in its place (a
            # write of real data into the handle itself would land in that copy: refused)
            name = getattr(func, "__name__", str(func))
            if isinstance(args[0] if args else None, PackedHandle) and (
                    func is torch.Tensor.__setitem__ or (name.endswith("_") and not name.startswith("__"))):
                raise RuntimeError(
                    f"kvarn_backend: {name}() outside the compiled model writes into a KV cache "
                    "handle, which holds no keys or values (the packed state does); write "
                    "through the compiled model, or start a new cache.")
            dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            flat = [_dequantized_handle(t, func, dense) if isinstance(t, PackedHandle) else t
                    for t in flat]
            args, kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
            with plain_tensor_functions():
                return func(*args, **kwargs)
        with plain_tensor_functions():
            out = _along_batch(func, args, kwargs)
            if out is None:
                out = func(*args, **kwargs)
            source = next((r for r in map(_source_of, flat) if r is not None), None)
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: _derived(t, source) if t.is_floating_point() else t, out)

    def __deepcopy__(self, memo: dict) -> "PackedHandle":
        # a plain tensor's deep copy (its storage, its token: the packed state copied), typed
        self.__class__ = torch.Tensor
        try:
            new = copy.deepcopy(self, memo)
        finally:
            self.__class__ = PackedHandle
        return _as_handle(new)


class PackedBuffer(torch.Tensor):
    """The type of a model-owned cache tensor (a preallocated buffer, a ``StaticCache``
    layer) whose tokens a packed state holds, between compiled calls.

    The rewritten graphs neither read nor write it (on CPU its memory is given back and reads
    zeros). Plain PyTorch touching it — an uncompiled forward's write or read, a reset —
    first gets the packed tokens dequantized into it (the buffer is a plain tensor again, and
    the next compiled call packs what it holds then); a whole-tensor ``zero_()``/``fill_()``
    skips the dequantization. Where the compiled graph cannot take the buffer's tokens back,
    a one-line error comes before anything is computed. Shape, dtype, device and storage
    queries pass through."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.compiler.is_compiling() and func not in _METADATA:
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, PackedBuffer):
                    _unpack_buffer(t, func, args)
        with plain_tensor_functions():
            return func(*args, **kwargs)


#: tensor queries and constructors that read no data (they pass a packed buffer through)
_METADATA = frozenset(
    [getattr(torch.Tensor, n) for n in (
        "size", "dim", "stride", "numel", "nelement", "ndimension", "storage_offset",
        "is_contiguous", "element_size", "data_ptr", "untyped_storage", "get_device",
        "is_pinned", "__len__", "__hash__",
        # what Dynamo asks of a graph input while it describes it for its fake copy (with
        # torch 2.11 outside is_compiling(), on every recompile)
        "_is_view", "is_floating_point", "is_complex", "is_inference", "is_conj", "is_neg",
        "_is_zerotensor", "dense_dim", "sparse_dim") if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n).__get__ for n in (
        "shape", "dtype", "device", "ndim", "layout", "requires_grad", "grad_fn", "grad",
        "_version", "_base", "itemsize", "nbytes") if hasattr(torch.Tensor, n)]
    # every is_* property (is_cuda, is_sparse, is_mkldnn, ...: what a fake copy is made from)
    + [getattr(torch.Tensor, n).__get__ for n in dir(torch.Tensor) if n.startswith("is_")
       and isinstance(inspect.getattr_static(torch.Tensor, n), types.GetSetDescriptorType)]
    # new tensors shaped like it (a second request's cache): they read none of its data
    + [getattr(torch, n) for n in ("zeros_like", "ones_like", "empty_like", "full_like",
                                   "rand_like", "randn_like", "randint_like")]
    + [getattr(torch.Tensor, n) for n in ("new_zeros", "new_ones", "new_empty", "new_full")])


def _packed_refs(t: torch.Tensor) -> list[tuple["CacheToken", str, int | None]]:
    """``(token, role, layer)`` of every packed state whose tokens model-owned buffer ``t``
    stands for and does not hold (not materialized): its own, or for a cache stacked over
    layers one per packed layer (``layer``: the index of ``t``'s first axis)."""
    refs = []
    ref = t.__dict__.get(TOKEN)
    if ref is not None and ref[0] is not None and ref[0].kind == "buffer" \
            and ref[1] not in ref[0].materialized:
        refs.append((ref[0], ref[1], None))
    for layer, (token, role) in sorted(t.__dict__.get(LAYER_TOKENS, {}).items()):
        if token is not None and token.kind == "buffer" and role not in token.materialized:
            refs.append((token, role, layer))
    return refs


def _unpack_buffer(t: torch.Tensor, func: Any, args: Any) -> None:
    refs = _packed_refs(t)
    reset = func in (torch.Tensor.zero_, torch.Tensor.fill_) and bool(args) and args[0] is t
    stuck = [token for token, _, _ in refs if not token.adopts]
    if stuck and not reset:
        raise RuntimeError(
            f"kvarn_backend: {getattr(func, '__name__', func)}() outside the compiled model "
            f"touches the KV cache of {stuck[0].site}, but graph {stuck[0].graph} keeps that "
            "cache packed and cannot take tokens written there back; run this call compiled, "
            "or leave the model uncompiled.")
    t.__class__ = torch.Tensor                   # a plain tensor from here on
    if not refs:
        return
    for token, role, _ in refs:
        token.materialized.add(role)
    _changed()
    if reset:
        return                                   # a reset needs none of the packed tokens
    dense: dict = {}
    for token, role, layer in refs:
        _materialize_buffer(token, role, t if layer is None else t[layer], dense)
    refs[0][0].book._note(f"{refs[0][0].site}: a call outside the compiled model touched its "
                          "packed KV cache: it was dequantized into the model's buffer first, "
                          "and the next compiled call packs what the buffer holds then")


def _bhsd(t: torch.Tensor, perm: tuple[int, int, int, int]) -> torch.Tensor:
    """A model's cache tensor as a [B, H, S, D] view; a cache without a heads axis (3-D: a
    multi-head latent attention latent) has a virtual trailing one of size one."""
    return (t.unsqueeze(-1) if t.dim() == 3 else t).permute(perm)


def _materialize_buffer(token: "CacheToken", role: str, t: torch.Tensor, dense: dict) -> None:
    """Write ``token``'s packed tokens, dequantized, into the model's buffer ``t``."""
    if id(token) not in dense:
        dense[id(token)] = materialize(token.state.buffers, dtype=t.dtype)
    full = dense[id(token)][0 if role == "k" else 1]                         # [B, H, cap, D]
    view = _bhsd(t, token.perm)[:token.batch]
    n = min(view.shape[2], full.shape[2])
    with torch.no_grad():
        view[:, :, :n].copy_(full[:, :, :n])


class plain_inputs:
    """Around a compiled call: the packed cache tensors among ``args[indices]`` are plain
    tensors while it runs (its runtime dispatches them to custom ops, which take no
    subclass), typed again afterwards, also when it raises."""

    def __init__(self, args: list[Any], indices: tuple[int, ...]):
        self.typed = [(args[i], type(args[i])) for i in indices
                      if type(args[i]) in (PackedBuffer, PackedHandle)]
        self.changes = _CHANGES[0]

    def __enter__(self) -> None:
        for t, _ in self.typed:
            t.__class__ = torch.Tensor

    def __exit__(self, *exc: Any) -> None:
        if self.changes == _CHANGES[0]:       # no token stamped or materialized meanwhile
            for t, cls in self.typed:
                if type(t) is torch.Tensor:
                    t.__class__ = cls
            return
        for t, cls in self.typed:
            if type(t) is torch.Tensor:
                if cls is PackedHandle:
                    t.__class__ = PackedHandle
                else:
                    _as_packed_buffer(t)


def _as_packed_buffer(t: Any) -> None:
    if type(t) is torch.Tensor and _packed_refs(t):
        t.__class__ = PackedBuffer


#: ops that pick or repeat a handle's batch rows (beam search's reorder, batch selection)
_BATCH_OPS = (torch.Tensor.index_select, torch.index_select, torch.Tensor.repeat_interleave,
              torch.repeat_interleave, torch.Tensor.__getitem__)


def _along_batch(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``func`` (one of :data:`_BATCH_OPS`) picking or repeating the batch rows (dim 0) of a
    handle that holds one value per row (stride 0 elsewhere), done on those values only: the
    result is again a handle of one value per row, not a full-size tensor. None: any other
    call (done as it is)."""
    if func not in _BATCH_OPS or not args or not isinstance(args[0], torch.Tensor):
        return None
    t, rest = args[0], list(args[1:])
    if t.dim() < 2 or any(t.stride(d) for d in range(1, t.dim())):
        return None
    rows = t[(slice(None),) + (slice(0, 1),) * (t.dim() - 1)]                # [B, 1, ..]
    if func is torch.Tensor.__getitem__:
        index = rest[0] if rest else None
        if isinstance(index, tuple):
            if any(i is not Ellipsis and i != slice(None) for i in index[1:]):
                return None
            index = index[0] if index else None
        if not isinstance(index, (torch.Tensor, list)):
            return None
        out = rows[index]
    else:
        dim = kwargs.get("dim", rest[0] if func in (torch.Tensor.index_select, torch.index_select)
                         else (rest[1] if len(rest) > 1 else None))
        if dim not in (0, -t.dim()):
            return None
        out = func(rows, *rest, **kwargs)
    if out.dim() != t.dim():
        return None
    return out.expand(out.shape[0], *t.shape[1:])


def _source_of(t: Any) -> tuple["CacheToken", str] | None:
    """The chain ``t`` (a handle, or one moved in plain torch) belongs to, else None."""
    if not isinstance(t, PackedHandle):
        return None
    return token_of(t) or t.__dict__.get(DERIVED)


def _derived(t: torch.Tensor, source: tuple["CacheToken", str] | None) -> torch.Tensor:
    """A handle made from another in plain torch (a reorder, a selection, a copy): typed, and
    naming the chain it came from unless it is a view that carries the chain's token."""
    _as_handle(t)
    if source is not None and token_of(t) is None:
        # (token, role, the token's edits then): a read in plain torch checks that no call
        # reordered or cropped the chain's state since
        t.__dict__.setdefault(DERIVED, (*source[:2], source[2] if len(source) > 2 else source[0].edits))
    return t


def _as_handle(t: torch.Tensor) -> torch.Tensor:
    if type(t) is torch.Tensor:
        t.__class__ = PackedHandle
    return t


def _derived_rows(t: torch.Tensor) -> tuple[tuple["CacheToken", str], list[int]] | None:
    """For a handle moved along the batch in plain torch (beam search's reorder, a selection,
    a repeat): the chain it came from and the rows it names (its tags), while that chain's
    state still holds those rows as they were (no call reordered or cropped it since)."""
    source = t.__dict__.get(DERIVED)
    if source is None or source[0].kind != "chain" or source[2] != source[0].edits:
        return None
    token = source[0]
    with plain_tensor_functions():
        tags = _row_tags(t, token.perm[2], token.perm[0])
    if tags is None or max(tags) >= token.state.batch:
        return None
    return (token, source[1]), tags


def _dequantized_handle(t: torch.Tensor, func: Any, dense: dict) -> torch.Tensor:
    name = getattr(func, "__name__", str(func))
    ref, rows = token_of(t), None
    if ref is None or ref[0].kind != "chain":
        derived = _derived_rows(t)
        if derived is None:
            raise RuntimeError(
                f"kvarn_backend: {name}() outside the compiled model read a KV cache handle that "
                "no longer names its packed rows (moved in plain PyTorch before a compiled call "
                "reordered or cropped the cache): it holds no keys or values; run this forward "
                "compiled, or start a new cache.")
        ref, rows = derived
    token, role = ref
    out = _dequantized(token, role, t, dense, rows)
    if out is None:
        raise RuntimeError(
            f"kvarn_backend: {name}() outside the compiled model read the KV cache of "
            f"{token.site} with shape {tuple(t.shape)}, but its packed state holds another "
            "shape (a view of the handle); run this forward compiled, or start a new cache.")
    token.book._note(f"{token.site}: a call outside the compiled model read its packed KV "
                     "cache: it was passed dequantized, and the next compiled call packs the "
                     "cache it made again")
    return out


def _dequantized(token: "CacheToken", role: str, t: torch.Tensor, dense: dict,
                 rows: list[int] | None = None) -> torch.Tensor | None:
    """The first ``len(t)`` tokens of ``token``'s state (of its batch ``rows``, in that
    order, if given), dequantized in ``t``'s layout and dtype (``dense`` caches one
    materialization per state and call); None when ``t`` is not shaped like them."""
    if id(token) not in dense:
        dense[id(token)] = materialize(token.state.buffers, dtype=t.dtype)
    full = dense[id(token)][0 if role == "k" else 1]                         # [B, H, cap, D]
    if rows is not None:
        full = full[torch.tensor(rows, device=full.device)]
    n = t.shape[token.perm[2]]
    inverse = [token.perm.index(a) for a in range(4)]
    value = full[:, :, :n].permute(inverse).contiguous()
    return value if value.shape == t.shape else None


#: the attribute naming the chain ``(token, role)`` a handle moved in plain torch came from
#: (its batch rows reordered, selected or repeated: it holds their tags, not the chain's token)
DERIVED = "_kvarn_derived_from"

#: the attribute of a cache stacked over layers: layer -> ``(token, role)``
LAYER_TOKENS = "_kvarn_layer_caches"


def token_of(t: Any, layer: int | None = None) -> tuple[CacheToken, str] | None:
    """The ``(token, role)`` a tensor carries, on itself or (a view of a handle: ``crop``)
    on its storage; for a cache stacked over layers, the one of ``layer``; None for any
    other tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    if layer is not None:
        ref = t.__dict__.get(LAYER_TOKENS, {}).get(layer)
        return ref if ref is not None and ref[0] is not None else None
    ref = t.__dict__.get(TOKEN)
    if ref is None and t.dim() and 0 in t.stride():
        ref = getattr(t.untyped_storage(), TOKEN, None)
    return ref if ref is not None and ref[0] is not None else None


#: bumped whenever a cache tensor gets a token or a packed buffer is materialized back
#: (:class:`CallMemo` trusts a call's states only while it is unchanged)
_CHANGES = [0]


def _changed() -> None:
    _CHANGES[0] += 1


def _stamp(t: torch.Tensor, token: CacheToken, role: str, storage: bool,
           layer: int | None = None) -> None:
    _changed()
    if layer is not None:       # one stacked tensor holds every layer's cache
        t.__dict__.setdefault(LAYER_TOKENS, {})[layer] = (token, role)
        return
    t.__dict__[TOKEN] = (token, role)
    if storage:
        setattr(t.untyped_storage(), TOKEN, (token, role))


@dataclasses.dataclass
class _Site:
    """One rewritten site of one compiled graph, as the runtime sees it."""

    name: str
    geometry: dict[str, Any]
    loc: CacheLocation
    graph: int


class CacheBook:
    """The packed states of one backend, keyed on the caches that hold them.

    ``allocate(name, **geometry)`` makes a new state, ``reset(state)`` empties one,
    ``note(text)`` adds a report note; :attr:`live` holds every state made here that a live
    cache (or the free list) still holds."""

    def __init__(self, allocate: Callable[..., LayerState], note: Callable[[str], None],
                 reset: Callable[[LayerState], None]):
        self._allocate = allocate
        self.live: dict[Any, LayerState] = {}
        self._note = note
        self._reset = reset
        #: site name -> states that no live cache holds (reused before allocating)
        self._free: dict[str, list[LayerState]] = {}
        #: id(state) -> weak reference to the token holding it
        self._owner: dict[int, weakref.ref] = {}
        #: site name -> the newest chain token (a reordered handle copy carries none)
        self._last_chain: dict[str, CacheToken] = {}
        self._serial = 0

    # ------------------------------------------------------------------ states
    def offer(self, name: str, state: LayerState) -> None:
        """A state allocated at compile time for site ``name``, free for the first cache."""
        if id(state) not in self._owner and all(s is not state for s in self._free.get(name, ())):
            self._free.setdefault(name, []).append(state)

    def clone(self, state: LayerState, name: str) -> LayerState:
        """A copy of ``state`` (``copy.deepcopy`` of a cache)."""
        new = dataclasses.replace(state, buffers=[b.clone() for b in state.buffers])
        self._keep(name, new)
        return new

    def bind(self, state: LayerState, token: CacheToken) -> None:
        self._owner[id(state)] = weakref.ref(token)
        weakref.finalize(token, self._release, token.site, state)

    def _keep(self, name: str, state: LayerState) -> None:
        self._serial += 1
        self.live[(name, self._serial)] = state

    def _release(self, name: str, state: LayerState) -> None:
        """The cache holding ``state`` is gone: the state is free for the next cache of
        its site (one free state per site is kept; more go)."""
        self._owner.pop(id(state), None)
        free = self._free.setdefault(name, [])
        if any(s.max_len == state.max_len and s.batch == state.batch for s in free):
            for key, st in list(self.live.items()):
                if st is state:
                    del self.live[key]
        else:
            free.append(state)

    def _fresh(self, site: _Site) -> LayerState:
        """A state for a cache seen for the first time: a free one of the site's geometry,
        else a new one."""
        g = site.geometry
        for st in self._free.get(site.name, []):
            if _fits(st, g) and st.sink_k.device == torch.device(g["device"]):
                self._free[site.name] = [s for s in self._free[site.name] if s is not st]
                self._reset(st)
                return st
        state = self._allocate(site.name, **g)
        self._keep(site.name, state)
        return state

    def _new_token(self, site: _Site) -> CacheToken:
        token = CacheToken(self, self._fresh(site), site.loc, site.graph)
        self.bind(token.state, token)
        return token

    # ------------------------------------------------------------------ per call
    def resolve(self, site: _Site, args: list[Any], fallback: Callable[[], LayerState]) -> LayerState:
        """The state of ``site`` for this call, from the cache tensors in ``args``."""
        loc = site.loc
        if loc.kind == "buffer":
            if loc.k_input is None or loc.v_input is None:
                return fallback()
            k, v = args[loc.k_input], args[loc.v_input]
            ref = token_of(k, loc.layer)
            if ref is None or not _fits(ref[0].state, site.geometry):
                token = self._new_token(site)
                _stamp(k, token, "k", False, loc.layer)
                _stamp(v, token, "v", False, loc.layer)
                return token.state
            token = ref[0]
            if token.materialized:
                # a full-precision graph ran on the model's buffers: they hold the tokens
                # now; the append (kvarn::append_from_) adopts them into the restarted state
                self._reset(token.state)
                token.materialized.clear()
                _changed()
            return token.state
        return self._resolve_chain(site, args)

    def _resolve_chain(self, site: _Site, args: list[Any]) -> LayerState:
        loc = site.loc
        past = args[loc.k_input] if loc.k_input is not None else None
        ref = token_of(past)
        axis = loc.perm[2]
        if ref is not None and _fits(ref[0].state, site.geometry):
            token = ref[0]
            held = past.shape[axis]
            if held < token.length:          # a cropped cache (DynamicCache.crop)
                token.state.make_room_to_crop()
                crop_(token.state.buffers, torch.full_like(token.state.lengths, held))
                token.length = held
                token.edits += 1
            self._last_chain[site.name] = token
            return token.state
        if isinstance(past, torch.Tensor) and past.numel():
            # the chain a handle moved in plain torch came from (else this site's newest)
            source = past.__dict__.get(DERIVED)
            last = source[0] if source is not None else self._last_chain.get(site.name)
            tags = _row_tags(past, axis, loc.perm[0])
            if tags is not None:
                if last is not None and _fits(last.state, site.geometry) \
                        and max(tags) < last.state.batch:
                    self._last_chain[site.name] = last
                    if tags != list(range(len(tags))):
                        last.edits += 1       # this call's graph reorders the rows
                    return last.state         # the handle, reordered along the batch (beam search)
                if last is not None and self._regroup(site, args, last, tags, past):
                    return self._last_chain[site.name].state
                raise RuntimeError(
                    f"kvarn_backend: {site.name} got a cache handle changed along the batch in a "
                    "way the packed state cannot follow (batch_repeat_interleave, "
                    "batch_select_indices, or handles of another graph); it holds no keys or "
                    "values. Start from an empty cache with the batch size you need.")
            # a past holding real keys and values (a forward that was not rewritten made it):
            # a new packed sequence starts from them
            token = self._new_token(site)
            pv = args[loc.v_input] if loc.v_input is not None else None
            if pv is None:
                raise RuntimeError(
                    f"kvarn_backend: {site.name} continues a cache the compiled model did not pack, "
                    "but its past values are not a graph input, so they cannot be adopted. Start "
                    "from an empty cache, or compile the forward that made this one.")
            self._adopt_past(token, past, pv)
            self._last_chain[site.name] = token
            return token.state
        token = self._new_token(site)
        self._last_chain[site.name] = token
        return token.state

    def _regroup(self, site: _Site, args: list[Any], last: CacheToken, tags: list[int],
                 past: torch.Tensor) -> bool:
        """A handle whose batch rows were selected or repeated (``batch_select_indices``,
        ``batch_repeat_interleave``): row i holds the tag of the packed row it continues. A new
        packed state of this call's batch takes those rows of ``last``'s state, and the
        handles passed in are re-tagged 0..B-1 in place, so the graph's own reorder (beam
        search) finds nothing left to do. False when this cannot be done faithfully."""
        loc, old = site.loc, last.state
        pv = args[loc.v_input] if loc.v_input is not None else None
        g = site.geometry
        handles = [t for t in (past, pv) if isinstance(t, torch.Tensor)]
        if old.context_parallel or max(tags) >= old.batch or len(tags) != g["batch"] \
                or not _fits(old, dict(g, batch=old.batch)):
            return False
        idx = torch.tensor(tags, device=old.sink_k.device)
        state = dataclasses.replace(old, buffers=[b.index_select(0, idx) for b in old.buffers])
        token = CacheToken(self, state, loc, site.graph)
        token.length = past.shape[loc.perm[2]]
        self._keep(site.name, state)
        self.bind(state, token)
        batch_axis = loc.perm[0]
        for t in handles:                      # the rows now are in order: tags 0..B-1
            shape = [1] * t.dim()
            shape[batch_axis] = t.shape[batch_axis]
            tags = torch.arange(t.shape[batch_axis], dtype=t.dtype, device=t.device).view(shape)
            if 0 in t.stride():                # one value per row (a reorder in plain torch)
                t.set_(tags.expand_as(t))
            else:
                t.copy_(tags.expand_as(t))
        self._last_chain[site.name] = token
        self._note(f"{token.site}: the cache's batch rows were selected or repeated "
                   f"({old.batch} -> {len(tags)} rows); the packed rows followed")
        return True

    def _derived_handle(self, t: Any) -> bool:
        """``t`` is shaped like a cat-cache handle of a packed chain (its heads, head dim and
        length, any batch) and holds row tags naming rows of that chain's state: a handle
        the compiled model returned, reordered, selected or repeated along the batch."""
        if isinstance(t, PackedHandle):       # moved in plain torch after a compiled call
            return True
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not _holds_row_tags(t):
            return False
        for token in self._last_chain.values():
            p, st = token.perm, token.state
            if t.shape[p[1]] == st.kv_heads and t.shape[p[2]] == token.length \
                    and t.shape[p[3]] in (st.head_dim, st.value_head_dim) \
                    and int(t.reshape(t.shape[0], -1)[:, 0].max()) < st.batch:
                return True
        return False

    def _adopt_past(self, token: CacheToken, pk: torch.Tensor, pv: torch.Tensor) -> None:
        state, perm = token.state, token.perm
        k, v = (_bhsd(x, perm) for x in (pk, pv))
        n = k.shape[2]
        state.reserve(n, fresh=True)
        start = torch.zeros(k.shape[0], dtype=torch.int64, device=k.device)
        torch.ops.kvarn.append_(state.buffers, k, v, start, state.config.op_method,
                                state.config.sinkhorn_iters, state.config.recent_window, 0,
                                state.config.check_finite, token.site)
        state.trim()
        token.length = n
        self._note(f"{token.site}: a cache a full-precision forward filled ({n} tokens) was "
                   "adopted into the packed state")

    def after(self, sites: list[tuple[_Site, LayerState]], out: Any, args: list[Any]) -> None:
        """Tag the handles a call returned with their chain's token; type the model-owned
        buffers it packed (:class:`PackedHandle`, :class:`PackedBuffer`)."""
        values = out if isinstance(out, (tuple, list)) else (out,)
        for site, state in sites:
            loc = site.loc
            if loc.kind == "buffer":
                for i in (loc.k_input, loc.v_input):
                    if i is not None:
                        _as_packed_buffer(args[i])
            if loc.kind != "chain" or not (loc.k_outputs or loc.v_outputs):
                continue
            token = self._last_chain.get(site.name)
            if token is None or token.state is not state:
                continue
            for role, where in (("k", loc.k_outputs), ("v", loc.v_outputs)):
                for i in where:
                    h = values[i]
                    if isinstance(h, torch.Tensor):
                        _stamp(h, token, role, True)
                        token.length = h.shape[loc.perm[2]]
                        _as_handle(h)

    # ------------------------------------------------------------------ the invariant
    def guard(self, args: list[Any], candidates: list[int], graph: int, why: str) -> list[Any]:
        """Before a graph runs: every packed cache among ``args[candidates]`` (inputs the
        graph reads without the kvarn ops) is materialized back, or the call is refused."""
        out = None
        dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in candidates:
            _refuse_stacked(args[i], graph, why)
            ref, rows = token_of(args[i]), None
            if ref is None:
                # a handle moved along the batch in plain torch: the rows it names
                derived = _derived_rows(args[i]) if isinstance(args[i], PackedHandle) else None
                if derived is None:
                    if self._derived_handle(args[i]):
                        raise RuntimeError(
                            f"kvarn_backend: graph {graph} reads in full precision ({why}) a "
                            "cache tensor that holds the batch-row tags of a packed cache (a "
                            "handle moved along the batch before a compiled call reordered or "
                            "cropped that cache, or one this backend did not make), not keys or "
                            "values; compile the model so that every forward's attention is "
                            "rewritten, or start a new cache.")
                    continue
                ref, rows = derived
            token, role = ref
            t = args[i]
            if token.kind == "buffer" and not token.adopts:
                raise RuntimeError(
                    f"kvarn_backend: graph {graph} reads the KV cache of {token.site} in full "
                    f"precision ({why}), but graph {token.graph} keeps that cache packed and "
                    "cannot take tokens written there back; compile the model so that every "
                    "forward's attention is rewritten, or leave it uncompiled.")
            if token.kind == "buffer" and role in token.materialized:
                continue
            if token.kind == "buffer":
                _materialize_buffer(token, role, t, dense)
                token.materialized.add(role)
                _changed()
                t.__class__ = torch.Tensor if type(t) is PackedBuffer else type(t)
                self._note(f"graph {graph} reads the packed KV cache of {token.site} in full "
                           f"precision ({why}): it is dequantized into the model's buffer before "
                           "such a call and packed again by the next rewritten one")
            else:
                value = _dequantized(token, role, t, dense, rows)
                if value is None:
                    raise RuntimeError(
                        f"kvarn_backend: graph {graph} reads the KV cache of {token.site} in full "
                        f"precision ({why}) with shape {tuple(t.shape)}, which is not the shape "
                        "of the tokens its packed state holds; start a new cache for this call.")
                out = list(args) if out is None else out
                out[i] = value
                self._note(f"graph {graph} reads the packed KV cache of {token.site} in full "
                           f"precision ({why}): it is passed dequantized to such a call")
        return args if out is None else out


class CallMemo:
    """The states one compiled graph's sites resolved to on its last call, for a graph whose
    every site keeps a model-owned buffer packed (a static cache's decode step).

    While the next call passes the very same buffer tensors (same objects, same storage,
    version counters unchanged: nothing wrote them) and no cache tensor anywhere got a token
    or was materialized back since, the call resolves to the same states and has nothing to
    claim, type or release: :meth:`states_for` hands them back, and the per-call
    bookkeeping costs a few identity checks instead of a few hundred microseconds."""

    __slots__ = ("watch", "_refs", "_seen", "_flat", "_changes")

    def __init__(self, watch: tuple[int, ...]):
        #: the argument positions whose tensors the states hang on (cache buffers, released inputs)
        self.watch = watch
        self._refs: tuple[weakref.ref, ...] = ()
        self._seen: tuple[tuple[int, int], ...] = ()
        self._flat: list[torch.Tensor] = []
        self._changes = -1

    def states_for(self, args: list[Any]) -> list[torch.Tensor] | None:
        """The last call's states (their buffers, as the graph takes them) if nothing they
        hang on changed since, else None."""
        if self._changes != _CHANGES[0]:
            return None
        for i, ref, (version, ptr) in zip(self.watch, self._refs, self._seen):
            t = args[i]
            if t is not ref() or t._version != version or t.data_ptr() != ptr:
                return None
        return self._flat

    def record(self, args: list[Any], flat: list[torch.Tensor]) -> None:
        """After a call that resolved, claimed, typed and released everything itself; ``flat``:
        its states' buffers as the graph took them (the states a memo serves grow no buffer,
        so they keep these)."""
        self._refs = tuple(weakref.ref(args[i]) for i in self.watch)
        self._seen = tuple((args[i]._version, args[i].data_ptr()) for i in self.watch)
        self._flat = flat
        self._changes = _CHANGES[0]


def _refuse_stacked(t: Any, graph: int, why: str) -> None:
    """A cache stacked over layers whose layers a graph keeps packed, read here in full
    precision: its own buffer was never written by the rewritten graphs (they take no tokens
    back from it either), so this call would read stale values; stop before it runs."""
    layers = t.__dict__.get(LAYER_TOKENS) if isinstance(t, torch.Tensor) else None
    for layer, (token, _) in sorted((layers or {}).items()):
        if token is not None:
            raise RuntimeError(
                f"kvarn_backend: graph {graph} reads the KV cache of {token.site} (layer {layer} "
                f"of a cache stacked over layers) in full precision ({why}), but graph "
                f"{token.graph} keeps that cache packed; compile the model so that every "
                "forward's attention is rewritten, or leave it uncompiled.")


def _fits(state: LayerState, g: dict[str, Any]) -> bool:
    # (the shapes read once: this runs per site and call)
    at = field_indices(state.buffers)
    b, h, _, d = state.buffers[at["sink_k"]].shape
    return b == g["batch"] and h == g["kv_heads"] and d == g["head_dim"] \
        and state.max_len == g["max_len"] \
        and state.buffers[at["sink_v"]].shape[-1] == (g.get("value_head_dim") or d)


def _holds_row_tags(t: Any) -> bool:
    """``t`` (no token of its own) looks like a chain handle the compiled model returned,
    derived along the batch (index_select, repeat_interleave, indexing): every batch row one
    whole number >= 0 at its first and last elements. Real keys and values never are."""
    if not isinstance(t, torch.Tensor) or t.dim() < 3 or not t.numel() or not t.is_floating_point():
        return False
    rows = t.reshape(t.shape[0], -1)
    return _tags(torch.cat([rows[:, :256], rows[:, -256:]], 1)) is not None


def _row_tags(past: torch.Tensor, axis: int, batch_axis: int) -> list[int] | None:
    """The batch-row tags ``past`` holds (a handle the compiled model returned, reordered,
    selected or repeated along the batch, or copied: its first positions hold one whole
    number >= 0 per row, as does its newest position), else None (real keys or values; a
    left-padded prompt's zero pad keys are constant too, but not its newest token)."""
    n = past.shape[axis]
    ends = torch.cat([past.narrow(axis, 0, min(4, n)), past.narrow(axis, n - 1, 1)], axis)
    return _tags(ends.movedim(batch_axis, 0).flatten(1))


def _tags(rows: torch.Tensor) -> list[int] | None:
    """The whole number >= 0 each row of ``rows`` [B, n] holds throughout, else None."""
    rows = rows.float()
    first = rows[:, :1]
    if not bool((rows == first).all() & (first == first.round()).all() & (first >= 0).all()):
        return None
    return [int(x) for x in first.flatten().tolist()]
