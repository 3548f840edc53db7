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
    lines += ["", "## Paper findings", "",
              "The KVarN paper's claims, checked on this run (yes/no per context length L; the "
              "numbers are in eval.json under `findings`)."]
    if s["windows"] == 1:
        lines += ["", "One window of text: each yes/no below is a single observation, and window-to-"
                      "window variation is of the size of these differences, so one window cannot "
                      "decide a claim either way (the full run averages 2 windows; more with --windows)."]
    for source, by_p in result.get("findings", {}).items():
        for preset, fnd in by_p.items():
            lines += ["", f"**{source.split('@')[0]} text (from token {source.split('@')[-1]}), {preset}**", ""]
            lines += [f"- {line}" for line in finding_lines(fnd)]
    d = result.get("diagnostics")
    for preset, by_m in (d or {}).get("skipped", {}).items():
        for method, why in by_m.items():
            lines += ["", f"Diagnostics of {method} {preset} skipped: {why}."]
    if d and d["by_config"]:
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
        lines += ["", f"## Key-value retrieval under pseudo-decode ({rs['n_prompts']} record(s) x "
                      f"{rs['n_questions']} questions per length; agreement with the fp model's answer)", "",
                  "Each line of a record gives one key (a common noun) a random 4-digit code; the model "
                  "is asked for one key's code. *fp accuracy*: the full-precision model's share of "
                  "right answers; agreement only means something where it solves the task.", "",
                  "| lines | prompt tokens | fp accuracy | preset | method | exact answer | token agreement | "
                  "same number | accuracy |", "|---|---|---|---|---|---|---|---|---|"]
        unsolved = [n for n, e in ret["by_lines"].items() if not e.get("fp_solves", True)]
        for n, e in ret["by_lines"].items():
            for preset, by_m in e["presets"].items():
                for method, r in by_m.items():
                    lines.append(f"| {n} | {e['prompt_tokens']} | {_fmt(e['fp_accuracy'], '.2f')} | {preset} | "
                                 f"{method} | {_fmt(r['exact'], '.2f')} | {_fmt(r['token_agreement'], '.2f')} | "
                                 f"{_fmt(r['value_agreement'], '.2f')} | {_fmt(r['accuracy'], '.2f')} |")
        if unsolved:
            lines += ["", f"**Note**: at {', '.join(unsolved)} lines the full-precision model answers "
                          "fewer than half of the questions right, so agreement there mostly compares two "
                          "wrong answers and says little about the quantizer."]
    t = result.get("timings_s")
    if t:
        lines += ["", "## Timings (s)", "", ", ".join(f"{k} {v:.1f}" for k, v in t.items())]
    return "\n".join(lines) + "\n"


def _yes(x: Any) -> str:
    return "undecided" if x is None else "yes" if x else "no"


def _per_length(d: dict[str, Any]) -> str:
    return ", ".join(f"L={L}: {_yes(v)}" for L, v in d.items())


def finding_lines(fnd: dict[str, Any]) -> list[str]:
    """One readable sentence per finding of :func:`~.findings._findings` (unknown ones as JSON)."""
    out = []
    for name, val in fnd.items():
        if name == "kivi_pseudo_gt_static_last_block":
            out.append(f"KIVI's pseudo-decode KL on the last block is above its static KL "
                       f"(error accumulates): {_per_length(val)}")
        elif name == "kivi_pseudo_kl_grows_with_context":
            out.append(f"KIVI's pseudo-decode KL grows with the context length: {_yes(val)}")
        elif name == "kivi_pseudo_last_block_kl_grows_with_context":
            out.append(f"KIVI's last-block pseudo-decode KL grows with the context length: {_yes(val)}")
        elif name == "kvarn_over_kivi_pseudo_kl_at_max_length":
            ratio = f"ratio {val['ratio']:.2f}" if val["ratio"] is not None else "KIVI's KL is 0 there"
            out.append(f"KVarN's pseudo-decode KL is at most half of KIVI's at L={val['length']}: "
                       f"{_yes(val['at_most_half'])} ({ratio})")
        elif name == "ordering_kvarn_le_hadamard_le_kivi":
            by_setting: dict[str, list[str]] = {}
            for key, ok in val.items():
                setting, L = key.split("@")
                by_setting.setdefault(setting, []).append(f"L={L}: {_yes(ok)}")
            out.append("KL order KVarN <= Hadamard-only <= KIVI: "
                       + "; ".join(f"{k} {', '.join(v)}" for k, v in by_setting.items()))
        elif name == "kvarn_vs_hadamard_pseudo_per_window":
            parts = []
            for L, r in val.items():
                se = f" ± {r['se']:.4f} (SE)" if r.get("se") is not None else " (one window: no SE)"
                parts.append(f"L={L}: lower in {r['lower_in']}/{r['windows']} windows, mean "
                             f"difference {r['mean_diff']:+.4f}{se}")
            out.append("KVarN vs Hadamard-only, pseudo-decode KL per window: " + "; ".join(parts))
        elif name == "undecided":
            out.extend(f"Undecided: {why}." for why in val.values())
        else:
            out.append(f"`{name}` = {json.dumps(to_jsonable(val))}")
    return out


# ------------------------------------------------------------------------------ plots
def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _figure(plt, rows: int, cols: int, width: float, height: float):
    """A figure with constrained layout: titles and the legend row below stay inside it."""
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False,
                             layout="constrained")
    return fig, axes


def _save(plt, fig, path: str | pathlib.Path) -> pathlib.Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pathlib.Path(path)


def _legend_below(fig, handles, labels, ncol: int | None = None) -> None:
    """One legend for the whole figure, under the plots (never on top of a curve), in as many
    even rows as the figure's width needs (about 1.6 inches per entry; ``ncol`` at most)."""
    if handles:
        fit = max(2, int(fig.get_figwidth() / 1.6))
        want = min(ncol or min(len(labels), 4), fit)
        rows = -(-len(labels) // want)
        fig.legend(handles, labels, loc="outside lower center", fontsize=8, frameon=False,
                   ncol=-(-len(labels) // rows))


def _wrap(text: str, width_in: float) -> str:
    """Wrap a title to the figure width (about 11 characters per inch at 10 pt)."""
    import textwrap
    return "\n".join(textwrap.wrap(text, max(int(width_in * 11), 20)))


def _context_axis(ax, lengths) -> None:
    """Log-2 context axis with a labelled tick at every evaluated length."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(L) for L in lengths])
    ax.minorticks_off()
    ax.set_xlim(min(lengths) / 2 ** 0.3, max(lengths) * 2 ** 0.3)


def plot_kl_vs_context(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """KL vs context length: one subplot per preset (row per text source); color = method,
    solid line + filled circles = pseudo-decode, dotted line + open squares = static."""
    from matplotlib.lines import Line2D

    plt = _plt()
    grids = result["datasets"]
    presets = list(grids[0]["results"])
    fig, axes = _figure(plt, len(grids), len(presets), 4.4, 3.5)
    handles: dict[str, Any] = {}
    folded: dict[str, list[str]] = {}
    styles = {"pseudo": dict(linestyle="-", marker="o", markersize=5),
              "static": dict(linestyle=":", marker="s", markersize=5, markerfacecolor="white")}
    for r, g in enumerate(grids):
        for c, preset in enumerate(presets):
            ax = axes[r][c]
            all_L: set[int] = set()
            for label, res, method in _curves(g["results"].get(preset, {})):
                Ls = sorted(int(L) for L in res["by_length"])
                all_L.update(Ls)
                for setting in ("pseudo", "static"):
                    ys = [res["by_length"][str(L)][setting]["kl"] for L in Ls]
                    ax.plot(Ls, ys, color=_color(method), **styles[setting])
                handles.setdefault(method, Line2D([], [], color=_color(method), linewidth=3))
                if label != method and preset not in folded.setdefault(label, []):
                    folded[label].append(preset)
            if all_L:
                _context_axis(ax, sorted(all_L))
            ax.set_yscale("log")
            ax.set_xlabel("context length L (tokens)")
            if c == 0:
                ax.set_ylabel("KL(fp ‖ quant), nats/token")
            ax.set_title(f"{preset}, {g['corpus']} text", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
    setting_handles = {"pseudo-decode": Line2D([], [], color="black", **styles["pseudo"]),
                       "static": Line2D([], [], color="black", **styles["static"])}
    labels = list(handles) + list(setting_handles)
    _legend_below(fig, list(handles.values()) + list(setting_handles.values()), labels,
                  ncol=len(labels) if len(labels) <= 7 else (len(labels) + 1) // 2)
    title = ("KL vs context. Solid, filled circles: pseudo-decode (quantized as the tokens are "
             "produced, all positions after the sink); dotted, open squares: static (last block "
             "over a clean prefix quantized once).")
    if folded:
        title += " " + "; ".join(f"{label.replace(' = ', ' and ')}: identical at {', '.join(ps)} (one curve)"
                                 for label, ps in folded.items()) + "."
    fig.suptitle(_wrap(title, 4.4 * len(presets)), fontsize=9)
    return _save(plt, fig, path)


def plot_block_curves(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Pseudo-decode KL of each block against its position, one subplot per preset (first source)."""
    plt = _plt()
    g = result["datasets"][0]
    presets = list(g["results"])
    fig, axes = _figure(plt, 1, len(presets), 4.4, 3.4)
    sink = g["sink_tokens"]
    handles: dict[str, Any] = {}
    folded: dict[str, list[str]] = {}
    for c, preset in enumerate(presets):
        ax = axes[0][c]
        for label, res, method in _curves(g["results"][preset]):
            cur = res["block_curve"]
            # blocks that read no quantized token (the sink, and with after_block the first block
            # after it) have KL ~1e-11; they are left out of the log plot
            pts = [(x, y) for x, y in zip(cur["block_start"], cur["kl"]) if x >= sink and y > 1e-9]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            (line,) = ax.plot(xs, ys, "-", marker=".", color=_color(method))
            handles.setdefault(method, line)
            if label != method and preset not in folded.setdefault(label, []):
                folded[label].append(preset)
        ax.set_yscale("log")
        ax.set_xlabel("block start position (tokens)")
        if c == 0:
            ax.set_ylabel("pseudo-decode KL of the block")
        ax.set_title(f"{preset}, {g['corpus']} text", fontsize=10)
        ax.grid(True, alpha=0.3)
    _legend_below(fig, list(handles.values()), list(handles), ncol=len(handles))
    title = "Pseudo-decode KL of each block of the window against its position"
    if folded:
        title += " (" + "; ".join(f"{label.replace(' = ', ' and ')}: identical at {', '.join(ps)}, one curve"
                                  for label, ps in folded.items()) + ")"
    fig.suptitle(_wrap(title, 4.4 * len(presets)), fontsize=9)
    return _save(plt, fig, path)


def plot_error_quantiles(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Magnitude vs direction split of the squared error inside each error-rank bucket.

    Each bar is one bucket of tokens ranked by error (worst first); it is split into the
    magnitude part (solid) and the direction part (hatched) of that bucket's error, and the
    label above it is the bucket's share of all the error.
    """
    from matplotlib.patches import Patch

    plt = _plt()
    d = result["diagnostics"]["by_config"]
    presets = list(d)
    buckets = ("top 1%", "top 1-5%", "rest 95%")
    n_methods = max(len(d[p]) for p in presets)
    fig, axes = _figure(plt, 2, len(presets), max(4.6, 1.5 * n_methods), 3.5)
    for c, preset in enumerate(presets):
        for r, kind in enumerate(("k", "v")):
            ax = axes[r][c]
            x, ticks, labels, centers = 0.0, [], [], []
            for method, res in d[preset].items():
                bk = {b["bucket"]: b for b in res["error_split"][kind]["buckets"]}
                first = x
                for name in buckets:
                    b = bk[name]
                    mag, dirn = b["magnitude_share"], b["direction_share"]
                    ax.bar(x, mag, color=_color(method), edgecolor="black")
                    ax.bar(x, dirn, bottom=mag, color=_color(method), alpha=0.35, hatch="//",
                           edgecolor="black")
                    ax.text(x, 1.01, f"{b['error_share']:.0%}", ha="center", va="bottom", fontsize=6)
                    ticks.append(x)
                    labels.append(name.replace("top ", "top\n").replace("rest ", "rest\n"))
                    x += 1
                centers.append(((first + x - 1) / 2, method))
                x += 0.6
            ax.set_xticks(ticks)
            ax.set_xticklabels(labels, fontsize=6)
            for cx, method in centers:
                ax.text(cx, -0.17, method, ha="center", va="top", fontsize=7,
                        transform=ax.get_xaxis_transform())
            ax.set_ylim(0, 1.12)
            if c == 0:
                ax.set_ylabel("share of the bucket's\nsquared error", fontsize=8)
            ax.set_title(f"{'keys' if kind == 'k' else 'values'}, {preset}", fontsize=10)
    handles = [Patch(facecolor="lightgray", edgecolor="black", label="magnitude part"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="direction part")]
    _legend_below(fig, handles, [h.get_label() for h in handles])
    fig.suptitle(_wrap("Per-token error by rank bucket (worst tokens first): magnitude vs direction "
                       "part; the label above a bar is that bucket's share of all the error",
                       max(4.6, 1.5 * n_methods) * len(presets)), fontsize=10)
    return _save(plt, fig, path)


def plot_layer_errors(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Per-layer relative error of K, V and the attention output, one subplot per preset."""
    from matplotlib.lines import Line2D

    plt = _plt()
    d = result["diagnostics"]["by_config"]
    presets = list(d)
    fig, axes = _figure(plt, 1, len(presets), 4.6, 3.4)
    styles = {"K": ":", "V": "--", "attention output": "-"}
    from matplotlib.ticker import MaxNLocator

    methods: dict[str, None] = {}
    folded: dict[str, list[str]] = {}
    for c, preset in enumerate(presets):
        ax = axes[0][c]
        for label, res, method in _curves(d[preset]):
            lay = res["layers"]
            methods[method] = None
            if label != method:
                folded.setdefault(label, []).append(preset)
            for style, ys in zip(styles.values(), (lay["k_rel"], lay["v_rel"], lay["attn_out_rel"])):
                ax.plot(ys, style, color=_color(method), marker="." if len(ys) <= 8 else None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        if c == 0:
            ax.set_ylabel("relative error ‖x̂ - x‖ / ‖x‖")
        ax.set_title(preset, fontsize=10)
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=_color(m), linewidth=3) for m in methods]
    handles += [Line2D([], [], color="black", linestyle=st) for st in styles.values()]
    _legend_below(fig, handles, list(methods) + list(styles), ncol=len(handles))
    title = f"Per-layer relative error at L = {result['diagnostics']['length']} (static setting)"
    if folded:
        title += " (" + "; ".join(f"{label.replace(' = ', ' and ')}: identical at {', '.join(ps)}, one curve"
                                  for label, ps in folded.items()) + ")"
    fig.suptitle(_wrap(title, 4.6 * len(presets)), fontsize=9)
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
