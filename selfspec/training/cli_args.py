"""Command-line plumbing shared by the commands: flag types, and the checks that answer bad input
in one line before any model is loaded (so a typo costs a second, not a model load, and a failed
command leaves no output behind).

Light on purpose (no torch): ``selfspec`` runs these before importing anything heavy.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Callable

STATE_FILE = "trainer_state.pt"   # as training/checkpoint.py writes it (that module imports torch)
GROUP_BY_LENGTH_HELP = ("micro-batches of sequences of similar lengths: less padding (more sequences a second), but "
                        "some batches hold only long sequences, so peak memory is that of batch-size sequences of --max-len "
                        "(true | false)")


def flag_type(typ: type) -> Callable[[str], object]:
    """argparse ``type`` for a config field: bools take true/false/1/0/yes/no (``bool("false")`` is True)."""
    if typ is not bool:
        return typ

    def parse(text: str) -> bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

    parse.__name__ = "bool"
    return parse


def run_module(argv: list[str] | None, *, add_args, run, prog: str, description: str) -> int:
    """``python -m`` entry shared by the training commands: one-line errors, 130 when interrupted."""
    args = add_args(argparse.ArgumentParser(prog=prog, description=description)).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        result = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 130 if result.interrupted else 0


# ---------------------------------------------------------------------------------------------- checks


def flag(name: str) -> str:
    """``max_new_tokens`` -> ``--max-new-tokens``: messages name the flag the user typed."""
    return "--" + name.replace("_", "-")


def at_least(value, low: float, name: str) -> None:
    """Refuse ``value < low``, NaN and infinity (None passes: the flag was not given)."""
    if value is not None and not low <= value < math.inf:
        raise ValueError(f"{flag(name)} must be {_finite(value)}>= {low:g} (got {value:g})")


def positive(value, name: str) -> None:
    """Refuse ``value <= 0``, NaN and infinity (None passes)."""
    if value is not None and not 0 < value < math.inf:
        raise ValueError(f"{flag(name)} must be {_finite(value)}> 0 (got {value:g})")


def _finite(value) -> str:
    """How a bound's message starts: "a finite number " where the value given was NaN or infinite."""
    return "" if math.isfinite(value) else "a finite number "


def check_generation_flags(extra: dict) -> None:
    """train-heads' and train-draft's flags for the data they generate from --prompts (None: not given)."""
    for name in ("max_prompts", "max_new_tokens", "gen_batch_size"):
        at_least(extra.get(name), 1, name)


def in_unit_interval(value, name: str, *, open_low: bool = False, open_high: bool = False) -> None:
    """Refuse a value outside [0, 1] (or (0, 1], [0, 1) with the open ends given)."""
    if value is None:
        return
    low_ok = value > 0 if open_low else value >= 0
    high_ok = value < 1 if open_high else value <= 1
    if not (low_ok and high_ok) or math.isnan(value):
        span = f"{'(' if open_low else '['}0, 1{')' if open_high else ']'}"
        raise ValueError(f"{flag(name)} must be in {span} (got {value:g})")


def check_sampling(*, temperature: float, top_p: float | None = None, top_k: int | None = None,
                   repetition_penalty: float | None = None) -> None:
    """temperature >= 0 (0 = greedy), top-p in (0, 1], top-k >= 0, repetition penalty > 0."""
    at_least(temperature, 0, "temperature")
    in_unit_interval(top_p, "top_p", open_low=True)
    at_least(top_k, 0, "top_k")
    if repetition_penalty is not None and not 0 < repetition_penalty < math.inf:
        raise ValueError(f"--repetition-penalty must be {_finite(repetition_penalty)}> 0 (got {repetition_penalty}; 1 is off)")


def check_prompt_text(prompt: str) -> None:
    if not prompt or not prompt.strip():
        raise ValueError("--prompt is empty: give some text for the model to answer or continue")


def check_input_file(path, name: str) -> Path:
    """An input file that must exist and hold something."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{flag(name)} {path}: no such file: check the path")
    if p.is_file() and p.stat().st_size == 0:
        raise ValueError(f"{flag(name)} {path} is empty: give a file with one JSON object per line")
    return p


def check_output_dir(path, *, resume: bool | None = None, force: bool | None = None,
                     allowed: tuple[str, ...] = ()) -> None:
    """Refuse to write into a path that is a file, or a non-empty directory this run would overwrite.

    ``resume``: the command can continue a run (--resume); a directory holding a run is fine with it
    and refused without. ``force``: the command can overwrite (--force). ``allowed``: entries the
    command itself writes there (see ``TRAINING_OUTPUTS``), which do not count.
    """
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {path} is a file: pass a directory path")
    if not out.is_dir() or force or resume:
        return
    if (out / STATE_FILE).is_file():
        raise ValueError(f"--out {path} already holds a training run: pass --resume to continue it, or a new --out")
    found = [p.name for p in out.iterdir() if p.name not in allowed]
    if found:
        hint = "a new --out" + (", or --force to overwrite it" if force is not None else "")
        hint += ", or --resume to continue a run there" if resume is not None else ""
        raise ValueError(f"--out {path} exists and is not empty ({found[0]}{', ...' if len(found) > 1 else ''}): pass {hint}")


# What train-heads / train-draft write into --out themselves (a heads directory or a draft, its model
# card, --prompts' data): an --out holding only these is retrained in place, as the scripts that
# regenerate the shipped checkpoints do; anything else there is refused.
TRAINING_OUTPUTS = ("data", "config.json", "model.safetensors", "README.md", "lora", "generation_config.json",
                    "selfspec_draft.json")


def check_training_config(config, *, resume: bool) -> None:
    """The numbers every training run takes (TrainConfig and DraftConfig share them), and --out."""
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "save_every", "max_len"):
        at_least(getattr(config, name), 1, name)
    for name in ("warmup", "weight_decay", "draft_vocab_size", "hard_weight", "num_heads", "lora", "exit_intermediate"):
        at_least(getattr(config, name, None), 0, name)
    positive(config.lr, "lr")
    in_unit_interval(config.eval_fraction, "eval_fraction", open_high=True)
    at_least(getattr(config, "exit_layer", None), 1, "exit_layer")
    if getattr(config, "kind", None) == "medusa":
        at_least(config.num_heads, 1, "num_heads")
    if getattr(config, "mixed_precision", "auto") not in ("auto", "no", "bf16"):
        raise ValueError(f"--mixed-precision {config.mixed_precision!r}: use auto, no or bf16")
    check_output_dir(config.out, resume=resume, allowed=TRAINING_OUTPUTS)


def check_corpus_arg(corpus: str, drafter: str | None = None) -> None:
    """--corpus: auto, none or a corpus directory (only for drafters whose lookup reads one)."""
    if corpus in ("auto", "none"):
        return
    from ..shipped import LOOKUP_DRAFTERS

    if drafter is not None and drafter not in LOOKUP_DRAFTERS:
        raise ValueError(f"--drafter {drafter} has no lookup to feed a --corpus (only {', '.join(LOOKUP_DRAFTERS)} do): "
                         "drop --corpus")
    from ..corpus import read_corpus_config

    read_corpus_config(corpus)
