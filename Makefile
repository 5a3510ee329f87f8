# rdma-kv: the README's two commands are `make demo` and `make test`.
# Everything installs into $(VENV); nothing is installed system-wide.

PYTHON    ?= python3
VENV      ?= .venv
VENV_VLLM ?= .venv-vllm
KIT       ?= dist/rdma-kv-kit
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
STAMP     := $(VENV)/.rdma-kv-installed

.PHONY: install vllm-env demo selftest kit test test-core test-all bench bench-deps clean

# torch is pinned and installed first: an unpinned torch (or a range that
# admits a newer release) pulls the CUDA build with GBs of nvidia-* wheels.
$(STAMP): pyproject.toml setup.py $(wildcard src/rdma_kv/transport/csrc/*) src/rdma_kv/transport/_build.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/rdma-kv demo

# Does rdma-kv work on this host? UCX, reads between two processes, CUDA and
# NICs where present (docs/deploy.md, "Before starting an engine").
selftest: install
	$(VENV)/bin/rdma-kv selftest

# The carry kit for a machine without network: the wheels the selftest needs
# (not torch), under 64 MiB, and install.sh, which installs them there
# offline into a venv and runs the selftest: `bash $(KIT)/install.sh`.
# Versions are the ones installed in $(VENV), what the tests ran against.
kit: install
	PYTHON=$(PY) bash scripts/kit-build.sh $(KIT)

# vLLM's CPU build lives in its own venv (it pins its own stack, ~3 min and
# 2.8 GB on first install, seconds after): scripts/install-vllm.sh.
vllm-env: install
	bash scripts/install-vllm.sh $(VENV_VLLM)

# The whole suite: the library's tests, then the end-to-end tests inside real
# vLLM (tests/vllm) with the vLLM venv's interpreter.
test: install vllm-env
	$(PY) -m pytest -m "not slow" --ignore=tests/vllm
	$(VENV_VLLM)/bin/python -m pytest tests/vllm -m "not slow"

# Without vLLM: the library's tests only.
test-core: install
	$(PY) -m pytest -m "not slow" --ignore=tests/vllm

# Everything, including the long soak and fault campaigns (marker `slow`)
# and the Ray Serve test (Ray's LLM stack added to the vLLM venv).
test-all: install vllm-env
	RAY=1 bash scripts/install-vllm.sh $(VENV_VLLM)
	$(PY) -m pytest --ignore=tests/vllm
	$(VENV_VLLM)/bin/python -m pytest tests/vllm

# NIXL is a benchmark peer only, never a dependency: installed without its
# dependency tree (it would pull CUDA torch).
bench-deps: install
	$(PIP) install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1

bench: bench-deps
	$(VENV)/bin/rdma-kv bench --vs nixl

clean:
	rm -rf build dist src/*.egg-info src/rdma_kv/transport/_ucp*.so
