# `make demo` and `make test` set up everything they need on a machine with Python 3.11+, make and apt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEBIAN_PACKAGES := prometheus prometheus-alertmanager chromium jsonnet
# A test run starts about a hundred interpreters (the workers, the CLI's processes): their bytecode
# is kept, in the virtualenv rather than beside the sources, even where PYTHONDONTWRITEBYTECODE is set.
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache

.PHONY: demo test test-fast lint format system-deps bench clean

$(BIN)/inference-cost-exporter: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/inference-cost-exporter
	$(BIN)/inference-cost-exporter demo

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

lint: $(BIN)/inference-cost-exporter
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: $(BIN)/inference-cost-exporter system-deps lint
	$(TEST_ENV) $(BIN)/pytest

# The unit layer alone: no server, no process, no binary (so one worker a core).
test-fast: $(BIN)/inference-cost-exporter
	$(TEST_ENV) $(BIN)/pytest -m "not integration" -n auto

bench: $(BIN)/inference-cost-exporter
	$(BIN)/python -m bench

format: $(BIN)/inference-cost-exporter
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
