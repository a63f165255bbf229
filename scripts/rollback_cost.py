"""What the rollback after a verification step costs: moving each row's accepted tree path into place
on every layer of a static cache (``KVCache.keep`` with a path that is not a chain prefix).

    python scripts/rollback_cost.py [--model smollm2-135m] [--rows 1,8] [--threads 1] [--repeats 300]

Times (median of warm repeats) the move on a cache of the model's shape (layers, KV heads, head
size; no weights are loaded) three ways: a gather and a scatter per layer's keys and values (the
eager cache's ``keep``), the static step's one pass over every layer uncompiled, and that pass
compiled (``StaticStep.move`` under ``compile=True``; on a GPU that pass is one CUDA graph). A step
that accepts a chain prefix (or nothing) moves nothing and costs none of this.
"""

from __future__ import annotations

import argparse
import time

import torch


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _row_counts(text: str) -> list[int]:
    return [_positive(r.strip()) for r in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=_row_counts, default=[1, 8], help="comma list of row counts")
    ap.add_argument("--threads", type=_positive, default=1)
    ap.add_argument("--repeats", type=_positive, default=300)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import transformers

    from selfspec.core.backbone import Backbone
    from selfspec.loading import model_config
    from selfspec.runtime.step import StaticStep

    try:
        config = model_config(a.model)
    except ValueError as e:
        ap.error(str(e))
    shape = dict(num_hidden_layers=config.num_hidden_layers, num_key_value_heads=config.num_key_value_heads,
                 head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    # A stand-in with the model's cache shape: the move reads no weights, so a narrow model will do.
    tiny = transformers.LlamaConfig(vocab_size=64, hidden_size=shape["head_dim"], intermediate_size=8,
                                    num_attention_heads=1, num_key_value_heads=1,
                                    num_hidden_layers=shape["num_hidden_layers"])
    backbone = Backbone(transformers.AutoModelForCausalLM.from_config(tiny).eval())
    layers, heads, dim = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
    print(f"{a.model}: {layers} layers x {heads} KV heads x {dim}; a path of 3 accepted nodes out of a tree of 16, "
          f"{a.threads} thread(s), median of {a.repeats}")
    for rows in a.rows:
        times = {}
        for way in ("per layer", "one pass", "one pass, compiled"):
            step = StaticStep(backbone, compile=way.endswith("compiled"))
            cache = step.new_cache(rows, 512)
            if way == "per layer":
                cache.mover = None
            cache.allocate(layers, heads, dim, dtype=torch.float32, device="cpu")
            paths = [torch.tensor([0, 2, 3])] * rows

            def once():
                cache.lengths = [[300 + 16] * rows for _ in range(layers)]
                cache.keep([300] * rows, paths)
            for _ in range(5):
                once()
            seconds = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                once()
                seconds.append(time.perf_counter() - t)
            times[way] = sorted(seconds)[len(seconds) // 2]
        print(f"rows {rows}: " + ", ".join(f"{w} {1e3 * s:.2f} ms" for w, s in times.items()))


if __name__ == "__main__":
    main()
