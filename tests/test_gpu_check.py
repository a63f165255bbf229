"""scripts/gpu_check.sh, dry-run on the CPU (--device cpu --quick): every step of what a GPU machine
runs (environment report, exactness tests on the chosen device, float32 and bfloat16 benches, a
batched bench, a compiled bench) works
from this checkout, and the reports land where it says."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.demo
def test_gpu_check_dry_run_on_cpu(tmp_path):
    # Two threads, or the worker's share of the cores under `make test`'s parallel workers (conftest.py).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    # A narrow --wide-tree: the dry run checks the script's path for it; a 64-node tree would add a minute of
    # CPU (the default's bucket-filling tree is checked by test_wide_eagle_default_fills_the_largest_bucket)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick", "--wide-tree",
                        "dynamic-3-2-3", "--out", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    out = tmp_path / "out"
    assert json.loads((out / "env.json").read_text())["device"] == "cpu"
    assert "1 passed" in (out / "exactness.txt").read_text()
    res = json.loads((out / "fp32" / "results.json").read_text())   # --quick: bfloat16 runs in steps 4-5 only
    assert res["config"]["dtype"] == "float32" and res["config"]["device"] == "cpu"
    assert res["config"]["machine"].endswith("CPU (no GPU)")           # the report says what it ran on
    assert res["config"]["machine"] in (out / "fp32" / "results.md").read_text().splitlines()[0]
    checked = {name: m["identical"] for name, m in res["methods"].items() if name.startswith("selfspec")}
    # The shipped EAGLE head with a wide tree benched beside its shipped settings (its copy removed after)
    wide = f"selfspec-eagle@{out / 'eagle-wide'}"
    assert len(checked) == 4 and wide in checked and all(checked.values()), checked
    trees = {v for k, v in res["config"]["heads"].items() if "eagle-wide" in k and k.endswith("_tree")}
    assert trees == {"dynamic-3-2-3"}, res["config"]["heads"]
    assert not (out / "eagle-wide").exists()
    assert not (out / "bf16").exists()
    batched = json.loads((out / "bf16-batch8" / "results.json").read_text())
    assert batched["config"]["dtype"] == "bfloat16" and batched["config"]["batch_size"] == 2 and set(batched["methods"]) == {"hf-generate", "selfspec-ar",
                                                                                "selfspec-medusa"}
    compiled = json.loads((out / "bf16-compiled" / "results.json").read_text())
    assert compiled["config"]["compile"] is True and set(compiled["methods"]) == {"hf-generate", "selfspec-ar"}
    assert (out / "bf16-compiled" / "cudagraph-skips.txt").is_file()   # why a pass ran without CUDA graphs, if one did
    assert not (out / "draft-4l").exists()
    # Step 6: tune-tree timed the shipped EAGLE head on this kind of device; its timings and picks kept, not its weights
    tuned = out / "eagle-tune"
    assert sorted(p.name for p in tuned.iterdir()) == ["config.json", "tune-tree.json"]
    search = json.loads((tuned / "tune-tree.json").read_text())
    assert search["device"] == "cpu" and all(c["threshold"] == 0 for c in search["candidates"]) and search["candidates"]
    assert json.loads((tuned / "config.json").read_text())["decode"]["tree"] in {c["spec"] for c in search["candidates"]}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "tpu"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "cuda or cpu" in r.stderr


def test_wide_eagle_default_fills_the_largest_bucket():
    import importlib.util

    spec = importlib.util.spec_from_file_location("wide_eagle", ROOT / "scripts" / "wide_eagle.py")
    wide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wide)
    # 51 drafted nodes + 12 copied tokens + the root = 64 rows
    decode = wide.wide_settings("default", 12, 64)
    assert (decode["tree"], decode["lookup"], decode["threshold"]) == ("dynamic-10-8-51", 12, 0.0)
    assert wide.wide_settings("dynamic-5-4-8", 8, 64)["tree"] == "dynamic-5-4-8"
    with pytest.raises(ValueError, match="depth"):
        wide.wide_settings("dynamic-0-1-1", 8, 64)


@pytest.mark.parametrize("args, message", [
    (["--sample", "0"], "--sample must be a positive whole number"),
    (["--eagle-heads", "/nonexistent"], "holds no heads"),
    (["--skip", "2,9"], "comma list of steps 2-6"),
    (["--dtypes", "fp8"], "float32 and/or bfloat16"),
    (["--wide-tree", "wide"], "--wide-tree takes default, none or dynamic-D-K-M"),
])
def test_gpu_check_refuses_bad_sizes_in_one_line(args, message):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", *args], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--out", "x"], "--prompts FILE is required"),
    (["--prompts", __file__, "--out", "x", "--gen-seconds", "soon"], "whole numbers"),
    (["--prompts", __file__], "--out DIR is required"),
])
def test_gpu_train_eagle_refuses_bad_input_in_one_line(args, message):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train_eagle.sh"), *args], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
