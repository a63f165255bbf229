"""Self-instruct prompts: the target writes new task prompts in the style of a few seed prompts.

The heads only learn the contexts they are shown. A prompt file with few open-ended tasks (e.g. the
175 Self-Instruct seeds in train.jsonl) gives the heads few such contexts, however many answers are
sampled per prompt. Here the target itself proposes new tasks: each request shows it ``examples``
seed prompts, numbered, and lets it sample the next one. The proposals are cut at the first blank
line or next "Task" marker, filtered (length, letters, no repeated lines, not a seed, not seen
before) and written as a prompt file that ``selfspec gen-data`` then answers. Nothing outside the
seed file and the target model is used, so dev prompts never leak in.

Output rows: ``{"id": "synth-<n>", "source": "synth", "prompt": ...}``. Rerunning with the same
``--out`` resumes: requests are numbered (the count is kept next to the output) and each batch's
RNG is seeded from its first request number, so a resumed run goes on with new requests.

CLI: ``selfspec synth-prompts --model smollm2-135m --seeds train.jsonl --sources self_instruct_seed --n 3000 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..io import atomic_write_text
from ..loading import check_model_name, load_model
from .cli_args import at_least, positive
from .data import load_prompts, select_prompts

MIN_CHARS, MAX_CHARS = 16, 400


def few_shot_request(examples: list[str]) -> str:
    """The raw-text request for one new task: the examples as "Task i:" paragraphs, then an open "Task k+1:"."""
    body = "".join(f"Task {i + 1}: {e.strip()}\n\n" for i, e in enumerate(examples))
    return body + f"Task {len(examples) + 1}:"


def clean_proposal(text: str) -> str | None:
    """The proposed task in ``text`` (what the model wrote after "Task k+1:"), or None when unusable."""
    text = re.split(r"\n\s*Task \d+\s*:", text)[0]
    text = text.strip().split("\n\n")[0].strip()
    if not (MIN_CHARS <= len(text) <= MAX_CHARS) or sum(c.isalpha() for c in text) < MIN_CHARS // 2:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(set(lines)) < len(lines):
        return None  # a repeated line: the model looped
    words = text.split()
    if len(words) >= 8 and len(set(words)) < len(words) / 2:
        return None  # degenerate repetition within a line
    return text


def synthesize_prompts(model, tokenizer, seeds: list[str], out: Path, *, n: int, examples: int = 3,
                       temperature: float = 0.9, max_new_tokens: int = 64, batch_size: int = 64, seed: int = 0,
                       max_requests: int | None = None, progress: bool = True) -> list[dict]:
    """Append proposals to ``out`` (JSONL) until it holds ``n`` prompts; return all its rows.

    Gives up after ``max_requests`` requests (default ``8 * n``) so a model that rarely writes a usable
    task cannot loop forever; the rows kept so far stay in ``out``.
    """
    if n < 1 or examples < 1 or batch_size < 1 or max_new_tokens < 1 or temperature <= 0:
        raise ValueError("n, examples, batch_size and max_new_tokens must be >= 1 and temperature > 0")
    pool = [s for s in seeds if len(s) <= MAX_CHARS] or list(seeds)
    if len(pool) < examples:
        raise ValueError(f"{len(pool)} usable seed prompts for {examples} examples per request: give more seeds or fewer --examples")
    rows, state = _read_existing(out)
    seen = {_key(s) for s in seeds} | {_key(r["prompt"]) for r in rows}
    requests = state.get("requests", 0)
    max_requests = 8 * n if max_requests is None else max_requests
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    started = time.perf_counter()
    with tqdm(total=n, initial=min(len(rows), n), unit="prompt", desc="synth-prompts", disable=not progress,
              file=sys.stderr) as bar:
        while len(rows) < n and requests < max_requests:
            rng = random.Random(f"{seed}:{requests}")
            texts = [few_shot_request(rng.sample(pool, examples)) for _ in range(batch_size)]
            enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
            with torch.random.fork_rng(devices=[]), torch.inference_mode():
                torch.manual_seed(rng.getrandbits(62))
                gen = model.generate(input_ids=enc.input_ids.to(model.device), attention_mask=enc.attention_mask.to(model.device),
                                     max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0,
                                     top_p=1.0, min_p=None, pad_token_id=pad)
            requests += batch_size
            for ids in gen[:, enc.input_ids.shape[1]:].tolist():
                text = clean_proposal(tokenizer.decode(ids, skip_special_tokens=True))
                if text is not None and _key(text) not in seen and len(rows) < n:
                    seen.add(_key(text))
                    rows.append({"id": f"synth-{len(rows)}", "source": "synth", "prompt": text})
                    bar.update(1)
            bar.set_postfix(kept=f"{len(rows) / max(requests, 1):.0%}", s=f"{time.perf_counter() - started:.0f}")
            _write(out, rows, {"requests": requests, "seed": seed, "examples": examples, "temperature": temperature})
    if len(rows) < n:
        print(f"selfspec: warning: stopped after {requests} requests with {len(rows)} of {n} prompts "
              "(the model rarely wrote a usable task)", file=sys.stderr)
    return rows


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def _state_path(out: Path) -> Path:
    return out.with_name(out.name + ".state.json")


def _read_existing(out: Path) -> tuple[list[dict], dict]:
    if not out.is_file():
        return [], {}
    state = json.loads(_state_path(out).read_text()) if _state_path(out).is_file() else {}
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()], state


def _write(out: Path, rows: list[dict], state: dict) -> None:
    # Rows, then state, each by rename: a kill between the two only repeats a batch's requests.
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(_state_path(out), json.dumps(state) + "\n")


def add_synth_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help="alias, model directory, .gguf file or hub id (e.g. smollm2-135m)")
    parser.add_argument("--seeds", required=True, help="prompt file (JSONL with \"prompt\") or dataset whose prompts are the examples")
    parser.add_argument("--sources", default=None, help="comma-separated \"source\" values of the seeds to use (default: all)")
    parser.add_argument("--out", required=True, help="output JSONL; rerunning with the same one resumes")
    parser.add_argument("--n", type=int, default=1000, help="prompts to write")
    parser.add_argument("--examples", type=int, default=3, help="seed prompts shown per request")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest proposal, in tokens")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def check_synth_args(args: argparse.Namespace) -> None:
    """The flags' numbers, --out and the model name, checked before the model loads."""
    for name in ("n", "examples", "max_new_tokens", "batch_size", "threads"):
        at_least(getattr(args, name), 1, name)
    positive(args.temperature, "temperature")
    out = Path(args.out)
    if out.suffix != ".jsonl":
        raise ValueError(f"--out {out} must end in .jsonl (it is a prompt file for gen-data)")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: pass a .jsonl file path")
    check_model_name(args.model)


def run_synth(args: argparse.Namespace) -> int:
    check_synth_args(args)
    out = Path(args.out)
    seeds = load_prompts(args.seeds)
    seeds = [r["prompt"] for r in select_prompts(seeds, sources=args.sources)]
    if not seeds:
        raise ValueError(f"{args.seeds} holds no seed prompts: give a JSONL file with one {{\"prompt\": ...}} per line")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    rows = synthesize_prompts(loaded.model, loaded.tokenizer, seeds, out, n=args.n, examples=args.examples,
                              temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, seed=args.seed, progress=not args.no_progress)
    print(f"synth-prompts: {len(rows)} prompts in {out} from {len(seeds)} seeds", flush=True)
    return 0
