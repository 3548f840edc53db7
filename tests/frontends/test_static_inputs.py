"""The rewritten graphs keep what Dynamo says about their inputs, so CUDA graphs can run them.

AOTAutograd tells static inputs (parameters, buffers, tensors marked static such as a
transformers StaticCache's) from the others by Dynamo's metadata on the graph module and its
placeholders; ``mode="reduce-overhead"`` copies every non-static input into the graph on every
replay and skips a graph that mutates one. The backend rewrites a copy of Dynamo's graph: the
copy must carry that metadata, the packed states it adds must have their own (static in a
CUDA decode graph, whose steps never sync with the host), and AOTAutograd must read it
without error. Real compiles of a tiny Llama on CPU with a StaticCache (prefill, decode).
"""

from __future__ import annotations

import pytest
import torch

from kvarn_compile import _torch_compat, kvarn_backend
from kvarn_compile.backend import _mark_added_inputs
from kvarn_compile.testing import tiny_generate, tiny_model, tiny_prompt, tiny_static_cache
from kvarn_compile.testing import TINY_MAX_LEN as MAX_LEN, TINY_PRESET as PRESET


def _static(node) -> bool:
    return bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


@pytest.fixture()
def rewritten_graphs(monkeypatch):
    """The graph modules the backend hands to Inductor for a generate over a StaticCache."""
    torch._dynamo.reset()
    seen = []
    real = _torch_compat.compile_fx_with_pass

    def spy(gm, inputs, *args, **kwargs):
        seen.append(gm)
        return real(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(_torch_compat, "compile_fx_with_pass", spy)
    model = tiny_model("llama", "sdpa")
    model.compile(backend=kvarn_backend(**PRESET, max_cache_len=MAX_LEN))
    tiny_generate(model, tiny_prompt(1), cache=tiny_static_cache(model, 1), new=3)
    yield [gm for gm in seen
           if any(p.name.startswith("kvarn_") for p in gm.graph.find_nodes(op="placeholder"))]
    torch._dynamo.reset()


def test_rewritten_graphs_carry_dynamo_input_metadata(rewritten_graphs):
    from torch._functorch._aot_autograd.frontend_utils import _try_get_metadata_from_dynamo

    assert len(rewritten_graphs) == 2, "prefill and decode graphs"
    for gm in rewritten_graphs:
        assert "dynamo_compile_id" in gm.meta and hasattr(gm, "_param_name_to_source")
        placeholders = gm.graph.find_nodes(op="placeholder")
        assert all(hasattr(p, "_dynamo_source") for p in placeholders)
        added = [p for p in placeholders if p.name.startswith("kvarn_")]
        assert added and all(p._dynamo_source is None for p in added)
        # parameters and the StaticCache's marked tensors stay static; on CPU (no CUDA
        # graphs) the states are not marked
        assert any(_static(p) for p in placeholders)
        assert not any(_static(p) for p in added)
        # AOTAutograd reads it without error; the states count as static once marked (what
        # the backend does for a CUDA decode graph)
        params = dict(gm.named_parameters(remove_duplicate=False))
        n = len(params) + len(placeholders)
        _, before = _try_get_metadata_from_dynamo(gm, params.keys(), n, [])
        assert before, "static inputs must reach AOTAutograd"
        _mark_added_inputs(gm, len(added), static=True)
        _, after = _try_get_metadata_from_dynamo(gm, params.keys(), n, [])
        first = len(params) + placeholders.index(added[0])
        assert set(after) - set(before) == set(range(first, first + len(added)))
