# The two commands of the README. Each sets itself up: the virtual
# environment is created and filled on first use (and again whenever
# pyproject.toml changes).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: run test lint install

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# torch first, by its exact version: this picks the local CPU wheel
	# instead of pulling CUDA wheels through another package's requirement.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[extras,dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/reinforge train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check reinforge tests benchmarks
