"""Quality evaluation of KV-cache quantizers on a real model: ``kvarn-compile eval``.

    from kvarn_compile.eval import EvalSettings, run_eval, write_outputs

    result = run_eval(EvalSettings(presets=("k2v2",), lengths=(512, 1024)))
    write_outputs(result, "eval-out")       # eval.json, summary.md, *.png

Modules:

* :mod:`.harness` - static and pseudo-decode runners, the pseudo-decode cache
  (:class:`PseudoQuantCache`), KL/top-1, and the backends that build a quantized cache
  (:func:`packed_backend`: the real ``KVarNCache``; a compile backend plugs in the same way);
* :mod:`.diagnostics` - per-layer K/V/attention-output errors, the magnitude/direction
  split by error quantile, the outlier-restore experiment;
* :mod:`.product` - packed cache vs simulation, and greedy generation through the cache;
* :mod:`.retrieval` - numbered-line retrieval under pseudo-decode;
* :mod:`.suite` - :class:`EvalSettings` and :func:`run_eval` (the whole run);
* :mod:`.report` - JSON, markdown summary and plots.
"""

from .harness import (ALL_METHODS, RULES, PseudoQuantCache, PseudoQuantLayer, QuantBackend,
                      block_logits, fp_reference, kl_top1, method_config, packed_backend,
                      pseudo_decode_metrics, quantize_prefix, run_blocks, simulated_backend,
                      static_block_logits)
from .product import generation_check, product_pseudo_decode, simulated_like_product
from .report import markdown_summary, write_outputs
from .retrieval import build_prompts, retrieval_eval
from .suite import FAITHFUL_KL, EvalSettings, FaithfulnessError, paired_difference, quick_settings, run_eval

__all__ = [
    "ALL_METHODS", "RULES", "EvalSettings", "FAITHFUL_KL", "FaithfulnessError", "PseudoQuantCache",
    "PseudoQuantLayer", "QuantBackend", "block_logits", "build_prompts", "fp_reference",
    "generation_check", "kl_top1", "markdown_summary", "method_config", "packed_backend", "paired_difference",
    "product_pseudo_decode", "pseudo_decode_metrics", "quantize_prefix", "quick_settings",
    "retrieval_eval", "run_blocks", "run_eval", "simulated_backend", "simulated_like_product",
    "static_block_logits", "write_outputs",
]
