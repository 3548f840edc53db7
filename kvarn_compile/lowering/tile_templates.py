"""The KVarN Triton template (CUDA only): source, grid function, TritonTemplate object.

The template source is package data (``kvarn_compile/lowering/templates/*.py.jinja``) loaded
with ``importlib.resources``. The ``TritonTemplate`` object is built lazily, on the first
CUDA lowering: Inductor cannot even render a template without a GPU driver, so nothing
here runs on a CPU-only machine (tests render it standalone: :func:`render_standalone`).

One template serves decode and multi-token shapes (prefill, chunked prefill, speculative
verify): the lowering's configs differ (splits of the tile range for a few query rows;
one split for many, in the loop's own block: ``default_block_m``), the program does not. How it shares the kernel's
body: the template is only the *driver* of one program (its grid position, the query rows
it packs, the split range, the loads of q/kv bounds/bias, the stores). The tile loop, i.e.
the in-register unpack of the codes, the dual-scale fold into the scores and the values
and the online softmax, is ``_decode_range`` of
:mod:`kvarn_compile.kernels.triton.attention`, which the rendered module imports (its last
lines). Triton inlines it at compile time and includes its source in its own cache key;
Inductor's cache key (the rendered text) gets ``KVARN_SRC``, a hash of kvarn's sources, so
an edited loop is never served from a stale cache. The standalone
``_kvarn_decode_attn_kernel`` calls the very same loop, and its tests
(tests/kernels/test_triton.py, interpreter on CPU) cover it.
"""

from __future__ import annotations

import functools
import importlib.resources

__all__ = ["template_source", "decode_template", "TEMPLATE_FILES",
           "render_standalone", "launch_standalone", "standalone_tensors"]

TEMPLATE_FILES = ("kvarn_decode.py.jinja",)


def template_source(name: str) -> str:
    """The text of ``kvarn_compile/lowering/templates/<name>`` (package data)."""
    return (importlib.resources.files("kvarn_compile.lowering") / "templates" / name).read_text()


def kvarn_decode_grid(batch_kv_heads, rows, meta, *, cdiv):
    """How is this kernel parallelized?

    Grid (B * H, SPLIT, cdiv(GROUP_Q * TQ, BLOCK_M)). Program (b * H + h, s, mb) packs the
    query rows m = t * GROUP_Q + hg of kv head h (block mb: every query head hg of
    BLOCK_M / GROUP_Q consecutive positions t), so each packed K/V tile of a kv head is
    read and unpacked once for all of its query heads. The tiles the block can see,
    [min kv_lo // G, cdiv(max kv_hi, G)) clamped to n_tiles[b] (the causal tile skip of a
    multi-token block), are cut into SPLIT contiguous ranges; split s walks its range
    BLOCK_N tokens at a time with an online softmax and writes its normalized partial and
    its lse to slot s. Decode splits the tile range across programs (few rows); multi-token
    shapes run one split (many row blocks keep the GPU busy). The caller merges the slots by
    log-sum-exp (Inductor-generated code).
    """
    return (batch_kv_heads, meta["SPLIT"], cdiv(rows, meta["BLOCK_M"]))


@functools.lru_cache(maxsize=None)
def decode_template():
    from kvarn_compile._torch_compat import inductor

    ind = inductor()
    return ind.triton_template("kvarn_decode", ind.SymbolicGridFn(kvarn_decode_grid),
                               template_source("kvarn_decode.py.jinja"))


# ------------------------------------------------------------------------------ standalone
def render_standalone(name: str, tensors: dict, constexprs: dict, directory, out_rank: int = 5):
    """Render a template into a plain ``@triton.jit`` function, without Inductor.

    Stand-ins for Inductor's jinja hooks: ``def_kernel`` becomes a ``def`` taking every
    input (in ``tensors`` order), the output ``OUT``, the strides and sizes of each and the
    ``constexprs``; ``stride``/``size`` read those arguments; ``store_output`` is a
    ``tl.store`` at the dot product of its indices with OUT's strides. The kernel body is
    the template's own text, so this runs the template's logic under ``TRITON_INTERPRET=1``
    on CPU (tests/lowering/test_lowering.py) and outside a compiled graph on a GPU (the benchmark).
    Launch it with :func:`launch_standalone`. ``directory``: where the module file goes
    (Triton reads the source of a jit function from its file).
    """
    import importlib.util
    import pathlib

    import jinja2

    names = list(tensors)
    ranks = {n: t.dim() for n, t in tensors.items()} | {"OUT": out_rank}
    params = names + ["OUT"]
    for n in names + ["OUT"]:
        params += [f"{n}_stride_{i}" for i in range(ranks[n])]
        params += [f"{n}_size_{i}" for i in range(ranks[n])]
    params += [f"{k}: tl.constexpr" for k in constexprs]

    def def_kernel(*argnames):
        if list(argnames) != names:
            raise ValueError(f"Expected the template's inputs {list(argnames)}, but got {names}.")
        return "@triton.jit\ndef kvarn_kernel(" + ", ".join(params) + "):"

    def store_output(indices, val, mask=None, val_shape=None):
        addr = " + ".join(f"({ix}) * OUT_stride_{k}" for k, ix in enumerate(indices))
        return f"tl.store(OUT + {addr}, {val}, mask={mask})"

    text = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(
        template_source(name)).render(
        def_kernel=def_kernel, store_output=store_output,
        stride=lambda n: ", ".join(f"{n}_stride_{k}" for k in range(ranks[n])),
        size=lambda n, i: f"{n}_size_{i % ranks[n]}", **constexprs)
    stem = "kvarn_standalone_" + name.split(".")[0]
    path = pathlib.Path(directory) / f"{stem}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + text)
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kvarn_kernel


def standalone_tensors(inputs, split_max: int) -> dict:
    """The tensor arguments of a :func:`render_standalone` kernel, by template name, from
    ``ops.attention.tile_inputs`` (the per-tile key frames and the bias only where present),
    and an lse buffer [B, Hq, Tq, split_max] of -inf."""
    import torch

    q_rot, qp, kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, nt, lo, hi, bias = inputs
    frames = kp is not None
    tensors = dict(Q=q_rot, **({"QP": qp} if frames else {}), KC=kc, KRS=krs, KRZ=krz, KCS=kcs,
                   VC=vc, VRS=vrs, VRZ=vrz, VCS=vcs, **({"KP": kp} if frames else {}),
                   NT=nt, KVLO=lo, KVHI=hi)
    if bias is not None:
        tensors["BIAS"] = bias.contiguous()
    tensors["LSE"] = torch.full((*q_rot.shape[:3], split_max), float("-inf"), device=q_rot.device)
    return tensors


def launch_standalone(kernel, tensors: dict, out, grid, constexprs: dict) -> None:
    """Run a :func:`render_standalone` kernel: tensors, OUT, then every stride and size."""
    args = [*tensors.values(), out]
    for t in (*tensors.values(), out):
        args += [*t.stride(), *t.shape]
    kernel[grid](*args, **constexprs)
