"""The installed package carries every module and the shipped heads (pyproject lists packages by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_directory_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "selfspec").rglob("__init__.py")}
    missing = found - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_shipped_heads_are_package_data():
    cfg = _pyproject()["tool"]["setuptools"]
    assert cfg["package-dir"]["selfspec.checkpoints"] == "checkpoints"
    globs = cfg["package-data"]["selfspec.checkpoints"]
    shipped = [p for p in (ROOT / "checkpoints").rglob("*") if p.is_file()]
    assert shipped
    for p in shipped:
        rel = p.relative_to(ROOT / "checkpoints")
        assert any(rel.match(g) and len(rel.parts) == len(Path(g).parts) for g in globs), \
            f"{rel} would not be installed: add a pattern for it to package-data in pyproject.toml"


def test_an_installed_package_finds_its_shipped_heads(tmp_path):
    """Installed from a wheel (no source checkout beside it), shipped heads resolve inside the package."""
    import shutil
    import subprocess
    import sys

    site = tmp_path / "site"
    shutil.copytree(ROOT / "selfspec", site / "selfspec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "checkpoints", site / "selfspec" / "checkpoints")
    code = ("from selfspec.shipped import CHECKPOINTS, shipped_corpus, shipped_heads, default_drafter; "
            "print(shipped_heads('smollm2-135m', 'medusa')); print(default_drafter('smollm2-135m')); "
            "print(shipped_corpus('smollm2-135m')); print((CHECKPOINTS / 'smollm2-135m' / 'default.json').is_file())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(site / "selfspec" / "checkpoints" / "smollm2-135m" / "medusa")
    assert out[3] == "True"     # default.json travels with the package
    assert out[1] == json.loads((ROOT / "checkpoints" / "smollm2-135m" / "default.json").read_text())["drafter"]
    assert out[2] == str(site / "selfspec" / "checkpoints" / "smollm2-135m" / "corpus")
    assert (Path(out[2]) / "corpus.npz").is_file()
