"""Outputs of an evaluation: one JSON with every number, a markdown summary and PNG plots.

    paths = write_outputs(result, "eval-out")
    # eval.json, summary.md, kl_vs_context.png, block_kl.png, error_quantiles.png, layer_errors.png

Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

__all__ = ["to_jsonable", "write_json", "markdown_summary", "write_outputs", "plot_kl_vs_context",
           "plot_block_curves", "plot_error_quantiles", "plot_layer_errors"]

_COLORS = {"none": "tab:gray", "kivi": "tab:red", "hadamard": "tab:orange", "kvarn": "tab:blue",
           "kvarn+clip": "tab:green", "kvarn+krot": "tab:purple", "hadamard+krot": "tab:brown"}


def _color(method: str) -> str:
    """A fixed color per method; names not listed get one from a spare palette."""
    spare = ("tab:pink", "tab:olive", "tab:cyan", "black")
    return _COLORS.get(method) or spare[sum(map(ord, method)) % len(spare)]


def _curves(by_method: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(label, result, method) of every quantized method to draw; a method whose results equal an
    earlier one's (the same quantizer under another name, e.g. kvarn+clip at 4-bit keys) is
    folded into that one's label instead of drawn on top of it."""
    out: list[list] = []
    for method, res in by_method.items():
        if method == "none":
            continue  # KL ~ 1e-12: the faithfulness check, not a curve
        twin = next((c for c in out if c[1] == res), None)
        if twin is not None:
            twin[0] += f" = {method}"
        else:
            out.append([method, res, method])
    return [(label, res, method) for label, res, method in out]


def to_jsonable(obj: Any) -> Any:
    """Plain JSON types: non-finite floats become null, tuples lists, keys strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if hasattr(obj, "item"):  # tensors / numpy scalars
        return to_jsonable(obj.item())
    return str(obj)


def write_json(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text(json.dumps(to_jsonable(result), indent=1, allow_nan=False) + "\n")
    return path


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float) and spec == ".4f" and 0 < abs(x) < 1e-3:
        return f"{x:.2e}"
    return format(x, spec)


# ------------------------------------------------------------------------------ markdown
def markdown_summary(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"# KVarN quality evaluation: {s['model_name']}", ""]
    mi = s["model_info"]
    lines.append(f"{mi['class']}, {mi['layers']} layers, {mi['kv_heads']} KV heads, head_dim "
                 f"{mi['head_dim']}, {mi['dtype']}. Block b = {s['block']}, windows = {s['windows']}, "
                 f"pseudo-decode rule `{s['rule']}`, seed {s['seed']}. torch {s['versions']['torch']}, "
                 f"transformers {s['versions']['transformers']}, kvarn_compile {s['versions']['kvarn_compile']}.")
    if s.get("key_outliers_applied"):
        ko = s["key_outliers_applied"]
        lines.append(f"**Stress model**: key offsets {ko['channels']} (channel: value, every KV head, before "
                     f"RoPE) in layers {ko['layers']} (`--key-outliers`).")
    lines.append("")
    lines.append("KL = mean KL(fp ‖ quantized) of next-token distributions, nats/token; top-1 = agreement "
                 "of the argmax. Static: last block [L-b, L) over a once-quantized prefix. Pseudo: all "
                 "positions after the sink, blocks quantized as they are produced; 'last blk' = pseudo-decode "
                 "over the same positions as static.")
    for g in result["datasets"]:
        lines += ["", f"## {g['corpus']} (window offsets {g['window_offsets']}, {g['window_tokens']} tokens each)",
                  "", "| method | preset | L | static KL | static top-1 | pseudo KL | pseudo top-1 | pseudo last blk KL |",
                  "|---|---|---|---|---|---|---|---|"]
        for preset, by_m in g["results"].items():
            for method, r in by_m.items():
                for L, e in r["by_length"].items():
                    st, ps = e["static"], e["pseudo"]
                    lines.append(f"| {method} | {preset} | {L} | {_fmt(st['kl'])} | {_fmt(st['top1'], '.3f')} | "
                                 f"{_fmt(ps['kl'])} | {_fmt(ps['top1'], '.3f')} | {_fmt(ps['kl_last_block'])} |")
    f = result.get("faithfulness", {})
    if f.get("checked"):
        lines += ["", f"**Faithfulness** (method none vs plain model): static KL max {_fmt(f['static_kl_max'], '.2e')}, "
                      f"pseudo-decode KL max {_fmt(f['pseudo_kl_max'], '.2e')} (threshold {f['threshold']:.0e}): "
                      f"{'PASS' if f['passed'] else 'FAIL'}."]
    lines += ["", "## Paper findings", ""]
    for source, by_p in result.get("findings", {}).items():
        for preset, fnd in by_p.items():
            for name, val in fnd.items():
                lines.append(f"- {source} {preset}: `{name}` = {json.dumps(to_jsonable(val))}")
    d = result.get("diagnostics")
    if d:
        lines += ["", f"## Diagnostics (static, L = {d['length']}, {d['windows']} window(s))", "",
                  "| method | preset | K rel err | V rel err | attn-out rel err | K err share top 1% / top 5% | "
                  "magnitude share in top 1% / rest | static KL | KL restore top 5% | KL restore rest 95% | "
                  "MSE left after top 5% |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for preset, by_m in d["by_config"].items():
            for method, r in by_m.items():
                kb = {b["bucket"]: b for b in r["error_split"]["k"]["buckets"]}
                o = {(x["fraction"], x["restore"]): x for x in r["outliers"]}
                top5, rest5 = o.get((0.05, "top"), {}), o.get((0.05, "rest"), {})
                lines.append(
                    f"| {method} | {preset} | {_fmt(r['k_rel_mean'])} | {_fmt(r['v_rel_mean'])} | "
                    f"{_fmt(r['attn_out_rel_mean'])} | {_fmt(kb['top 1%']['error_share'], '.3f')} / "
                    f"{_fmt(kb['top 5%']['error_share'], '.3f')} | {_fmt(kb['top 1%']['magnitude_share'], '.3f')} / "
                    f"{_fmt(kb['rest 95%']['magnitude_share'], '.3f')} | {_fmt(r['baseline']['kl'])} | "
                    f"{_fmt(top5.get('kl'))} | {_fmt(rest5.get('kl'))} | {_fmt(top5.get('mse_remaining'), '.3f')} |")
    p = result.get("product_check")
    if p:
        lines += ["", f"## Product path (L = {p['length']}, b = {p['block']}, backend `{p['backend']}`, "
                      f"positions {p['positions']})", "",
                  "KL over the same positions. *packed*: the real cache, chunks of b tokens, tiles frozen "
                  "on append (before the chunk attends); *sim (cache rules)*: fake-quantize simulation with "
                  "the same rule and fp16 exact tokens; *packed deferred*: the real cache with "
                  "spec_tokens=b (a chunk stays exact while it attends = the paper's pseudo-decode); "
                  "*sim main*: the main pseudo-decode simulation; *noise*: relative KL change of the "
                  "simulation from dropping the fp16 rounding alone.", "",
                  "| method | preset | KL packed | KL sim (cache rules) | rel diff | KL packed deferred | "
                  "KL sim main | rel diff | noise | top-1 packed / sim |", "|---|---|---|---|---|---|---|---|---|---|"]
        for preset, by_m in p["by_config"].items():
            for method, r in by_m.items():
                if "skipped" in r:
                    lines.append(f"| {method} | {preset} | skipped: {r['skipped']} | | | | | | | |")
                    continue
                lines.append(
                    f"| {method} | {preset} | {_fmt(r.get('kl_product'))} | {_fmt(r.get('kl_sim_product_rules'))} | "
                    f"{_fmt(r.get('rel_diff'), '.2%')} | {_fmt(r.get('kl_product_deferred'))} | "
                    f"{_fmt(r.get('kl_sim_main'))} | {_fmt(r.get('rel_diff_deferred_vs_sim_main'), '.2%')} | "
                    f"{_fmt(r.get('rel_noise_fp16_rounding'), '.2%')} | "
                    f"{_fmt(r.get('top1_product'), '.3f')} / {_fmt(r.get('top1_sim_product_rules'), '.3f')} |")
    gen = result.get("generation")
    if gen:
        lines += ["", f"## Greedy generation ({gen['new_tokens']} tokens after a {gen['prompt_tokens']}-token "
                      "prompt of the corpus)", "",
                  "| backend | config | sites rewritten | first divergence | greedy match | teacher-forced top-1 "
                  "| teacher-forced KL |",
                  "|---|---|---|---|---|---|---|"]
        for bname, by_c in gen["by_backend"].items():
            for name, r in by_c.items():
                if "skipped" in r:
                    lines.append(f"| {bname} | {name} | skipped | | | | |")
                    continue
                lines.append(f"| {bname} | {name} | {r.get('sites_rewritten', 'n/a')} | {r['first_divergence']} | "
                             f"{_fmt(r['greedy_match'], '.3f')} | {_fmt(r['teacher_forced_top1'], '.3f')} | "
                             f"{_fmt(r['teacher_forced_kl'])} |")
    ret = result.get("retrieval")
    if ret:
        rs = ret["settings"]
        lines += ["", f"## Line retrieval under pseudo-decode ({rs['n_prompts']} record(s) x {rs['n_questions']} "
                      "questions per length; agreement with the fp model's answer)", "",
                  "| lines | prompt tokens | fp accuracy | preset | method | exact answer | token agreement | "
                  "same number | accuracy |", "|---|---|---|---|---|---|---|---|---|"]
        for n, e in ret["by_lines"].items():
            for preset, by_m in e["presets"].items():
                for method, r in by_m.items():
                    lines.append(f"| {n} | {e['prompt_tokens']} | {_fmt(e['fp_accuracy'], '.2f')} | {preset} | "
                                 f"{method} | {_fmt(r['exact'], '.2f')} | {_fmt(r['token_agreement'], '.2f')} | "
                                 f"{_fmt(r['value_agreement'], '.2f')} | {_fmt(r['accuracy'], '.2f')} |")
    t = result.get("timings_s")
    if t:
        lines += ["", "## Timings (s)", "", ", ".join(f"{k} {v:.1f}" for k, v in t.items())]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ plots
def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: str | pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pathlib.Path(path)


def plot_kl_vs_context(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """KL vs context length: one subplot per preset (row per text source), static dashed, pseudo solid."""
    plt = _plt()
    grids = result["datasets"]
    presets = list(grids[0]["results"])
    fig, axes = plt.subplots(len(grids), len(presets), figsize=(4.2 * len(presets), 3.6 * len(grids)),
                             squeeze=False)
    for r, g in enumerate(grids):
        for c, preset in enumerate(presets):
            ax = axes[r][c]
            for label, res, method in _curves(g["results"][preset]):
                Ls = sorted(int(L) for L in res["by_length"])
                for setting, style in (("static", "--"), ("pseudo", "-")):
                    ys = [res["by_length"][str(L)][setting]["kl"] for L in Ls]
                    ax.plot(Ls, ys, style, marker="o", color=_color(method), label=f"{label} {setting}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length L (tokens)")
            ax.set_ylabel("KL(fp ‖ quant), nats/token")
            ax.set_title(f"{preset} — {g['corpus']}")
            ax.grid(True, which="both", alpha=0.3)
            if r == 0 and c == 0:
                ax.legend(fontsize=7)
    fig.suptitle("static (dashed, last block) vs pseudo-decode (solid, all positions after the sink)")
    return _save(plt, fig, path)


def plot_block_curves(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Pseudo-decode KL of each block against its position, one subplot per preset (first source)."""
    plt = _plt()
    g = result["datasets"][0]
    presets = list(g["results"])
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.4), squeeze=False)
    sink = g["sink_tokens"]
    for c, preset in enumerate(presets):
        ax = axes[0][c]
        for label, res, method in _curves(g["results"][preset]):
            cur = res["block_curve"]
            # blocks that read no quantized token (the sink, and with after_block the first block
            # after it) have KL ~1e-11; they are left out of the log plot
            pts = [(x, y) for x, y in zip(cur["block_start"], cur["kl"]) if x >= sink and y > 1e-9]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, "-", marker=".", color=_color(method), label=label)
        ax.set_yscale("log")
        ax.set_xlabel("block start position")
        ax.set_ylabel("pseudo-decode KL of the block")
        ax.set_title(f"{preset} — {g['corpus']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_error_quantiles(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Magnitude vs direction split of the squared error inside each error-rank bucket.

    Each bar is one bucket of tokens ranked by error (worst first); it is split into the
    magnitude part (solid) and the direction part (hatched) of that bucket's error, and the
    label above it is the bucket's share of all the error.
    """
    plt = _plt()
    d = result["diagnostics"]["by_config"]
    presets = list(d)
    buckets = ("top 1%", "top 1-5%", "rest 95%")
    fig, axes = plt.subplots(2, len(presets), figsize=(4.6 * len(presets), 6.8), squeeze=False)
    for c, preset in enumerate(presets):
        for r, kind in enumerate(("k", "v")):
            ax = axes[r][c]
            x, ticks, labels = 0.0, [], []
            for method, res in d[preset].items():
                bk = {b["bucket"]: b for b in res["error_split"][kind]["buckets"]}
                for name in buckets:
                    b = bk[name]
                    mag, dirn = b["magnitude_share"], b["direction_share"]
                    ax.bar(x, mag, color=_color(method), edgecolor="black",
                           label="magnitude" if not ticks else None)
                    ax.bar(x, dirn, bottom=mag, color=_color(method), alpha=0.35, hatch="//",
                           edgecolor="black", label="direction" if not ticks else None)
                    ax.text(x, 1.01, f"{b['error_share']:.0%}", ha="center", va="bottom", fontsize=6)
                    ticks.append(x)
                    labels.append(f"{method}\n{name}")
                    x += 1
                x += 0.5
            ax.set_xticks(ticks)
            ax.set_xticklabels(labels, fontsize=6, rotation=90)
            ax.set_ylim(0, 1.12)
            ax.set_ylabel("share of the bucket's squared error")
            ax.set_title(f"{'keys' if kind == 'k' else 'values'} — {preset}")
            ax.legend(fontsize=7, loc="center right")
    fig.suptitle("per-token error by rank bucket: magnitude (solid) vs direction (hatched); "
                 "label = bucket's share of all error")
    return _save(plt, fig, path)


def plot_layer_errors(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Per-layer relative error of K, V and the attention output, one subplot per preset."""
    plt = _plt()
    d = result["diagnostics"]["by_config"]
    presets = list(d)
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.4), squeeze=False)
    for c, preset in enumerate(presets):
        ax = axes[0][c]
        for method, res in d[preset].items():
            lay = res["layers"]
            ax.plot(lay["k_rel"], ":", color=_color(method), label=f"{method} K")
            ax.plot(lay["v_rel"], "--", color=_color(method), label=f"{method} V")
            ax.plot(lay["attn_out_rel"], "-", color=_color(method), label=f"{method} attn out")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative error")
        ax.set_title(preset)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    return _save(plt, fig, path)


def write_outputs(result: dict[str, Any], out_dir: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Write eval.json, summary.md and the PNG plots into ``out_dir``; return their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(result, out / "eval.json")}
    md = out / "summary.md"
    md.write_text(markdown_summary(result))
    paths["markdown"] = md
    paths["kl_vs_context"] = plot_kl_vs_context(result, out / "kl_vs_context.png")
    paths["block_kl"] = plot_block_curves(result, out / "block_kl.png")
    if result.get("diagnostics", {}).get("by_config"):
        paths["error_quantiles"] = plot_error_quantiles(result, out / "error_quantiles.png")
        paths["layer_errors"] = plot_layer_errors(result, out / "layer_errors.png")
    return paths
