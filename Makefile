# Set-up and the two front-door commands. Both create or reuse the virtualenv at .venv and are
# safe to run again. torch is installed first and pinned: a bare `torch` requirement would let
# pip fetch a multi-GB CUDA build. A torch the venv can already import is left as it is: on a
# GPU machine with its own CUDA build (offline), `make test VENV_ARGS=--system-site-packages`
# uses that one; TORCH chooses another version to install.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: quickstart test lint format venv clean gpu-check

venv: $(STAMP)

$(STAMP): requirements.txt setup.py pyproject.toml csrc/dataset_helpers.cpp
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	# Megatron-LM's own dataset reader, an independent reference in the tests (its deps are
	# torch, numpy and packaging, all installed above).
	$(BIN)/python -m pip install --quiet --no-deps megatron-core==0.16.1
	# CCNet's own perplexity code, the reference of the KenLM perplexity stage's test (its
	# modules the test imports need only packages installed above)
	$(BIN)/python -m pip install --quiet --no-deps cc_net==1.0.0
	# torchao's float8 training, the FP8 GEMMs --fp8-backend torchao runs (optional for users;
	# its float8 code needs nothing past torch)
	$(BIN)/python -m pip install --quiet --no-deps torchao==0.15.0
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

quickstart: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/quickstart.sh

# Two parts. The test files measured to run one single-threaded process (tests/shared_files.txt)
# are shared among TEST_WORKERS processes (pytest-xdist, each file whole in one of them; one
# worker would leave a core idle). Then the others, whose ranks fill the cores, one at a time:
# two of them side by side slow each other far more than twice (docs/testing.md). Both parts
# always run; the target fails if either did.
TEST_WORKERS ?= 2
PYTEST := PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

# The project's bytecode is compiled once first: with PYTHONDONTWRITEBYTECODE set (as on CI)
# every process the tests start would otherwise compile the engine's sources again.
test: $(STAMP) lint
	$(BIN)/python -m compileall -q engine parallel tools tests > /dev/null
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial"; shared=$$?; \
	$(PYTEST) -p no:xdist -m serial; serial=$$?; \
	test $$shared -eq 0 && test $$serial -eq 0

# On a machine with CUDA GPUs: every check only a GPU can make, with a report under docs/gpu/
# (tools/gpu_check.py; without a GPU it says so and exits 0).
gpu-check: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python tools/gpu_check.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf build *.egg-info engine/data/indexed/_helpers*.so .pytest_cache .ruff_cache
