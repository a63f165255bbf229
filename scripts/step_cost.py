"""The host work of one decoding step, per drafter, against transformers' cost of one token.

    python scripts/step_cost.py [--runs 7] [--new 96] [--prompt 64] [--batch 1] [--threads 1] [--compile]

On a tiny random llama (4 layers, hidden 64, vocabulary 512) the model's own arithmetic is nearly free,
so what a step costs here is the loop's Python and small-tensor work: the part of a step that a GPU
cannot hide. Each drafter (untrained heads, width fitting off, so every step verifies its whole tree)
decodes ``--new`` tokens after a ``--prompt``-token prompt, greedy, interleaved with transformers' greedy
``generate``, in one process; the fastest of ``--runs`` runs of each is reported as milliseconds per
verification step, and as a multiple of transformers' milliseconds per token. With ``--batch`` B, each
decode runs B prompts (against transformers' batched ``generate`` of B rows): a step verifies every row
and transformers' step makes a token for each, so what grows with the rows shows up as a larger multiple.

Eager runs also count the operations a step dispatches (every aten call, a view included, under a
``TorchDispatchMode``, in one more decode of each): a measure of the host work that does not move with
the machine's load, where the milliseconds move by 10-20% from run to run on a shared VM.
"""

from __future__ import annotations

import argparse
import time

import torch


def tiny_llama(seed: int = 0, **over):
    import transformers as tf

    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512)
    cfg.update(over)
    config = tf.LlamaConfig(**cfg)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)   # clear greedy winners
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--new", type=int, default=96, help="new tokens per run")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--batch", type=int, default=1, help="prompts per decode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="selfspec's drafters through the compiled static step")
    ap.add_argument("--drafters", default="none,lookup,medusa,eagle,early-exit,draft-model")
    a = ap.parse_args()
    if min(a.runs, a.new, a.prompt, a.batch) < 1:
        ap.error("--runs, --new, --prompt and --batch must be at least 1")
    torch.set_num_threads(a.threads)
    from selfspec.model import SelfSpeculativeModel, untrained_heads

    model = tiny_llama()
    ids = torch.randint(1, 512, (a.batch, a.prompt), generator=torch.Generator().manual_seed(0))
    made = {}
    for name in a.drafters.split(","):
        heads = {"medusa": "medusa", "eagle": "eagle", "early-exit": "early-exit"}.get(name)
        kw = {}
        if heads == "early-exit":
            kw["exit_layer"] = 2
        h = untrained_heads(heads, model, "tiny", **kw) if heads else None
        draft = tiny_llama(seed=1, num_hidden_layers=1) if name == "draft-model" else None
        made[name] = SelfSpeculativeModel(model, None, drafter_name=name, heads=h, name="tiny", draft_model=draft,
                                          fit_width=False, compile=a.compile)

    def hf():
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new, min_new_tokens=a.new,
                           do_sample=False)
        return a.new

    def ours(sm):
        sm.generate(ids, max_new_tokens=a.new)
        return sm.last_stats.target_forwards - 1   # the decode's steps (each verifies every row)

    runs = {"hf": (hf, [])} | {n: ((lambda sm=sm: ours(sm)), []) for n, sm in made.items()}
    for fn, _ in runs.values():   # warm-up (compiles, first-call allocations)
        fn()
    for _ in range(a.runs):
        for fn, times in runs.values():
            t = time.perf_counter()
            steps = fn()
            times.append((time.perf_counter() - t) * 1e3 / steps)
    ops = {} if a.compile else {name: _ops(fn) for name, (fn, _) in runs.items()}   # per step (per token: hf)
    base = min(runs["hf"][1])
    print(f"tiny llama (4 layers, hidden 64, vocab 512), {a.threads} thread(s), {a.prompt}-token prompt, "
          f"{a.new} new tokens, {a.batch} row(s), fastest of {a.runs}{', compiled' if a.compile else ', eager'}, torch {torch.__version__}")
    counted = (" | ops per step | x transformers' ops per token", "|---|---") if ops else ("", "")
    print(f"| method | ms per step | x transformers' ms per token | tau{counted[0]} |\n|---|---|---|---{counted[1]}|")
    row = lambda name: f" | {ops[name]:.0f} | {ops[name] / ops['hf']:.2f}" if ops else ""   # noqa: E731
    print(f"| transformers generate | {base:.2f} | 1.00 | 1.00{row('hf')} |")
    for name, sm in made.items():
        best = min(runs[name][1])
        print(f"| selfspec {name} | {best:.2f} | {best / base:.2f} | {sm.last_stats.tau:.2f}{row(name)} |")


def _ops(decode) -> float:
    """The aten operations one run of ``decode`` (which returns its steps) dispatches, per step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        steps = decode()
    return count.n / steps


if __name__ == "__main__":
    main()
