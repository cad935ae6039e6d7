# make train: set up .venv if needed, then the main job (2-rank DDP on the default config).
# make test:  the same set-up, then the whole test suite.
# make bench: benchmarks against a plain PyTorch loop (figures, never pass/fail).
VENV    ?= .venv
PYTHON  ?= python3
NPROC   ?= 2
CONFIG  ?= configs/default.yaml
ARGS    ?=
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: train test bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) launch/train.py --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -rs tests

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf runs .pytest_cache
