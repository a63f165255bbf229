"""results.json, results.md (tables) and speedup.png from a bench result dict."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(result: dict) -> str:
    cfg, methods = result["config"], result["methods"]
    lines = [
        f"model `{cfg['model']}`, {cfg['device']} ({cfg['threads']} threads), {cfg['dtype']}, "
        f"{cfg['n_prompts']} prompts from `{cfg['prompts']}`, {cfg['max_new_tokens']} new tokens, "
        f"temperature {cfg['temperature']}",
        "",
        "| method | tokens/s | speedup | median speedup | vs selfspec-ar | tau | drafts verified / step "
        "| acceptance by depth | draft / verify share | peak MB | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # The speculation's own gain: selfspec's plain loop already beats transformers' generate on overhead.
    ar = methods.get("selfspec-ar", {}).get("tokens_per_s")
    for name, m in methods.items():
        vs_ar = f"{m['tokens_per_s'] / ar:.2f}x" if ar and name.startswith("selfspec-") else "-"
        acc = " ".join(f"{a:.2f}" for a in m.get("acceptance_by_depth") or []) or "-"
        share = (f"{m['draft_share']:.0%} / {m['verify_share']:.0%}" if "draft_share" in m else "-")
        ident = "-" if m["identical"] is None else ("yes" if m["identical"] else f"NO ({len(m['diverged_prompts'])})")
        if m.get("numeric_ties"):
            ident += f", {m['numeric_ties']} numeric ties"
        lines.append(f"| {name} | {m['tokens_per_s']:.1f} | {_f(m['speedup'])}x | {_f(m['speedup_median'])}x | {vs_ar} | "
                     f"{_f(m['tau'])} | {_f(m.get('drafted_per_step'))} | {acc} | {share} | {_f(m['peak_memory_mb'], '{:.0f}')} | {ident} |")
    cats = sorted({c for m in methods.values() for c in m["per_category"]})
    if len(cats) > 1:
        lines += ["", "Speedup by category:", "", "| method | " + " | ".join(cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name, m in methods.items():
            lines.append(f"| {name} | " + " | ".join(f"{_f(m['per_category'][c]['speedup'])}x" for c in cats) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
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
    ax.set_ylabel("speedup vs hf-greedy")
    cfg = result["config"]
    ax.set_title(f"{cfg['model']} on {cfg['device']}, {cfg['n_prompts']} prompts, T={cfg['temperature']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_report(result: dict, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "results.json", json.dumps(result, indent=2))
    _atomic_write(out / "results.md", markdown(result))
    plot(result, out / "speedup.png")
