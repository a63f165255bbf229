"""results.json, results.md (tables) and three charts from a bench result dict: speedup.png (per method and
category), acceptance.png (acceptance by draft depth per method) and speed_tau.png (speed-up against tau)."""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_write_text, counted, pyplot, save_figure
from .harness import BASELINE


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def decoding_mode(temperature: float, *, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0) -> str:
    """What every method (hf-generate included) was asked to do: "greedy", or sampling and with what."""
    penalty = "" if repetition_penalty == 1.0 else f", repetition penalty {repetition_penalty:g}"
    if temperature <= 0:
        return "greedy" + penalty
    return f"sampling (T={temperature:g}, top-p {top_p:g}, top-k {top_k if top_k > 0 else 'off'}{penalty})"


def markdown(result: dict) -> str:
    cfg, methods = result["config"], ran(result)
    mode = cfg.get("decoding") or decoding_mode(cfg["temperature"])  # results from before the field existed
    B = cfg.get("batch_size", 1)
    lines = [
        f"model `{cfg['model']}`, {cfg.get('machine') or cfg['device']} ({counted(cfg['threads'], 'thread')}), {cfg['dtype']}, "
        f"{cfg['n_prompts']} prompts from `{cfg['prompts']}`, {cfg['max_new_tokens']} new tokens, {mode}"
        + (f", batches of {B} (tokens/s: all rows together; per row: divide by {B})" if B > 1 else "")
        + (", selfspec methods compiled (`--compile`)" if cfg.get("compile") else "")
        + (f"; `selfspec-auto` ran as `{cfg['auto']}` (the default drafter)" if cfg.get("auto") else ""),
        "",
        "| method | tokens/s | speedup | median speedup | vs selfspec-ar | tau | drafts verified / step "
        "| acceptance by depth | peak MB | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # The speculation's own gain: selfspec's plain loop already beats transformers' generate on overhead.
    ar = methods.get("selfspec-ar", {}).get("tokens_per_s")
    for name, m in methods.items():
        vs_ar = f"{m['tokens_per_s'] / ar:.2f}x" if ar and name != BASELINE else "-"
        acc = " ".join(f"{a:.2f}" for a in m.get("acceptance_by_depth") or []) or "-"
        ident = "n/a (quantized)" if m.get("quantized") else "-" if m["identical"] is None else ("yes" if m["identical"] else f"NO ({len(m['diverged_prompts'])})")
        if m.get("numeric_ties"):
            ident += f", {m['numeric_ties']} numeric ties"
        lines.append(f"| {name} | {m['tokens_per_s']:.1f} | {_f(m['speedup'])}x | {_f(m['speedup_median'])}x | {vs_ar} | "
                     f"{_f(m['tau'])} | {_f(m.get('drafted_per_step'))} | {acc} | {_f(m['peak_memory_mb'], '{:.0f}')} | {ident} |")
    cats = sorted({c for m in methods.values() for c in m["per_category"]})
    if len(cats) > 1:
        lines += ["", "Speedup by category:", "", "| method | " + " | ".join(cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name, m in methods.items():
            lines.append(f"| {name} | " + " | ".join(f"{_f(m['per_category'][c]['speedup'])}x" for c in cats) + " |")
    refused = {n: m["refused"] for n, m in result["methods"].items() if "refused" in m}
    if refused:
        lines += ["", f"Refused batches of {B}: " + "; ".join(f"{n} ({why})" for n, why in refused.items())]
    return "\n".join(lines) + "\n"


def ran(result: dict) -> dict:
    """The methods that ran (those that refused a batch hold only ``refused``)."""
    return {n: m for n, m in result["methods"].items() if "refused" not in m}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    methods = ran(result)
    names = list(methods)
    cats = sorted({c for m in methods.values() for c in m["per_category"]})
    groups = ["all"] + cats if len(cats) > 1 else ["all"]
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4))
    for gi, g in enumerate(groups):
        vals = [(m["speedup"] if g == "all" else m["per_category"][g]["speedup"]) or 0 for m in methods.values()]
        ax.bar([i + gi * width for i in range(len(names))], vals, width, label=g)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel(f"speedup vs {BASELINE}")
    ax.set_title(_title(result))
    ax.legend()
    save_figure(fig, path)


def _title(result: dict) -> str:
    cfg = result["config"]
    mode = cfg.get("decoding") or decoding_mode(cfg["temperature"])
    return f"{cfg['model']} on {cfg['device']}, {cfg['n_prompts']} prompts, {mode}"


def plot_acceptance(result: dict, path: Path) -> None:
    """P(draft at depth d accepted | drafted), one line per drafting method."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for name, m in ran(result).items():
        acc = m.get("acceptance_by_depth") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            drawn += 1
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance (accepted / drafted at that depth)")
    ax.set_ylim(0, 1)
    ax.set_title(_title(result), fontsize=9)
    if drawn:
        ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_speed_tau(result: dict, path: Path) -> None:
    """Speed-up against tau: how far above the diagonal a drafter is says what its drafting costs."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in ran(result).items():
        if m.get("tau") is not None and m.get("speedup") is not None:
            ax.scatter(m["tau"], m["speedup"])
            ax.annotate(name, (m["tau"], m["speedup"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("tau (tokens committed per target forward)")
    ax.set_ylabel(f"speedup vs {BASELINE}")
    ax.set_title(_title(result), fontsize=9)
    save_figure(fig, path)


def write_report(result: dict, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(result, indent=2))
    atomic_write_text(out / "results.md", markdown(result))
    plot(result, out / "speedup.png")
    plot_acceptance(result, out / "acceptance.png")
    plot_speed_tau(result, out / "speed_tau.png")
