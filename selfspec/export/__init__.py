"""``selfspec export-heads``: trained heads in the layouts serving engines load.

=====================  ======  ==========================================================
format                 heads   loaded by
=====================  ======  ==========================================================
``eagle3-sglang``      eagle   SGLang (``--speculative-algorithm EAGLE3``), vLLM
``eagle3-speculators`` eagle   vLLM (``vllm serve DIR``), vLLM speculators
``medusa-vllm``        medusa  vLLM (``"method": "medusa"``)
``medusa-tgi``         medusa  Hugging Face TGI (``medusa_lm_head.safetensors``)
=====================  ======  ==========================================================

Each format's layout is described in its module (``eagle3.py``, ``medusa.py``). What a format cannot
hold (the final hidden state as a feature, a root-token input, wider MLPs, a draft vocabulary where
the engine scores the full one) is refused in one line naming the training flag that makes heads it
can hold. The directory appears whole or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..heads import read_heads_config
from . import eagle3, medusa

FORMATS = {   # format -> the heads kind it holds
    "eagle3-sglang": "eagle",
    "eagle3-speculators": "eagle",
    "medusa-vllm": "medusa",
    "medusa-tgi": "medusa",
}
DTYPES = ("float32", "float16", "bfloat16")


def check_export(heads_dir, fmt: str, *, num_layers: int):
    """The heads' config, once they are known to fit ``fmt`` (ValueError with the fix otherwise)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose from {', '.join(FORMATS)}")
    config = read_heads_config(heads_dir)
    if config.kind != FORMATS[fmt]:
        others = [f for f, k in FORMATS.items() if k == config.kind]
        hint = f"formats for {config.kind} heads: {', '.join(others)}" if others else f"{config.kind} heads have no export format"
        raise ValueError(f"--format {fmt} holds {FORMATS[fmt]} heads, but {heads_dir} holds {config.kind} heads ({hint})")
    if config.lora:
        raise ValueError(f"{heads_dir} was trained with LoRA on the backbone (Medusa-2): the engines would run the "
                         "original target, so these heads do not match it; train heads without --lora to export them")
    why = eagle3.refusal(config, num_layers, fmt) if config.kind == "eagle" else medusa.refusal(config, fmt)
    if why:
        raise ValueError(why)
    return config


def export_heads(heads_dir, fmt: str, out, *, model=None, dtype: str = "float32", speculative_tokens: int = 3):
    """Write ``heads_dir``'s heads as ``fmt`` into the new directory ``out``; returns ``out``.

    ``model``: the target (name or path; default: the one the heads were trained for): the LM head
    rows the heads share are taken from it, and its hub id names the verifier.
    """
    import torch
    from safetensors.torch import save_file

    from ..core.backbone import config_fingerprint
    from ..heads import load_heads
    from ..io import atomic_dir, atomic_write_text
    from ..loading import hub_id_of, load_model, model_config

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    base = read_heads_config(heads_dir).base_model
    model = model or base
    config = check_export(heads_dir, fmt, num_layers=model_config(model).num_hidden_layers)
    loaded = load_model(model, device="cpu", dtype=torch.float32)
    heads = load_heads(heads_dir, expect_kind=config.kind, fingerprint=config_fingerprint(loaded.model.config),
                       device="cpu", dtype=torch.float32, model=loaded.model)
    verifier = hub_id_of(loaded.name)
    store = getattr(torch, dtype)
    target_lm_head = loaded.model.get_output_embeddings().weight
    if config.kind == "eagle":
        lm_head = heads.module.lm_head.weight
        files = {"model.safetensors": eagle3.tensors(heads, lm_head=lm_head, fmt=fmt, dtype=store)}
        cfg = eagle3.config(heads, fmt=fmt, target_config=loaded.model.config, verifier=verifier,
                            draft_size=lm_head.shape[0], dtype=store, speculative_tokens=speculative_tokens)
    else:
        files, cfg = medusa.files(heads, fmt=fmt, lm_head=target_lm_head, dtype=store, verifier=verifier,
                                  target_config=loaded.model.config)
    with atomic_dir(Path(out)) as tmp:
        for name, tensors in files.items():
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        atomic_write_text(tmp / "config.json", json.dumps(cfg, indent=2) + "\n")
        atomic_write_text(tmp / "README.md", _card(fmt, heads_dir, verifier, cfg))
    return Path(out)


def serve_commands(fmt: str, verifier: str, directory: str) -> list[str]:
    """The command that serves ``directory`` (written as ``fmt``) beside ``verifier`` in its engine."""
    if fmt == "eagle3-sglang":
        return [f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 \\",
                f"    --speculative-draft-model-path {directory} --speculative-num-steps 3 \\",
                "    --speculative-eagle-topk 4 --speculative-num-draft-tokens 8",
                "# or in vLLM:",
                f"vllm serve {verifier} --speculative-config "
                f"'{{\"method\": \"eagle3\", \"model\": \"{directory}\", \"num_speculative_tokens\": 3}}'"]
    if fmt == "eagle3-speculators":
        return [f"vllm serve {directory}    # the verifier {verifier} is named in config.json"]
    if fmt == "medusa-vllm":
        return [f"vllm serve {verifier} --speculative-config "
                f"'{{\"method\": \"medusa\", \"model\": \"{directory}\", \"num_speculative_tokens\": 3}}'"]
    return [f"text-generation-launcher --model-id {directory} --speculate 3    # loads {verifier} from config.json"]


def _card(fmt: str, heads_dir, verifier: str, cfg: dict) -> str:
    """A short README for the exported directory: what it is, for which target, how to serve it."""
    return "\n".join([
        "---", "library_name: selfspec", f"base_model: {json.dumps(verifier)}",
        f"tags: [speculative-decoding, selfspec, {FORMATS[fmt]}, {fmt}]", "---", "",
        f"# {FORMATS[fmt]} heads for `{verifier}` ({fmt})", "",
        f"Exported by `selfspec export-heads --format {fmt}` from `{heads_dir}` (see its README for how they were "
        "trained and measured). The target model is not included: serve them beside it.", "",
        "## Serve", "", "```bash", *serve_commands(fmt, verifier, "THIS_DIR"), "```", ""])
