"""KVarN configuration: one frozen, validated dataclass and its named presets.

A config says *what* the packed cache stores (bits, tile length, scale dtype, which
quantizer) and *which tokens stay in high precision* (the sink and the recent window).
It never says how a kernel is tiled: that is the lowering's business.

Every field is checked in ``__post_init__``; an invalid value raises ``ValueError`` naming
the field, the value it got and what is allowed, e.g.::

    >>> KVarNConfig(key_bits=5)
    Traceback (most recent call last):
    ...
    ValueError: KVarNConfig.key_bits: expected one of (2, 3, 4, 8), but got 5. ...
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["KVarNConfig", "PRESETS", "get_config", "METHODS", "SCALE_DTYPES", "KEY_FRAMES", "CLIPS",
           "checked_max_cache_len", "KVarNOptions", "options_from", "LATENT_ROPE_BITS"]

#: Quantizers the packed format supports. All share one storage layout (codes, a row
#: scale and zero point per tile row, a scale per tile column); they differ in the
#: transform applied before round-to-nearest.
#:   kvarn    - Hadamard-style rotation + two-axis variance normalization + RTN
#:   hadamard - rotation + RTN (no normalization; column scales are all 1)
#:   kivi     - RTN only (per-channel K, per-token V; no rotation, no normalization)
METHODS: tuple[str, ...] = ("kvarn", "kivi", "hadamard")

#: Frames a K tile may be stored in (``KVarNConfig.key_frame``).
KEY_FRAMES: tuple[str, ...] = ("rotated", "auto")

#: Range choices of round-to-nearest (``KVarNConfig.clip``).
CLIPS: tuple[str, ...] = ("none", "mse")

#: Storage dtypes allowed for the folded scales. float16 is the reference format;
#: float8_e4m3fn stores every scale vector as fp8 codes times one fp16 factor per vector
#: (the paper's ~2.25 bpe accounting); bfloat16/float32 are for models whose K/V exceed
#: the fp16 range.
SCALE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

SUPPORTED_BITS = (2, 3, 4, 8)

#: Bits of the shared RoPE key of a multi-head latent attention cache (a latent state keeps
#: it as its values; the latent, its keys, takes the preset's key bits). Positions do not
#: survive 2 bits.
LATENT_ROPE_BITS = 8
SUPPORTED_GROUPS = (32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class KVarNConfig:
    """How a KV cache is compressed. Use :func:`get_config` to start from a preset.

    Fields:
        key_bits, value_bits: code width of the quantized region (2, 3, 4 or 8).
        group_size: G, the tile length in tokens. A K tile is [head_dim, G] (rows are
            channels), a V tile is [G, head_dim] (rows are tokens).
        sinkhorn_iters: T, iterations of the log-domain variance normalization (kvarn only).
        sink_tokens: how many leading tokens of every sequence stay in high precision.
            ``None`` means "one tile" (G), the reference policy; 0 disables the sink.
        recent_window: R, the number of newest *complete* tokens kept in high precision on
            top of the incomplete tail tile (the paper's S=128/R=128 setting uses R=128).
            0 (default) is the reference policy: only the incomplete tile stays exact.
        scale_dtype: storage dtype of the folded scales (see ``SCALE_DTYPES``).
        method: which quantizer fills the packed format (see ``METHODS``).
        exact_dtype: dtype of the high-precision sink and tail. "auto" (default): fp16 for
            fp32 models (as the reference keeps them), the model dtype for fp16/bf16 models;
            "float32" keeps fp32 models' sink and tail in fp32.
        check_finite: raise a ValueError naming the layer and token when a NaN/inf reaches
            the quantizer, instead of storing the token as NaN (see README "Limits").
        key_frame: "auto" (default): a K tile whose largest |k| is >= 16x the median
            channel range is stored plain (per-channel RTN, as KIVI), every other tile
            rotated; one flag byte per tile and head. Protects keys with a few huge
            channels (a k_proj bias after RoPE) that rotation would spread over every
            channel; on tiles without such channels it is the reference tile bit for bit.
            "rotated": the reference rule, every K tile through the method's rotation (no
            flag bytes). Values are always rotated.
        clip: "none" (reference: each row's RTN range is its min-max) or "mse": 2-bit key
            rows (one channel over a tile's tokens) take the clipped range (min-max shrunk
            around its centre by a factor in 1.0 .. 0.5) with the smallest rounding error.
            Same format, same bits; values and wider codes keep min-max.
    """

    key_bits: int = 4
    value_bits: int = 2
    group_size: int = 128
    sinkhorn_iters: int = 8
    sink_tokens: int | None = None
    recent_window: int = 0
    scale_dtype: str = "float16"
    method: str = "kvarn"
    check_finite: bool = False
    exact_dtype: str = "auto"
    key_frame: str = "auto"
    clip: str = "none"

    def __post_init__(self) -> None:
        def bad(field: str, value: object, allowed: str, fix: str = "") -> ValueError:
            msg = f"KVarNConfig.{field}: expected {allowed}, but got {value!r}."
            return ValueError(msg + (f" {fix}" if fix else ""))

        for field in ("key_bits", "value_bits"):
            value = getattr(self, field)
            if isinstance(value, bool) or value not in SUPPORTED_BITS:
                raise bad(field, value, f"one of {SUPPORTED_BITS}",
                          "Use 4 for keys and 2 or 4 for values (presets k4v2, k4v4, k2v2).")
        if isinstance(self.group_size, bool) or self.group_size not in SUPPORTED_GROUPS:
            raise bad("group_size", self.group_size, f"one of {SUPPORTED_GROUPS}",
                      "The presets use 128 (default) or 64 (the *_g64 presets).")
        if not isinstance(self.sinkhorn_iters, int) or isinstance(self.sinkhorn_iters, bool) \
                or not 0 <= self.sinkhorn_iters <= 64:
            raise bad("sinkhorn_iters", self.sinkhorn_iters, "an int in [0, 64]",
                      "The reference uses 8; the paper used 16.")
        if self.sink_tokens is not None and (
                not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool)
                or self.sink_tokens < 0 or self.sink_tokens % self.group_size):
            raise bad("sink_tokens", self.sink_tokens,
                      f"None (one tile) or a non-negative multiple of group_size={self.group_size}",
                      "Sinks are whole tiles so the quantized region stays tile-aligned.")
        if not isinstance(self.recent_window, int) or isinstance(self.recent_window, bool) \
                or self.recent_window < 0 or self.recent_window % self.group_size:
            raise bad("recent_window", self.recent_window,
                      f"a non-negative multiple of group_size={self.group_size}",
                      "0 keeps only the incomplete tile exact (the reference policy).")
        if self.scale_dtype not in SCALE_DTYPES:
            raise bad("scale_dtype", self.scale_dtype, f"one of {tuple(SCALE_DTYPES)}")
        if self.method not in METHODS:
            raise bad("method", self.method, f"one of {METHODS}")
        if self.exact_dtype not in ("auto", "float32"):
            raise bad("exact_dtype", self.exact_dtype, "'auto' or 'float32'")
        if not isinstance(self.check_finite, bool):
            raise bad("check_finite", self.check_finite, "a bool")
        if self.clip not in CLIPS:
            raise bad("clip", self.clip, f"one of {CLIPS}",
                      "'mse' searches a clipped range for 2-bit key rows (same format and bits).")
        if self.key_frame not in KEY_FRAMES:
            raise bad("key_frame", self.key_frame, f"one of {KEY_FRAMES}",
                      "'auto' chooses rotated or plain per K tile.")

    # ----------------------------------------------------------------------------------
    @property
    def sink(self) -> int:
        """Number of leading high-precision tokens (resolves ``sink_tokens=None`` to G)."""
        return self.group_size if self.sink_tokens is None else self.sink_tokens

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    def replace(self, **changes: object) -> "KVarNConfig":
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(
                f"KVarNConfig has no field(s) {sorted(unknown)}; expected some of "
                f"{[f.name for f in dataclasses.fields(self)]}.")
        return dataclasses.replace(self, **changes)

    @property
    def op_method(self) -> str:
        """The method string the runtime ops take: the method plus quantizer options
        that the packed state cannot carry itself (``"+clip"`` for ``clip="mse"``)."""
        return self.method + ("+clip" if self.clip == "mse" else "")

    def short(self) -> str:
        """A compact name such as ``kvarn-k4v2-g128``."""
        extra = ""
        if self.scale_dtype != "float16":
            extra += f"-s{self.scale_dtype.replace('float', 'f').replace('_e4m3fn', '')}"
        if self.recent_window:
            extra += f"-r{self.recent_window}"
        if self.method == "kvarn" and self.sinkhorn_iters != 8:
            extra += f"-t{self.sinkhorn_iters}"
        if self.key_frame == "rotated" and self.method != "kivi":
            extra += "-krot"
        if self.clip != "none":
            extra += f"-clip{self.clip}"
        return f"{self.method}-k{self.key_bits}v{self.value_bits}-g{self.group_size}{extra}"


PRESETS: dict[str, KVarNConfig] = {
    "k4v2": KVarNConfig(key_bits=4, value_bits=2, group_size=128),
    "k4v4": KVarNConfig(key_bits=4, value_bits=4, group_size=128),
    "k2v2": KVarNConfig(key_bits=2, value_bits=2, group_size=128),
    # k2v2 with 2-bit keys' RTN range chosen by rounding error: same format and bits,
    # pseudo-decode KL 55-66% lower than k2v2 on the default model (docs/quality.md)
    "k2v2_clip": KVarNConfig(key_bits=2, value_bits=2, group_size=128, clip="mse"),
    "k4v2_g64": KVarNConfig(key_bits=4, value_bits=2, group_size=64),
    "k4v4_g64": KVarNConfig(key_bits=4, value_bits=4, group_size=64),
}


def get_config(preset: str | KVarNConfig = "k4v2", **overrides: object) -> KVarNConfig:
    """The preset's config with ``overrides`` applied, e.g. ``get_config("k2v2", method="kivi")``."""
    if isinstance(preset, KVarNConfig):
        base = preset
    else:
        if preset not in PRESETS:
            raise ValueError(
                f"Unknown KVarN preset {preset!r}: expected one of {tuple(PRESETS)}. "
                "Pass overrides such as key_bits=... to customize a preset.")
        base = PRESETS[preset]
    return base.replace(**overrides) if overrides else base


def checked_max_cache_len(value: object) -> int:
    """``value`` if it is a valid ``max_cache_len`` (a positive int: tokens per sequence);
    else a clear ``ValueError``. Shared by every entry point that takes one."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Expected max_cache_len to be a positive int (tokens per sequence), "
                         f"but got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class KVarNOptions:
    """How a front-end keeps its packed caches, validated once; taken by
    :func:`~kvarn_compile.kvarn_backend`, :func:`~kvarn_compile.inductor_pass` and
    :class:`~kvarn_compile.hf.KVarNCache` (``options=``, or the same names as keywords).

    Attributes:
        max_cache_len: tokens per sequence for caches whose capacity the model does not fix
            (``torch.cat`` caches such as transformers' DynamicCache; ``KVarNCache``'s
            capacity). Preallocated model caches keep their own length.
        release_buffers: free the memory of model-owned full-precision cache buffers that
            the rewritten graphs no longer read (``KVarNCache`` has none).
        spec_tokens: newest tokens of each write kept uncommitted, so they can still be
            rewritten (speculative decoding).
    """

    max_cache_len: int = 8192
    release_buffers: bool = True
    spec_tokens: int = 0

    def __post_init__(self) -> None:
        checked_max_cache_len(self.max_cache_len)
        if not isinstance(self.release_buffers, bool):
            raise ValueError(f"Expected release_buffers to be True or False, but got "
                             f"{self.release_buffers!r}.")
        if not isinstance(self.spec_tokens, int) or isinstance(self.spec_tokens, bool) \
                or self.spec_tokens < 0:
            raise ValueError(f"Expected spec_tokens to be an int >= 0 (uncommitted tokens per "
                             f"write), but got {self.spec_tokens!r}.")


def options_from(options: KVarNOptions | None = None, **given: object) -> KVarNOptions:
    """``options``, or :class:`KVarNOptions` built from the keywords ``given`` that are not
    None; both at once is an error (one place sets each option)."""
    given = {k: v for k, v in given.items() if v is not None}
    if options is None:
        return KVarNOptions(**given)
    if not isinstance(options, KVarNOptions):
        raise ValueError(f"Expected options to be a kvarn_compile.KVarNOptions, but got "
                         f"{type(options).__name__}.")
    if given:
        raise ValueError(f"Expected either options=KVarNOptions(...) or the keywords "
                         f"{sorted(given)}, but got both; put them in the options object.")
    return options

