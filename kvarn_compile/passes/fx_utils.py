"""Small helpers over Dynamo (torch-IR) FX graphs, shared by the pass's modules: op matching,
example values and compile-time sizes, basic indexes, naming a node in a reason (and
:class:`Unsupported`, the exception a reason travels in), the mutation-preserving DCE."""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

__all__ = ["is_op", "is_size_query", "example", "arg", "module_path", "dce", "single_user", "source_line", "model_frames", "concrete", "describe",
           "SDPA", "Unsupported", "same_size", "sizes_equal"]


SDPA = torch._C._nn.scaled_dot_product_attention

# Dynamo spells one op several ways: torch.foo(x), x.foo() (call_method "foo"), operator.foo.
_ALIASES: dict[str, tuple[Any, ...]] = {
    "matmul": (torch.matmul, operator.matmul),
    "softmax": (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax),
    "dropout": (torch.nn.functional.dropout, torch.dropout),
    "transpose": (torch.transpose,),
    "mul": (operator.mul, torch.mul),
    "truediv": (operator.truediv, torch.div),
    "add": (operator.add, torch.add),
    "sub": (operator.sub, torch.sub),
    "max": (torch.max,),
    "amax": (torch.amax,),
    "detach": (torch.detach,),
    "iadd": (operator.iadd,),
    "cat": (torch.cat,),
    "reshape": (torch.reshape,),
    "expand": (),
    "getitem": (operator.getitem,),
    "setitem": (operator.setitem,),
    "repeat_interleave": (torch.repeat_interleave,),
    "index_copy_": (),
    "narrow": (torch.narrow,),
    "copy_": (),
    "sdpa": (SDPA, torch.nn.functional.scaled_dot_product_attention),
    "einsum": (torch.einsum, torch.functional.einsum),
    "permute": (torch.permute,),
    "unsqueeze": (torch.unsqueeze,),
    "squeeze": (torch.squeeze,),
    "split": (torch.split, torch.functional.split),
    "linear": (torch.nn.functional.linear, torch._C._nn.linear),
    "flatten": (torch.flatten,),
    "index_put_": (torch.ops.aten.index_put_, torch.ops.aten.index_put_.default,
                   torch.index_put_),
    "masked_fill": (torch.masked_fill,),
    "where": (torch.where,),
    "swapaxes": (torch.swapaxes, torch.swapdims),
}
_METHOD_NAMES = {"truediv": ("div",), "mul": ("mul",), "add": ("add",), "sub": ("sub",),
                 "swapaxes": ("swapdims",)}


def is_op(node: Any, *names: str) -> bool:
    """True when ``node`` calls one of the named ops, as a function or as a method."""
    if not isinstance(node, fx.Node):
        return False
    for name in names:
        if node.op == "call_function" and node.target in _ALIASES.get(name, ()):
            return True
        if node.op == "call_method" and node.target in (name, *_METHOD_NAMES.get(name, ())):
            return True
    return False


def is_size_query(node: Any, of: fx.Node) -> bool:
    """True when ``node`` reads only the shape of ``of`` (``of.size()``, ``of.size(d)``,
    ``of.shape``, ``of.dim()``, ``aten.sym_size``): what Dynamo records for
    ``b, h, s, d = x.shape`` under dynamic shapes."""
    if not isinstance(node, fx.Node) or not node.args or node.args[0] is not of:
        return False
    if node.op == "call_method":
        return node.target in ("size", "dim")
    if node.op == "call_function":
        if node.target is getattr:
            return len(node.args) > 1 and node.args[1] == "shape"
        return node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default,
                               torch.ops.aten.dim.default)
    return False


def example(node: Any) -> Any:
    """The example (fake) value Dynamo recorded for ``node``, or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument ``name`` of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def model_frames(node: fx.Node) -> list[str]:
    """The ``File "...", line N, in f`` lines of the stack Dynamo recorded for ``node``,
    outermost first, without the frames of a tensor subclass's ``__torch_function__`` (a
    packed cache's type runs the op there; the model's own line is the one that asked)."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return [line.strip() for line in trace if line.strip().startswith("File ")
            and not line.strip().endswith("in __torch_function__")]


def source_line(node: fx.Node) -> str:
    """``file.py:LINE`` of the model code that produced ``node`` (its innermost frame), or
    "" when Dynamo recorded no stack trace."""
    frames = model_frames(node)
    if not frames:
        return ""
    loc = frames[-1].split(",")
    file = loc[0].split('"')[1].rsplit("/", 1)[-1] if '"' in loc[0] else loc[0]
    line = loc[1].strip().replace("line ", "") if len(loc) > 1 else "?"
    return f"{file}:{line}"


def describe(node: Any) -> str:
    """A node as a reason names it: ``op (file.py:LINE)``."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op == "placeholder":
        return f"graph input {node.name}"
    if node.op == "call_method":
        op = f".{node.target}()"
    else:
        op = getattr(node.target, "__name__", None) or str(node.target)
        op = {"setitem": "x[...] = ...", "getitem": "x[...]"}.get(op, op)
    where = source_line(node)
    return f"{op} ({where})" if where else op


class Unsupported(Exception):
    """A matched site that cannot be rewritten faithfully; the message is the reason."""


def module_path(node: fx.Node) -> str:
    """Dotted module path of the module that produced ``node`` (from nn_module_stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_path(str(path))


_ROOT = re.compile(r"^(L|G)(\[[^\]]*\])*\.?")


def _clean_path(path: str) -> str:
    # "L['self'].model.layers[0].self_attn" or "L['args'][0].model.layers[0].self_attn"
    #   -> "model.layers.0.self_attn"
    path = _ROOT.sub("", path)
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


def _impure(node: fx.Node) -> bool:
    # Dynamo records in-place methods (add_, index_copy_, copy_) as call_method nodes with
    # no users; the default DCE would delete them and silently drop the mutation. Calls into
    # functorch's C API (torch.vmap's _vmap_increment_nesting / _vmap_decrement_nesting,
    # grad levels) change interpreter state and often have no users either.
    if node.is_impure() or (node.op == "call_method" and str(node.target).endswith("_")):
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.setitem:
        return True
    module = getattr(node.target, "__module__", None) or ""
    name = getattr(node.target, "__name__", "") or ""
    return module.startswith("torch._C._functorch") or module.startswith("torch._functorch") \
        or "nesting" in name


def dce(graph: fx.Graph, keep: Iterable[fx.Node] = ()) -> None:
    """Dead-code elimination that keeps in-place method calls, setitem, functorch calls and
    ``keep`` (the pass passes every node that had no users before it ran: Dynamo graphs hold
    no dead pure code, so such a node is there for its side effect)."""
    kept = set(keep)
    graph.eliminate_dead_code(is_impure_node=lambda n: n in kept or _impure(n))


# ------------------------------------------------------------------------------ sizes and indexes
def same_size(a: Any, b: Any) -> bool:
    """``a == b`` known at compile time: ints, or SymInts (or the nodes producing them)
    with one and the same expression."""
    a, b = example(a), example(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        try:
            return bool(statically_known_true(a == b))
        except Exception:  # noqa: BLE001 - not provable
            return str(getattr(a, "node", a)) == str(getattr(b, "node", b))
    return False


def sizes_equal(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _shape(node: Any) -> tuple | None:
    val = example(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _expand_index(index: Any, ndim: int) -> list | None:
    """A getitem/setitem index as one entry per axis, ``None`` entries for inserted axes and
    Ellipsis expanded to whole slices; None when it is not a plain basic index."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if sum(e is Ellipsis for e in entries) > 1:
        return None
    used = sum(e is not None and e is not Ellipsis for e in entries)
    if used > ndim:
        return None
    out = []
    for e in entries:
        if e is Ellipsis:
            out.extend([slice(None)] * (ndim - used))
            used = ndim
        else:
            out.append(e)
    return out + [slice(None)] * (ndim - sum(e is not None for e in out))


def _full(sl: slice, size: Any) -> bool:
    """``sl`` covers a whole axis of ``size``."""
    return isinstance(sl, slice) and sl.step in (None, 1) and sl.start in (None, 0) \
        and (sl.stop is None or same_size(sl.stop, size)
             or (isinstance(sl.stop, int) and isinstance(size, int) and sl.stop >= size))


def _noop_cast(n: fx.Node) -> bool:
    """``x.to(...)``, ``x.float()``, ``x.type_as(y)``... that changes neither dtype nor device:
    PyTorch returns ``x`` itself (an alias)."""
    if n.op != "call_method" or n.target not in ("to", "type", "type_as", "float", "double",
                                                 "half", "bfloat16", "contiguous"):
        return False
    src, out = example(n.args[0]), example(n)
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if n.target == "contiguous":
        return src.is_contiguous()
    return src.dtype == out.dtype and src.device == out.device


def concrete(n: Any) -> Any:
    """``n``, or its value when it is a symbolic size whose value is known (Dynamo made the
    size dynamic, then a guard fixed it: no free symbols left)."""
    return int(n) if isinstance(n, torch.SymInt) and is_concrete_int(n) else n
