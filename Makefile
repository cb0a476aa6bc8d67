# `make serve` and `make test` set everything up on a fresh machine.
SHELL  := /bin/bash
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CPU machines get the pinned CPU build of torch (a plain `torch` pulls a multi-GB CUDA build);
# on a GPU box set TORCH_SPEC, e.g. `make test TORCH_SPEC=torch==2.13.0 EXTRAS=test,fleet,cuda` (README).
# A box with an NVIDIA driver also gets the `cuda` extra (CuPy for the attention kernels); every
# box gets `fleet` (the Envoy binary the fleet drills of `make test` run through).
HAS_CUDA   := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
COMMA      := ,
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= $(if $(HAS_CUDA),test$(COMMA)lint$(COMMA)fleet$(COMMA)cuda,test$(COMMA)lint$(COMMA)fleet)
PYTEST_ARGS ?=
SOAK_S ?= 60

.PHONY: install serve test lint bench soak kernel-check kernel-resources gpu-check clean

# One line per stage; what pip and setuptools print goes to $(INSTALL_LOG), whose tail is shown
# when a stage fails.
INSTALL_LOG := $(VENV)/install.log
$(STAMP): setup.cfg pyproject.toml
	@mkdir -p $(VENV); : > $(INSTALL_LOG); \
	stage() { printf '%-60s ' "$$1"; shift; \
	  if "$$@" >>$(INSTALL_LOG) 2>&1; then echo ok; \
	  else echo FAILED; echo "--- the last 40 lines of $(INSTALL_LOG):"; tail -n 40 $(INSTALL_LOG); return 1; fi; }; \
	stage "virtual environment $(VENV)" sh -c 'test -x $(PY) || $(PYTHON) -m venv $(VENV)' && \
	stage "pip, setuptools, wheel" $(PY) -m pip install --upgrade pip setuptools wheel && \
	stage "torch ($(TORCH_SPEC))" $(PY) -m pip install "$(TORCH_SPEC)" && \
	stage "ringserve, editable, with [$(EXTRAS)]" $(PY) -m pip install -e ".[$(EXTRAS)]" && \
	{ stage "CPU kernels (gpu_proc/csrc)" $(PY) -m ringserve.gpu_proc.cpu_ext \
	  || echo "  (the server falls back to the torch reference path; why: $(INSTALL_LOG))"; }
	@touch $(STAMP)
	@echo "installed; the whole log: $(INSTALL_LOG)"

install: $(STAMP)

# Serves SmolLM2-135M-Instruct, fetched and converted into ~/.cache/ringserve on the first start;
# `make serve ARGS='--model tiny'` (or a checkpoint directory, or a .gguf file) serves another.
serve: $(STAMP)
	$(VENV)/bin/ringserve serve $(ARGS)

# ruff (lint and format), mypy and the layer contracts (import-linter, pyproject.toml). mypy and
# import-linter read the installed layout (`ringserve.api` is api/, ...), mirrored in build/lint as
# symlinks to the real files; reports name the real paths.
LINT_TREE := build/lint
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)/ringserve
	cp -rs $(CURDIR)/ringserve/. $(LINT_TREE)/ringserve/
	for d in api gpu_proc shm tools; do cp -rs $(CURDIR)/$$d $(LINT_TREE)/ringserve/; done
	find $(LINT_TREE) -name __pycache__ -prune -exec rm -rf {} +
	cd $(LINT_TREE) && $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml
	set -o pipefail; MYPYPATH=$(LINT_TREE) $(VENV)/bin/mypy --config-file pyproject.toml -p ringserve 2>&1 \
	  | sed -E 's#$(LINT_TREE)/ringserve/(api|gpu_proc|shm|tools)/#\1/#; s#$(LINT_TREE)/ringserve/#ringserve/#'

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	mkdir -p bench-results
	$(VENV)/bin/ringserve bench ring --json | tee bench-results/ring.json
	$(VENV)/bin/ringserve bench step --json | tee bench-results/step.json
	$(VENV)/bin/ringserve bench sched-overhead --json | tee bench-results/sched-overhead.json
	$(VENV)/bin/ringserve bench api --json | tee bench-results/api.json
	$(VENV)/bin/ringserve bench prefix --json | tee bench-results/prefix.json
	$(VENV)/bin/ringserve bench sched --json | tee bench-results/sched.json

# Serve under Poisson load with 20 % hang-ups for SOAK_S seconds, then fail on any leaked KV block,
# file descriptor or shared-memory segment, or RSS that does not level off (`make soak SOAK_S=3600`);
# bench-results/soak/ gets the RSS samples, plot and table for docs/BENCHMARKS.md.
soak: $(STAMP)
	$(PY) -m ringserve.tools.harness.soak --duration $(SOAK_S) --out bench-results/soak

# The CUDA kernels' exact source on the CPU execution harness (tests/kernel_harness): the full
# matrix in forward, reverse and random thread order, and every planted bug caught (prints which
# check caught each). `make test` runs the quick matrix.
kernel-check: $(STAMP)
	RINGSERVE_KERNEL_CHECK=full $(PY) -m pytest tests/kernel_harness -q -s

# On a GPU box: the GPU suite, kernel and step benchmarks, a load test and the transformers
# baseline in one run (docs/operations.md); exits 2 without CUDA.
gpu-check: $(STAMP)
	$(VENV)/bin/ringserve gpu-check --out bench-results/gpu-check.json

# Registers, spills, shared memory, occupancy and HMMA count of every kernel (needs nvcc; the SASS
# columns need cuobjdump and nvdisasm on PATH).
kernel-resources: $(STAMP)
	$(VENV)/bin/ringserve kernel-resources

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
