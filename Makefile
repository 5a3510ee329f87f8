# rdma-kv: the README's two commands are `make demo` and `make test`.
# Everything installs into $(VENV); nothing is installed system-wide.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.rdma-kv-installed

.PHONY: install demo test test-all bench bench-deps clean

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

test: install
	$(PY) -m pytest -m "not slow"

test-all: install
	$(PY) -m pytest

# NIXL is a benchmark peer only, never a dependency: installed without its
# dependency tree (it would pull CUDA torch).
bench-deps: install
	$(PIP) install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1

bench: bench-deps
	$(VENV)/bin/rdma-kv bench --vs nixl

clean:
	rm -rf build src/*.egg-info src/rdma_kv/transport/_ucp*.so
