"""Width fitting with and without its calibration, in one process: what scaling a drafter's chances to
what its steps were accepted with is worth here.

    python scripts/calibration_ab.py PROMPTS.jsonl [--drafter medusa] [--limit 12] [--max-new-tokens 128]
                                     [--temperature 0] [--threads 2]

Three models on the demo target: the plain loop, the drafter with width fitting as it ships (its
``Calibration`` learning from every step), and the same drafter fitting on its raw chances (a
calibration that never scales). They run interleaved prompt by prompt (the order flipped every other
prompt) after a warm-up; greedy outputs are checked identical to the plain loop's. Prints tokens per
second of each drafter over the plain loop's, and its tau.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts")
    ap.add_argument("--drafter", default="medusa", choices=["medusa", "eagle", "lookup"])
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.limit < 1 or a.max_new_tokens < 1 or a.threads < 1 or a.temperature < 0:
        ap.error("--limit, --max-new-tokens and --threads must be at least 1, --temperature at least 0")
    torch.set_num_threads(a.threads)
    from selfspec.bench.harness import load_prompts
    from selfspec.model import SelfSpeculativeModel
    from selfspec.runtime.width import Calibration

    class Raw(Calibration):
        def factors(self, depth):
            return [1.0] * (depth + 1)

    class RawOnly(dict):
        def setdefault(self, key, default=None):
            return super().setdefault(key, Raw())

    def load(drafter: str) -> SelfSpeculativeModel:
        return SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter=drafter, dtype=torch.float32)

    models = {"plain": load("none"), "calibrated": load(a.drafter), "raw": load(a.drafter)}
    models["raw"]._calibrations = RawOnly()
    tok = models["plain"].tokenizer
    try:
        rows = load_prompts(a.prompts, limit=a.limit)
    except ValueError as e:
        ap.error(str(e))

    def ids_of(prompt: str) -> torch.Tensor:
        x = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                    return_tensors="pt")
        return x if isinstance(x, torch.Tensor) else x["input_ids"]

    kw = {"max_new_tokens": a.max_new_tokens}
    if a.temperature > 0:
        kw |= {"do_sample": True, "temperature": a.temperature}
    tokens = dict.fromkeys(models, 0)
    seconds = dict.fromkeys(models, 0.0)
    taus: dict[str, list[float]] = {"calibrated": [], "raw": []}
    for sm in models.values():   # warm-up: first-call allocations, the cost prior
        sm.generate(ids_of(rows[0].text), max_new_tokens=16)
    for i, row in enumerate(rows):
        ids = ids_of(row.text)
        order = list(models) if i % 2 == 0 else list(reversed(models))
        outs = {}
        for name in order:
            t = time.perf_counter()
            out = models[name].generate(ids, generator=torch.Generator().manual_seed(i), **kw)
            seconds[name] += time.perf_counter() - t
            tokens[name] += out.shape[1] - ids.shape[1]
            outs[name] = out
            if name in taus:
                taus[name].append(models[name].last_stats.tau)
        if a.temperature == 0 and not all(torch.equal(o, outs["plain"]) for o in outs.values()):
            raise SystemExit(f"calibration_ab: prompt {i}: a drafter's greedy output differs from the plain loop's")
    rate = {name: tokens[name] / seconds[name] for name in models}
    print(f"{a.drafter}, {len(rows)} prompts of {a.prompts}, {a.max_new_tokens} new tokens, T={a.temperature}, "
          f"{a.threads} threads, torch {torch.__version__}; plain loop {rate['plain']:.1f} tokens/s")
    for name in taus:
        print(f"  {name:10s} {rate[name] / rate['plain']:.3f}x of the plain loop, tau {sum(taus[name]) / len(taus[name]):.2f}")


if __name__ == "__main__":
    main()
