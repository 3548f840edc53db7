"""The packed KV-cache state of one attention layer: its typed layout and its allocation.

Token layout of batch row b (S sink tokens, G tokens per tile, n_tiles[b] frozen tiles)::

    positions  [0, S)                 -> sink_k/sink_v, high precision (model dtype)
    positions  [S, S + n_tiles*G)     -> packed tiles: codes + dual scales (rotated frame)
    positions  [S + n_tiles*G, len)   -> tail_k/tail_v, a ring buffer of W slots,
                                         position p lives in slot (p - S) % W

A tile is frozen (rotated, normalized, quantized, packed) as soon as its G tokens are
committed and at least ``recent_window`` newer committed tokens exist; its tail slots are
then free again. Nothing else holds these tokens: no full-precision copy of the quantized
region exists. By default every buffer is allocated once to the maximum length, so compiled
graphs and CUDA graphs see static shapes. A *growable* state (``allocate_layer(...,
grow_from=tokens)``: caches the model does not preallocate, such as transformers'
DynamicCache) holds only what its tokens need and grows along dim 2 of its sequence
members (:data:`GROW_AXIS_FIELDS`: sink, tiles, tail) up to ``max_len``
(:meth:`LayerState.reserve` before an append, :meth:`LayerState.trim` after it): while a
sequence is shorter than the sink, the sink holds exactly its tokens (S is read off the
sink's shape, so every kernel sees a short sink that holds the whole sequence) and tail and
tiles hold nothing; past the sink, the tiles hold the frozen tiles and the tail the tokens
after them (exactly, until the first tile freezes; then rounded up while that stays within
what fp16 would hold). Compiled graphs treat that one dimension as dynamic (any size,
0 included) and never recompile for it.

The buffers travel to the custom ops as one flat list (a custom-op schema takes
``Tensor[]``). :class:`StateLayout` is the one place that knows the order of that list and
which optional members it holds; :func:`unpack` turns a list (of tensors, Inductor IR
nodes or FX nodes alike) into :class:`StateFields` with named members, and every op,
kernel and lowering reads the state through it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from kvarn_compile.config import KVarNConfig

__all__ = ["StateLayout", "StateFields", "Tiles", "Geometry", "unpack", "field_indices", "LayerState",
           "allocate_layer", "fp16_cache_bytes", "BASE_FIELDS", "FP8_FACTOR_FIELDS",
           "KEY_FRAME_FIELDS", "TILE_FIELDS", "GROW_AXIS_FIELDS", "BUF", "grow_axis_indices",
           "grown_sizes"]

T = TypeVar("T")

#: Members every state has, in list order.
BASE_FIELDS = (
    "sink_k", "sink_v",                                     # [B, H, S, D] exact dtype
    "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",  # [B,H,n,D,G*kb/8] [B,H,n,D] x2 [B,H,n,G]
    "v_codes", "v_row_scale", "v_row_zero", "v_col_scale",  # [B,H,n,G,D*vb/8] [B,H,n,G] x2 [B,H,n,D]
    "tail_k", "tail_v",                                     # [B, H, W, D] exact dtype, ring buffer
    "lengths", "committed", "n_tiles",                      # [B] int64
    "capacity",                                             # [B] int64: max_len, constant
)
#: Per-vector fp16 factors of fp8 scales ([B, H, n, 1] each), after the base members.
FP8_FACTOR_FIELDS = ("k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor")
#: Per-tile key frames (uint8 [B, H, n]; 1 = that K tile is stored un-rotated), last.
KEY_FRAME_FIELDS = ("k_plain",)
#: The members of one side (K or V) of the packed tiles, without the ``k_``/``v_`` prefix.
TILE_FIELDS = ("codes", "row_scale", "row_zero", "col_scale")
#: Every member whose dim 2 is a sequence axis (sink slots, tile slots, tail slots): the
#: axis a growable state grows along.
GROW_AXIS_FIELDS = frozenset(
    ["sink_k", "sink_v", "tail_k", "tail_v"] + [f"{kind}_{f}" for kind in "kv" for f in TILE_FIELDS]
    + list(FP8_FACTOR_FIELDS) + list(KEY_FRAME_FIELDS))
#: Size a growing axis is compiled with when it is smaller: a size of 0 or 1 would be
#: specialized to a constant by the compiler's shape analysis (0 and 1 are never symbolic);
#: the compiled code then runs with any size (see ``backend``'s compile stand-ins).
MIN_GROWN_SLOTS = 2
#: Once a tile is frozen, a growable state's tail grows in steps of up to this many slots.
SLOT_STEP = 16


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Which optional members a state holds, and so the order of its flat buffer list."""

    fp8_factors: bool = False
    key_frames: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return _names(self)

    def index(self, name: str) -> int:
        """Position of member ``name`` in the buffer list (KeyError if this layout lacks it)."""
        return _indices(self)[name]

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of(cls, buffers: Sequence[Any] | int) -> StateLayout:
        """The layout of a buffer list (or of a list of that length)."""
        n = buffers if isinstance(buffers, int) else len(buffers)
        layout = _BY_LENGTH.get(n)
        if layout is None:
            raise ValueError(f"Expected a KVarN state of {sorted(_BY_LENGTH)} buffers, but got {n}.")
        return layout


@functools.lru_cache(maxsize=None)
def _names(layout: StateLayout) -> tuple[str, ...]:
    return (BASE_FIELDS + (FP8_FACTOR_FIELDS if layout.fp8_factors else ())
            + (KEY_FRAME_FIELDS if layout.key_frames else ()))


@functools.lru_cache(maxsize=None)
def _indices(layout: StateLayout) -> dict[str, int]:
    return {name: i for i, name in enumerate(_names(layout))}


_BY_LENGTH = {len(_names(lay)): lay for lay in (StateLayout(f, k) for f in (False, True)
                                                for k in (False, True))}


def field_indices(buffers: Sequence[Any]) -> dict[str, int]:
    """Member name -> position in a state's buffer list (a cached dict: the per-token paths
    read a few members without building :class:`StateFields`)."""
    return _indices(StateLayout.of(buffers))


#: Positions of the members that sit at a fixed place in every layout that has them (the
#: base members, then the fp8 factors). Prefer :func:`unpack`; this is for tests and tools.
BUF = {name: i for i, name in enumerate(BASE_FIELDS + FP8_FACTOR_FIELDS)}


def grow_axis_indices(buffers: Sequence[Any] | int) -> tuple[int, ...]:
    """Positions in a buffer list of the members a growable state grows (along dim 2)."""
    layout = StateLayout.of(buffers)
    return tuple(i for i, name in enumerate(layout.names) if name in GROW_AXIS_FIELDS)


@dataclasses.dataclass(frozen=True)
class Tiles(Generic[T]):
    """One side (K or V) of the packed tiles: codes and the dual scales."""

    codes: T
    row_scale: T
    row_zero: T
    col_scale: T
    row_factor: T | None = None     # fp8 scales only
    col_factor: T | None = None

    @property
    def core(self) -> tuple[T, T, T, T]:
        """(codes, row_scale, row_zero, col_scale)."""
        return self.codes, self.row_scale, self.row_zero, self.col_scale


@dataclasses.dataclass(frozen=True)
class StateFields(Generic[T]):
    """A state's buffer list with named members; ``T`` is whatever the list holds."""

    layout: StateLayout
    sink_k: T
    sink_v: T
    k: Tiles[T]
    v: Tiles[T]
    tail_k: T
    tail_v: T
    lengths: T
    committed: T
    n_tiles: T
    capacity: T
    k_plain: T | None = None

    def tiles(self, kind: str) -> Tiles[T]:
        return self.k if kind == "k" else self.v

    def pack(self) -> list[T]:
        """The flat list, in the layout's order."""
        named = self.named()
        return [named[n] for n in self.layout.names]

    def named(self) -> dict[str, T]:
        """Every member present, by its flat name (``k_codes``, ``lengths``, ...)."""
        out: dict[str, Any] = {"sink_k": self.sink_k, "sink_v": self.sink_v}
        for kind, tiles in (("k", self.k), ("v", self.v)):
            for f in TILE_FIELDS:
                out[f"{kind}_{f}"] = getattr(tiles, f)
        out.update(tail_k=self.tail_k, tail_v=self.tail_v, lengths=self.lengths,
                   committed=self.committed, n_tiles=self.n_tiles, capacity=self.capacity)
        if self.layout.fp8_factors:
            for kind, tiles in (("k", self.k), ("v", self.v)):
                out[f"{kind}_row_factor"] = tiles.row_factor
                out[f"{kind}_col_factor"] = tiles.col_factor
        if self.layout.key_frames:
            out["k_plain"] = self.k_plain
        return out


def unpack(buffers: Sequence[T]) -> StateFields[T]:
    """Named members of a state's flat buffer list (tensors, IR nodes or FX nodes)."""
    layout = StateLayout.of(buffers)
    at = _indices(layout)
    b = lambda name: buffers[at[name]]  # noqa: E731
    opt = lambda name: buffers[at[name]] if name in at else None  # noqa: E731

    def side(kind: str) -> Tiles:
        return Tiles(*(b(f"{kind}_{f}") for f in TILE_FIELDS),
                     row_factor=opt(f"{kind}_row_factor"), col_factor=opt(f"{kind}_col_factor"))

    return StateFields(layout, b("sink_k"), b("sink_v"), side("k"), side("v"), b("tail_k"),
                       b("tail_v"), b("lengths"), b("committed"), b("n_tiles"), b("capacity"),
                       opt("k_plain"))


def _tensor_size(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes of a state, read off its buffers' shapes."""

    batch: int
    kv_heads: int
    head_dim: int      # D: the keys' (and queries') head dim
    sink: int          # S: high-precision sink tokens
    group: int         # G: tokens per packed tile
    max_tiles: int     # n_max: tile slots per row
    tail: int          # W: tail ring slots
    key_bits: int
    value_bits: int
    value_head_dim: int = 0   # Dv: the values' (and outputs') head dim; 0 reads as D

    def __post_init__(self):
        if not self.value_head_dim:
            object.__setattr__(self, "value_head_dim", self.head_dim)

    @classmethod
    def of(cls, state: StateFields | Sequence[Any],
           size: Callable[[Any], Sequence[int]] = _tensor_size) -> Geometry:
        """From fields or a buffer list; ``size`` reads a member's shape (IR nodes: static ints)."""
        f = state if isinstance(state, StateFields) else unpack(state)
        bsz, heads, s, d = size(f.sink_k)
        dv = size(f.sink_v)[-1]
        g = size(f.k.col_scale)[-1]
        kc, vc = size(f.k.codes), size(f.v.codes)
        return cls(batch=bsz, kv_heads=heads, head_dim=d, sink=s, group=g, max_tiles=kc[2],
                   tail=size(f.tail_k)[2], key_bits=8 * kc[-1] // g, value_bits=8 * vc[-1] // dv,
                   value_head_dim=dv)


_SINK, _TAIL, _TILES = range(3)
_REGION = {name: _SINK if name.startswith("sink") else _TAIL if name.startswith("tail") else _TILES
           for name in GROW_AXIS_FIELDS}


@dataclasses.dataclass(frozen=True)
class _Growth:
    """What a growable state's sizing reads on every call, worked out once: bytes per batch
    row of a sink/tail slot, of an fp16 token (K and V) and of a tile slot; the whole tail's
    and the whole tiles' slots; where the sizes are read; (index, region) of every grown
    member."""

    token: int
    fp16_token: int
    tile: int
    tail: int
    whole: int
    at: tuple[int, int, int]
    regions: tuple[tuple[int, int], ...]


@dataclasses.dataclass
class LayerState:
    """One layer's packed cache. ``buffers`` is the flat list the ops mutate in place."""

    config: KVarNConfig
    buffers: list[torch.Tensor]
    max_len: int
    name: str = ""
    #: context parallelism (``kvarn_compile.ops.context_parallel``): the group's key, and the
    #: sequence tile number of slot 0 (this rank holds tiles ``tile_offset ..``)
    context_parallel: str = ""
    tile_offset: int = 0
    #: the tile slots grow with the sequence (:meth:`reserve`) instead of being allocated
    #: for ``max_len`` up front; ``version`` counts reallocations (callers holding the
    #: buffer list compare it)
    growable: bool = False
    version: int = 0
    #: uncommitted tokens the tail ring was sized for (``allocate_layer(spec_tokens=)``)
    spec_tokens: int = 0
    #: growable states: the tokens of the rows after the append of the last ``reserve``
    #: (the most, and the fewest any row holds)
    tokens: int = 0
    shortest: int = 0
    _last_wanted: tuple[Any, tuple[int, int, int]] = dataclasses.field(
        default=(None, (0, 0, 0)), repr=False, compare=False)

    @property
    def fields(self) -> StateFields[torch.Tensor]:
        return unpack(self.buffers)

    @property
    def geometry(self) -> Geometry:
        return Geometry.of(self.fields)

    def __getattr__(self, item: str) -> torch.Tensor:
        # flat member names (state.lengths, state.k_codes, ...), through the layout
        buffers = self.__dict__.get("buffers")
        if buffers is None or item.startswith("__"):
            raise AttributeError(item)
        layout = StateLayout.of(buffers)
        if item in _indices(layout):
            return buffers[layout.index(item)]
        if item in FP8_FACTOR_FIELDS:
            raise AttributeError(f"{item} is only allocated for float8_e4m3fn scales")
        raise AttributeError(item)

    @property
    def k_plain(self) -> torch.Tensor | None:
        """Per-tile key-frame flags (``key_frame="auto"`` states only), else None."""
        return self.fields.k_plain

    # ------------------------------------------------------------------ geometry
    @property
    def batch(self) -> int:
        return self.sink_k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.sink_k.shape[1]

    @property
    def head_dim(self) -> int:
        """The keys' head dim (the queries'), D."""
        return self.sink_k.shape[-1]

    @property
    def value_head_dim(self) -> int:
        """The values' head dim (the attention output's), Dv; D unless allocated otherwise."""
        return self.sink_v.shape[-1]

    @property
    def sink_len(self) -> int:
        return self.sink_k.shape[2]

    @property
    def max_tiles(self) -> int:
        return self.k_codes.shape[2]

    @property
    def tail_len(self) -> int:
        return self.tail_k.shape[2]

    # ------------------------------------------------------------------ growth
    def reserve(self, tokens: int, *, fresh: bool = False, shortest: int | None = None) -> bool:
        """Make room for an append that brings the rows to ``tokens`` tokens (at most
        ``max_len``); True when buffers were reallocated (``buffers`` then holds new tensors,
        ``version`` counts up).

        Growable states only (others hold ``max_len`` already: a no-op). Sizes follow
        :func:`grown_sizes`; the tokens held so far keep their positions (copied over), so
        call it between appends, never with data in flight. Nothing shrinks here (the append
        still reads the tail it holds; :meth:`trim` gives the room back after it). Past 16
        tiles the tiles grow by at least 1/16 of their slots at once (long sequences copy
        their tiles O(log) times, not once per tile). ``fresh``: this call starts a new
        sequence at position 0, nothing held must survive, and the buffers take exactly the
        sizes ``tokens`` needs. ``shortest``: the fewest tokens a row holds after the append
        (rows of unequal lengths; default: all rows hold ``tokens``).
        """
        if not self.growable:
            return False
        tokens = min(max(int(tokens), 0), self.max_len)
        self.tokens, self.shortest = tokens, tokens if shortest is None else min(shortest, tokens)
        have = self.grown
        sink, tail, tiles = self._wanted(have[2])
        if fresh:
            if (sink, tail, tiles) == have:
                return False
            self._reallocate((sink, tail, tiles), keep=False)
            return True
        if sink <= have[0] and tail <= have[1] and tiles <= have[2]:
            return False
        if tiles > have[2]:
            tiles = min(self._growth.whole, max(tiles, have[2] + have[2] // 16))
            sink, tail, _ = self._wanted(tiles)       # the padding the new tiles leave
        self._reallocate((max(sink, have[0]), max(tail, have[1]), max(tiles, have[2])), keep=True)
        return True

    def trim(self) -> bool:
        """After an append to the tokens of the last :meth:`reserve`: give back the tail slots
        its frozen tiles freed (the tokens after the last frozen tile keep their positions).
        True when buffers were reallocated. Call it only after that append succeeded."""
        if not self.growable:
            return False
        have = self.grown
        tail = self._wanted(have[2])[1]
        if tail >= have[1]:
            return False
        self._reallocate((have[0], tail, have[2]), keep=True)
        return True

    def make_room_to_crop(self) -> bool:
        """Give a growable state's tail the whole ring before a crop into its packed tiles
        (``ops.append.crop_`` moves up to a tile's tokens back into the tail); True when
        buffers were reallocated."""
        if not self.growable or self.tail_len >= self._growth.tail:
            return False
        self._reallocate((self.sink_len, self._growth.tail, self.max_tiles), keep=True)
        return True

    def _wanted(self, tiles_held: int) -> tuple[int, int, int]:
        """(sink, tail, tile) slots for :attr:`tokens`, the tail rounded up to the whole ring,
        or else to :data:`SLOT_STEP`, as far as the bytes stay within fp16's for those tokens
        when the state holds ``tiles_held`` tile slots (or the tiles it needs, if more)."""
        key = (self.tokens, self.shortest, tiles_held)
        if self._last_wanted[0] == key:            # trim after reserve: the same question
            return self._last_wanted[1]
        c = self._growth
        sink, tail, tiles = grown_sizes(self.config, tokens=self.tokens, max_len=self.max_len,
                                        tail=c.tail, hold=self.spec_tokens, shortest=self.shortest)
        if self.tokens > sink:
            # fp16 bytes of the tokens, less the sink and tiles held: what the tail may take;
            # the whole ring once that fits (no more tail copies), else rounded up
            budget = (self.tokens * c.fp16_token - sink * c.token - max(tiles, tiles_held) * c.tile) // c.token
            pad = c.tail - tail if budget >= c.tail else (-tail) % SLOT_STEP
            tail = min(tail + max(min(pad, budget - tail), 0), c.tail)
        self._last_wanted = (key, (sink, tail, tiles))
        return sink, tail, tiles

    @functools.cached_property
    def _growth(self) -> _Growth:
        f = self.fields
        heads, dims = f.sink_k.shape[1], f.sink_k.shape[3] + f.sink_v.shape[3]
        return _Growth(
            token=heads * dims * f.sink_k.element_size(), fp16_token=heads * dims * 2,
            tile=self.tile_bytes(), tail=_tail_slots(self.config, self.spec_tokens),
            whole=tiles_for(self.config, max_len=self.max_len),
            at=tuple(f.layout.index(n) for n in ("sink_k", "tail_k", "k_codes")),
            regions=tuple((i, _REGION[n]) for i, n in enumerate(f.layout.names) if n in GROW_AXIS_FIELDS))

    @property
    def grown(self) -> tuple[int, int, int]:
        """(sink, tail, tile) slots per row now allocated."""
        b, (i, j, k) = self.buffers, self._growth.at
        return b[i].shape[2], b[j].shape[2], b[k].shape[2]

    def _reallocate(self, sizes: tuple[int, int, int], *, keep: bool) -> None:
        """New buffers for the regions (sink, tail, tiles) whose slots change to ``sizes``;
        with ``keep`` the tokens held so far stay at their positions: sink and tile slots are
        copied as they are, the tail ring is re-laid for its new size (position p sits in
        slot ``(p - S) % W``)."""
        f = self.fields
        for i, region in self._growth.regions:
            old = self.buffers[i]
            if old.shape[2] == sizes[region]:
                continue
            new = old.new_zeros((*old.shape[:2], sizes[region], *old.shape[3:]))
            if keep and region == _TAIL:
                _ring_copy(new, old, f)
            elif keep:
                n = min(old.shape[2], sizes[region])
                new[:, :, :n].copy_(old[:, :, :n])
            self.buffers[i] = new
        self.capacity.fill_(capacity_for(self.config, sizes, max_len=self.max_len))
        self.version += 1

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the state holds, counted from the live tensors."""
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def tile_bytes(self) -> int:
        """Bytes of one packed tile of one batch row, all KV heads (codes, scales, factors
        and key-frame flags)."""
        f = self.fields
        members = [t for tiles in (f.k, f.v) for t in (*tiles.core, tiles.row_factor, tiles.col_factor)]
        members.append(f.k_plain)
        # per slot: every dim but batch and the tile axis (a state may have no slot at all)
        return sum(t.shape[1] * math.prod(t.shape[3:]) * t.element_size()
                   for t in members if t is not None)

    def used_bytes(self) -> dict[str, int]:
        """Bytes that hold the current tokens, by region (for bits-per-element reports).

        Preallocated but still empty tile slots are not counted here; ``nbytes`` counts
        them. Per batch row: the sink and the W tail slots are always in use.
        """
        exact = lambda t: t[0].numel() * t.element_size()  # noqa: E731
        return {
            "sink": self.batch * (exact(self.sink_k) + exact(self.sink_v)),
            "tiles": self.tiles_held() * self.tile_bytes(),
            "tail": self.batch * (exact(self.tail_k) + exact(self.tail_v)),
        }

    def tiles_held(self) -> int:
        """Filled tile slots of all batch rows in this state (on a context-parallel rank: the
        filled tiles of its own range)."""
        n, off = self.max_tiles, self.tile_offset
        return sum(max(0, min(t - off, n)) for t in self.n_tiles.tolist())

    def describe(self) -> str:
        c = self.config
        return (f"LayerState({self.name or 'layer'}: B={self.batch}, H={self.kv_heads}, "
                f"D={self.head_dim}{'' if self.value_head_dim == self.head_dim else f'/{self.value_head_dim}'}, max_len={self.max_len}, sink={self.sink_len}, "
                f"tiles={self.max_tiles}x{c.group_size}, tail={self.tail_len}, "
                f"{c.short()}, {self.nbytes} bytes)")


def _tail_slots(config: KVarNConfig, spec_tokens: int) -> int:
    """Ring size: one tile still filling + the recent window + room for uncommitted tokens."""
    g = config.group_size
    return g + config.recent_window + g * math.ceil(spec_tokens / g)


def exact_dtype_for(config: KVarNConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype of sink and tail: fp16 for fp32 models (like the reference, so the
    comparison with an fp16 cache is fair), the model's own dtype for fp16/bf16 models;
    ``exact_dtype="float32"`` keeps fp32."""
    if config.exact_dtype == "float32":
        return torch.float32
    return torch.float16 if dtype == torch.float32 else dtype


def tiles_for(config: KVarNConfig, *, max_len: int) -> int:
    """Tile slots per row at ``max_len``: whole tiles after the sink (the rest stays in the
    tail)."""
    return max(max_len - min(config.sink, max_len), 0) // config.group_size


def _ring_copy(new: torch.Tensor, old: torch.Tensor, f: StateFields[torch.Tensor]) -> None:
    """Copy the live tail tokens of ring ``old`` into ring ``new`` of another size: position p
    of a row lives in slot ``(p - S) % W`` of each; the live positions are those from the
    row's first tail position (after its frozen tiles) up to its length, at most as many as
    either ring holds."""
    w_old, w_new = old.shape[2], new.shape[2]
    if not w_old or not w_new:
        return
    s, g = f.sink_k.shape[2], f.k.col_scale.shape[-1]
    bsz, heads = old.shape[:2]
    base = s + f.n_tiles * g                                            # [B] first tail position
    pos = base[:, None] + torch.arange(w_new, device=old.device)        # w_new positions in a row:
    live = (pos < f.lengths[:, None]) & (f.lengths[:, None] > s)        # every new slot once
    shape = (bsz, heads, w_new, *old.shape[3:])
    at = lambda idx: idx.view(bsz, 1, w_new, *[1] * (old.dim() - 3)).expand(shape)  # noqa: E731
    moved = old.gather(2, at((pos - s) % w_old))
    moved = torch.where(at(live), moved, torch.zeros((), dtype=old.dtype, device=old.device))
    new.scatter_(2, at((pos - s) % w_new), moved)


def grown_sizes(config: KVarNConfig, *, tokens: int, max_len: int, tail: int, hold: int = 0,
                shortest: int | None = None) -> tuple[int, int, int]:
    """The fewest (sink, tail, tile) slots of a growable state whose rows hold ``tokens``
    tokens (``shortest`` the fewest any row holds; default all ``tokens``) after an append
    that keeps up to ``hold`` of them uncommitted; ``tail``: the whole ring's slots.

    The kernels read the sink length S and the tail ring size W off the buffers' shapes;
    positions stay where the whole-size state has them (the tail is re-laid when W changes):

    * up to S tokens: a sink of exactly the tokens (a sequence that lies wholly in its sink),
      no tail, no tiles;
    * beyond: the whole sink, tile slots for every tile the tokens can fill (at most those
      of ``max_len``: an append commits the tokens before its start, so up to ``hold`` of
      its own may be all that waits), and tail slots for the tokens after the tiles frozen
      at least (all but ``hold`` committed; the most over the rows' lengths). With
      ``hold`` > 0 a tile's slot may so come up to ``hold`` tokens before its tile.
    """
    sink = min(config.sink, max_len)
    tokens = min(max(tokens, 0), max_len)
    lo = tokens if shortest is None else min(max(shortest, 0), tokens)
    if tokens <= sink:
        return tokens, 0, 0
    g, recent = config.group_size, config.recent_window
    whole = tiles_for(config, max_len=max_len)
    frozen = lambda n, held: min(max((n - held - sink - recent) // g, 0), whole)  # noqa: E731
    live = lambda n: max(n - sink - frozen(n, hold) * g, 0)  # noqa: E731
    need = live(tokens)
    if frozen(lo, hold) != frozen(tokens, hold):     # rows on both sides of a frozen tile
        need = max(need, live(sink + recent + hold + frozen(tokens, hold) * g - 1))
    return sink, min(need, tail), frozen(tokens, 0)


def capacity_for(config: KVarNConfig, sizes: tuple[int, int, int], *, max_len: int) -> int:
    """Tokens per row a state with (sink, tail, tile) slots ``sizes`` may hold: ``max_len``
    when its sink and tiles are whole, else what its sink, tiles and tail hold together."""
    sink, tail, tiles = sizes
    if sink >= min(config.sink, max_len) and tiles >= tiles_for(config, max_len=max_len):
        return max_len
    return min(sink + tiles * config.group_size + tail, max_len)


def allocate_layer(config: KVarNConfig, *, batch: int, kv_heads: int, head_dim: int,
                   max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                   spec_tokens: int = 0, name: str = "", grow_from: int | None = None,
                   value_head_dim: int | None = None) -> LayerState:
    """Allocate one layer's packed cache for ``max_len`` tokens per batch row.

    ``value_head_dim``: the values' head dim when it differs from the keys' ``head_dim``
    (multi-head latent attention decompressed: K 192, V 128); each side is rotated and
    quantized in its own frame.

    ``spec_tokens`` is how many uncommitted (speculative) tokens beyond a full tail tile
    may exist at once; with the default auto-commit 0 suffices. ``grow_from``: a growable
    state sized for that many tokens (:func:`grown_sizes`), grown by
    :meth:`LayerState.reserve` up to ``max_len``; None preallocates every slot.
    """
    dv = head_dim if value_head_dim is None else value_head_dim
    for what, dim in (("head_dim", head_dim), ("value_head_dim", dv)):
        if dim % 16 or dim < 16:
            raise ValueError(f"Expected {what} to be a multiple of 16, but got {dim}.")
    if not dtype.is_floating_point:
        raise ValueError(f"Expected a floating-point model dtype, but got {dtype}.")
    if max_len < 1 or batch < 1 or kv_heads < 1:
        raise ValueError(f"Expected positive batch, kv_heads and max_len, but got "
                         f"{batch}, {kv_heads}, {max_len}.")
    g = config.group_size
    exact = exact_dtype_for(config, dtype)
    sink = min(config.sink, max_len)
    tiles = tiles_for(config, max_len=max_len)
    tail = _tail_slots(config, spec_tokens)
    if grow_from is not None:
        sink, tail, tiles = grown_sizes(config, tokens=grow_from, max_len=max_len, tail=tail,
                                        hold=spec_tokens)
    kb, vb = config.key_bits, config.value_bits
    if (g * kb) % 8 or (dv * vb) % 8:
        raise ValueError(f"{kb}/{vb}-bit codes do not pack whole bytes for G={g}, Dv={dv}.")
    sdt = config.torch_scale_dtype
    fp8 = sdt == torch.float8_e4m3fn
    zdt = torch.float16 if fp8 else sdt
    layout = StateLayout(fp8_factors=fp8, key_frames=config.key_frame == "auto" and config.method != "kivi")

    def new(*dims: int, dt: torch.dtype) -> torch.Tensor:
        return torch.zeros(batch, kv_heads, *dims, dtype=dt, device=device)

    def factors() -> dict[str, torch.Tensor | None]:
        if not fp8:
            return {}
        return {"row_factor": new(tiles, 1, dt=torch.float16), "col_factor": new(tiles, 1, dt=torch.float16)}

    def counter(value: int = 0) -> torch.Tensor:
        return torch.full((batch,), value, dtype=torch.int64, device=device)

    fields = StateFields(
        layout,
        sink_k=new(sink, head_dim, dt=exact), sink_v=new(sink, dv, dt=exact),
        k=Tiles(new(tiles, head_dim, g * kb // 8, dt=torch.uint8), new(tiles, head_dim, dt=sdt),
                new(tiles, head_dim, dt=zdt), new(tiles, g, dt=sdt), **factors()),
        v=Tiles(new(tiles, g, dv * vb // 8, dt=torch.uint8), new(tiles, g, dt=sdt),
                new(tiles, g, dt=zdt), new(tiles, dv, dt=sdt), **factors()),
        tail_k=new(tail, head_dim, dt=exact), tail_v=new(tail, dv, dt=exact),
        lengths=counter(), committed=counter(), n_tiles=counter(),
        capacity=counter(capacity_for(config, (sink, tail, tiles), max_len=max_len)),
        k_plain=new(tiles, dt=torch.uint8) if layout.key_frames else None)
    tokens = min(max(grow_from or 0, 0), max_len)
    return LayerState(config=config, buffers=fields.pack(), max_len=max_len, name=name,
                      growable=grow_from is not None, spec_tokens=spec_tokens, tokens=tokens,
                      shortest=tokens)


def fp16_cache_bytes(*, batch: int, kv_heads: int, head_dim: int, tokens: int,
                     value_head_dim: int | None = None) -> int:
    """Bytes of a plain fp16 K+V cache holding ``tokens`` tokens (the comparison baseline)."""
    dv = head_dim if value_head_dim is None else value_head_dim
    return batch * kv_heads * tokens * (head_dim + dv) * 2
