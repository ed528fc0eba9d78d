# `make demo` and `make test` work on a fresh machine from nothing.
#
# Environment: the active virtualenv when there is one (a GPU user installs their own CUDA torch there
# first), otherwise ./.venv. Torch: whatever torch the environment already has is kept and pinned while the
# rest installs; with none, `torch==2.13.0` is installed (on this project's CPU machines a local CPU wheel).

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
ifdef VIRTUAL_ENV
ENV_DIR ?= $(VIRTUAL_ENV)
else
ENV_DIR ?= .venv
endif
PY := $(ENV_DIR)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(ENV_DIR)/.composer-installed
# Seeded, so the demo is the same video on every machine. Over seeds 0-19 this prompt comes out red, round and
# moving down and right 20 times of 20 ("moving left": 13 of 20; docs/demo-model.md has the per-direction figures).
PROMPT ?= a red circle moving down and right on a black background
SEED ?= 0
OUTPUT ?= outputs/demo.mp4

.PHONY: install demo test test-all lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(ENV_DIR)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(ENV_DIR)/torch-pin.txt
	$(PIP) install -q -c $(ENV_DIR)/torch-pin.txt -e ".[dev,serve,quant]"
	$(PY) -c "import torch, composer; print('composer installed with torch', torch.__version__)"
	touch $(STAMP)

demo: install
	$(ENV_DIR)/bin/composer generate --prompt "$(PROMPT)" --seed $(SEED) --output $(OUTPUT) --overwrite

# Test processes (pytest-xdist): each test file runs whole in one of them (--dist loadfile: a file's fixtures are built
# once); every test process uses one intra-op thread (tests/conftest.py). 3 on a 2-core machine: part of the tests'
# time is spent waiting on the processes and servers they start, and with 2 the cores sat idle then (the full tier
# 14:19 with 2, 73% of both cores busy; 12:54 with 3; 2026-11-27). The files heavy with slow tests go out first
# (tests/conftest.py): 19:33 -> 14:13 for 1646 tests on 2026-11-28, the slow files no longer left to one process at the end.
TEST_JOBS ?= 3
TEST_JOBS_ALL ?= $(TEST_JOBS)

# The quick tier (<= 5 minutes on 2 CPU cores): everything but the tests marked slow (long end-to-end runs, subprocess
# launches, the scripts' own runs). `make test-all` runs every test (<= 15 minutes; what CI runs).
test: install
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow" tests

test-all: install
	$(PY) -m pytest -q -n $(TEST_JOBS_ALL) --dist loadfile --durations=30 tests

lint: install
	$(ENV_DIR)/bin/ruff check composer tests benchmarks demo scripts
	$(ENV_DIR)/bin/lint-imports

bench: install
	$(PY) benchmarks/wan_vs_diffusers.py

clean:
	rm -rf outputs .pytest_cache
