"""The main job, ``kvarn-compile run``: what KVarN does for a real model at a long context.

1. **load**: the default model (SmolLM2-135M-Instruct, fp32) twice, and a prompt of
   ``prompt_tokens`` tokens of real text (the Lee news corpus unless told otherwise).
2. **prefill**: by default the prompt runs once through the uncompiled model in full
   precision, in chunks, into a transformers ``StaticCache`` of prompt + new tokens, and
   every model starts from a copy of it (``prefill_mode="compiled"``: each compiled model
   prefills itself, see :func:`.speed.prefill`).
3. **compile and generate**: one copy of the model is compiled with ``kvarn_backend(preset)``
   (as a user writes it; its first step takes the prompt's K/V over into packed states and
   releases the fp buffers, which is what transformers' ``generate(...,
   compile_config=...)`` does too); the other is the uncompressed baseline, compiled with
   plain ``torch.compile`` (Inductor) and also run eager. ``new_tokens`` greedy tokens of
   the Inductor model; the KVarN and eager models are fed the same tokens in the same loop,
   which times every step of all three, interleaved, after two warm-up steps that compile
   the decode graphs.
4. **quality**: on every decoded position, KL(uncompressed ‖ KVarN) and top-1 agreement
   (teacher-forced: both saw the same tokens), and the first position where KVarN's greedy
   choice differs, which is where free-running greedy streams part. The eager model
   against the Inductor model gives the floor of these numbers (rounding only).
5. **memory**: the full-precision cache's bytes against the packed states' bytes in use
   (tokens held) and allocated (capacity), bits per element.

Settings are arguments of :func:`run_main_job` (and flags of ``kvarn-compile run``):
context length, chunk, new tokens, preset, corpus, compiler.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

__all__ = ["DEFAULTS", "run_main_job", "print_main_job", "add_run_command", "add_run_arguments",
           "validate_run_args", "run_from_args", "run_command"]

#: Defaults of ``kvarn-compile run``: a context where a KV cache dominates decode cost (on 2 CPU
#: cores KVarN decode only ties with Inductor fp32 at 2k tokens), short enough for about 5
#: minutes the first time (model conversion, corpora and C++ build once) and under 2 after
#: that on 2 mostly idle cores (docs/performance.md).
DEFAULTS = {"prompt_tokens": 8192, "new_tokens": 32, "chunk": 512, "preset": "k4v2",
            "corpus": "lee", "warmup": 2, "prefill": "eager"}


@torch.no_grad()
def run_main_job(model_name: str | None = None, *, preset: str = DEFAULTS["preset"],
                 prompt_tokens: int = DEFAULTS["prompt_tokens"], new_tokens: int = DEFAULTS["new_tokens"],
                 chunk: int = DEFAULTS["chunk"], corpus: str = DEFAULTS["corpus"],
                 compiler: str = "inductor", eager: bool = True, warmup: int = DEFAULTS["warmup"],
                 prefill_mode: str = DEFAULTS["prefill"], progress: bool = True) -> dict[str, Any]:
    """Run the main job (see the module docstring); return every number as a JSON-ready dict."""
    from kvarn_compile.config import get_config
    from kvarn_compile.eval.harness import kl_top1
    from kvarn_compile.eval.models import CORPORA, DEFAULT_MODEL, load_model, text_windows
    from kvarn_compile.hf import kv_geometry

    from .progress import Phases
    from .speed import (cache_bytes, decode_interleaved, eager_runner, make_runners, packed_bytes,
                        prefill, spread)

    _check(prompt_tokens=prompt_tokens, new_tokens=new_tokens, chunk=chunk, warmup=warmup)
    chunk = min(chunk, prompt_tokens)
    cfg = get_config(preset)
    phases = Phases(enabled=progress)
    with phases("load model and text"):
        kv_model, tok = load_model(model_name)
        fp_model, _ = load_model(model_name)
        ids = text_windows(tok, 1, prompt_tokens, corpus)
    max_len = prompt_tokens + new_tokens
    with phases("set up kvarn_backend and torch.compile"):
        runners = make_runners(kv_model, fp_model, preset=cfg, max_len=max_len, compiler=compiler,
                               eager=eager)
    build_cpu_kernels(phases)
    by = {r.name: r for r in runners}
    kv, ind = by["kvarn"], by["inductor"]
    fp_cache_allocated = cache_bytes(ind.cache)          # before anything can be released
    source = by.get("eager") or eager_runner(fp_model, max_len)
    last = prefill(runners, ids, chunk, phases, mode=prefill_mode, source=source)
    if prefill_mode == "compiled":   # the prompt's last logits differ only then
        for r in (kv, ind):
            r.logits.append(last[r.name])
    tokens = decode_interleaved(runners, int(last["inductor"].argmax()), prompt_tokens,
                                new_tokens - 1, phases, warmup=warmup)

    with phases("quality and memory"):
        fp_logits, kv_logits = torch.stack(ind.logits), torch.stack(kv.logits)
        kl, agree = kl_top1(fp_logits, kv_logits)
        # kv_logits[j] predicts generated token off + j; with an eager prefill the first token
        # comes from the shared full-precision prefill, so it is the same by construction
        off = new_tokens - len(kv.logits)
        kv_choice = kv_logits.argmax(-1)
        differs = (kv_choice != tokens[off:new_tokens]).nonzero()
        first_div = off + int(differs[0]) if len(differs) else new_tokens
        floor = None
        if eager:
            e_logits = torch.stack(by["eager"].logits)
            e_kl, e_agree = kl_top1(fp_logits[len(fp_logits) - len(e_logits):], e_logits)
            floor = {"kl_mean": float(e_kl.mean()), "kl_max": float(e_kl.max()),
                     "top1": float(e_agree.mean()), "positions": int(e_kl.numel())}
        steps = len(tokens) - 1                    # decode steps: tokens[i] fed, tokens[i + 1] predicted
        margin = fp_logits[-steps:].float().topk(2, dim=-1).values
        margin = (margin[:, 0] - margin[:, 1])
        kv_heads, head_dim = kv_geometry(kv_model)
        n_layers = kv_model.config.get_text_config(decoder=True).num_hidden_layers
        held = max_len - 1                        # the last token is predicted, never fed
        per_token = 2 * kv_heads * head_dim * n_layers   # K and V elements per token
        dtype = next(fp_model.parameters()).dtype
        fp_used = per_token * held * dtype.itemsize
        packed = packed_bytes(kv.backend)
        report = kv.backend.report
        released = report.released_bytes
        bpe_tiles = _tile_bpe(kv.backend, cfg, head_dim)

    with phases("same text through a KIVI cache of the same bits", note="simulated, for scale"):
        sim = same_size_baselines(fp_model, ind.cache, prompt_tokens, cfg, tokens[:steps],
                                  fp_logits[-steps:])

    speed = {r.name: {"label": r.label, "ms_per_step": spread(r.step_ms),
                      "tokens_per_s": 1e3 / spread(r.step_ms)["median"] if r.step_ms else None,
                      "steps_ms": r.step_ms, "warmup_steps_s": r.warmup_s,
                      "prefill_chunk_s": spread(r.prefill_s) if r.prefill_s else None,
                      "first_prefill_chunk_s": r.first_call_s.get("prefill"),
                      "first_decode_step_s": r.first_call_s.get("decode"),
                      "compile_timers_s": r.compile_timers_s,
                      "compiled": r.name != "eager"}
             for r in runners}
    ratios = {}
    for other in ("inductor", "eager"):
        if other in by and kv.step_ms and by[other].step_ms:
            paired = [o / k for o, k in zip(by[other].step_ms, kv.step_ms)]
            ratios[other] = {"median_ratio": spread(by[other].step_ms)["median"] / spread(kv.step_ms)["median"],
                             "paired": spread(paired)}
    text = tok.decode(tokens[:new_tokens])
    return {
        "model": model_name or DEFAULT_MODEL, "preset": preset, "config": cfg.short(),
        "dtype": str(dtype).replace("torch.", ""), "layers": n_layers, "kv_heads": kv_heads,
        "head_dim": head_dim, "corpus": corpus, "corpus_description": CORPORA[corpus].description,
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "chunk": chunk, "compiler": compiler,
        "warmup_steps": warmup, "prefill_mode": prefill_mode,
        "rewrite": {"sites_rewritten": len(report.rewritten), "sites_total": len(report.sites),
                    "graphs_compiled": report.graphs, "report": str(report)},
        "kv_bytes": {
            "tokens_held": held, "capacity_tokens": max_len,
            "full_precision_used": fp_used, "full_precision_dtype": str(dtype).replace("torch.", ""),
            "full_precision_allocated": fp_cache_allocated,
            "fp16_used": per_token * held * 2,
            "kvarn_used": packed["used"], "kvarn_allocated": packed["allocated"],
            "kvarn_used_by_region": packed["used_by_region"],
            "model_fp_buffers_released": released,
            "caches_released": released / fp_cache_allocated if fp_cache_allocated else None},
        "compression": {"vs_full_precision": fp_used / packed["used"], "vs_fp16": per_token * held * 2 / packed["used"]},
        "bpe_overall": 8 * packed["used"] / (per_token * held), "bpe_tiles": bpe_tiles,
        "speed": {"context_tokens": [prompt_tokens + warmup, max_len - 1], "runners": speed,
                  "kvarn_speedup": ratios},
        "quality": {"positions": int(kl.numel()), "first_position": off,
                    "teacher_forced_top1": float(agree.mean()),
                    "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                    "kl_per_position": [float(x) for x in kl],
                    "greedy_first_divergence": first_div, "noise_floor_eager_vs_inductor": floor,
                    "top2_margin_at_divergence": (float(margin[first_div - (new_tokens - steps)])
                                                  if first_div < new_tokens and first_div >= new_tokens - steps
                                                  else None),
                    "top2_margin_median": float(margin.median()),
                    "same_bits_simulated": sim},
        "text": {"prompt_tail": tok.decode(ids[0, -24:]), "uncompressed": text,
                 "kvarn_same_prefix": tok.decode(tokens[:first_div]),
                 "kvarn_diverging_token": tok.decode(kv_choice[first_div - off:first_div - off + 1])
                 if first_div < new_tokens else None,
                 "uncompressed_token_there": tok.decode(tokens[first_div:first_div + 1])
                 if first_div < new_tokens else None,
                 "side_by_side": _side_by_side(tok, tokens, kv_choice, off, first_div, new_tokens)},
        "phases_s": dict(phases.durations), "total_s": phases.elapsed(),
        "threads": torch.get_num_threads(),
    }


def build_cpu_kernels(phases) -> None:
    """Build the C++ CPU kernels now, as a phase of its own, when their current sources are not
    built yet (once per source version; kept under the kvarn cache folder). Otherwise the
    first compiled step would build them, unannounced, inside its compile time."""
    from kvarn_compile.kernels.cpu import attention, build, quantize

    if build.mode() == "0" or all(build.is_built(k) for k in ("attention", "quantize")):
        return
    with phases("build the C++ CPU kernels", note=f"once; kept in {build.build_dir()}"), \
            build.announced_elsewhere():
        attention.available()
        quantize.available()


def same_size_baselines(model, fp_cache, prompt_tokens: int, cfg, fed: torch.Tensor,
                        ref_logits: torch.Tensor) -> dict[str, Any]:
    """KL / top-1 of the decode positions over the prompt's K/V quantized once by KIVI with
    KVarN's bits, tile and sink (the eval's static setting, simulated in full precision): what
    another quantizer of the same size gives on the same text. (KVarN simulated the same way
    gave KL 0.0143 against the packed cache's 0.0145 on the default run; left out, it costs a
    minute.)

    ``fp_cache``: a full-precision ``StaticCache`` holding the prompt; ``fed`` [steps]: the
    decode steps' input tokens; ``ref_logits`` [steps, V]: the uncompressed model's logits."""
    from kvarn_compile.eval.harness import block_logits, kl_top1, method_config, quantize_prefix

    kv = [(layer.keys, layer.values) for layer in fp_cache.layers]
    out: dict[str, Any] = {"positions": int(fed.numel()), "setting": "prompt quantized once, decoded tokens exact"}
    for method in ("kivi",):
        prefix = quantize_prefix(kv, method_config(method, cfg), prompt_tokens)
        logits = block_logits(model, fed.view(1, -1), prefix)
        kl, agree = kl_top1(ref_logits, logits)
        out[method] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(agree.mean())}
    return out


def _side_by_side(tok, tokens: torch.Tensor, kv_choice: torch.Tensor, off: int, first_div: int,
                  new_tokens: int, n: int = 8) -> dict[str, list[str]] | None:
    """From the first divergence on, ``n`` positions: the uncompressed model's token and
    KVarN's choice at the same position, given the same (uncompressed) text before it."""
    if first_div >= new_tokens:
        return None
    stop = min(first_div + n, new_tokens, off + len(kv_choice))
    return {"uncompressed": [tok.decode(tokens[i:i + 1]) for i in range(first_div, stop)],
            "kvarn": [tok.decode(kv_choice[i - off:i - off + 1]) for i in range(first_div, stop)]}


def _tile_bpe(backend, cfg, head_dim: int) -> float | None:
    """Bits per element inside one packed K+V tile, from the live tensors."""
    state = next(iter(backend.states.values()), None)
    if state is None or not int(state.n_tiles.max()):
        return None
    per_tile = sum(t[0, 0, 0].numel() * t.element_size() for t in state.buffers[2:10])
    return 8 * per_tile / (2 * cfg.group_size * head_dim)


def _check(*, prompt_tokens: int, new_tokens: int, chunk: int, warmup: int) -> None:
    """The settings' own rules (the CLI reports them as usage errors, naming the flag)."""
    problems = validate_settings(prompt_tokens=prompt_tokens, new_tokens=new_tokens, chunk=chunk,
                                 warmup=warmup)
    if problems:
        raise ValueError("; ".join(msg for _, msg in problems))


def validate_settings(*, prompt_tokens: int, new_tokens: int, chunk: int,
                      warmup: int = DEFAULTS["warmup"]) -> list[tuple[str, str]]:
    """[(flag, message)] of every rule the settings break."""
    out = []
    if prompt_tokens < 1:
        out.append(("--prompt-tokens", f"expected --prompt-tokens >= 1, but got {prompt_tokens}"))
    if chunk < 1:
        out.append(("--chunk", f"expected --chunk >= 1, but got {chunk}"))
    elif prompt_tokens > chunk and prompt_tokens % chunk:
        lo = prompt_tokens // chunk * chunk
        out.append(("--prompt-tokens", f"expected --prompt-tokens to be a multiple of --chunk ({chunk}): "
                                       f"every prefill chunk has the same length, so one prefill graph "
                                       f"compiles; but got {prompt_tokens} (try {lo or chunk} or {lo + chunk})"))
    if new_tokens < warmup + 2:
        out.append(("--new-tokens", f"expected --new-tokens >= {warmup + 2} (the first {warmup} decode "
                                    f"steps compile and are not timed), but got {new_tokens}"))
    return out


# ------------------------------------------------------------------------------ CLI
RUN_HELP = "the main job: KVarN vs full precision on the real model"
RUN_DESCRIPTION = ("The main job: load the model, compile it with kvarn_backend and, next to it, "
                   "the same model with plain torch.compile (Inductor) over a full-precision "
                   "static cache; prefill a long prompt of real text through both, decode in one "
                   "interleaved loop and print KV bytes (in use and allocated), agreement with "
                   "the uncompressed model and decode speed with its spread.")


def add_run_command(sub) -> argparse.ArgumentParser:
    """The ``run`` subcommand and its arguments, on the subparsers ``sub``."""
    from kvarn_compile.eval.args import add_command

    return add_command(sub, "run", help=RUN_HELP, description=RUN_DESCRIPTION,
                       arguments=add_run_arguments)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    from kvarn_compile.config import PRESETS

    from kvarn_compile.eval.args import int_at_least

    from .cli import add_threads_argument
    from .speed import PREFILL_MODES

    d = DEFAULTS
    p.add_argument("--preset", default=d["preset"], choices=sorted(PRESETS),
                   help=f"KVarN format (default {d['preset']}: 4-bit keys, 2-bit values)")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=d["prompt_tokens"], metavar="N",
                   help=f"context: tokens of real text prefilled before generating (default "
                        f"{d['prompt_tokens']}; a multiple of --chunk)")
    p.add_argument("--new-tokens", type=int_at_least(d["warmup"] + 2, "two warm-up steps compile"),
                   default=d["new_tokens"], metavar="N",
                   help=f"greedy tokens generated and compared; all but the first {d['warmup'] + 1} "
                        f"are timed steps (default {d['new_tokens']})")
    p.add_argument("--chunk", type=int_at_least(1), default=d["chunk"], metavar="N",
                   help=f"prefill chunk length in tokens (default {d['chunk']})")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                   help="what runs kvarn_backend's rewritten graphs (default inductor; eager: no "
                        "Inductor compile of the KVarN model)")
    p.add_argument("--prefill", choices=PREFILL_MODES, default=d["prefill"],
                   help="eager (default): the prompt runs once through the uncompiled model in full "
                        "precision and every model starts from a copy of that cache; the KVarN "
                        "model's first compiled step packs it (as transformers' generate with a "
                        "compile_config); compiled: each compiled model prefills itself (compiles a "
                        "prefill graph; KVarN chunks attend the packed earlier chunks; slower)")
    p.add_argument("--no-eager", action="store_true",
                   help="leave the eager model out of the speed comparison")
    p.add_argument("--kv-report", action="store_true",
                   help="first print the quantizer report of 'kvarn-compile kv-report' (one window)")
    p.add_argument("--skip-kv-report", action="store_true", help=argparse.SUPPRESS)  # the old default
    add_threads_argument(p)


def validate_run_args(args: argparse.Namespace) -> None:
    from kvarn_compile.eval.args import UsageError

    problems = validate_settings(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                 chunk=args.chunk)
    if problems:
        flag, msg = problems[0]
        raise UsageError(f"argument {flag}: {msg}")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_grad_enabled(False)
    results: dict[str, Any] = {}
    if args.kv_report:
        from .kv_report import kv_report, print_kv_report

        rep = kv_report(args.model, tokens=1024, windows=1, corpus=args.corpus,
                        progress=not args.no_progress)
        print_kv_report(rep)
        results["kv_report"] = rep
    res = run_main_job(args.model, preset=args.preset, prompt_tokens=args.prompt_tokens,
                       new_tokens=args.new_tokens, chunk=args.chunk, corpus=args.corpus,
                       compiler=args.compiler, eager=not args.no_eager, prefill_mode=args.prefill,
                       progress=not args.no_progress)
    print_main_job(res)
    results["main"] = res
    return results


def run_command(args: argparse.Namespace) -> int:
    """Run ``kvarn-compile run`` with checked ``args``: under ``--threads``, results to ``--json``."""
    from .cli import run_with_threads

    return run_with_threads(args, "run", run_from_args)


# ------------------------------------------------------------------------------ output
def _tile_bpe_at(config_short: str, head_dim: int) -> float:
    """Bits per element of one packed K+V tile at ``head_dim`` for the preset whose
    ``KVarNConfig.short()`` is ``config_short`` (codes plus fp16 row scale, row zero and column
    scale of K and V; as :func:`_tile_bpe` measures on the live tensors)."""
    from kvarn_compile.config import PRESETS

    cfg = next(c for c in PRESETS.values() if c.short() == config_short)
    g, d = cfg.group_size, head_dim
    k = d * g * cfg.key_bits / 8 + 2 * (2 * d + g)
    v = g * d * cfg.value_bits / 8 + 2 * (2 * g + d)
    return 8 * (k + v) / (2 * g * d)


def _print_speed(p, res: dict[str, Any]) -> None:
    """The speed lines: first KVarN against the fastest uncompressed runner, then the table."""
    from .speed import format_spread

    sp = res["speed"]
    runners = sp["runners"]
    n = runners["kvarn"]["ms_per_step"]["n"]
    lo, hi = sp["context_tokens"]
    ratios = sp["kvarn_speedup"]
    p(f"  speed      decode at {lo}-{hi} tokens of context, {n} timed steps per model in one "
      "interleaved loop")

    def how(other: str) -> str:
        pr = ratios[other]["paired"]
        x = pr["median"]
        word = f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
        return (f"{word} than {runners[other]['label']} (median of the per-step ratios, IQR "
                f"{pr['p25']:.2f}-{pr['p75']:.2f})")

    plain = sorted((o for o in ("eager", "inductor") if o in ratios),
                   key=lambda o: runners[o]["ms_per_step"]["median"])
    if plain:
        best = plain[0]
        p(f"             KVarN is {how(best)}, the fastest uncompressed runner here")
        for other in plain[1:]:
            p(f"             and {how(other)}")
        if plain[0] == "eager" and "inductor" in plain:
            p("             (Inductor's step is the slower uncompressed one: in every layer its compiled "
              "graph copies the whole K and V cache out to every query head (repeat_kv) before "
              "attention, which eager hands the KV heads as they are; docs/performance.md)")
    p("             ms/step median [IQR] min-max:")
    for name, r in runners.items():
        tps = f"{r['tokens_per_s']:6.1f} tok/s" if r["tokens_per_s"] else "   n/a"
        what = {"kvarn": "compiled with kvarn_backend", "inductor": "torch.compile, full-precision static cache",
                "eager": "not compiled, full-precision static cache"}.get(name, "")
        p(f"             {r['label']:14} {format_spread(r['ms_per_step']):>34}  {tps}  ({what})")


def _print_quality(p, res: dict[str, Any], fp_dt: str) -> None:
    """Quality with its scale: the noise floor, a same-size KIVI cache, and why greedy streams part."""
    q, t = res["quality"], res["text"]
    floor, sim = q["noise_floor_eager_vs_inductor"], q.get("same_bits_simulated")
    div = q["greedy_first_divergence"]
    first = (" (the first token comes from the shared full-precision prefill)"
             if q.get("first_position") else "")
    p(f"  quality    {q['positions']} decoded positions{first}, each given the uncompressed model's "
      "greedy text so far (teacher-forced).")
    p("             KL(fp ‖ cache): how far the next-token distribution moves, nats/token (0: identical); "
      "top-1: share of positions with the same top token")
    p(f"             {'':44}{'KL mean':>9} {'(max)':>8}  {'top-1':>6}")
    p(f"             {'KVarN ' + res['preset'] + ', this run':44}{q['kl_mean']:9.4f} ({q['kl_max']:6.3f})  "
      f"{q['teacher_forced_top1']:6.3f}")
    if sim:
        for method, label in (("kivi", "KIVI, same bits (simulated)"),
                              ("kvarn", "KVarN, same bits (simulated)")):
            if method not in sim:
                continue
            r = sim[method]
            p(f"             {label:44}{r['kl_mean']:9.4f} ({r['kl_max']:6.3f})  {r['top1']:6.3f}")
    if floor:
        p(f"             {'noise floor: eager vs Inductor ' + fp_dt + ' (rounding)':44}{floor['kl_mean']:9.1e} "
          f"({floor['kl_max']:6.0e})  {floor['top1']:6.3f}")
    if sim:
        p(f"             (simulated: the prompt's K/V quantized once, the {sim['positions']} decoded tokens exact)")
    if div >= res["new_tokens"]:
        p(f"             free-running greedy decoding: KVarN picks the same {div} tokens")
    else:
        margin = q.get("top2_margin_at_divergence")
        gap = (f"; there the uncompressed model's two best tokens are {margin:.2f} logits apart (median "
               f"over all positions {q['top2_margin_median']:.2f})" if margin is not None else "")
        p("             free-running greedy decoding: "
          + ("KVarN's first token already differs" if div == 0 else
             f"KVarN picks the same first {div} tokens, then differs") + gap)
        p("             Why so early: a small model's greedy choice is often a near tie, so any change "
          "of the cache can flip it; after that, both streams continue different texts. The "
          "teacher-forced numbers above measure the cache; the divergence point mostly measures the ties.")
    p(f"  text       prompt ends  ...{t['prompt_tail']!r}")
    p(f"             uncompressed {t['uncompressed']!r}")
    if t["kvarn_diverging_token"] is None:
        p("             KVarN        the same tokens")
        return
    same = f"same first {div} tokens, then " if div else ""
    p(f"             KVarN        {same}{t['kvarn_diverging_token']!r} where the uncompressed "
      f"model has {t['uncompressed_token_there']!r}")
    sbs = t.get("side_by_side")
    if sbs:
        width = [max(len(repr(a)), len(repr(b))) for a, b in zip(sbs["uncompressed"], sbs["kvarn"])]
        row = lambda toks: " ".join(f"{x!r:{w}}" for x, w in zip(toks, width))  # noqa: E731
        p(f"             the next {len(width)} positions, each after the same uncompressed text "
          "(a token KVarN would pick differently is marked *):")
        p(f"               uncompressed {row(sbs['uncompressed'])}")
        p(f"               KVarN        {row(sbs['kvarn'])}")
        p("                            " + " ".join(("*" if a != b else " ").ljust(w)
                                                    for a, b, w in zip(sbs["uncompressed"], sbs["kvarn"], width)))


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def print_main_job(res: dict[str, Any], file=None) -> None:
    out = file or sys.stdout
    p = lambda *a: print(*a, file=out)  # noqa: E731
    kb, sp, rw = res["kv_bytes"], res["speed"], res["rewrite"]
    fp_dt = kb["full_precision_dtype"].replace("float", "fp")
    p(f"\nkvarn_backend({res['preset']!r}) on {res['model']} ({res['dtype']}, {res['layers']} layers, "
      f"{res['kv_heads']} KV heads x {res['head_dim']}): a prompt of {res['prompt_tokens']} tokens from the "
      f"{res['corpus_description']} (--corpus {res['corpus']}), then {res['new_tokens']} greedy tokens")
    caches = kb["caches_released"]
    graphs = rw["graphs_compiled"]
    per_graph = (f" ({res['layers']} layers x 2 graphs: prefill, decode)"
                 if graphs == 2 and rw["sites_total"] == 2 * res["layers"] else
                 f" ({res['layers']} layers, one decode graph)"
                 if graphs == 1 and rw["sites_total"] == res["layers"] else f" in {graphs} graphs")
    p(f"  rewrite    {rw['sites_rewritten']}/{rw['sites_total']} attention sites rewritten{per_graph}; "
      f"released the KVarN model's {fp_dt} StaticCache buffers "
      f"({_mib(kb['model_fp_buffers_released'])}"
      + (f" = {caches:g} cache of {kb['capacity_tokens']} tokens" if caches and abs(caches - round(caches)) < 1e-9
         else "") + ")")
    p(f"  KV cache   {kb['tokens_held']} tokens held: {fp_dt} {_mib(kb['full_precision_used'])}"
      + (f" ({_mib(kb['fp16_used'])} in fp16)" if fp_dt != "fp16" else "")
      + f" | KVarN {_mib(kb['kvarn_used'])} in use ({res['compression']['vs_full_precision']:.1f}x smaller"
      + (f" than {fp_dt}, {res['compression']['vs_fp16']:.1f}x than fp16)" if fp_dt != "fp16" else ")")
      + f", {_mib(kb['kvarn_allocated'])} allocated for {kb['capacity_tokens']} tokens")
    tiles = (f", {res['bpe_tiles']:.3f} in the packed tiles (codes plus their scales; the per-row "
             f"scales weigh more at head_dim {res['head_dim']} than at 128, where {res['preset']} tiles take "
             f"{_tile_bpe_at(res['config'], 128):.3f})" if res["bpe_tiles"] and res["head_dim"] != 128
             else f", {res['bpe_tiles']:.3f} in the packed tiles" if res["bpe_tiles"] else "")
    p(f"  bits/elem  {res['bpe_overall']:.2f} overall (the sink and the newest tokens stay exact in fp16)"
      f"{tiles}; {fp_dt} is {8 * (2 if fp_dt == 'fp16' else 4 if fp_dt == 'fp32' else 2)}")
    _print_speed(p, res)
    comp = []
    for r in sp["runners"].values():
        if not r["compiled"]:
            continue
        parts = [f"{what} {r[key]:.0f} s" for what, key in (("prefill", "first_prefill_chunk_s"),
                                                              ("decode", "first_decode_step_s"))
                 if r.get(key) is not None]
        comp.append(f"{r['label']} " + " + ".join(parts))
    eager_prefill = res["prefill_mode"] == "eager"
    p(f"  compile    {'; '.join(comp)} (first chunk / first step, incl. compiling"
      + ("; KVarN's first step also packs the prompt)" if eager_prefill else ")"))
    chunks = [f"{r['label']} {r['prefill_chunk_s']['median']:.2f} s" for r in sp["runners"].values()
              if r.get("prefill_chunk_s")]
    how = ("once, eager in full precision; every model starts from a copy of that cache"
           if eager_prefill else "through each compiled model")
    p(f"  prefill    {res['prompt_tokens']} tokens {how}; per {res['chunk']}-token chunk (median): "
      f"{', '.join(chunks) if chunks else 'n/a'}")
    _print_quality(p, res, fp_dt)
    groups: dict[str, float] = {}
    for name, secs in res["phases_s"].items():
        key = next((k for k in ("build", "compile", "prefill", "decode") if name.startswith(k)),
                   "decode" if name.startswith("warm-up") else
                   "quality" if name.startswith(("quality", "same text")) else "load and set-up")
        groups[key] = groups.get(key, 0.0) + secs
    threads = f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}"
    p(f"  time       {res['total_s']:.0f} s in all ({threads}): "
      + ", ".join(f"{k} {v:.0f} s" for k, v in groups.items()))
