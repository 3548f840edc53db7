"""Compile every Triton kernel and template of kvarn_compile for sm_90 (H100/H200) on any
machine, GPU or not, and print what decides their speed, one JSON object per kernel and config.

    python benchmarks/gpu/static_report.py             # every kernel and config (~1 min)
    python benchmarks/gpu/static_report.py --quick     # the decode and append kernels only (CI, ~40 s)
    python benchmarks/gpu/static_report.py --sass DIR  # also write each kernel's SASS there

How: Triton compiles through its NVIDIA backend down to a cubin without touching a GPU once it
has an active driver to ask for the target; a stand-in driver (``_StandInDriver``) answers
"cuda, sm_90, warp 32" and ``JITFunction.warmup`` does the rest (TTGIR, PTX, ptxas, cubin).
The templates are rendered standalone (``lowering.tile_templates.render_standalone``): Inductor
itself will not render a template without a real driver. Must run without
``TRITON_INTERPRET=1`` (the interpreter replaces ``@triton.jit`` functions at import); the
script drops it from its own environment before importing triton.

Per kernel and config:

* ``registers``, ``stack_bytes`` and ``local_bytes`` (``cuobjdump -res-usage`` on the cubin
  Triton built), ``spill_stores``/``spill_loads`` (bytes its SASS stores to and loads from local
  memory, as ``ptxas -v`` counts spills: read from that cubin, since ptxas run again on the PTX
  without Triton's own options allocates otherwise), ``shared_bytes`` (the dynamic shared
  memory Triton asks for at launch);
* ``ctas_per_sm``: resident CTAs on one sm_90 SM, the least of the register file (64 Ki
  registers, allocated per warp in units of 256), shared memory (228 KiB, 1 KiB reserved per
  CTA), 64 warps and 32 CTAs;
* ``loop_instructions``: SASS instructions executed per thread for one packed tile: the body of
  the outermost loop (a backward branch in the SASS before its last EXIT; the cold paths
  after it, such as a diverged shuffle's fallback, branch back too) times the runs of that loop per tile
  (G // BLOCK_N for the decode loop, which walks BLOCK_N tokens a step), with a nested inner
  loop counted as often as it runs per tile (the prefill template); ``loop_global_loads``: the
  global loads in that body by width; ``widest_global_load`` (bytes, 16 = LDG.E.128);
  ``loop_spill_instructions``: local loads and stores (spill traffic) in that body, counted
  the same way (a kernel's spills can sit outside its loop, where they cost once);
  ``loop_spill_stores``: the stores among them (0: the loop only reloads values set before
  it, from L1, and keeps its own state in registers). Where a block's rows have bounds
  (causal, windows: the templates, a prompt's launch), the phased loop runs the tiles every
  row sees whole apart from the edge tiles: ``loop_*`` is the former's loop (nearly every
  tile), ``edge_loop_instructions``/``edge_loop_spill_instructions``/``edge_loop_spill_stores``
  the edge tiles' (at most two per block and split);
* ``tile_bytes``: bytes of codes and scales read per packed tile (K and V; the per-tile cost of
  the memory wall);
* ``est_bandwidth_fraction`` (decode kernels): the issue-bound estimate below;
* ``row_instructions`` (multi-token blocks): warp instructions per query row and packed tile,
  ``loop_instructions * W / BLOCK_M``: a prefill's issue cost, comparable across block sizes
  (a larger block reads each tile from L2 for more rows; every warp of the phased loop
  still unpacks the whole tile for its own 16 rows).

Issue-bound model (decode). Decode attention over a packed cache is meant to be limited by
HBM bandwidth; it is instead limited by instruction issue when its loop is long. An sm_90 SM
has 4 warp schedulers that each issue at most one warp instruction per cycle. One CTA of W
warps spends ``loop_instructions * W`` warp instructions on a tile of ``tile_bytes`` bytes, so
with every SM busy and perfect issue (no stalls, no dual issue) the kernel reads at most::

    issue_bw = SMS * 4 * tile_bytes / (loop_instructions * W) * CLOCK_HZ

bytes per second, and ``est_bandwidth_fraction = min(1, issue_bw / HBM_BYTES_PER_S)`` with the
H200's 132 SMs, 1.98 GHz boost clock and 4.8 TB/s HBM3e. It is an upper bound: stalls (a byte
load is a 1-byte transaction per thread, so L1 throughput as well), the exact sink/tail and
the split merge come on top. A fraction near 1 means the loop is short enough that memory,
not issue, is the limit. The same bound for FlashAttention split-KV over an fp16 cache is
near 1 with 3x (4-bit keys / 2-bit values) to 5.3x (2/2) the bytes per token.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # compiled kernels, not the interpreter's stand-ins
# the kernels as a CUDA build of torch compiles them (kernels.use_inline_ptx), on any torch
os.environ.setdefault("KVARN_TRITON_PTX", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

#: H200 (sm_90) figures of the issue-bound model.
SMS = 132
CLOCK_HZ = 1.98e9
HBM_BYTES_PER_S = 4.8e12
SCHEDULERS_PER_SM = 4
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024
WARPS_PER_SM = 64
CTAS_PER_SM = 32

#: A second outermost loop with the longest one's matmuls and at least this share of its
#: instructions is the same tiles' loop, run apart (``loop_stats``: the phased loop's edge
#: tiles, 0.81-0.92 of the tile loop's on sm_90; the exact region's loops are ~0.3).
EDGE_LOOP_SHARE = 0.75

_BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _StandInDriver:
    """Just enough of an active Triton driver to compile for a CUDA target: the target, a
    device 0 and a stream 0. Launching anything through it fails."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return None

    def map_python_to_cpp_type(self, t):
        return t

    def __getattr__(self, name):
        raise AttributeError(f"the stand-in compile driver has no {name!r}: it compiles, never launches")


def resources(kernel, sass_text: str) -> dict:
    """Registers, stack and local memory of the compiled kernel (``cuobjdump -res-usage`` on
    the cubin Triton built), and its spill traffic: the bytes its local stores and loads move
    (``STL``/``LDL`` in its SASS, each as wide as it is), as ``ptxas -v`` counts spill bytes.
    Read from that cubin, not from ptxas run again on its PTX: Triton passes ptxas options of
    its own (3.9: ``--regAllocOptLevel=2``), and another allocation spills otherwise."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        cubin = pathlib.Path(d) / "c.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    for key, field in (("registers", "REG"), ("stack_bytes", "STACK"), ("local_bytes", "LOCAL")):
        m = re.search(rf"\b{field}:(\d+)", usage)
        out[key] = int(m[1]) if m else None
    moved = {"STL": 0, "LDL": 0}
    for _, body in _instructions(sass_text):
        op = re.sub(r"^@!?U?P\w+\s+", "", body).split()[0]
        kind = op.split(".")[0]
        if kind in moved:
            width = next((int(p) for p in op.split(".")[1:] if p in ("64", "128")), 32)
            moved[kind] += width // 8
    out["spill_stores"], out["spill_loads"] = moved["STL"], moved["LDL"]
    return out


def sass(kernel) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = pathlib.Path(d) / "k.cubin"
        p.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(_BIN / "cuobjdump"), "-sass", str(p)], capture_output=True,
                              text=True, check=True).stdout


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"BRA\s+(?:`?\(?\.?L?_?x?_?\d*\)?)?\s*(0x[0-9a-f]+)")
_LOAD_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def _instructions(text: str) -> list[tuple[int, str]]:
    return [(int(a, 16), body.strip()) for a, body in _INSN.findall(text)]


def _load_width(op: str) -> int | None:
    """Bytes per thread of a global load (LDG, or LDGSTS: cp.async to shared), else None."""
    if not (op.startswith("LDG") or op.startswith("LDGSTS")):
        return None
    parts = op.split()[0].split(".")
    width = 4
    for p in parts[1:]:
        width = _LOAD_WIDTH.get(p, width)
    return width


def loop_stats(text: str, inner_trips: int = 1, outer_trips: int = 1) -> dict:
    """Per-tile instruction count and global loads from SASS (see the module doc):
    ``outer_trips`` times the tile loop's body, a nested loop counted ``inner_trips`` times.

    The tile loop is the outermost loop with the most instructions; where the phased loop runs
    a range's edge tiles (per-row bounds) apart from the tiles every row sees whole, its
    SASS has two such loops (as many matmuls, the second within ``EDGE_LOOP_SHARE`` of the
    first's instructions): the shorter one, without the bounds, is the tile loop
    (``loop_*``), the other the edge loop (``edge_loop_instructions``,
    ``edge_loop_spill_instructions``, ``edge_loop_spill_stores``)."""
    insns = _instructions(text)
    # ptxas places cold paths after the kernel's last EXIT (the fallback of a warp shuffle
    # that may run diverged, ``BRA.DIV``, jumps there and back into the body): a backward
    # branch from there is not a loop
    last_exit = max((a for a, body in insns if re.sub(r"^@!?U?P\w+\s+", "", body)
                     .startswith("EXIT")), default=None)
    loops = []
    for addr, body in insns:
        op = re.sub(r"^@!?U?P\w+\s+", "", body)
        if op.startswith("BRA") and (last_exit is None or addr < last_exit):
            m = re.search(r"(0x[0-9a-f]+)", op)
            if m and int(m[1], 16) < addr:
                loops.append((int(m[1], 16), addr))
    if not loops:
        return {"loop_instructions": 0, "loop_global_loads": {}, "widest_global_load": None,
                "loop_spill_instructions": 0, "loop_spill_stores": 0}

    def count(lo, hi):
        return sum(1 for a, _ in insns if lo <= a <= hi)

    top = [ab for ab in loops
           if not any(o != ab and o[0] <= ab[0] and ab[1] <= o[1] for o in loops)]
    ops = [(a, re.sub(r"^@!?U?P\w+\s+", "", body)) for a, body in insns]

    def mmas(lo, hi):
        return sum(1 for a, op in ops if lo <= a <= hi and op.startswith(("HMMA", "HGMMA")))

    longest = max(top, key=lambda ab: count(*ab))
    # the same matmuls, a few bounds more or fewer: the same tiles' loop, run apart
    tile_loops = sorted((ab for ab in top if ab == longest or (
        count(*ab) >= EDGE_LOOP_SHARE * count(*longest) and mmas(*ab) == mmas(*longest) > 0)),
        key=lambda ab: count(*ab))

    def stats(outer):
        inner = [ab for ab in loops if ab != outer and outer[0] <= ab[0] and ab[1] <= outer[1]]

        def trips_of(a):
            return outer_trips * (inner_trips if any(lo <= a <= hi for lo, hi in inner) else 1)

        total = count(*outer)
        for lo, hi in inner:
            total += (inner_trips - 1) * count(lo, hi)
        total *= outer_trips
        # spill traffic (local loads / stores) inside the loop, counted as the instructions
        # are (stores: 0 means the loop only reloads values set before it, none of its own
        # state)
        local = [(a, op) for a, op in ops if outer[0] <= a <= outer[1]]
        spills = sum(trips_of(a) for a, op in local if op.startswith(("LDL", "STL")))
        spill_stores = sum(trips_of(a) for a, op in local if op.startswith("STL"))
        loads: dict[str, int] = {}
        for a, op in local:
            w = _load_width(op)
            if w is not None:
                key = f"{w}B" + ("_async" if op.startswith("LDGSTS") else "")
                loads[key] = loads.get(key, 0) + trips_of(a)
        return total, spills, spill_stores, loads

    total, spills, spill_stores, loads = stats(tile_loops[0])
    widest = max((int(k.split("B")[0]) for k in loads), default=None)
    out = {"loop_instructions": total, "loop_global_loads": loads, "widest_global_load": widest,
           "loop_spill_instructions": spills, "loop_spill_stores": spill_stores,
           "loops": len(loops)}
    if len(tile_loops) > 1:
        total, spills, spill_stores, _ = stats(tile_loops[-1])
        out.update(edge_loop_instructions=total, edge_loop_spill_instructions=spills,
                   edge_loop_spill_stores=spill_stores)
    return out


def ctas_per_sm(registers: int, warps: int, shared: int) -> int:
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // (regs_per_warp * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED_PER_CTA)
    return min(by_regs, by_shared, WARPS_PER_SM // warps, CTAS_PER_SM)


def tile_bytes(d: int, g: int, kb: int, vb: int, scale_bytes: int = 2, dv: int | None = None) -> int:
    """Codes and scales of one K tile [D, G] and one V tile [G, Dv] (state layout: rs/rz per
    row, cs per column); Dv = D unless given."""
    dv = d if dv is None else dv
    codes = d * g * kb // 8 + g * dv * vb // 8
    scales = (2 * d + g) + (2 * g + dv)
    return codes + scales * scale_bytes


def issue_bound_fraction(loop_instructions: int, warps: int, nbytes: int) -> float:
    if loop_instructions <= 0:
        return 0.0
    bw = SMS * SCHEDULERS_PER_SM * nbytes / (loop_instructions * warps) * CLOCK_HZ
    return min(1.0, bw / HBM_BYTES_PER_S)


# ------------------------------------------------------------------------------ cases
@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel and config to compile. ``family`` is what CI holds to no spills
    ("decode", "append") or only to compiling ("combine", "prefill")."""
    name: str
    family: str
    config: dict
    compile: object               # () -> compiled kernel
    warps: int
    nbytes: int | None = None     # codes + scales per tile (decode)
    inner_trips: int = 1          # runs of a nested loop per run of the outer loop
    outer_trips: int = 1          # runs of the outer loop per tile (decode: G // BLOCK_N chunks)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _decode_loop(precision, block_n, block_m, kb, dv, vb, phased, num_warps, prefetch):
    """The decode loop's path and its defaults, as the launchers pick them
    (``attention.phased_decode``, ``loop_warps``, ``DECODE_PREFETCH``); ``phased`` False
    forces the byte loop. Returns (phased, num_warps, prefetch, name suffix for non-defaults)."""
    from kvarn_compile.kernels.triton import attention as A

    auto = A.phased_decode(precision, block_n, kb, dv, vb)
    phased = auto if phased is None else (phased and auto)
    suffix = "" if phased == auto else "_bytes"
    if num_warps is None:
        num_warps = A.loop_warps(phased, block_m, dv)
    elif num_warps != A.loop_warps(phased, block_m, dv):
        suffix += f"_w{num_warps}"
    if prefetch is None:
        prefetch = A.DECODE_PREFETCH[phased]
    elif prefetch != A.DECODE_PREFETCH[phased]:
        suffix += "_prefetch" if prefetch else "_noprefetch"
    return phased, num_warps, prefetch, suffix


def _tile_tensors(b, h, n, d, dv, g, kb, vb):
    """Zero packed tiles (fp16 scales) for a warmup: k codes, row scale, col scale, v codes,
    row scale, col scale, n_tiles, key-frame flags (the zero points reuse the row scales)."""
    f16, u8 = torch.float16, torch.uint8
    return (torch.zeros(b, h, n, d, g * kb // 8, dtype=u8), torch.zeros(b, h, n, d, dtype=f16),
            torch.zeros(b, h, n, g, dtype=f16), torch.zeros(b, h, n, g, dv * vb // 8, dtype=u8),
            torch.zeros(b, h, n, g, dtype=f16), torch.zeros(b, h, n, dv, dtype=f16),
            torch.zeros(b, dtype=torch.int64), torch.zeros(b, h, n, dtype=u8))


def _decode_kernel_case(kb, vb, precision, *, d=128, g=128, hq=32, h=8, plain=False, block_m=16,
                        block_n=64, dv=None, num_warps=None, prefetch=None, phased=None):
    from kvarn_compile.kernels.triton import attention as A

    dv = d if dv is None else dv
    phased, num_warps, prefetch, suffix = _decode_loop(precision, block_n, block_m, kb, dv, vb,
                                                       phased, num_warps, prefetch)

    def build():
        b, n, split = 1, 4, 4
        q = torch.zeros(b, hq, 1, d)
        kc, krs, kcs, vc, vrs, vcs, nt, kp = _tile_tensors(b, h, n, d, dv, g, kb, vb)
        o = torch.zeros(b, hq, 1, split, dv)
        lse = torch.zeros(b, hq, 1, split)
        return A._kvarn_decode_attn_kernel.warmup(
            q, *q.stride()[:3], kc, krs, krs, kcs, vc, vrs, vrs, vcs, nt, nt, nt, q, 0, 0, 0,
            q, kp, o, lse, 1.0, h, n, 1, GROUP_Q=hq // h, D=d, BLOCK_D=_block(d), DV=dv,
            BLOCK_DV=_block(dv), G=g, K_BITS=kb,
            V_BITS=vb, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=prefetch,
            HAS_KV_START=False, HAS_KV_END=False, HAS_BIAS=False, HAS_K_PLAIN=plain,
            INPUT_PRECISION=precision, PHASED=phased, grid=(1,), num_warps=num_warps, num_stages=1)

    cfg = dict(kernel="_kvarn_decode_attn_kernel", k_bits=kb, v_bits=vb, D=d, G=g,
               group_q=hq // h, BLOCK_M=block_m, BLOCK_N=block_n, input_precision=precision,
               k_plain=plain, num_warps=num_warps, prefetch=prefetch, phased=phased)
    if dv != d:
        cfg["DV"] = dv
    return Case(f"decode_kernel_k{kb}v{vb}_d{d}" + (f"v{dv}" if dv != d else "")
                + f"g{g}_n{block_n}_{precision}" + ("_plain" if plain else "") + suffix, "decode",
                cfg, build, num_warps, tile_bytes(d, g, kb, vb, dv=dv), outer_trips=g // block_n)


def _attention_case(kb, vb, precision, *, d=128, g=128, hq=32, h=8, block_n=128, dv=None,
                    mask=False, tq=1, block_m=None):
    """``_kvarn_attn_kernel``: the CUDA op in one launch (the tile loop of
    ``_decode_kernel_case`` plus the query rotation, the exact region and the merge), a
    16-bit cache (the exact region's dtype), with the launcher's defaults."""
    from kvarn_compile.kernels.triton import attention as A

    dv = d if dv is None else dv
    default_m = A.default_block_m(hq // h * tq, A.phased_decode(precision, A.loop_block_n(16, g),
                                                                 kb, dv, vb))
    block_m = default_m if block_m is None else block_m
    block_n = A.loop_block_n(block_m, g) if block_m > 16 else block_n
    phased, num_warps, prefetch, suffix = _decode_loop(precision, block_n, block_m, kb, dv, vb,
                                                       None, None, None)

    def build():
        f16 = torch.float16
        # a decode step: 4 tile splits and the exact region's programs, merged by the last;
        # a prompt: one program per block for all of it (FUSED), as the launcher runs them
        fused = tq > 1
        b, n, split, s, w = 1, 4, 1 if fused else 4, 128, 255
        q = torch.zeros(b, hq, tq, d, dtype=f16)
        rot, rot_v = torch.zeros(d, d), torch.zeros(dv, dv)
        sk, sv = torch.zeros(b, h, s, d, dtype=f16), torch.zeros(b, h, s, dv, dtype=f16)
        tk, tv = torch.zeros(b, h, w, d, dtype=f16), torch.zeros(b, h, w, dv, dtype=f16)
        kc, krs, kcs, vc, vrs, vcs, nt, kp = _tile_tensors(b, h, n, d, dv, g, kb, vb)
        m = torch.zeros(b, 1, tq, 4096, dtype=torch.bool)
        exact = 1 if fused else A.exact_splits(s + w)
        o = torch.zeros(b, hq, tq, split + exact, dv)
        lse = torch.zeros(b, hq, tq, split + exact)
        cnt = torch.zeros(b * h, dtype=torch.int32)
        return A._kvarn_attn_kernel.warmup(
            q, *q.stride()[:3], rot, rot_v, sk, sv, tk, tv, nt, nt, kc, krs, krs, kcs, vc, vrs,
            vrs, vcs, kp, m, 0, 0, m.stride(2), 1, 4096, o, lse, cnt, q, lse, cnt, o,
            1.0, h, n, tq, s, w, 0, 1, GROUP_Q=hq // h, D=d, BLOCK_D=_block(d), DV=dv,
            BLOCK_DV=_block(dv), G=g, K_BITS=kb, V_BITS=vb, SPLIT=split, EXACT=exact,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_E=A.EXACT_BLOCK, PREFETCH=prefetch, CAUSAL=True, MULTI=tq > 1,
            HAS_WINDOW=False, HAS_MASK=mask, MASK_ROW=mask and tq == 1, MASK_FLAG=mask,
            ERR_MASK=32, HAS_K_PLAIN=True,
            INPUT_PRECISION=precision, PHASED=phased, Q_SCRATCH=True, FUSED=fused,
            SCRATCH_W=max(_block(d), _block(dv)), grid=(1,),
            num_warps=num_warps, num_stages=1)

    cfg = dict(kernel="_kvarn_attn_kernel", k_bits=kb, v_bits=vb, D=d, G=g, group_q=hq // h,
               BLOCK_M=block_m, BLOCK_N=block_n, input_precision=precision, k_plain=True,
               num_warps=num_warps, prefetch=prefetch, phased=phased, mask=mask, tq=tq)
    if dv != d:
        cfg["DV"] = dv
    return Case(f"attention_k{kb}v{vb}_d{d}" + (f"v{dv}" if dv != d else "")
                + f"g{g}_n{block_n}_{precision}" + (f"_tq{tq}" if tq > 1 else "")
                + ("_mask" if mask else "") + (f"_m{block_m}" if block_m != default_m else "")
                + suffix, "decode" if tq == 1 else "prefill",
                cfg, build, num_warps, tile_bytes(d, g, kb, vb, dv=dv), outer_trips=g // block_n)


def _latent_case(*, d=512, dv=64, g=128, kb=4, vb=8, hq=16, frames=False, precision="fp16"):
    """The split-K tile kernel of ``kvarn::latent_attention`` (absorbed multi-head latent
    attention: the latent, ``d`` channels at ``kb`` bits, read for the scores and the output;
    the RoPE key, ``dv`` at ``vb`` bits), one kv head for ``hq`` query heads, one query
    token, in the launcher's default config (``latent_attention.default_config``)."""
    from kvarn_compile.kernels.triton import latent_attention as L

    cfg_k = L.default_config(d, hq, torch.device("cuda"))
    block_n = min(g, cfg_k["block_n"])
    nf = 2 if frames else 1

    def build():
        f16, u8 = torch.float16, torch.uint8
        b, h, n, split, tq = 1, 1, 4, 4, 1
        q, qp = torch.zeros(b, hq, tq, d), torch.zeros(b, hq, tq, dv)
        kc = torch.zeros(b, h, n, d, g * kb // 8, dtype=u8)
        krs, kcs = torch.zeros(b, h, n, d, dtype=f16), torch.zeros(b, h, n, g, dtype=f16)
        vc = torch.zeros(b, h, n, g, dv * vb // 8, dtype=u8)
        vrs, vcs = torch.zeros(b, h, n, g, dtype=f16), torch.zeros(b, h, n, dv, dtype=f16)
        fac = torch.zeros(b, h, n, 1, dtype=f16)
        nt = torch.zeros(b, dtype=torch.int64)
        ids, cnt = torch.zeros(b, h, nf, n, dtype=torch.int32), torch.zeros(b, h, nf, dtype=torch.int32)
        o, lse = torch.zeros(b, hq, tq, nf, split, d), torch.zeros(b, hq, tq, nf, split)
        return L._latent_tiles_kernel.warmup(
            q, q, *q.stride()[:3], qp, *qp.stride()[:3], kc, krs, krs, kcs, vc, vrs, vrs, vcs,
            fac, fac, fac, fac, nt, nt, nt, q, 0, 0, 0, ids, cnt, o, lse, 1.0, h, n, tq,
            GROUP_Q=hq // h, D=d, BLOCK_D=_block(d), BLOCK_DC=cfg_k["block_dc"], DV=dv,
            BLOCK_DV=_block(dv), G=g, K_BITS=kb, V_BITS=vb, NF=nf, SPLIT=split,
            BLOCK_M=cfg_k["block_m"], BLOCK_N=block_n, PREFETCH=True, HAS_LO=False, HAS_HI=False,
            HAS_BIAS=False, HAS_FACTORS=False, INPUT_PRECISION=precision, grid=(1,),
            num_warps=cfg_k["num_warps"], num_stages=1)

    return _latent_row("_latent_tiles_kernel", "latent_kernel", build, cfg_k, block_n, kb=kb,
                       vb=vb, d=d, dv=dv, g=g, hq=hq, frames=frames, precision=precision)


def _latent_row(kernel: str, prefix: str, build, cfg_k: dict, block_n: int, *, kb, vb, d, dv, g,
                hq, frames, precision) -> "Case":
    """The report row of a latent attention kernel or template: one latent tile serves the
    scores and the output, so a tile's bytes are the codes and scales of it and of the
    RoPE tile."""
    cfg = dict(kernel=kernel, k_bits=kb, v_bits=vb, D=d, DV=dv, G=g, group_q=hq,
               BLOCK_M=cfg_k["block_m"], BLOCK_N=block_n, BLOCK_DC=cfg_k["block_dc"],
               frames=frames, input_precision=precision, num_warps=cfg_k["num_warps"])
    return Case(f"{prefix}_k{kb}v{vb}_d{d}v{dv}g{g}_n{block_n}_{precision}"
                + ("_frames" if frames else ""), "decode", cfg, build, cfg_k["num_warps"],
                tile_bytes(d, g, kb, vb, dv=dv), outer_trips=g // block_n)


def _combine_case(split=16, d=128):
    from kvarn_compile.kernels.triton import attention as A

    def build():
        o = torch.zeros(4, split, d)
        lse = torch.zeros(4, split)
        return A._combine_splits_kernel.warmup(
            o, lse, o, lse, D=d, BLOCK_D=d, SPLIT=split, BLOCK_S=triton.next_power_of_2(split),
            grid=(1,), num_warps=4)

    return Case(f"combine_splits_{split}", "combine", dict(kernel="_combine_splits_kernel",
                                                          SPLIT=split, D=d), build, 4)


def _quantize_case(kind, bits, *, d=128, g=128, iters_on=True):
    from kvarn_compile.kernels.triton import quantize as Q

    def build():
        f16 = torch.float16
        rows, cols = (d, g) if kind == "k" else (g, d)
        x = torch.zeros(1, 1, g, d, dtype=f16)
        rot = torch.zeros(d, d)
        codes = torch.zeros(1, 1, 2, rows, cols * bits // 8, dtype=torch.uint8)
        rs = torch.zeros(1, 1, 2, rows, dtype=f16)
        cs = torch.zeros(1, 1, 2, cols, dtype=f16)
        dst = torch.zeros(1, 1, dtype=torch.int64)
        return Q._kvarn_quantize_tiles_kernel.warmup(
            x, *x.stride()[:3], rot, codes, rs, rs, cs, dst, 8, 1, 2, 1,
            D=d, G=g, BLOCK_D=max(16, triton.next_power_of_2(d)), IS_K=kind == "k", BITS=bits,
            ROTATE=True, NORMALIZE=iters_on, ROT_CHUNK=Q._rot_chunk(d),
            SCRATCH=scratch(codes), PART_A=part_a, grid=(1,), num_warps=warps)

    def scratch(codes):
        rows, cols = (d, g) if kind == "k" else (g, d)
        return Q._scratch_fits(codes, rows, cols, bits, g if kind == "k" else Q._block_d(d))

    part_a = Q._part_a(kind, d)
    warps = Q._num_warps(d, g, part_a)   # the launcher's choices (quantize_tiles_into)
    cfg = dict(kernel="_kvarn_quantize_tiles_kernel", kind=kind, bits=bits, D=d, G=g,
               normalize=iters_on, num_warps=warps,
               scratch=iters_on and scratch(torch.zeros(1, 1, 2, d if kind == "k" else g,
                                                        (g if kind == "k" else d) * bits // 8,
                                                        dtype=torch.uint8)))
    if Q._rot_chunk(d):
        cfg["rot_chunk"] = Q._rot_chunk(d)
    if part_a:
        cfg["part_a"] = part_a
    return Case(f"quantize_{kind}{bits}_d{d}_g{g}", "append", cfg, build, warps)


def _append_decode_case(*, b=1, h=8, d=128, g=128, sink=128, tail=255, tiles=4,
                        exact=torch.float16, new=torch.bfloat16, dv=None):
    from kvarn_compile.kernels.triton import append as A

    dv = d if dv is None else dv

    def build():
        k = torch.zeros(b, h, 1, d, dtype=new)
        v = torch.zeros(b, h, 1, dv, dtype=new)
        sk = torch.zeros(b, h, sink, d, dtype=exact)
        tk = torch.zeros(b, h, tail, d, dtype=exact)
        st = torch.zeros(b, h, g, d, dtype=exact)
        sv = torch.zeros(b, h, sink, dv, dtype=exact)
        tv = torch.zeros(b, h, tail, dv, dtype=exact)
        stv = torch.zeros(b, h, g, dv, dtype=exact)
        c = torch.zeros(b, dtype=torch.int64)
        flags = torch.zeros((), dtype=torch.int32)
        kp = torch.zeros(b, h, tiles, dtype=torch.uint8)
        dh = torch.zeros(b * h, 1, dtype=torch.int64)
        return A._append_decode_kernel.warmup(
            k, v, *k.stride()[:2], k.stride(3), *v.stride()[:2], v.stride(3), c, sk, sv, tk, tv,
            c, c, c, c, st, stv, c, flags, 0, kp, dh, dh, h, H_P2=triton.next_power_of_2(h), D=d,
            BLOCK_D=triton.next_power_of_2(d), DV=dv, BLOCK_DV=triton.next_power_of_2(dv),
            S=sink, W=tail, G=g, N_MAX=tiles,
            BLOCK_T=min(g, 32), CHECK_RANGE=exact == torch.float16 and new != torch.float16,
            FRAMES=True, DOMINANCE=16.0, ERR_POS=1, ERR_CAP=2, ERR_TL=4, ERR_RNG=8, ERR_NF=16,
            ERR_MANY=64, grid=(1,), num_warps=4)

    cfg = dict(kernel="_append_decode_kernel", kv_heads=h, D=d, G=g, sink=sink, tail=tail,
               key_frames=True, num_warps=4)
    if dv != d:
        cfg["DV"] = dv
    return Case(f"append_decode_h{h}_d{d}" + (f"v{dv}" if dv != d else "") + f"_g{g}", "append",
                cfg, build, 4)


def _template_case(template, *, kb, vb, block_n, block_m, precision="tf32", d=128, g=128,
                   hq=32, h=8, tq=1, split=4, num_warps=None, num_stages=1, bias=False,
                   plain=False, prefetch=None, dv=None, phased=None, bool_mask=False):
    """The tile template (``kvarn_decode.py.jinja``) rendered standalone. tq > 1: a
    multi-token ("prefill") config, as ``heuristics.prefill_configs`` makes it: one split,
    the loop's own warps for the block."""
    from kvarn_compile.kernels.triton import attention as A
    from kvarn_compile.lowering.tile_templates import render_standalone

    family = "decode" if tq == 1 else "prefill"
    dv = d if dv is None else dv
    if family == "prefill":
        split = 1
    phased, num_warps, prefetch, suffix = _decode_loop(precision, block_n, block_m, kb, dv, vb,
                                                       phased, num_warps, prefetch)

    def build():
        f16, u8, i64 = torch.float16, torch.uint8, torch.int64
        b, n = 1, 4
        q = torch.zeros(b, hq, tq, d)
        tensors = dict(Q=q, **({"QP": q} if plain else {}),
                       KC=torch.zeros(b, h, n, d, g * kb // 8, dtype=u8),
                       KRS=torch.zeros(b, h, n, d, dtype=f16), KRZ=torch.zeros(b, h, n, d, dtype=f16),
                       KCS=torch.zeros(b, h, n, g, dtype=f16),
                       VC=torch.zeros(b, h, n, g, dv * vb // 8, dtype=u8),
                       VRS=torch.zeros(b, h, n, g, dtype=f16), VRZ=torch.zeros(b, h, n, g, dtype=f16),
                       VCS=torch.zeros(b, h, n, dv, dtype=f16),
                       **({"KP": torch.zeros(b, h, n, dtype=u8)} if plain else {}),
                       NT=torch.zeros(b, dtype=i64), KVLO=torch.zeros(b, tq, dtype=i64),
                       KVHI=torch.zeros(b, tq, dtype=i64))
        if bias:    # (bias 2: one row for the block, a bool mask as HF passes it)
            tensors["BIAS"] = torch.zeros(b, 1, tq, n * g, dtype=torch.bool
                                          if bias == 2 or bool_mask else torch.float32)
        split_max = split if family == "decode" else 1
        tensors["LSE"] = torch.zeros(b, hq, tq, split_max)
        out = torch.zeros(b, hq, tq, split_max, dv)
        # the constexprs the lowering passes (lowering/tiles.py)
        ce = dict(GROUP_Q=hq // h, D=d, BLOCK_D=_block(d), DV=dv, BLOCK_DV=_block(dv), G=g,
                  BLOCK_N=block_n, K_BITS=kb, V_BITS=vb,
                  SPLIT=split if family == "decode" else 1, SPLIT_MAX=split_max, BLOCK_M=block_m,
                  PREFETCH=int(prefetch),
                  HAS_BIAS=bias, HAS_K_PLAIN=plain, INPUT_PRECISION=precision, SM_SCALE=0.088,
                  KVARN_SRC=0, PHASED=phased,
                  KEY_PART=A.key_part(_block(d)) if family == "prefill" else 0)
        kernel = render_standalone(template, tensors, ce, _RENDER_DIR)
        args = [*tensors.values(), out]
        for t in (*tensors.values(), out):
            args += [*t.stride(), *t.shape]
        return kernel.warmup(*args, grid=(1,), num_warps=num_warps, num_stages=num_stages, **ce)

    cfg = dict(kernel=template.split(".")[0] + "_template", k_bits=kb, v_bits=vb, D=d, G=g,
               group_q=hq // h, TQ=tq, BLOCK_N=block_n, BLOCK_M=block_m,
               input_precision=precision, bias=bias, bool_mask=bool_mask or bias == 2,
               k_plain=plain, num_warps=num_warps,
               num_stages=num_stages, prefetch=prefetch)
    cfg["phased"] = phased
    if dv != d:
        cfg["DV"] = dv
    name = ("kvarn_prefill" if family == "prefill" else template.split('.')[0]) \
        + f"_k{kb}v{vb}" + (f"_d{d}v{dv}" if dv != d else f"_d{d}" if d != 128 else "") \
        + f"_n{block_n}_m{block_m}" + ("_bias" if bias else "") + ("row" if bias == 2 else "") \
        + ("_bool" if bool_mask and bias == 1 else "") \
        + ("_plain" if plain else "") + (f"_{precision}" if precision != "tf32" else "") + suffix
    return Case(name, family, cfg, build, num_warps,
                tile_bytes(d, g, kb, vb, dv=dv) if family == "decode" else None,
                outer_trips=g // block_n)


def _latent_template_case(*, d=512, dv=64, g=128, kb=4, vb=8, hq=16, frames=False,
                          precision="fp16", split=4):
    """The ``kvarn_latent`` template (the Inductor lowering of ``kvarn::latent_tile_partials_``,
    whose loop is the latent kernel's ``_latent_range``) rendered standalone with the
    constexprs ``lowering/latent.py`` passes, in the config it offers first (the launcher's
    ``latent_attention.default_config``), one query token, no mask."""
    from kvarn_compile.kernels.triton import latent_attention as L
    from kvarn_compile.lowering.latent import TEMPLATE_FILE
    from kvarn_compile.lowering.tile_templates import render_standalone

    cfg_k = L.default_config(d, hq, torch.device("cuda"))
    block_n = min(g, cfg_k["block_n"])
    nf = 2 if frames else 1

    def build():
        f16, u8, i32, i64 = torch.float16, torch.uint8, torch.int32, torch.int64
        b, h, n, tq = 1, 1, 4, 1
        q = torch.zeros(b, hq, tq, d)
        tensors = dict(Q=q, **({"QP": q} if frames else {}), QPE=torch.zeros(b, hq, tq, dv),
                       KC=torch.zeros(b, h, n, d, g * kb // 8, dtype=u8),
                       KRS=torch.zeros(b, h, n, d, dtype=f16), KRZ=torch.zeros(b, h, n, d, dtype=f16),
                       KCS=torch.zeros(b, h, n, g, dtype=f16),
                       VC=torch.zeros(b, h, n, g, dv * vb // 8, dtype=u8),
                       VRS=torch.zeros(b, h, n, g, dtype=f16), VRZ=torch.zeros(b, h, n, g, dtype=f16),
                       VCS=torch.zeros(b, h, n, dv, dtype=f16),
                       **({"IDS": torch.zeros(b, h, 2, n, dtype=i32),
                           "CNT": torch.zeros(b, h, 2, dtype=i32)} if frames else {}),
                       NT=torch.zeros(b, dtype=i64), KVLO=torch.zeros(b, tq, dtype=i64),
                       KVHI=torch.zeros(b, tq, dtype=i64))
        tensors["LSE"] = torch.zeros(b, hq, tq, nf, split)
        out = torch.zeros(b, hq, tq, nf, split, d)
        ce = dict(GROUP_Q=hq // h, D=d, BLOCK_D=_block(d), BLOCK_DC=cfg_k["block_dc"], DV=dv,
                  BLOCK_DV=_block(dv), G=g, BLOCK_N=block_n, K_BITS=kb, V_BITS=vb, NF=nf,
                  SPLIT=split, SPLIT_MAX=split, BLOCK_M=cfg_k["block_m"], PREFETCH=1,
                  HAS_BIAS=False, HAS_FACTORS=False, INPUT_PRECISION=precision, SM_SCALE=0.088,
                  KVARN_SRC=0)
        kernel = render_standalone(TEMPLATE_FILE, tensors, ce, _RENDER_DIR, out_rank=6)
        args = [*tensors.values(), out]
        for t in (*tensors.values(), out):
            args += [*t.stride(), *t.shape]
        return kernel.warmup(*args, grid=(1,), num_warps=cfg_k["num_warps"], num_stages=1, **ce)

    return _latent_row("kvarn_latent_template", "kvarn_latent", build, cfg_k, block_n, kb=kb,
                       vb=vb, d=d, dv=dv, g=g, hq=hq, frames=frames, precision=precision)


_RENDER_DIR = pathlib.Path(tempfile.mkdtemp(prefix="kvarn_static_"))


def cases(quick: bool) -> list[Case]:
    """Quick (CI): the decode kernel and the decode template in their production configs;
    the append kernels: the tile quantizer for keys and values at D = G = 128 and keys at
    64, and the decode step's append; for keys and values of different head dims (D = 192,
    Dv = 128) the decode kernel, the decode step's append and the key quantizer; the value
    quantizer past 128 channels (D = 192); the latent attention kernel (D = 512, Dv = 64);
    a prompt's default block (the prefill template and the op in one launch, with a
    bool mask and key frames); the decode kernel and template at head dim 256; the decode
    kernel, template and op with 2-bit keys (k2v2). Full: also
    the other code widths and precisions, the autotune configs, the combine kernel, the
    prefill template, more D = 192 and D = 256 configs, the quantizer at head dim 256 and
    for a latent state's keys (512), and the latent attention's template (``kvarn_latent``)."""
    out = [
        # the production configs: fp16 code matmuls (kernels.CUDA_PRECISION), BLOCK_N = G
        _decode_kernel_case(4, 2, "fp16", block_n=128),
        _attention_case(4, 2, "fp16"),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16,
                       precision="fp16"),
        _quantize_case("k", 4),
        _quantize_case("v", 2),
        _quantize_case("k", 4, d=64, g=64),
        _append_decode_case(),
        # keys and values of different head dims (MLA decompressed: D = 192 padded to 256 on
        # the score side, Dv = 128 on the value side); 128 query heads over 128 kv heads
        _decode_kernel_case(4, 2, "fp16", d=192, dv=128, hq=16, h=16, block_n=128),
        _append_decode_case(h=16, d=192, dv=128),
        _quantize_case("k", 4, d=192),   # (V tiles of Dv = 128: quantize_v2_d128_g128 above)
        # a V tile past 128 channels (16 warps, rotated in chunks): with triton 3.6 ptxas
        # failed to allocate its registers while the chunks were unrolled
        _quantize_case("v", 2, d=192),
        # absorbed multi-head latent attention (DeepSeek: latent 512 at 4 bits, RoPE key 64 at
        # 8 bits, 16 query heads per kv head)
        _latent_case(),
        # a prompt's queries in their default block (16 rows), key frames on and a bool mask
        # per row, as transformers passes one: the prefill template and the op in one launch
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       precision="fp16", bias=True, bool_mask=True, plain=True),
        _attention_case(4, 2, "fp16", tq=64, mask=True),
        # head dim 256 (Gemma 2 and 3; 2 query heads per kv head): the decode kernel and
        # template at 4 warps (loop_warps), the keys in two parts of 128
        _decode_kernel_case(4, 2, "fp16", d=256, hq=16, h=8, block_n=128),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16,
                       precision="fp16", d=256, hq=16, h=8),
        # 2-bit keys (k2v2) in the production configs: 70% of a k4v2 tile's bytes for the
        # same per-token work (softmax, scales), so a lower estimate at the same loop length
        _decode_kernel_case(2, 2, "fp16", block_n=128),
        _template_case("kvarn_decode.py.jinja", kb=2, vb=2, block_n=128, block_m=16,
                       precision="fp16"),
        _attention_case(2, 2, "fp16"),
    ]
    if quick:
        return out
    out += [
        # the byte loop (``_decode_range_bytes``) in the production config: the phased loop's
        # baseline
        _decode_kernel_case(4, 2, "fp16", block_n=128, phased=False),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16,
                       precision="fp16", bias=2, plain=True),
        # the op in one launch: a mask, 2-bit keys, MLA's head dims, a prefill block
        _attention_case(4, 2, "fp16", mask=True),
        _attention_case(4, 2, "fp16", d=192, dv=128, hq=16, h=16),
        _attention_case(4, 2, "fp16", tq=64),
        _attention_case(4, 2, "fp16", tq=64, block_m=64),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16,
                       precision="fp16", phased=False),
        _decode_kernel_case(4, 2, "tf32"),
        _decode_kernel_case(2, 2, "tf32"),
        _decode_kernel_case(4, 2, "ieee"),     # exact fp32 FMA dots (no tensor cores)
        _decode_kernel_case(4, 2, "tf32x3"),   # ~fp32 accuracy on tensor cores
        _decode_kernel_case(4, 2, "fp16"),     # fp16 operands (tf32's significand), fp32 sums
        _decode_kernel_case(2, 2, "fp16"),
        _decode_kernel_case(4, 2, "tf32", plain=True),
        _decode_kernel_case(4, 2, "tf32", d=64, g=64, hq=8, h=8),
        _quantize_case("k", 2),
        _quantize_case("v", 4),
        _quantize_case("k", 2, g=64),    # a 128 x 64 tile (8 warps; it spilled at 4)
        _quantize_case("k", 4, d=256),   # head dim 256 (Gemma): 16 warps, rotated in chunks,
        _quantize_case("v", 2, d=256),   # keys in two parts of 128 rows
        _quantize_case("k", 4, d=512),   # a latent state's keys (MLA absorbed: latent 512)
        # the largest value tile of 256-token tiles that quantize.tile_fits lets the kernel take
        _quantize_case("v", 2, d=128, g=256),
        _combine_case(),
        _template_case("kvarn_decode.py.jinja", kb=2, vb=2, block_n=64, block_m=16),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=64, block_m=16),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=64, block_m=16,
                       prefetch=False),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=32, block_m=16, num_warps=8),
        # a 256-query prompt, key frames on: the default block (16 rows, the decode step's)
        # with no mask, a bool mask per row (as transformers passes one), an fp32 one; the
        # 64-row block the autotuner also offers; the byte loop (tf32) at its own 64 rows
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       precision="fp16", plain=True),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       precision="fp16", bias=True, plain=True),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=64, block_m=64, tq=256,
                       precision="fp16", bias=True, bool_mask=True, plain=True),
        # the 16-row block at 4 warps (autotune): no spills, more warp instructions a row
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       precision="fp16", bias=True, bool_mask=True, plain=True, num_warps=4),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=64, block_m=64, tq=256,
                       bias=True, plain=True),
        # D = 192, Dv = 128 (the production configs are in the quick list)
        _decode_kernel_case(4, 2, "fp16", d=192, dv=128, hq=16, h=16, block_n=64),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=64, block_m=16, d=192, dv=128,
                       hq=16, h=16, precision="fp16"),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=4, block_n=64, block_m=16, d=192, dv=128,
                       hq=16, h=16),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       d=192, dv=128, hq=16, h=16, precision="fp16"),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       d=192, dv=128, hq=16, h=16, precision="fp16", bias=True, bool_mask=True,
                       plain=True),
        # D = 256: the op in one launch, for a decode step and a prompt's block; the prompt
        # template's block
        _attention_case(4, 2, "fp16", d=256, hq=16, h=8),
        _attention_case(4, 2, "fp16", d=256, hq=16, h=8, tq=64, mask=True),
        _template_case("kvarn_decode.py.jinja", kb=4, vb=2, block_n=128, block_m=16, tq=256,
                       precision="fp16", d=256, hq=16, h=8, bias=True, bool_mask=True,
                       plain=True),
        _latent_case(frames=True),
        _latent_case(g=64),
        _latent_case(kb=2),
        _latent_case(hq=128),
        # the same loop as the Inductor template of the latent attention's lowering
        _latent_template_case(),
        _latent_template_case(frames=True),
    ]
    return out


def report(case: Case, sass_dir: pathlib.Path | None = None) -> dict:
    row = {"name": case.name, "family": case.family, "config": case.config}
    try:
        # a failing ptxas makes triton print the kernel's whole PTX: to stderr, so that
        # stdout stays one JSON object per line
        with contextlib.redirect_stdout(sys.stderr):
            kernel = case.compile()
    except Exception as err:  # noqa: BLE001 - a compile error is a result, reported as such
        row["error"] = f"{type(err).__name__}: {str(err)[-1500:]}"
        return row
    text = sass(kernel)
    row.update(resources(kernel, text))
    row["shared_bytes"] = int(kernel.metadata.shared)
    row["num_warps"] = int(kernel.metadata.num_warps)
    row["ctas_per_sm"] = ctas_per_sm(row["registers"] or 255, row["num_warps"], row["shared_bytes"])
    if sass_dir is not None:
        (sass_dir / f"{case.name}.sass").write_text(text)
    row.update(loop_stats(text, case.inner_trips, case.outer_trips))
    if case.family == "prefill":
        row["row_instructions"] = round(row["loop_instructions"] * case.warps
                                        / case.config["BLOCK_M"], 1)
    if case.nbytes is not None:
        row["tile_bytes"] = case.nbytes
        row["est_bandwidth_fraction"] = round(
            issue_bound_fraction(row["loop_instructions"], case.warps, case.nbytes), 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="decode and append kernels only (CI)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass", type=pathlib.Path, default=None, help="write each kernel's SASS here")
    ap.add_argument("--only", default=None, help="a substring of the case names to keep")
    args = ap.parse_args(argv)
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    driver.set_active(_StandInDriver(args.arch))
    rows = []
    from kvarn_compile.kernels import use_inline_ptx

    print(json.dumps({"triton": triton.__version__, "torch": torch.__version__,
                      "arch": f"sm_{args.arch}", "inline_ptx": use_inline_ptx(),
                      "model": {"sms": SMS, "clock_hz": CLOCK_HZ,
                                "hbm_bytes_per_s": HBM_BYTES_PER_S}}))
    for case in cases(args.quick):
        if args.only and args.only not in case.name:
            continue
        row = report(case, args.sass)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
