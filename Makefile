# `make demo` and `make test` set up everything they need on a machine with Python 3.11+, make and apt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEBIAN_PACKAGES := prometheus prometheus-alertmanager chromium jsonnet
# A test run starts about a hundred interpreters (the workers, the CLI's processes): their bytecode
# is kept, in the virtualenv rather than beside the sources, even where PYTHONDONTWRITEBYTECODE is set.
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache

# The exporter and its runtime dependencies alone (what `demo` and `install` need), then the test tools.
RUNTIME := $(VENV)/.installed-runtime
TOOLS := $(VENV)/.installed-tools

.PHONY: demo install test test-fast lint format system-deps bench docs dist clean

$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(TOOLS): $(RUNTIME)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(RUNTIME)
	$(BIN)/inference-cost-exporter demo

install: $(RUNTIME)
	@echo "installed: $(BIN)/inference-cost-exporter"

# Installs the Prometheus binaries the integration tests run, when we may (root with apt-get).
system-deps:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null \
		&& command -v chromium >/dev/null && command -v jsonnet >/dev/null; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBIAN_PACKAGES) >/dev/null; \
	else \
		echo "note: not root or no apt-get; integration tests need $(DEBIAN_PACKAGES) (skipped unless CI is set)"; \
	fi

lint: $(TOOLS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: $(TOOLS) system-deps lint
	$(TEST_ENV) $(BIN)/pytest

# The unit layer alone: no server, no process, no binary (so one worker a core).
test-fast: $(TOOLS)
	$(TEST_ENV) $(BIN)/pytest -m "not integration" -n auto

bench: $(TOOLS)
	$(BIN)/python -m bench

format: $(TOOLS)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The documentation site (site/), every link and anchor checked.
docs: $(TOOLS)
	$(BIN)/mkdocs build --strict

# The wheel and the sdist (dist/), checked as PyPI would check them.
dist: $(TOOLS)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache
