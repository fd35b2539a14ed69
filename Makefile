# Set-up and checks. `make test` and `make bench` create what they need on a fresh clone.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
TORCH_VERSION := 2.13.0
# torch-xla's newest release pins its torch: a second environment for tests/xla.
XLA_VENV := .venv-xla
XLA_VERSION := 2.9.0
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

$(XLA_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install $(PIP_QUIET) torch==$(XLA_VERSION) torch-xla==$(XLA_VERSION) numpy pytest hypothesis
	$(XLA_VENV)/bin/pip install $(PIP_QUIET) --no-deps -e .
	touch $@

# torch-xla's real PJRT CPU client: no TPU needed, no mock.
test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/xla

test: lint test-main test-xla

bench: $(VENV)/.installed
	$(VENV)/bin/python -m torchdi bench --quick

check: $(VENV)/.installed
	$(VENV)/bin/python -m torchdi check

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
