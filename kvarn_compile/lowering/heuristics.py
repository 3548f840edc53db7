"""Tile configurations of the KVarN Triton templates: small dataclasses and their lists.

Each template has one always-present default config, a short autotune list (used when
Inductor runs with ``max_autotune``) and a generated exhaustive list (``KVARN_AUTOTUNE=
exhaustive``). Configs that do not fit a shape (BLOCK_N > G, more splits than tiles) are
filtered here, never raised on: the lowering always keeps the extern fallback.

Shape buckets key the autotune database (``kvarn_compile.autotune``): the cache capacity
in tokens rounded up to a power of two, and the query length ("decode" rows fit in one
BLOCK_M of packed GQA heads, otherwise "prefill").
"""

from __future__ import annotations

import dataclasses
import itertools
import os

__all__ = ["DecodeConfig", "decode_configs", "prefill_configs", "tune_mode",
           "length_bucket", "query_bucket", "split_max", "DECODE_ROWS_MAX"]

#: Up to this many query rows (GQA heads x query tokens) a program packs them all (decode).
DECODE_ROWS_MAX = 64


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """A config of the tile template (``templates/kvarn_decode.py.jinja``): split-K for a few
    query rows (:func:`decode_configs`), one split for many (:func:`prefill_configs`)."""

    block_n: int      # tokens per inner step (divides G)
    block_m: int      # query rows per program (>= 16 for tl.dot; heads x positions)
    split: int        # tile-range splits walked in parallel (<= split_max)
    num_warps: int | None     # None: the loop's own (kernels.triton.attention.loop_warps)
    num_stages: int
    prefetch: bool | None = None   # the next step's loads issued before this step's math;
    #                                None: the loop's own (DECODE_PREFETCH)

    def resolved(self, phased: bool, dv: int = 128) -> "DecodeConfig":
        """This config with the loop's defaults filled in (phased: the fp16 phased loop; dv:
        the value head dim), the eager launcher's (``kvarn_decode_attention``) for the same
        block."""
        from kvarn_compile.kernels.triton.attention import DECODE_PREFETCH, loop_warps

        return dataclasses.replace(
            self, num_warps=loop_warps(phased, self.block_m, dv) if self.num_warps is None
            else self.num_warps,
            prefetch=DECODE_PREFETCH[phased] if self.prefetch is None else self.prefetch)

    def template_kwargs(self) -> dict[str, int]:
        if self.num_warps is None or self.prefetch is None:
            raise ValueError("Expected a resolved DecodeConfig (DecodeConfig.resolved).")
        return {"BLOCK_N": self.block_n, "BLOCK_M": self.block_m, "SPLIT": self.split,
                "PREFETCH": int(self.prefetch), "num_warps": self.num_warps,
                "num_stages": self.num_stages}


def tune_mode() -> str:
    """"default" | "autotune" | "exhaustive": how many template configs to offer on CUDA.

    (The lowering asks for "interpret" on CPU tensors in the CPU Triton mode: the default
    config and one other, so autotuning has two choices and the interpreter stays fast.)

    ``KVARN_AUTOTUNE`` (default/autotune/exhaustive) wins; otherwise Inductor's
    ``max_autotune`` selects "autotune".
    """
    env = os.environ.get("KVARN_AUTOTUNE", "").strip().lower()
    if env in ("default", "autotune", "exhaustive"):
        return env
    from kvarn_compile._torch_compat import inductor

    return "autotune" if inductor().config.max_autotune else "default"


def _pow2_at_least(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def length_bucket(tokens: int) -> int:
    """The cache capacity rounded up to a power of two (>= 1024)."""
    return _pow2_at_least(tokens, 1024)


def query_bucket(q_heads: int, kv_heads: int, q_len: int) -> str:
    rows = (q_heads // max(kv_heads, 1)) * q_len
    return "decode" if rows <= DECODE_ROWS_MAX else f"prefill{_pow2_at_least(q_len, 16)}"


def split_max(batch_kv_heads: int, tiles: int, sms: int) -> int:
    """Split slots of the partial outputs: about two waves of programs, <= tiles, <= 64."""
    want = -(-2 * sms // max(batch_kv_heads, 1))
    return max(1, min(want, tiles, 64))


def decode_configs(mode: str, *, group: int, rows: int, max_split: int) -> list[DecodeConfig]:
    """The default: the loop's own step (``loop_block_n``: the whole tile up to 128 for up
    to 16 rows), the lowering's split count, and the loop's own warps and prefetch (``DecodeConfig.resolved``: the phased fp16 loop 2 warps, its loads
    where they are used; the byte loop 4 warps, the next step's loads issued first). The
    byte loop's was the fastest of the sweep on an H200 (k4v2, G = 128, 32k and 128k
    tokens: 45 us and 168 us; BLOCK_N 64: 50 and 178; no prefetch: 56 and 205; 8 warps or
    twice the splits: slower); the phased loop's comes from its sm_90 static report."""
    from kvarn_compile.kernels.triton.attention import loop_block_n

    block_m = _pow2_at_least(rows)
    default = DecodeConfig(block_n=loop_block_n(block_m, group), block_m=block_m,
                           split=max_split, num_warps=None, num_stages=1)
    if mode == "default":
        candidates = [default]
    elif mode == "interpret":
        candidates = [default, DecodeConfig(block_n=max(16, min(64, group) // 2), block_m=block_m,
                                            split=max(1, max_split // 2), num_warps=None,
                                            num_stages=1)]
    elif mode == "autotune":
        splits = sorted({max_split, max(1, max_split // 2), max(1, max_split // 4)})
        candidates = [default] + [
            DecodeConfig(bn, block_m, s, w, 1)
            for bn, s, w in itertools.product((32, 64, 128), splits, (2, 4, 8))]
    else:
        splits = sorted({max(1, max_split >> k) for k in range(6)})
        candidates = [default] + [
            DecodeConfig(bn, block_m, s, w, st, pf)
            for bn, s, w, st, pf in itertools.product((16, 32, 64, 128), splits, (2, 4, 8),
                                                      (1, 2, 3), (True, False))]
    keep = [c for c in candidates if c.block_n <= group and group % c.block_n == 0
            and 1 <= c.split <= max_split]
    return list(dict.fromkeys(keep))


def prefill_configs(mode: str, *, group: int, rows: int, phased: bool) -> list[DecodeConfig]:
    """Multi-token shapes (``rows`` = query heads per kv head x query positions): one split,
    the loop's own block (``default_block_m``: 16 rows for the phased loop, ``phased`` being
    whether it runs phased at that block's step; up to 64 for the byte loop) and its own
    step, warps and prefetch for such a block."""
    from kvarn_compile.kernels.triton.attention import default_block_m, loop_block_n

    block_m = default_block_m(rows, phased)
    default = DecodeConfig(block_n=loop_block_n(block_m, group), block_m=block_m, split=1,
                           num_warps=None, num_stages=1)
    if mode == "default":
        candidates = [default]
    elif mode == "interpret":
        candidates = [default, DecodeConfig(block_n=max(16, min(64, group) // 2),
                                            block_m=max(16, block_m // 2), split=1,
                                            num_warps=4, num_stages=1)]
    elif mode == "autotune":
        # and the 16-row block at the loop's own step and warps (the byte loop's default is
        # larger: its unpacking is shared by a warp's rows, where the phased loop's is not),
        # and at 4 warps: the phased loop's 2-warp block keeps its loop out of local memory
        # on sm_90 with triton 3.9 but not with 3.6 (2-55 local loads per tile with a mask
        # and key frames), 4 warps with both, for ~40% more warp instructions per query row
        # (static report); which is faster is the GPU's to measure
        candidates = [default] + [DecodeConfig(loop_block_n(16, group), 16, 1, w, 1)
                                  for w in (None, 4)] + [
            DecodeConfig(bn, bm, 1, w, 1) for bm, bn, w in
            itertools.product((32, 64, 128), (32, 64, 128), (4, 8))]
    else:
        candidates = [default] + [DecodeConfig(bn, bm, 1, w, st, pf) for bm, bn, w, st, pf in
                                  itertools.product((16, 32, 64, 128), (16, 32, 64, 128),
                                                    (2, 4, 8), (1, 2, 3), (True, False))]
    keep = [c for c in candidates if c.block_n <= group and group % c.block_n == 0]
    return list(dict.fromkeys(keep))
