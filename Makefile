# Two commands on a fresh machine:
#   make demo   set up .venv and plan a run of the built-in default model (no download, no GPU)
#   make test   run the test suite
#   make lint   ruff's checks and its formatter's (configured in pyproject.toml)
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch. On a GPU machine, install the CUDA build of torch into the venv first.
TORCH ?= torch==2.13.0

.PHONY: demo test setup lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/memfit plan

# One line per test as it ends (-v), and the 25 slowest at the end.
test: $(VENV)/.installed
	$(PY) -m pytest -v --durations=25

# ruff check: the rules pyproject.toml selects; ruff format --check: no file the formatter would change.
LINTED := src tests benchmarks scripts
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
