"""The KVarN FX pass: find attention and the KV-cache update feeding it, rewrite both.

The tables of recognized spellings (every row says which model code it covers; a site that
does not match exactly is left alone and reported with a reason):

* :mod:`.cache_writes` - ``CACHE_WRITES``: how a layer writes its new K/V rows into a cache
  (``index_copy_``, ``index_put_``, slice or positions assignment, ``narrow().copy_``,
  ``torch.cat``), and ``resolve_write``;
* :mod:`.reads` - ``KV_STEPS`` and ``trace_kv``: the view steps from an attention operand back
  to its cache (the cache's layout, the batch rows and positions read, the GQA expansion);
* :mod:`.attention_forms` - ``ATTENTIONS``: ``scaled_dot_product_attention`` and the eager
  matmul/einsum + softmax chain, scores in any order of batch, heads, queries and keys
  (``einsum("bshd,bthd->bsht")``, DeepSeek-V3) with the keys last (``AttentionSite``,
  ``MaskSpec``);
* :mod:`.window_caches` - ``WINDOW_CACHES``: sliding-window caches (the newest W kept, a
  roll), refused; a window *read* of a full cache (``k[:, :, max(0, end - W):end]``, per-layer
  windows) is rewritten: kvarn::attention reads [0, end) with the positions before the
  window masked out;
* :mod:`.stacked_caches` - caches stacked over layers (``cache_k[layer, :bsz, a:b] = xk``):
  one 4-D view per layer, which the tables then match as a per-layer cache.

The pass over a graph:

* :mod:`.matching` - pairing an attention with the writes feeding its K and V, and the checks;
* :mod:`.sites` - every attention site of a graph (``find_sites``), ``SiteReport``, site names;
  unrecognized attention and attention inside called subgraphs reported;
* :mod:`.rewrite` - the rewrite to ``kvarn::append_`` + ``kvarn::attention``, the cache
  hand-over, ``RewriteContext``, ``rewrite_graph``.

Helpers: :mod:`.fx_utils` (node matching, example values and sizes, ``Unsupported``, the
mutation-preserving DCE), :mod:`.graph_text` (the normalized graph text of the graph log and
the golden graph tests), :mod:`.context_parallel` (a rewritten graph's kvarn ops pointed at
their context-parallel forms).
"""

from kvarn_compile.passes.rewrite import rewrite_graph
from kvarn_compile.passes.sites import SiteReport, find_sites

__all__ = ["SiteReport", "find_sites", "rewrite_graph"]
