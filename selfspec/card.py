"""A heads directory's or distilled draft's model card (README.md), written from what was
recorded, never from typed-in numbers. ``selfspec train-heads`` writes one when a run ends (with its
front matter, so the directory uploads to a model hub as it is); ``scripts/model_card.py`` rewrites it
with dev-prompt accuracy and bench results added::

    python scripts/model_card.py checkpoints/smollm2-135m/medusa --bench bench-out/dev/results.json \
        --method selfspec-medusa --reproduce "selfspec train-heads ..."

Training facts come from the heads' config.json (``provenance``: data, steps, tokens, wall time,
held-out accuracy; ``decode``: the tuned settings) and tune-tree.json (the tree search; tune-tree-sampled.json, the
sampled one, where it ran; tune-tree-cuda.json and the like, those on another kind of device); accuracy on dev
prompts from ``selfspec eval-heads --json``; tau and speed from a ``selfspec bench`` results.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .heads import read_heads_config, recorded_devices, recorded_search
from .io import atomic_write_text, counted
from .settings import SETTING_KEYS


def _pct(xs) -> str:
    return " / ".join(f"{x:.1%}" for x in xs) if xs else "-"


def _bench_section(bench: dict, method: str) -> list[str]:
    m = bench["methods"][method]
    c = bench["config"]
    acc = " ".join(f"{a:.2f}" for a in m.get("acceptance_by_depth") or [])
    lines = ["## Measured by `selfspec bench`", "",
            f"`{c.get('command')}`", "",
            f"{c['n_prompts']} prompts of `{c['prompts']}`, {c['max_new_tokens']} new tokens, greedy, "
            f"{c.get('machine') or c['device']}, {c['threads']} threads, {c['dtype']}, as bench method `{method}`"
            + (" (CPU figures move with the kind of CPU)" if c["device"] == "cpu" else "") + ":", "",
            f"- tau (mean accepted length, bonus counted): {m['tau']:.2f}",
            f"- acceptance by depth: {acc}",
            f"- speed-up over transformers greedy generate: {m['speedup']:.2f}x "
            f"(median per prompt {m['speedup_median']:.2f}x)",
            f"- identical to transformers greedy: {m['identical']}"]
    prefix = method.removeprefix("selfspec-") + "_"   # the bench records "eagle_tree", "eagle@DIR_tree", ...
    used = {k.removeprefix(prefix): v for k, v in (c.get("heads") or {}).items()
            if k.startswith(prefix) and k.removeprefix(prefix) in SETTING_KEYS}   # not "eagle_heads_tree" (another method)
    if used:
        lines.append("- settings used: " + ", ".join(f"{k} {v}" for k, v in used.items()))
    look = bench["methods"].get("selfspec-lookup")
    if look and used.get("lookup"):
        lines.append(f"- the context lookup alone (`selfspec-lookup`, no heads) in the same run: {look['speedup']:.2f}x, "
                     f"tau {look['tau']:.2f}")
    ar = bench["methods"].get("selfspec-ar")
    if ar and method != "selfspec-ar":
        lines.append(f"- selfspec with no drafter (`selfspec-ar`) in the same run: {ar['speedup']:.2f}x, so the "
                     f"drafter's own contribution is {m['speedup'] / ar['speedup']:.2f}x")
    return lines + [""]


def _eval_section(ev: dict) -> list[str]:
    ref = ev.get("held_out_train_split")
    medusa = ev["kind"] == "medusa"
    lines = ["## Accuracy on unseen prompts", "",
             f"`{ev.get('command')}`", "",
             f"{ev['prompts']} prompts of `{ev['prompts_file']}`, the target's own greedy answers "
             f"({ev['max_new_tokens']} new tokens), each head scored where decoding uses it, against the target's "
             f"actual tokens (a token outside the draft vocabulary counts as a miss)"
             + (f"; the same count on the {ref['prompts']} held-out training sequences for comparison:" if ref else ":"),
             "", "| head | top-1 | top-5 |" + (" top-1 held-out train | top-5 held-out train |" if ref else ""),
             "|---|---|---|" + ("---|---|" if ref else "")]
    for k, (t1, t5) in enumerate(zip(ev["top1"], ev["top5"])):
        name = k + 1 if medusa else {"early-exit": "exit", "draft-model": "draft (next token)",
                                     "eagle": f"draft step {k + 1}"}[ev["kind"]]
        row = f"| {name} | {t1:.1%} | {t5:.1%} |"
        lines.append(row + (f" {ref['top1'][k]:.1%} | {ref['top5'][k]:.1%} |" if ref else ""))
    return lines + [""]


# What each shipped data directory holds (scripts/gen_distill_data.sh makes all three).
DATA_NOTES = {
    "smollm2-135m-greedy": "greedy answers to prompts of the project's `train.jsonl` prompt set (maths and code; not in this repository)",
    "smollm2-135m-t0.7": "16 answers sampled at temperature 0.7 per Self-Instruct seed prompt of train.jsonl",
    "smollm2-135m-self-instruct": "greedy answers to prompts the target wrote itself in the style of those "
                                  "seeds (`selfspec synth-prompts`, training/prompts/smollm2-135m-self-instruct.jsonl)",
    "broad-ref": "teacher forcing: the broad prompt set's own reference answers (QA over passages, dialogue "
                 "summarisation, translation, MATH, code, roleplay, writing, factoid QA, adversarial requests), "
                 "`selfspec gen-data --references`; the target's distributions over them are the teacher",
    "broad-self": "greedy answers (up to 160 tokens) to the broad prompt set, shuffled with seed 0, longest "
                  "prompts first (`scripts/train_demo_checkpoints.sh`, stage 4)",
    "smollm2-135m-broad-self": "greedy answers (up to 160 tokens) to a prefix of the broad prompt set shuffled "
                               "with seed 0 (QA over passages, summarisation, translation, maths, code, roleplay, "
                               "writing, adversarial requests; `scripts/gen_broad_self.sh`)",
    "smollm2-135m-broad-gpu": "greedy answers (up to 160 tokens, bfloat16, on a GPU) to the next prompts of that "
                              "shuffled broad set (`scripts/gpu_train_eagle.sh`, its first stage)",
    "smollm2-135m-broad-cpu": "greedy answers (up to 160 tokens, bfloat16, on a CPU) to the prompts among the first "
                              "15,088 of that shuffled broad set that the two directories above do not answer "
                              "(`selfspec gen-data --skip-stored`)",
}


def _pick_rule(ts: dict) -> str:
    """The sentence saying how tune-tree picked among its timed candidates (the rule of the run that wrote ``ts``)."""
    if ts.get("tolerance") is None:
        return ""
    if ts.get("tau_tolerance") is None:   # recorded before the rule preferred the best drafting
        return (f" The pick: of the candidates within {ts['tolerance']:.0%} of the best speedup, the one that "
                "verifies the fewest nodes per step.")
    return (f" The pick: of the candidates within {ts['tolerance']:.0%} of the best speedup (tied), the one that "
            f"drafts best: the highest tau (taus within {ts['tau_tolerance']:.0%} of it count as tied, and of "
            "those the one verifying the fewest nodes per step wins).")


def _search_lines(ts: dict, decode, *, title: str) -> list[str]:
    """A tune-tree record ``ts`` (greedy, or sampled at ``ts["temperature"]``) and the pick ``decode`` made from
    it, as a card section: how the candidates were timed, the table, the pick."""
    temperature = ts.get("temperature")
    how = "greedy" if temperature is None else f"sampled at temperature {temperature:g}, plain decoding too"
    lines = [title, "",
             "Chosen by `selfspec tune-tree` on "
             + (f"{ts['n_prompts']} prompts of {ts['prompts']} the heads never saw (seeded sample, seed "
                f"{ts.get('seed', 0)}) " if ts.get("prompts") else f"{ts['held_out_prompts']} held-out training prompts ")
             + f"({ts['max_new_tokens']} new tokens, {how}, {counted(ts['threads'], 'thread')}"
             + (f", on {ts['hardware']}" if ts.get("hardware") else "") + "), each run interleaved with plain "
             "decoding on the same prompt; speedup is the median per-prompt ratio to it. Threshold: nodes whose "
             "draft path probability is below it are not proposed; gate: a step whose tree is expected to get "
             "fewer tokens accepted proposes nothing; lookup: up to this many tokens copied from the context "
             "are grafted on; verified/step counts the nodes verified."
             + (" A second round timed again the fastest candidates (" +
                f"at most {ts['finalists']}, those within twice the tolerance of the best) on {ts['n_prompts']} "
                "other prompts of the file; their numbers pool both rounds (runs), and the pick is one of them." if ts.get("finalists") and ts.get("prompts") else "")
             + _pick_rule(ts), "",
             "| tree | draft nodes | threshold | gate | lookup | verified/step | tokens/s | speedup | tau | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in ts["candidates"]:
        name = c["spec"] if isinstance(c["spec"], str) else f"{c['size']}-node Medusa tree"
        name = f"{name} (depth-expand-nodes)" if name.startswith("dynamic-") else name
        t, nodes = c.get("threshold", 0.0), c.get("nodes_per_step")
        speedup = f"{c['speedup']:.2f}x" if c.get("speedup") else "-"
        lines.append(f"| {name} | {c['size']} | {t:g} | {c.get('gate', 0.0):g} | {c.get('lookup', 0)} | "
                     f"{'-' if nodes is None else f'{nodes:.2f}'} | "
                     f"{c['tokens_per_s']:.1f} | {speedup} | {c['tau']:.2f} | {c.get('runs') or '-'} |")
    chosen = decode.tree
    lines.append("")
    lines.append(f"Chosen: `{chosen if isinstance(chosen, str) else [tuple(p) for p in chosen]}`, "
                 f"threshold {decode.threshold:g}, gate {decode.gate:g}, lookup {decode.lookup}.")
    lines.append("")
    return lines


def _data_lines(data: str | None, rows: list[int] | None) -> list[str]:
    """One line per data directory: what it holds, rows and response tokens the run used."""
    from .training.data import data_dirs, load_distillation_data

    if not data:
        return ["- data: unknown"]
    dirs = data_dirs(data)
    lines = ["- data (self-distillation: the target's own distributions over its answers or reference answers; "
             "dev prompts never used):"]
    for i, d in enumerate(dirs):
        used = rows[i] if rows else None
        ds = load_distillation_data(d, rows=[used] if used is not None else None)
        lines.append(f"  - `{d}`: {len(ds)} sequences, {sum(ds['n_response'])} response tokens; "
                     f"{DATA_NOTES.get(d.name, 'self-distillation data')}")
    return lines


def _init_lines(init: dict | None) -> list[str]:
    """A warm-started run: the runs it started from (its ``init``, that run's ``init``, ...), whose
    steps and time come on top of this run's, each on the hardware it recorded (runs from before
    that was recorded say so). The last of the chain was trained from scratch."""
    chain = []
    while init:
        chain.append(init)
        init = init.get("init")
    lines = []
    for n, run in enumerate(chain):
        stage = len(chain) - n
        how = "trained from scratch" if stage == 1 else f"itself warm-started from `{chain[n + 1]['path']}`"
        lines += [f"- {'warm-started from' if n == 0 else 'which was'} `{run['path']}` (stage {stage}, {how}: "
                  f"{run.get('steps')} steps, {run.get('tokens_seen')} response tokens seen, {run.get('wall_s')} s on {run.get('hardware') or 'hardware not recorded'}) on:",
                  *("  " + line for line in _data_lines(run.get("data"), run.get("rows"))[1:])]
    if chain:
        lines.append(f"- the numbers above are stage {len(chain) + 1}'s own; every earlier stage's held-out sequences stay held out")
    return lines


def draft_card(ckpt: Path, bench: dict | None, method: str | None, hardware: str, dev_eval: dict | None = None) -> str:
    meta = json.loads((ckpt / "selfspec_draft.json").read_text())
    t = meta.get("training") or {}
    tc = t.get("train_config") or {}
    ev = t.get("eval") or {}
    lines = [f"# {ckpt.name}: distilled draft model for `{meta['base_model']}`", "",
             f"The target's embeddings, first {meta['num_layers']} decoder layers, final norm and LM head as a "
             f"standalone causal LM; the layers and norm distilled (KL) to the target's final distribution, "
             f"embeddings and LM head frozen. Only the trained tensors are stored ({meta['dtype']}); "
             f"`materialize_draft` (called by `from_pretrained(draft_model=...)` and `selfspec bench "
             f"--draft-model`) re-attaches the shared ones from the base model and writes an ordinary "
             f"transformers model directory, usable as `generate(assistant_model=...)`.", "",
             "## Training", "",
             *_data_lines(t.get("data"), t.get("rows")),
             f"- steps: {t.get('steps')} (batch {tc.get('batch_size')} x accumulation {tc.get('grad_accum')}), "
             f"lr {tc.get('lr')}, warm-up {tc.get('warmup')} + cosine, loss on the "
             f"{tc.get('draft_vocab_size')} most frequent response tokens",
             f"- response tokens seen: {t.get('tokens_seen')}",
             f"- wall time: {t.get('wall_s')} s on {t.get('hardware') or hardware} (the one-off backbone feature pass not included)",
             f"- held-out (train-split prompts never trained on) top-1 agreement with the target: "
             f"{_pct(ev.get('top1'))}, top-5: {_pct(ev.get('top5'))}, KL {ev.get('loss', float('nan')):.3f} "
             f"over {ev.get('tokens')} positions", ""]
    if dev_eval:
        lines += _eval_section(dev_eval)
    if bench and method:
        lines += _bench_section(bench, method)
    return "\n".join(lines)


def _settings_lines(ckpt: Path, decode) -> list[str]:
    """The tune-tree sections: for the CPU (the decode section's top level), then for each other kind of
    device it timed the heads on (``decode.devices``), greedy and sampled."""
    from .settings import HOME_DEVICE

    lines = []
    for device in dict.fromkeys((HOME_DEVICE, *recorded_devices(ckpt), *decode.measured_devices())):
        mine, on = decode.for_device(device), "" if device == HOME_DEVICE else f", on {device}"
        ts = recorded_search(ckpt, device=device)
        if ts:
            lines += _search_lines(ts, mine, title=f"## Tree and threshold (tree=\"auto\", threshold=\"auto\"{on})")
        elif device == HOME_DEVICE and mine.tree is not None:
            lines += ["## Tree and threshold (tree=\"auto\", threshold=\"auto\")", "",
                      f"`{mine.tree}`, threshold {mine.threshold:g}, gate {mine.gate:g}, lookup {mine.lookup}: "
                      "not timed for these heads by `selfspec tune-tree` (no tune-tree.json here); carried over from the "
                      "heads they were warm-started from or replace.", ""]
        sampled = recorded_search(ckpt, sampled=True, device=device)
        if sampled and mine.sampled is not None:
            lines += _search_lines(sampled, mine.sampled, title="## When sampling (do_sample=True; tree, threshold, gate "
                                                                f"and lookup \"auto\"{on})")
    others = decode.measured_devices()
    if others:
        lines += [f"Devices with settings of their own: {', '.join(others)}; every other kind of device reads the "
                  f"{HOME_DEVICE}'s above.", ""]
    return lines


def card(ckpt: Path, bench: dict | None, method: str | None, hardware: str, dev_eval: dict | None = None) -> str:
    if (ckpt / "selfspec_draft.json").is_file():
        return draft_card(ckpt, bench, method, hardware, dev_eval)
    config = read_heads_config(ckpt)
    cfg, extra, decode = asdict(config), config.provenance, config.decode
    tc = extra.get("train_config") or {}
    ev = extra.get("eval") or {}
    kind = cfg["kind"]
    lines = [f"# {ckpt.name}: {kind} heads for `{cfg['base_model']}`", ""]
    if kind == "medusa":
        reads = " and the root token's embedding" if cfg.get("token_input") else ""
        lines.append(f"{cfg['num_heads']} Medusa heads (zero-initialised residual blocks on the last hidden state{reads}, "
                     f"sharing the target's LM head).")
        wide = [f"head {k + 1}: {w}" for k, w in enumerate(cfg.get("head_mlp") or []) if w]
        if wide:
            lines.append(f"Heads with a second, wider residual MLP (width): {', '.join(wide)}.")
    elif kind == "eagle":
        aux = cfg["aux_layers"]
        final = " (transformers' hidden-state indices, where N, the layer count, is the final state after the final norm)"
        lines.append(f"An EAGLE-3-class feature head: one decoder layer ({cfg['attn_heads']} attention heads, "
                     f"{cfg['kv_heads']} KV heads, MLP width {cfg['intermediate_size']}) over the target's hidden states "
                     f"after layers {', '.join(str(a) for a in aux)}{final} (fused {len(aux)}H -> H) and the next token's "
                     "embedding; it drafts autoregressively with its own KV cache, as a dynamic tree (EAGLE-2)."
                     + (" Its LM head is the target's own (draft-vocabulary rows, not stored)."
                        if cfg.get("shared_lm_head") else ""))
        lines.append(f"Training-time test: {tc.get('ttt_steps')} draft steps unrolled per position, loss "
                     f"sum_j {tc.get('head_weight_base')}^j KL(target || draft), on {tc.get('loss_rows')} rows.")
    else:
        lines.append(f"Exit adapter `{cfg.get('adapter', 'mlp')}` on the hidden states after the first "
                     f"{cfg['exit_layer']} decoder layers (final norm and LM head shared with the target).")
    if cfg.get("draft_vocab_size"):
        lines.append(f"Draft vocabulary: the {cfg['draft_vocab_size']} most frequent response tokens.")
    if cfg.get("lora"):
        lines.append("**The backbone was fine-tuned with LoRA (Medusa-2): generation follows the fine-tuned model, "
                     "not the original.**")
    else:
        lines.append("The backbone is untouched: greedy output is token-identical to the original model.")
    lines += ["", "## Training", "",
              *_data_lines(extra.get("data"), extra.get("rows") or ([extra["sequences"]] if "sequences" in extra else None)),
              f"- steps: {extra.get('steps')} (batch {tc.get('batch_size')} x accumulation {tc.get('grad_accum')}), "
              f"lr {tc.get('lr')}, warm-up {tc.get('warmup')} + cosine",
              f"- response tokens seen: {extra.get('tokens_seen')}"
              + (f" (the loss also reads the prompt rows: {tc.get('batch_size')} x {extra.get('steps')} sequences of at most "
                 f"{tc.get('max_len')} tokens)" if tc.get("loss_rows") == "all" else ""),
              f"- wall time: {extra.get('wall_s')} s on {extra.get('hardware') or hardware}"
              + (" (the frozen target runs inside every step)" if kind == "eagle" else
                 " (the one-off backbone feature pass not included)"),
              *_init_lines(extra.get("init")),
              f"- held-out (train-split prompts never trained on) top-1 / top-5 by {'draft step' if kind == 'eagle' else 'head'}: "
              f"{_pct(ev.get('top1'))} | {_pct(ev.get('top5'))} over {ev.get('tokens')} positions (training's own "
              f"count, which also scores deeper heads from the prompt's last positions)", ""]
    lines += _settings_lines(ckpt, decode)
    if dev_eval:
        lines += _eval_section(dev_eval)
    if bench and method:
        lines += _bench_section(bench, method)
    return "\n".join(lines)


def this_hardware(device=None) -> str:
    """What a run on ``device`` (default: the GPU when there is one) runs on, as a card or a bench report
    states it: the GPU's name, else the CPU's core count and model name. Training records it with each run
    (``provenance.hardware``), the bench in its results (``config.machine``)."""
    import os
    import platform

    import torch

    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{os.cpu_count()}-core {name + ' ' if name else ''}CPU (no GPU)"


def front_matter(ckpt: Path) -> str:
    """The YAML block model hubs read from a README: library, base model, tags."""
    if (ckpt / "selfspec_draft.json").is_file():
        base, kind = json.loads((ckpt / "selfspec_draft.json").read_text())["base_model"], "draft-model"
    else:
        config = read_heads_config(ckpt)
        base, kind = config.base_model, config.kind
    from .loading import hub_id_of

    base = hub_id_of(base)   # the hub id an alias stands for
    return "\n".join(["---", "library_name: selfspec", f"base_model: {json.dumps(base)}",
                      "tags: [speculative-decoding, selfspec, " + kind + "]", "---", ""])


def write_card(ckpt, *, bench: dict | None = None, method: str | None = None, dev_eval: dict | None = None,
               hardware: str | None = None, reproduce: tuple[str, ...] = ()) -> Path:
    """Write ``ckpt/README.md``: front matter, then :func:`card`, then the commands that rebuild it."""
    ckpt = Path(ckpt)
    text = front_matter(ckpt) + card(ckpt, bench, method, hardware or this_hardware(), dev_eval)
    if reproduce:
        text += "\n## Reproduce\n\n```bash\n" + "\n".join(reproduce) + "\n```\n"
    atomic_write_text(ckpt / "README.md", text)
    return ckpt / "README.md"
