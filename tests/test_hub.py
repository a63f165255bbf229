"""Hub ids, offline: a model, its tokenizer and heads published as hub repos resolve through the
Hugging Face cache exactly as they would online (the download itself is the only step not run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec.heads import save_heads
from selfspec.model import untrained_heads

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached_repo(cache: Path, repo_id: str) -> Path:
    """The snapshot directory huggingface_hub resolves ``repo_id`` to, offline, inside ``cache``."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def test_model_and_heads_given_as_hub_ids_resolve_offline_and_decode_exactly(tmp_path):
    cache = tmp_path / "hub"
    model = tiny_model("llama", seed=1)
    model_dir = _cached_repo(cache, "selfspec-test/tiny")
    model.save_pretrained(model_dir)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1", pad_token="w0").save_pretrained(model_dir)
    heads = untrained_heads("medusa", model, "selfspec-test/tiny")
    with torch.no_grad():
        for p in heads.module.parameters():
            p.normal_(std=0.05)
    save_heads(heads, _cached_repo(cache, "selfspec-test/tiny-heads"))

    script = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from selfspec import SelfSpeculativeModel
sm = SelfSpeculativeModel.from_pretrained("selfspec-test/tiny", drafter="medusa", heads="selfspec-test/tiny-heads")
ids = torch.tensor([[5, 9, 13, 2, 40]])
ours = sm.generate(ids, max_new_tokens=24)[0].tolist()
ref = AutoModelForCausalLM.from_pretrained("selfspec-test/tiny").eval()
theirs = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0].tolist()
try:
    SelfSpeculativeModel.from_pretrained("selfspec-test/tiny", drafter="medusa", heads="selfspec-test/not-cached")
    missing = "loaded"
except FileNotFoundError as e:
    missing = str(e)
w = sm.heads.module.blocks[0].linear.weight
print(json.dumps({"ours": ours, "theirs": theirs, "name": sm.name, "heads_for": sm.heads.config.base_model,
                  "w": float(w.abs().sum()), "missing": missing}))
"""
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ours"] == got["theirs"]
    assert got["name"] == "selfspec-test/tiny"
    assert got["heads_for"] == "selfspec-test/tiny"
    assert abs(got["w"] - float(heads.module.blocks[0].linear.weight.detach().abs().sum())) < 1e-3   # the published heads, not untrained ones
    assert "selfspec-test/not-cached" in got["missing"] and "\n" not in got["missing"]
