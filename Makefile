# make train: set up .venv if needed, then the main job (2-rank DDP on the default config).
# make test:  the same set-up, then lint, type and layer checks (make lint), then the whole test
#             suite on TEST_WORKERS pytest workers (each file on one; the files of one SLURM
#             cluster or of the test hosts on one between them), with its 25 slowest tests last.
# make bench: benchmarks against a plain PyTorch loop (figures, never pass/fail).
# make chaos: N= random faults (SEED=) injected into real runs, every invariant checked after
#             each episode (bench/chaos/README.md); EPISODE=K replays one episode of the seed.
VENV    ?= .venv
PYTHON  ?= python3
NPROC   ?= 2
CONFIG  ?= configs/default.yaml
ARGS    ?=
N       ?= 40
SEED    ?= 0
EPISODE ?=
# Three, on two cores: part of the suite waits (on rendezvous, SLURM, timeouts) rather than
# computes.
TEST_WORKERS ?= 3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: train test lint bench chaos setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,dev]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) launch/train.py --config $(CONFIG) $(ARGS)

test: $(STAMP) lint
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --durations=25 tests

# ruff (lint and format) and mypy on src/, as configured in pyproject.toml; the layers of
# src/dtrain (imports only downwards, no cycle: tests/test_layers.py, read from the source).
lint: $(STAMP)
	$(PY) -m ruff check src
	$(PY) -m ruff format --check src
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py

# The peers it compares dtrain with (Lightning, Accelerate) are the `bench` extra, pinned too.
bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) bench/run_all.py

chaos: $(STAMP)
	$(PY) bench/chaos/run.py --faults $(N) --seed $(SEED) $(if $(EPISODE),--episode $(EPISODE))

clean:
	rm -rf runs .pytest_cache
