"""Side-by-side comparison of decoding methods, in one process, interleaved per prompt.

Protocol (the rules in DESIGN.md): fixed thread count; one warm-up generation per method; for
each prompt every method runs once, in an order rotated from prompt to prompt so machine drift
hits all alike; CUDA synchronised before clocks are read; same dtype for all. The baseline is
``hf-generate``: transformers' own ``generate``, decoding as the run asks (greedy, or sampling at
its temperature; it used to be called ``hf-greedy``, a name still accepted). For greedy runs
every method's tokens are compared with hf-generate's: a divergence at a position where
hf-generate's top-2 logit margin is within the tie tolerance counts as a numeric tie (reported
apart); any other divergence makes the method not ``identical``. The tolerance is 1e-3 in float32;
in half precision, where a logit of 20 moves in steps of 0.125 (bfloat16), it is 4 such steps at
the top logit's size: verifying several tokens in one pass rounds differently from transformers'
one-token steps, and a margin that small is below what the dtype resolves.
"""

from __future__ import annotations

import json
import math
import statistics
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..core.backbone import Backbone
from ..core.decode import DecodeStats
from ..core.clock import now

BASELINE = "hf-generate"
# Old names still accepted on the command line: hf-generate was "hf-greedy" even when it sampled.
ALIASES = {"hf-greedy": BASELINE}
# What ``drafter="auto"`` picks for the model at the run's temperature: named on the command line, run as
# that drafter's own method (``methods.resolve_auto``), so a report never holds the same decoding twice.
AUTO_METHOD = "selfspec-auto"
ALL_METHODS = (BASELINE, "hf-static", "hf-assisted", "hf-assisted-bf16", "hf-early-exit", "hf-prompt-lookup",
               "selfspec-ar", "selfspec-lookup", "selfspec-lookup-context", "selfspec-early-exit", "selfspec-medusa",
               "selfspec-medusa-heads", "selfspec-medusa-context", "selfspec-eagle", "selfspec-eagle-heads",
               "selfspec-eagle-context", "selfspec-lookup-whole", "selfspec-medusa-whole", "selfspec-eagle-whole",
               "selfspec-draft-model")
# "-heads": the same heads and tree with the lookup off (what the heads draft on their own);
# "-context": the lookup reads the context only, no corpus (what the corpus adds, in one run);
# "-whole": every step verifies whole trees (no width fitting or back-off: runtime/).
# The serving engines, run in the engines' own Python (engines.py; `make engines` installs them); not in "all".
ENGINE_METHOD_NAMES = ("vllm", "vllm-eagle3", "vllm-ngram", "llamacpp", "llamacpp-lookup")
# Methods that need --draft-model; "hf-assisted-bf16" gives transformers' assisted generation the
# draft in bfloat16, the precision selfspec's draft-model drafter uses on CPUs with BF16 instructions.
DRAFT_METHODS = frozenset({"hf-assisted", "hf-assisted-bf16", "selfspec-draft-model"})
TIE_MARGIN = 1e-3   # float32
TIE_ULPS = 4        # half precision: this many units in the last place of the top logit


def tie_tolerance(top_logit: float, dtype: torch.dtype) -> float:
    """The largest top-2 logit margin a divergence may have and still count as a numeric tie."""
    if dtype not in (torch.bfloat16, torch.float16):
        return TIE_MARGIN
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top_logit), 1.0)))
    return max(TIE_MARGIN, TIE_ULPS * ulp)


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    stats: DecodeStats | None = None   # selfspec methods only
    peak_mb: float | None = None


@dataclass
class Method:
    """A named way to generate: ``fn(batch: [ids (1, n_b)], max_new_tokens, generator) -> ([new tokens per
    row], stats|None)``; a batch of one is the classic single-prompt call."""

    name: str
    fn: Callable
    runs: dict[str, Run] = field(default_factory=dict)
    refused: str | None = None   # why the method would not take a batch (transformers' own refusal)
    quantized: bool = False      # runs other (quantized) weights: its output is not compared with the baseline
    external: bool = False       # runs in another process (a serving engine): this process's peak memory is not its


def load_prompts(path: str | Path, *, limit: int | None = None, sample: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts from a JSONL file: the first ``limit``, or a seeded random ``sample`` (kept in file order,
    so a file sorted by category is still covered evenly)."""
    prompts = _read_prompts(path, limit=limit)
    if sample is not None and sample < len(prompts):
        import random

        keep = sorted(random.Random(seed).sample(range(len(prompts)), sample))
        prompts = [prompts[i] for i in keep]
    return prompts


def _read_prompts(path: str | Path, *, limit: int | None) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ValueError(f"prompts file {path} {what}: give a JSONL file with one {{\"prompt\": ...}} per line")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i + 1} is not valid JSON: each line must be one JSON object") from None
        except RecursionError:
            raise ValueError(f"{path}:{i + 1} is JSON nested too deeply to read: each line must be one flat JSON "
                             "object") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{i + 1} has no \"prompt\" string: give each line a {{\"prompt\": ...}} object")
        if not row["prompt"].strip():
            raise ValueError(f"{path}:{i + 1} has an empty prompt: fix or drop that line")
        prompts.append(Prompt(id=str(row.get("id", i)), category=str(row.get("category", "all")), text=row["prompt"]))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts: give a JSONL file with one {{\"prompt\": ...}} per line")
    return prompts


def interleaved_order(methods: list[str], prompt_index: int) -> list[str]:
    """Rotate the method order by one per prompt: each method runs first, second, ... equally often."""
    k = prompt_index % len(methods)
    return methods[k:] + methods[:k]


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets the process's peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def top2_margin(model, ids: torch.Tensor, prefix: list[int]) -> float:
    """The baseline's top-2 logit margin for the token after ``ids + prefix`` (one extra forward), in
    units of the tie tolerance at that logit size and the model's dtype: below 1 is a numeric tie."""
    x = torch.cat([ids, torch.tensor([prefix], dtype=ids.dtype, device=ids.device)], dim=1)
    with torch.no_grad():
        out = model(x).logits[0, -1]
    top = torch.topk(out.float(), 2).values
    return float(top[0] - top[1]) / tie_tolerance(float(top[0]), out.dtype)


@dataclass
class Comparison:
    identical: bool
    diverged: list[str]   # prompt ids with a real divergence
    ties: list[str]       # prompt ids whose only divergence is a numeric tie


def compare_to_baseline(baseline: dict[str, Run], method: dict[str, Run], margin_fn) -> Comparison:
    """Token-by-token check; ``margin_fn(prompt_id, position) -> float`` gives the baseline's top-2 margin
    in units of the tie tolerance (``top2_margin``): a first divergence where it is below 1 is a tie."""
    diverged, ties = [], []
    for pid, ref in baseline.items():
        got = method[pid].tokens
        if got == ref.tokens:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
        if pos < min(len(got), len(ref.tokens)) and margin_fn(pid, pos) < 1.0:
            ties.append(pid)
        else:
            diverged.append(pid)
    return Comparison(identical=not diverged, diverged=diverged, ties=ties)


def run_bench(
    methods: list[Method],
    prompts: list[Prompt],
    encode: Callable[[str], torch.Tensor],
    *,
    model,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    progress: bool = True,
    batch_size: int = 1,
) -> dict:
    """Run every method on every prompt (interleaved) and return the results dict (see ``summarise``).

    batch_size B > 1: prompts go in batches of B (file order); each batch is one call of each
    method, its wall time shared equally by its rows. A method that refuses batches (transformers'
    assisted paths do) is reported as refused, not dropped silently."""
    from tqdm.auto import tqdm

    device = Backbone(model).device
    names = [m.name for m in methods]
    if BASELINE not in names:
        raise ValueError(f"the methods must include {BASELINE!r}: every speedup is divided by it")
    by_name = {m.name: m for m in methods}
    encoded = {p.id: encode(p.text).to(device) for p in prompts}

    def generator(pid: str) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed + zlib.crc32(pid.encode()) % 10_000)

    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    warm = [encoded[p.id] for p in batches[0]]
    longest = max(int(ids.shape[-1]) for ids in encoded.values()) + max_new_tokens
    sizes = sorted({len(b) for b in batches})
    prefill = max(len(b) * max(int(encoded[p.id].shape[-1]) for p in b) for b in batches)   # left-padded batches
    for m in methods:  # warm-up: kernels, allocator, caches (static caches sized and graphs compiled for the whole run first)
        if hasattr(m.fn, "prepare"):
            m.fn.prepare(longest, sizes, prefill)
        try:
            m.fn(warm, min(16, max_new_tokens), generator("warmup"))
        except (ValueError, NotImplementedError) as e:
            if len(warm) == 1 or m.name == BASELINE:
                raise
            m.refused = str(e).splitlines()[0]
    methods = [m for m in methods if m.refused is None]
    names = [m.name for m in methods]

    bar = tqdm(total=len(batches) * len(methods), desc="bench", disable=not progress, unit="run")
    for i, batch in enumerate(batches):
        for name in interleaved_order(names, i):
            m = by_name[name]
            _reset_peak(device)
            t0 = now(device)
            rows, stats = m.fn([encoded[p.id] for p in batch], max_new_tokens, generator(batch[0].id))
            wall = now(device) - t0
            for j, (p, tokens) in enumerate(zip(batch, rows)):   # the batch's stats go with its first row
                m.runs[p.id] = Run(tokens=list(tokens), wall_s=wall / len(batch), stats=stats if j == 0 else None,
                                   peak_mb=None if m.external else _peak_mb(device))
            bar.update(1)
    bar.close()

    greedy = temperature <= 0
    margins: dict[tuple[str, int], float] = {}

    def margin(pid: str, pos: int) -> float:
        if (pid, pos) not in margins:
            margins[(pid, pos)] = top2_margin(model, encoded[pid], by_name[BASELINE].runs[pid].tokens[:pos])
        return margins[(pid, pos)]

    comparisons = {
        m.name: compare_to_baseline(by_name[BASELINE].runs, m.runs, margin) for m in methods if not m.quantized
    } if greedy else {}
    results = summarise(methods, prompts, comparisons)
    for m in by_name.values():
        if m.refused is not None:
            results[m.name] = {"refused": m.refused}
    return results


def _agg(runs: list[Run]) -> dict:
    tokens = sum(len(r.tokens) for r in runs)
    wall = sum(r.wall_s for r in runs)
    out = {"n_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0}
    stats = [r.stats for r in runs if r.stats is not None]
    if stats:
        steps = sum(s.steps for s in stats)
        committed = sum((a + 1) * n for s in stats for a, n in enumerate(s.accepted_hist))
        out["tau"] = committed / steps if steps else 1.0
        out["drafted_per_step"] = sum(s.drafted for s in stats) / steps if steps else 0.0
        depth = max(len(s.drafted_by_depth) for s in stats)
        drafted = [sum(s.drafted_by_depth[d] for s in stats if d < len(s.drafted_by_depth)) for d in range(depth)]
        accepted = [sum(s.accepted_by_depth[d] for s in stats if d < len(s.accepted_by_depth)) for d in range(depth)]
        out["acceptance_by_depth"] = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    return out


def summarise(methods: list[Method], prompts: list[Prompt], comparisons: dict[str, Comparison]) -> dict:
    base = next(m for m in methods if m.name == BASELINE)
    categories = sorted({p.category for p in prompts})
    results = {}
    base_all = _agg(list(base.runs.values()))
    for m in methods:
        runs = [m.runs[p.id] for p in prompts]
        row = _agg(runs)
        row["speedup"] = row["tokens_per_s"] / base_all["tokens_per_s"] if base_all["tokens_per_s"] else None
        # Median over prompts of the per-prompt speedup: robust to a few long or noisy prompts.
        per_prompt = [(len(m.runs[p.id].tokens) / m.runs[p.id].wall_s) /
                      (len(base.runs[p.id].tokens) / base.runs[p.id].wall_s) for p in prompts
                      if m.runs[p.id].wall_s > 0 and base.runs[p.id].wall_s > 0 and base.runs[p.id].tokens]
        row["speedup_median"] = statistics.median(per_prompt) if per_prompt else None
        row.setdefault("tau", 1.0 if m.name in (BASELINE, "selfspec-ar") else None)
        peaks = [r.peak_mb for r in runs if r.peak_mb is not None]
        row["peak_memory_mb"] = max(peaks) if peaks else None
        cmp = comparisons.get(m.name)
        row["identical"] = None if cmp is None else cmp.identical
        row["quantized"] = m.quantized
        row["diverged_prompts"] = None if cmp is None else cmp.diverged
        row["numeric_ties"] = None if cmp is None else len(cmp.ties)
        row["per_category"] = {}
        for c in categories:
            ids = [p.id for p in prompts if p.category == c]
            cat = _agg([m.runs[i] for i in ids])
            cat_base = _agg([base.runs[i] for i in ids])
            row["per_category"][c] = {
                "tokens_per_s": cat["tokens_per_s"],
                "speedup": cat["tokens_per_s"] / cat_base["tokens_per_s"] if cat_base["tokens_per_s"] else None,
                "tau": cat.get("tau", row["tau"] if row["tau"] == 1.0 else None),
            }
        results[m.name] = row
    return results
