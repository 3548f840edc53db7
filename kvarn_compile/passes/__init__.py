"""The KVarN FX pass: find attention and the KV-cache update feeding it, rewrite both.

* :mod:`.patterns` - the tables of recognized spellings (cache writes, KV reads, attention);
* :mod:`.rewrite` - pairing, checks and the rewrite to ``kvarn::append_`` + ``kvarn::attention``;
* :mod:`.fx_utils` - node matching helpers and the mutation-preserving DCE.
"""

from kvarn_compile.passes.rewrite import SiteReport, find_sites, rewrite_graph

__all__ = ["SiteReport", "find_sites", "rewrite_graph"]
