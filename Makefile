# Set-up and checks. `make test` and `make bench` create what they need on a fresh clone.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
TORCH_VERSION := 2.13.0
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: test test-main test-xla lint bench check clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) torch==$(TORCH_VERSION)
	$(VENV)/bin/pip install $(PIP_QUIET) -e '.[test,dev,bench]'
	touch $@

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check torchdi tests benchmarks examples
	$(VENV)/bin/mypy

test-main: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests --ignore=tests/xla

test: lint test-main

bench: $(VENV)/.installed
	$(VENV)/bin/python -m torchdi bench --quick

check: $(VENV)/.installed
	$(VENV)/bin/python -m torchdi check

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
