# Set-up and checks. `make test` and `make bench` create what they need on a fresh clone.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
TORCH_VERSION := 2.13.0
# torch-xla's newest release pins its torch: a second environment for tests/xla. It also holds
# torchvision, whose registry wheels are built against the registry's (CUDA) torch: 0.24.0 matches
# torch 2.9.0 there, while no torchvision build loads beside the CPU-only torch 2.13.0 of $(VENV).
XLA_VENV := .venv-xla
XLA_VERSION := 2.9.0
TORCHVISION_VERSION := 0.24.0
# The newest torch the registry serves (a CUDA build; it runs on CPU too): a third environment,
# so that a torch internal that moved shows up as a failing test here, not on a user's machine.
# It is also the environment of make test-gpu, the only one whose torch has CUDA.
NEXT_VENV := .venv-next
NEXT_TORCH_VERSION := 2.14.1
# What the version runs (torch 2.9 in $(XLA_VENV), $(NEXT_TORCH_VERSION) in $(NEXT_VENV)) cover:
# every engine's operators, the preparation rules, compile soundness on aot_eager (the engines'
# private internals and their fallbacks, tests/test_fence.py), DifferentiateWith, State, sparse.
# Not the scenario sweep, inductor or the slow tests: those run on the main torch.
VERSION_TESTS := tests/test_operators.py tests/test_prep_rules.py tests/test_compile_soundness.py \
	tests/test_fence.py tests/test_differentiate_with.py tests/test_state.py tests/test_sparse.py
VERSION_MARKS := not scenarios and not inductor and not slow and not cuda
# float64 only there: the float32 cases of the operator grid exercise the same torch internals.
VERSION_SELECT := not float32
# No pip cache: where the registry is reached over HTTP (CI), pip would otherwise keep a copy of
# every wheel it downloads, about 7 GB beside the environments' 14 GB for the two CUDA builds of
# torch; a CI run once stopped on 'No space left on device' while installing them.
PIP_QUIET := --quiet --disable-pip-version-check --no-cache-dir

.PHONY: test test-main test-main-scenarios test-main-rest test-xla test-next test-oldest test-gpu lint bench check clean docs docs-check

# The docs extra too: `make test` checks the docs while the suite runs in this environment, and
# nothing may be installed into an environment a running test imports from.
$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) torch==$(TORCH_VERSION)
	$(VENV)/bin/pip install $(PIP_QUIET) -e '.[test,dev,bench,docs]'
	touch $@

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check torchdi tests benchmarks examples
	$(VENV)/bin/mypy

# The docstring examples run as doctests with the core suite (conftest.py provides torch, torchdi).
# Every default scenario on aot_eager is about half of the suite's time: a process of its own,
# which runs beside the rest under make test.
test-main: test-main-scenarios test-main-rest

test-main-scenarios: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests/test_compile.py -m scenarios

# Two pytest-xdist workers, a test file each at a time (module-scoped preparations stay shared):
# this part is the longest, and alone on one core once the shorter parts end it left CI's second
# core idle for its last third.
test-main-rest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile tests torchdi --doctest-modules --ignore=tests/xla -m "not scenarios"

$(XLA_VENV)/.dependencies: Makefile
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install $(PIP_QUIET) torch==$(XLA_VERSION) torch-xla==$(XLA_VERSION) torchvision==$(TORCHVISION_VERSION) numpy pytest hypothesis
	touch $@

# After $(VENV)'s: an editable install writes torchdi.egg-info into this checkout, and two at
# once (make test runs in parallel) could trip over each other.
$(XLA_VENV)/.installed: $(XLA_VENV)/.dependencies $(VENV)/.installed setup.cfg pyproject.toml
	$(XLA_VENV)/bin/pip install $(PIP_QUIET) --no-deps -e .
	touch $@

# torch-xla's real PJRT CPU client: no TPU needed, no mock. The real-model tests run here too,
# where torchvision loads (resnet18 in train mode against the eager loop); GPT-2 runs in test-main.
test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/xla
	$(XLA_VENV)/bin/python -m pytest -q tests/test_real_models.py -k resnet

# After $(XLA_VENV)'s dependencies, not beside them: pip holds each environment's downloaded wheels
# (about 3 GB) until it has installed them, and the two at once are the peak of the disk make test
# needs.
$(NEXT_VENV)/.dependencies: Makefile | $(XLA_VENV)/.dependencies
	test -x $(NEXT_VENV)/bin/python || $(PY) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/pip install $(PIP_QUIET) torch==$(NEXT_TORCH_VERSION) numpy pytest hypothesis scipy
	touch $@

# After $(XLA_VENV)'s (and so $(VENV)'s): one editable install at a time writes torchdi.egg-info.
$(NEXT_VENV)/.installed: $(NEXT_VENV)/.dependencies $(XLA_VENV)/.installed setup.cfg pyproject.toml
	$(NEXT_VENV)/bin/pip install $(PIP_QUIET) --no-deps -e .
	touch $@

# The version runs: the newest torch, and the oldest (the metadata's floor, torch 2.9).
test-next: $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VERSION_TESTS) -m "$(VERSION_MARKS)" -k "$(VERSION_SELECT)"

test-oldest: $(XLA_VENV)/.installed
	$(XLA_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VERSION_TESTS) -m "$(VERSION_MARKS)" -k "$(VERSION_SELECT)"

# The CUDA tests (every backend, mode="reduce-overhead" CUDA graphs, State, sparse) in the
# environment whose torch is a CUDA build; without a device they skip, saying so.
# `make test-gpu GPU_PYTHON=python3` runs them with an interpreter whose torch already has CUDA
# (a GPU machine's own, where no registry can be reached), this checkout on its path.
GPU_PYTHON ?=
ifeq ($(GPU_PYTHON),)
test-gpu: $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests -m cuda
else
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -q -rs -p no:cacheprovider tests -m cuda
endif

# The parts at once (separate processes; the suites in separate environments): each suite is
# mostly one busy core. Each part's output is printed whole when it ends.
# One intra-op thread per process: seven parts on CI's two cores would otherwise oversubscribe them.
# One inductor compile thread: otherwise each process that compiles with inductor first starts a
# pool of compile workers, each importing torch, for programs of a few kernels (measured, a fresh
# process compiling one small function: 19.3 -> 15.2 s of CPU).
test:
	OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 $(MAKE) --no-print-directory -j7 --output-sync=target lint test-main test-xla test-next test-oldest docs-check

# The documentation site (Sphinx, docs/): warnings are errors.
docs: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

# Cheap check for make test: every page parsed and every docstring imported, nothing written.
docs-check: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W --keep-going -q -b dummy docs docs/_build/dummy

# Inductor's compiled programs in a cache of the project's own (.cache/inductor, ignored by git;
# make clean empties it) rather than /tmp/torchinductor_$USER, which a reboot empties and every
# process on the machine shares: a second make bench prepares from the first one's programs
# (measured, `--backends compile --scenarios mlp-small,hvp-1000`: 29 s -> 12-14 s wall, prep
# 18.9 s -> 4.6-5.7 s on mlp-small; load average 3). Safe: inductor's cache is keyed by the traced
# graph and the bench checks every value against torch; its "prep" column is then a warm-cache
# figure. TORCHDI_CACHE_DIR is not set: AutoCompile's persisted Mega-Cache artifacts added
# nothing measurable over this cache (4.9 s vs 4.6 s prep), and the bench has no AutoSparse row.
BENCH_CACHE := TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor

bench: $(VENV)/.installed
	$(BENCH_CACHE) $(VENV)/bin/python -m torchdi bench --quick

check: $(VENV)/.installed
	$(VENV)/bin/python -m torchdi check

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .cache *.egg-info docs/_build docs/reference/api
