"""The package's shape: imports run down a declared order of floors, no import circles, one
leaf for private torch APIs, one op library.

Read from the sources (``ast``), not by importing: every ``import`` counts, also the ones
inside functions (a lazy import hides a circle or an upward edge from Python but not from a
reader), except those under ``if TYPE_CHECKING:``. ``python tests/test_architecture.py``
prints the upward imports (none), the circles (none) and each module's floor and kvarn imports.
"""

from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = "kvarn_compile"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

#: The floors of the package, lowest first: a module may import its own floor and the floors
#: below it, never one above (docs/architecture.md draws the same order). A module's floor is
#: that of the longest prefix listed.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("config", "state", "_torch_compat", "paths")),
    ("quant", ("quant", "reference")),              # reference: quant's old name, one release
    ("kernels", ("kernels",)),
    ("ops", ("ops",)),
    ("autotune", ("autotune",)),
    ("passes/lowering", ("passes", "lowering")),
    ("report", ("report",)),
    ("front-ends", ("backend", "cache_book", "pre_grad_pass", "hf", "distributed", "")),   # "": the package API
    ("eval", ("eval",)),
    ("cli", ("cli",)),
    ("testing", ("testing",)),
)


def floor_of(module: str) -> int:
    """Index in :data:`FLOORS` of ``module`` (a dotted kvarn_compile module name)."""
    rel = module.removeprefix(PACKAGE).lstrip(".")
    best, level = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            hit = rel == prefix or rel.startswith(prefix + ".") or (prefix == "" and rel == "")
            if hit and len(prefix) > best:
                best, level = len(prefix), i
    if level is None:
        raise KeyError(f"{module} has no floor: add it to FLOORS in tests/test_architecture.py")
    return level


def upward_imports(graph: dict[str, dict[str, set[str]]] | None = None) -> list[str]:
    """Every import that runs up the floors, as "a (floor) -> b (floor)"."""
    graph = import_graph() if graph is None else graph
    out = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps["kvarn"]):
            if dep in graph and floor_of(dep) > floor_of(module):
                out.append(f"{module} ({FLOORS[floor_of(module)][0]}) -> {dep} "
                           f"({FLOORS[floor_of(dep)][0]})")
    return out


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """{"kvarn": kvarn modules imported, "external": other top-level names imported}."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    kvarn, external = set(), set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [(base, a.name) for a in node.names]
        for base, member in targets:
            full = f"{base}.{member}" if member else base
            if full in modules:              # a submodule: the edge goes to it
                target = full
            else:                            # a name from a module (or a package's __init__)
                target = base
                while target and target not in modules:
                    target = target.rpartition(".")[0]
            if target and target.split(".")[0] == PACKAGE:
                if target != name:
                    kvarn.add(target)
            else:
                external.add(full)
    return {"kvarn": kvarn, "external": external}


def import_graph() -> dict[str, dict[str, set[str]]]:
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in sorted(modules.items())}


def import_cycles(graph: dict[str, dict[str, set[str]]] | None = None) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph = import_graph() if graph is None else graph
    edges = {m: graph[m]["kvarn"] & graph.keys() for m in graph}
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


# ------------------------------------------------------------------------------ tests
def test_the_import_graph_reader_sees_a_circle():
    """The checker itself can fail: two modules importing each other (one lazily) is a circle."""
    graph = {"kvarn_compile.a": {"kvarn": {"kvarn_compile.b"}, "external": set()},
             "kvarn_compile.b": {"kvarn": {"kvarn_compile.a"}, "external": set()},
             "kvarn_compile.c": {"kvarn": {"kvarn_compile.a"}, "external": set()}}
    assert import_cycles(graph) == [["kvarn_compile.a", "kvarn_compile.b"]]
    tree_src = "def f():\n    from kvarn_compile.ops import attention\n"
    path = pathlib.Path(__file__).with_name("_lazy_import_probe.py")
    path.write_text(tree_src)
    try:
        found = imports_of("kvarn_compile.x", path, {"kvarn_compile.ops.attention": path,
                                                     "kvarn_compile.ops": path})
    finally:
        path.unlink()
    assert found["kvarn"] == {"kvarn_compile.ops.attention"}


def test_the_floor_checker_sees_an_upward_import():
    """The checker itself can fail: a pass importing a front-end (lazily) runs up the floors."""
    graph = {"kvarn_compile.passes.inductor": {"kvarn": {"kvarn_compile.backend"}, "external": set()},
             "kvarn_compile.backend": {"kvarn": {"kvarn_compile.passes.rewrite"}, "external": set()},
             "kvarn_compile.passes.rewrite": {"kvarn": set(), "external": set()}}
    assert upward_imports(graph) == ["kvarn_compile.passes.inductor (passes/lowering) -> "
                                     "kvarn_compile.backend (front-ends)"]
    assert floor_of("kvarn_compile") == floor_of("kvarn_compile.hf")
    assert floor_of("kvarn_compile.kernels.cpu.attention") < floor_of("kvarn_compile.ops.dispatch")


def test_every_module_has_a_floor_and_imports_only_run_down():
    graph = import_graph()
    for module in graph:
        floor_of(module)          # raises for a module no floor names
    up = upward_imports(graph)
    assert not up, "imports running up the floors (lazy ones included):\n  " + "\n  ".join(up)


def test_no_import_circles_in_the_package():
    cycles = import_cycles()
    assert not cycles, "import circles (lazy imports included): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_torch_compat_is_a_leaf_and_the_only_home_of_private_inductor_imports():
    graph = import_graph()
    assert graph[f"{PACKAGE}._torch_compat"]["kvarn"] == set()
    private = {m: sorted(e for e in g["external"] if e.startswith("torch._inductor"))
               for m, g in graph.items() if m != f"{PACKAGE}._torch_compat"}
    assert not {m: e for m, e in private.items() if e}


def test_every_op_is_declared_in_the_op_library():
    library = ROOT / "ops" / "library.py"
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        declares = any(s in text for s in ("custom_op(\"", "torch.library.define(", "Library(\""))
        assert not declares or path == library, f"{path.relative_to(ROOT)} declares an op"
    import torch

    import kvarn_compile.ops  # noqa: F401
    import kvarn_compile.autotune.tuning  # noqa: F401
    import kvarn_compile.lowering  # noqa: F401
    src = library.read_text()
    for name in dir(torch.ops.kvarn):
        op = getattr(torch.ops.kvarn, name)
        if isinstance(op, torch._ops.OpOverloadPacket):
            assert f'custom_op("kvarn::{name}"' in src, name


def test_the_references_are_pure_torch():
    """The oracles never call a kernel: the op references (ops/append.py, ops/attention.py,
    ops/regions.py) import no kernel, dispatch or lowering."""
    graph = import_graph()
    for ref in ("append", "attention", "regions"):
        deps = graph[f"{PACKAGE}.ops.{ref}"]["kvarn"]
        assert not {d for d in deps if d.startswith((f"{PACKAGE}.kernels", f"{PACKAGE}.ops.dispatch",
                                                     f"{PACKAGE}.lowering"))}, (ref, deps)


if __name__ == "__main__":
    g = import_graph()
    print("upward imports:", "\n  ".join([""] + upward_imports(g)) or "none")
    print("import circles:", import_cycles(g) or "none")
    for module, deps in g.items():
        print(f"{module} [{FLOORS[floor_of(module)][0]}]: {', '.join(sorted(deps['kvarn'])) or '-'}")
