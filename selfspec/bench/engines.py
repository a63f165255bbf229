"""The serving engines as bench methods: vLLM (plain, EAGLE-3 with selfspec's exported head, its n-gram
prompt lookup) and llama.cpp (plain and prompt lookup, through llama-cpp-python), each held in a worker
process of the engines' own Python (``engine_worker.py``; ``make engines`` builds that environment).

Every method is timed in the bench's process around its request, like the others; the worker loads its
engine once, before the warm-up. vLLM runs the same float32 weights as selfspec, so its greedy output is
checked like every other method's. llama.cpp runs the model's GGUF, whose weights are quantized: its output
is not compared (the report says "n/a (quantized)").
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..core.decode import DecodeStats

ENGINES_VENV = ".venv-engines"
ENGINES_PYTHON_ENV = "SELFSPEC_ENGINES_PYTHON"
LLAMACPP_LOOKUP_TOKENS = 10          # as transformers' prompt lookup in hf-prompt-lookup
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DEFAULT_VLLM_SPEC_TOKENS = 3
READY_TIMEOUT_S = 900                 # an engine's start, models loaded (vLLM: about a minute on 2 cores)

# method -> (engine, the Python package it needs)
ENGINE_METHODS = {
    "vllm": ("vllm", "vllm"),
    "vllm-eagle3": ("vllm", "vllm"),
    "vllm-ngram": ("vllm", "vllm"),
    "llamacpp": ("llamacpp", "llama_cpp"),
    "llamacpp-lookup": ("llamacpp", "llama_cpp"),
}
QUANTIZED = frozenset({"llamacpp", "llamacpp-lookup"})   # run the GGUF's quantized weights: not compared


def engines_python(given: str | None = None) -> Path:
    """The engines' Python: ``given``, else ``$SELFSPEC_ENGINES_PYTHON``, else ``.venv-engines/bin/python``
    in the current directory or in the repository this package runs from (where ``make engines`` puts it)."""
    if given or os.environ.get(ENGINES_PYTHON_ENV):
        return Path(given or os.environ[ENGINES_PYTHON_ENV])
    places = [Path.cwd(), Path(__file__).resolve().parents[2]]
    return next((p / ENGINES_VENV / "bin" / "python" for p in places if (p / ENGINES_VENV / "bin" / "python").is_file()),
                Path(ENGINES_VENV) / "bin" / "python")


def these(names: list[str], verb: str) -> str:
    """"vllm needs" / "vllm, vllm-ngram need": the methods and a verb that agrees with them."""
    return f"{', '.join(names)} {verb + 's' if len(names) == 1 else verb}"


def check_engines(names: list[str], python: str | None = None) -> Path | None:
    """Refuse, in one line, engine methods whose engine is not installed; returns the engines' Python (None
    where no engine method is asked for)."""
    wanted = sorted({ENGINE_METHODS[n][1] for n in names if n in ENGINE_METHODS})
    if not wanted:
        return None
    py = engines_python(python)
    how = (f"run `make engines` (vLLM's CPU build and llama-cpp-python in {ENGINES_VENV}), or point "
           f"--engines-python (or ${ENGINES_PYTHON_ENV}) at a Python that has them")
    if not py.is_file():
        raise ValueError(f"{these([n for n in names if n in ENGINE_METHODS], 'need')} the engines' Python, and "
                         f"{py} does not exist: {how}")
    probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    missing = subprocess.run([str(py), "-c", probe, *wanted], capture_output=True, text=True, timeout=120).stdout.split()
    if missing:
        which = [n for n in names if n in ENGINE_METHODS and ENGINE_METHODS[n][1] in missing]
        raise ValueError(f"{', '.join(which)}: {', '.join(missing)} is not installed in {py}: {how}")
    return py


def engine_env() -> dict:
    """The environment an engine runs in: offline unless told otherwise, none of selfspec's PYTHONPATH,
    and vLLM's CPU runner keeping no core to itself (it would by default; every method gets the same cores)."""
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONNOUSERSITE": "1"}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.pop("PYTHONPATH", None)
    return env


def last_error_line(log: Path) -> str:
    """What an engine's log says went wrong: its last line naming an Error, else its last line."""
    lines = [s for s in log.read_text(errors="replace").splitlines() if s.strip()]
    return ([s for s in lines if "Error" in s] or lines or ["no output"])[-1].strip()[:300]


class EngineWorker:
    """One ``engine_worker.py`` process: started with its config, then one JSON request and answer a line."""

    def __init__(self, python: Path, config: dict, *, name: str):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"selfspec-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name("engine_worker.py")), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=engine_env(), start_new_session=True)
        atexit.register(self.close)
        self._read(READY_TIMEOUT_S)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"{self.name}: the engine {'did not answer in time' if not ready else 'stopped'} "
                               f"({self.last_log_line()}; the whole log: {self.log.name})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']} (the engine's log: {self.log.name})")
        return answer

    def last_log_line(self) -> str:
        return last_error_line(Path(self.log.name))

    def request(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(3600)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def engine_stats(answer: dict, new_tokens: int) -> DecodeStats | None:
    """vLLM's spec-decode counters for one request as DecodeStats: steps = drafts, a histogram of how many
    drafted tokens each draft got accepted (from the accepted count per position), acceptance by depth
    as vLLM defines it (accepted at that position over drafts)."""
    drafts, per_pos = answer["drafts"], answer["accepted_per_pos"]
    if not drafts:
        return None
    at_least = [drafts, *per_pos]
    hist = [at_least[a] - (at_least[a + 1] if a + 1 < len(at_least) else 0) for a in range(len(at_least))]
    return DecodeStats(new_tokens=new_tokens, steps=drafts, drafted=answer["draft_tokens"], accepted_hist=hist,
                       drafted_by_depth=[drafts] * len(per_pos), accepted_by_depth=list(per_pos))


def export_eagle3(heads_dir, target_dir: str) -> str:
    """The EAGLE head exported for vLLM (eagle3-sglang layout, target given by path) into a directory
    removed when the process ends."""
    from ..export import export_heads

    tmp = tempfile.mkdtemp(prefix="selfspec-eagle3-")
    atexit.register(shutil.rmtree, tmp, True)
    return str(export_heads(heads_dir, "eagle3-sglang", Path(tmp) / "eagle3", model=target_dir))


def engine_method(name: str, *, python: Path, target_dir: str, gguf: str | None, eagle_dir: str | None,
                  eagle_heads: str | None, spec_tokens: int, threads: int, max_model_len: int, eos: list[int]):
    """The bench function of engine method ``name`` (greedy decoding); its worker starts now. ``fn.note``
    says what it ran, for the report."""
    engine = ENGINE_METHODS[name][0]
    config = {"engine": engine, "threads": threads, "max_model_len": max_model_len}
    if engine == "vllm":
        config["model"] = target_dir
        if name == "vllm-eagle3":
            config["speculative"] = {"method": "eagle3", "model": eagle_dir, "num_speculative_tokens": spec_tokens}
        elif name == "vllm-ngram":
            config["speculative"] = VLLM_NGRAM
    else:
        if gguf is None:
            raise ValueError(f"{name} runs a GGUF file: give --model a .gguf file or the demo alias")
        config.update(model=gguf, lookup_tokens=LLAMACPP_LOOKUP_TOKENS if name == "llamacpp-lookup" else 0)
    note = {"model": config["model"], "threads": threads}
    if config.get("speculative"):
        note["speculative"] = {**config["speculative"], **({"model": eagle_heads} if name == "vllm-eagle3" else {})}
    if config.get("lookup_tokens"):
        note["lookup_tokens"] = config["lookup_tokens"]
    print(f"selfspec bench: starting {name} in {python}", file=sys.stderr)
    worker = EngineWorker(python, config, name=name)
    batches = engine == "vllm"

    def fn(batch, n, gen):
        if len(batch) > 1 and not batches:
            raise ValueError(f"{name} takes one prompt at a time (llama-cpp-python decodes one sequence)")
        answer = worker.request(ids=[x[0].tolist() for x in batch], max_new_tokens=n, eos=eos)
        rows = answer["tokens"]
        return rows, engine_stats(answer, sum(map(len, rows)))
    fn.worker, fn.note = worker, note
    return fn
