"""Test helpers shipped with the package (the test suite's one helper kit; nothing in the
package imports it): graph recording and normalization for golden tests, SQNR, the
float64 attention oracle (over dense K/V or a packed cache), K/V generators, packed-state
checks, the numerics check of a rewritten attention, lowering fixtures, and the tiny
random-weight models (transformers families and the examples of a source checkout)."""

from kvarn_compile.testing.graphs import normalize_graph, record_graphs  # noqa: F401
from kvarn_compile.testing.models import *  # noqa: F401,F403
from kvarn_compile.testing.oracles import *  # noqa: F401,F403
from kvarn_compile.testing.states import *  # noqa: F401,F403

__all__ = [
    "normalize_graph", "record_graphs", "sqnr",
    # attention oracle (float64)
    "oracle_attention", "oracle_latent_attention", "reference_attention",
    # K/V generators
    "random_kv", "kv_like",
    # packed states
    "SMALL_G", "SMALL_D", "SMALL_H", "SMALL_CAP", "small_presets", "small_kv",
    "packed_state", "attend", "assert_attention_matches", "bits_equal", "snapshot", "assert_unchanged",
    "tile_buffers", "assert_tiles_equal_reference", "assert_states_identical", "PackedSequence",
    "TILE_BUFFERS", "FACTOR_BUFFERS", "latent_sequence", "latent_rows",
    # rewritten attention against the true K/V
    "kvarn_ops_reference", "quantization_bound", "check_numerics",
    # lowering
    "no_graph_caches", "packed_cache", "shared_decomposition_case",
    # tiny models
    "TINY_PRESET", "TINY_MAX_LEN", "TINY_PROMPT", "TINY_NEW", "TINY_NEW_SHORT", "TINY_WINDOW",
    "TINY_VOCAB", "TINY_FAMILIES", "family_attentions", "EAGER_RTOL", "INDUCTOR_RTOL", "FLIP_RTOL",
    "tiny_config_kwargs", "build_tiny", "tiny_model", "sliding_layers", "tiny_static_cache",
    "tiny_prompt", "tiny_generate", "EagerOracle", "flipped_codes", "assert_same_generation",
    "cache_arg", "static_cache_crops", "cpu_inductor_compiles_dynamic_llama",
    "check_sites", "fp_prefill_then_kvarn",
    "examples_dir", "load_example", "gpt_fast_model", "nanogpt_model", "llama_ref_model",
    "EXAMPLES", "model_cache_buffers",
]
