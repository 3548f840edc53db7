"""``_torch_compat``'s stand-ins for Inductor APIs an older torch lacks (torch 2.11, the lent
GPU machine's), exercised here on the installed torch by taking those APIs away: the code a
GPU run on 2.11 goes through, tested in CI where only 2.13 is installed."""

from __future__ import annotations

import types

import pytest
import torch

from kvarn_compile import _torch_compat as compat


def test_user_lowerings_on_the_builtin_table_fall_back_and_restore(monkeypatch):
    import torch._inductor.lowering as lowering

    seen = []

    def fallback_handler(op, add_to_fallback_set=True):
        seen.append(("fallback", op, add_to_fallback_set))
        return lambda *a, **kw: ("fallback kernel", a)

    monkeypatch.setattr(lowering, "fallback_handler", fallback_handler)
    op = torch.ops.aten.sin.default
    table = {op: "built-in"}
    user = compat._UserLowerings(table)
    answers = iter([None, "ours"])
    user[op] = lambda *a, **kw: next(answers)
    assert op in user and table[op] is not user[op]
    assert table[op]("x") == ("fallback kernel", ("x",))      # None: Inductor's fallback kernel
    assert seen == [("fallback", op, False)]
    assert table[op]("x") == "ours"
    user.pop(op, None)
    assert table[op] == "built-in" and op not in user          # the previous entry is back
    fresh = torch.ops.aten.cos.default
    user[fresh] = lambda *a: "ours"
    user.pop(fresh, None)
    assert fresh not in table


def test_select_algorithm_gives_the_winner_where_inductor_returns_the_node_alone(monkeypatch):
    import torch._inductor.select_algorithm as sa

    node = object()
    monkeypatch.setattr(sa, "autotune_select_algorithm", lambda *a, **kw: node)
    inputs = [types.SimpleNamespace(get_name=lambda: "buf0")]
    slow, fast = object(), object()
    compat._remember_best({slow: 2.0, fast: 1.0, object(): float("inf")}, "kvarn_x", inputs,
                          [slow, fast], None, None)
    assert compat._select_algorithm("kvarn_x", [slow, fast], inputs, None) == (node, fast)
    # not benchmarked: the only choice, else unknown
    assert compat._select_algorithm("kvarn_x", [slow], inputs, None) == (node, slow)
    assert compat._select_algorithm("kvarn_x", [slow, fast], inputs, None) == (node, None)
    # a torch that returns (node, choice) is passed through, and leaves nothing behind
    compat._remember_best({slow: 1.0}, "kvarn_x", inputs, [slow, fast], None, None)
    monkeypatch.setattr(sa, "autotune_select_algorithm", lambda *a, **kw: (node, fast))
    assert compat._select_algorithm("kvarn_x", [slow, fast], inputs, None) == (node, fast)
    assert not compat._BEST


def test_extern_choices_are_made_once_without_inductors_registry(monkeypatch):
    import torch._inductor.select_algorithm as sa

    made = []

    class OldChoice:                      # no ``lookup`` classmethod, as in torch 2.11
        def __init__(self, fn, name, **kwargs):
            made.append(name)

    monkeypatch.setattr(sa, "ExternKernelChoice", OldChoice)
    monkeypatch.setattr(compat, "_EXTERN_CHOICES", {})
    first = compat._extern_choice(len, "kvarn_test_extern", has_out_variant=False)
    assert compat._extern_choice(len, "kvarn_test_extern", has_out_variant=False) is first
    assert made == ["kvarn_test_extern"]


def test_templates_freeze_their_inputs_where_inductor_cannot_be_told_to(monkeypatch):
    import torch._inductor.select_algorithm as sa
    from torch._inductor import ir

    made = {}

    class OldTemplate:                    # no ``always_freeze_layout``, as in torch 2.11
        def __init__(self, name, grid, source, debug=False):
            made.update(name=name)

    class Data:
        def __init__(self, layout):
            self.layout, self.frozen = layout, False

        def freeze_layout(self):
            self.frozen = True

    monkeypatch.setattr(sa, "TritonTemplate", OldTemplate)
    compat._triton_template("kvarn_test", None, "src")
    assert made == {"name": "kvarn_test"}
    flexible = Data(ir.FlexibleLayout(torch.device("cpu"), torch.float32, [2, 3]))
    fixed = Data(ir.FixedLayout(torch.device("cpu"), torch.float32, [2, 3]))
    compat._freeze_template_inputs([types.SimpleNamespace(data=flexible),
                                    types.SimpleNamespace(data=fixed)])
    assert flexible.frozen and not fixed.frozen


def test_on_the_installed_torch_the_template_is_frozen_exactly_once():
    """Told (always_freeze_layout) where the installed torch has it, else frozen by hand."""
    import inspect

    from torch._inductor import ir
    from torch._inductor.select_algorithm import TritonTemplate

    told = "always_freeze_layout" in inspect.signature(TritonTemplate.__init__).parameters
    frozen = []
    data = types.SimpleNamespace(layout=ir.FlexibleLayout(torch.device("cpu"), torch.float32, [4]),
                                 freeze_layout=lambda: frozen.append(True))
    compat._freeze_template_inputs([types.SimpleNamespace(data=data)])
    assert frozen == ([] if told else [True])
