# `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CPU machines get the pinned CPU build of torch (a plain `torch` pulls a multi-GB CUDA build);
# on a GPU box set TORCH_SPEC, e.g. `make test TORCH_SPEC=torch==2.13.0 EXTRAS=test,cuda` (README).
# A box with an NVIDIA driver also gets the `cuda` extra (CuPy for the attention kernels).
HAS_CUDA   := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
COMMA      := ,
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= $(if $(HAS_CUDA),test$(COMMA)cuda,test)
PYTEST_ARGS ?=
SOAK_S ?= 60

.PHONY: install serve test test-fast bench soak kernels-ptx clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m ringserve.gpu_proc.cpu_ext || echo "CPU kernels not built (the server falls back to the torch reference path; see above)"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/ringserve serve $(ARGS)

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
# file descriptor or shared-memory segment, or RSS that keeps growing (`make soak SOAK_S=3600`).
soak: $(STAMP)
	$(PY) -m ringserve.tools.soak --duration $(SOAK_S)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
