"""What an EAGLE head's drafts are worth at decoding time, beyond tau: three probes on the demo model.

    python scripts/eagle_probe.py calibration --prompts P.jsonl [--heads DIR] [--n 30] [--tree dynamic-6-4-24]
    python scripts/eagle_probe.py temperature --prompts P.jsonl [--heads DIR] [--n 30] [--temperature 0.7]
    python scripts/eagle_probe.py candidates --prompts P.jsonl [--heads DIR] [--n 30] [--temperature 0.7]
    python scripts/eagle_probe.py vocab --prompts P.jsonl --sizes 12288,16384 --data DIRS [--heads DIR] [--n 30]
    python scripts/eagle_probe.py coverage --data DIRS --held-data DIRS [--sizes 12288,16384] [--heads DIR]

Each decodes the first ``--n`` prompts with the head's whole trees (lookup and corpus off, no cut,
no width fitting, no level stop), 128 new tokens, and reads every step's draft beside the target's
verification of it (a subclass of the drafter records both; the decode loop is the library's own).

* ``calibration`` (greedy): is a drafted node's probability under the head (the number width fitting
  and the level stop price a node by, ``runtime/width.py``) its chance of acceptance? For every node whose
  parent the step accepted: the head's probability of its edge, its rank among its siblings, and
  whether it is the target's greedy token there. Prints the acceptance rate per rank and probability bin.
* ``temperature`` (sampled): would the head's distribution, sharpened or flattened by a factor c
  (q^(1/c), renormalised over the draft vocabulary), have been accepted more often? Prints the mean
  first-child acceptance at the root, sum_x min(p(x), q_c(x)), for each c (c = 1: what decoding uses).
* ``candidates`` (sampled): children drawn from the head's q (what decoding does) against the head's top k
  tokens taken as they are, each verified as a point mass (accept x with p(x), else drop x from p:
  exact too, and it would free the tree to keep the best nodes of all levels, as greedy does). Prints,
  at the root, the chance that one of the first k children is accepted, k = 1..4: for draws, averaged
  over ``SIMULATIONS`` runs of the verifier's own rule per step; for the top k, the target's mass on them.
* ``vocab``: the head's LM head is the target's own rows for its draft vocabulary, so the vocabulary
  can grow without retraining. Copies of the head whose vocabulary adds the most frequent response
  tokens of ``--data`` (the head's training data) up to each size decode the same prompts; prints each
  one's tau beside the head's (outputs must be identical).
* ``coverage`` (no decoding): the share of the response tokens of ``--held-data`` (answers the head did
  not train on) that the head's vocabulary holds, and that each grown one (as ``vocab`` grows it) would.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

BINS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
FACTORS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)


def recording(drafter, seen: list) -> None:
    """Make ``drafter`` append (draft, sampling params, target output, accepted) for every row of every step
    to ``seen``."""
    base = type(drafter)

    class Recording(base):
        def draft(self, states):
            drafts = super().draft(states)
            self.pending = [(d, s.params) for d, s in zip(drafts, states)]
            return drafts

        def commit(self, states, accepted, outs):
            seen.extend((d, params, out, acc) for (d, params), out, acc in zip(self.pending, outs, accepted))
            return super().commit(states, accepted, outs)

    drafter.__class__ = Recording


def load(heads, tree: str):
    from selfspec import SelfSpeculativeModel

    m = SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter="eagle", heads=heads, tree=tree, threshold=0,
                                             lookup=0, corpus=None, fit_width=False)
    for d in {id(x): x for x in (m.drafter, m.sampled_drafter)}.values():
        d.level_stop = False
    return m


def encode(m, prompt: str) -> torch.Tensor:
    return m.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt")


def calibration(m, rows, a) -> None:
    seen: list = []
    recording(m.drafter, seen)
    table = collections.defaultdict(lambda: [0, 0, 0.0])   # (rank, bin) -> [nodes, accepted, sum of q]
    for i, row in enumerate(rows):
        seen.clear()
        m.generate(encode(m, row["prompt"]), max_new_tokens=a.max_new_tokens)
        for draft, _, out, acc in seen:
            t, top = draft.tree, out.logits.argmax(-1)
            parents = t.parents.clamp(min=0)
            match = (draft.tokens.to(top.device) == top[parents]).tolist()
            p = draft.path_p.float()
            edge = (p / p[parents].clamp(min=1e-30)).tolist()
            on = set(acc.path)
            for j in range(1, t.size):
                if int(t.parents[j]) in on:
                    b = next(k for k, hi in enumerate(BINS) if edge[j] <= hi or hi == BINS[-1])
                    cell = table[(min(int(t.ranks[j]), 3), b)]
                    cell[0] += 1
                    cell[1] += match[j]
                    cell[2] += edge[j]
        print(f"prompt {i + 1}/{len(rows)}", file=sys.stderr, flush=True)
    print("| rank | head probability | nodes | mean probability | accepted |\n|---|---|---|---|---|")
    for (rank, b), (n, hit, q) in sorted(table.items()):
        if n >= a.min_nodes:
            lo = 0 if b == 0 else BINS[b - 1]
            print(f"| {rank + 1}{'+' if rank == 3 else ''} | {lo:.2f}-{BINS[b]:.2f} | {n} | {q / n:.3f} | {hit / n:.3f} |")


def root_steps(m, rows, a):
    """Sampling the prompts at ``--temperature``: for every step, (p, q): the target's distribution after the
    root and the head's distribution the root's children were drawn from."""
    from selfspec.core.sampling import probs_from_logits

    seen: list = []
    recording(m.sampled_drafter, seen)
    torch.manual_seed(a.seed)
    for i, row in enumerate(rows):
        seen.clear()
        m.generate(encode(m, row["prompt"]), max_new_tokens=a.max_new_tokens, do_sample=True,
                   temperature=a.temperature)
        for draft, params, out, _ in seen:
            yield probs_from_logits(out.logits[0], params).float(), draft.q[int(draft.q_rows()[1])].float()
        print(f"prompt {i + 1}/{len(rows)}", file=sys.stderr, flush=True)


def temperature(m, rows, a) -> None:
    sums, steps = collections.Counter(), 0
    for p, q in root_steps(m, rows, a):
        logq = q.clamp(min=1e-30).log()
        for c in FACTORS:
            qc = torch.where(q > 0, (logq / c).softmax(-1), torch.zeros_like(q))
            sums[c] += float(torch.minimum(p, qc / qc.sum()).sum())
        steps += 1
    print(f"{steps} steps at T={a.temperature}\n\n| factor c | first-child acceptance |\n|---|---|")
    for c in FACTORS:
        print(f"| {c} | {sums[c] / max(steps, 1):.4f} |")


SIMULATIONS = 64   # candidates: verifier runs per step for drawn children
WIDTH = 4


def drawn_acceptance(p: torch.Tensor, q: torch.Tensor, g: torch.Generator) -> list[int]:
    """One run of recursive rejection sampling over WIDTH children drawn from q without replacement (the
    rule of ``verify.rejection_accept_tree``): for k = 1..WIDTH, whether one of the first k was accepted."""
    out, accepted = [], False
    for _ in range(WIDTH):
        if not accepted and q.sum() > 0:
            q = q / q.sum()
            x = int(torch.multinomial(q, 1, generator=g))
            if float(torch.rand((), generator=g)) < float(p[x] / q[x]):
                accepted = True
            else:
                r = (p - q).clamp(min=0)
                p, q = (r / r.sum() if r.sum() > 0 else r), q.clone()
                q[x] = 0
        out.append(int(accepted))
    return out


def candidates(m, rows, a) -> None:
    drawn, top, steps = torch.zeros(WIDTH), torch.zeros(WIDTH), 0
    g = torch.Generator().manual_seed(a.seed + 1)
    for p, q in root_steps(m, rows, a):
        top += p[q.topk(WIDTH).indices].cumsum(0)
        drawn += torch.tensor([drawn_acceptance(p, q, g) for _ in range(SIMULATIONS)], dtype=torch.float).mean(0)
        steps += 1
    print(f"{steps} steps at T={a.temperature}\n\n| children k | drawn from q | the head's top k |\n|---|---|---|")
    for k in range(WIDTH):
        print(f"| {k + 1} | {drawn[k] / max(steps, 1):.4f} | {top[k] / max(steps, 1):.4f} |")


def response_tokens(data: str):
    """Every response token of the gen-data directories ``data``, row after row."""
    from selfspec.training.data import load_distillation_data

    for r in load_distillation_data(data):
        yield from r["input_ids"][r["response_start"]: r["response_start"] + r["n_response"]]


def by_frequency(data: str) -> list[int]:
    """The response tokens of ``data``, most frequent first (counted once; every grown size reads it)."""
    return [t for t, _ in collections.Counter(response_tokens(data)).most_common()]


def grown(vocab: list[int], size: int, ranked: list[int]) -> list[int]:
    """``vocab`` and after it the most frequent tokens of ``ranked`` (``by_frequency``) it lacks, up to ``size``."""
    have = set(vocab)
    return vocab + [t for t in ranked if t not in have][: max(0, size - len(vocab))]


def head_vocab(heads: Path) -> list[int]:
    from safetensors.torch import load_file

    return load_file(heads / "model.safetensors")["draft_vocab"].tolist()


def coverage(heads: Path, ranked: list[int], held: list[int], a) -> None:
    vocab = head_vocab(heads)
    print(f"{len(held)} response tokens in {a.held_data}\n\n| draft vocabulary | tokens | share of them |\n|---|---|---|")
    for name, v in [("the head's", vocab)] + [(str(n), grown(vocab, n, ranked)) for n in a.sizes_list]:
        have = set(v)
        print(f"| {name} | {len(v)} | {sum(t in have for t in held) / max(len(held), 1):.4f} |")


def grown_copy(heads: Path, size: int, ranked: list[int], out: Path) -> Path:
    """A copy of ``heads`` whose draft vocabulary is ``grown`` to ``size``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(heads / "model.safetensors")
    vocab = grown(tensors["draft_vocab"].tolist(), size, ranked)
    shutil.copytree(heads, out)
    tensors["draft_vocab"] = torch.tensor(vocab, dtype=torch.int64)
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["draft_vocab_size"] = len(vocab)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def vocab(heads: Path, rows, ranked: list[int], a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"shipped": heads} | {str(s): grown_copy(heads, s, ranked, Path(tmp) / f"v{s}") for s in a.sizes_list}
        models = {k: load(d, a.tree) for k, d in dirs.items()}
        totals = {k: [0, 0] for k in models}
        for i, row in enumerate(rows):
            outs = []
            for k, m in models.items():
                outs.append(m.generate(encode(m, row["prompt"]), max_new_tokens=a.max_new_tokens).tolist())
                totals[k][0] += m.last_stats.new_tokens
                totals[k][1] += m.last_stats.target_forwards
            if any(o != outs[0] for o in outs):
                sys.exit(f"eagle_probe: prompt {i}: outputs differ between vocabularies")
            print(f"prompt {i + 1}/{len(rows)}", file=sys.stderr, flush=True)
    print("| draft vocabulary | tau |\n|---|---|")
    for k, (n, f) in totals.items():
        print(f"| {k} | {n / f:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("probe", choices=("calibration", "temperature", "candidates", "vocab", "coverage"))
    ap.add_argument("--prompts", default="", help="JSONL, one {\"prompt\": ...} a line (every probe but coverage)")
    ap.add_argument("--heads", default="checkpoints/smollm2-135m/eagle")
    ap.add_argument("--n", type=int, default=30, help="prompts decoded (the file's first)")
    ap.add_argument("--tree", default="dynamic-6-4-24")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-nodes", type=int, default=20, help="calibration: rows with fewer nodes are not printed")
    ap.add_argument("--sizes", default="12288,16384", help="vocab: draft vocabulary sizes to try")
    ap.add_argument("--data", default="", help="vocab, coverage: data directories (comma-separated) to count tokens in")
    ap.add_argument("--held-data", default="", help="coverage: data directories whose response tokens are counted")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.n < 1 or a.max_new_tokens < 1 or a.threads < 1 or a.temperature <= 0:
        ap.exit(2, "eagle_probe: --n, --max-new-tokens and --threads must be at least 1, --temperature above 0\n")
    if a.probe in ("vocab", "coverage") and not a.data:
        ap.exit(2, f"eagle_probe: {a.probe} needs --data, the head's training data directories\n")
    if a.probe == "coverage" and not a.held_data:
        ap.exit(2, "eagle_probe: coverage needs --held-data, answers the head did not train on\n")
    try:
        a.sizes_list = [int(n) for n in a.sizes.split(",")]
    except ValueError:
        ap.exit(2, f"eagle_probe: --sizes takes comma-separated vocabulary sizes (got {a.sizes!r})\n")
    heads = Path(a.heads)
    if not (heads / "config.json").is_file():
        ap.exit(2, f"eagle_probe: --heads {heads} holds no config.json (give a heads directory)\n")
    ranked, held = [], []
    if a.probe in ("vocab", "coverage"):
        try:   # a directory that is no gen-data output (or short of a DIR@N count) ends here, in one line
            ranked = by_frequency(a.data)
            held = list(response_tokens(a.held_data)) if a.probe == "coverage" else []
        except ValueError as e:
            ap.exit(2, f"eagle_probe: {e}\n")
    if a.probe == "coverage":
        coverage(heads, ranked, held, a)
        return
    if not a.prompts:
        ap.exit(2, f"eagle_probe: {a.probe} needs --prompts, a JSONL file\n")
    from selfspec.training.data import load_prompts

    try:
        rows = load_prompts(a.prompts, max_prompts=a.n)
    except ValueError as e:
        ap.exit(2, f"eagle_probe: {e}\n")
    if not rows:
        ap.exit(2, f"eagle_probe: --prompts {a.prompts} holds no prompts\n")
    torch.set_num_threads(a.threads)
    if a.probe == "vocab":
        vocab(heads, rows, ranked, a)
    else:
        {"calibration": calibration, "temperature": temperature, "candidates": candidates}[a.probe](
            load(heads, a.tree), rows, a)


if __name__ == "__main__":
    main()
