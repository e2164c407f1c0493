# nvmeof-roce: the two commands a new machine needs are `make demo` and `make test`.
# Everything they need (apt packages, the venv, the lab image) is set up here.

VENV      ?= .venv
PYTHON    ?= python3
NVMEOF    := $(VENV)/bin/nvmeof-roce
PYTEST    := $(VENV)/bin/python -m pytest
LAB_TIMEOUT ?= 3000

# Host packages: QEMU (software emulation), debootstrap, e2fsprogs and cpio build the lab image;
# fio runs the benchmark job files in the unit tests.
APT_PACKAGES := qemu-system-x86 debootstrap e2fsprogs cpio xz-utils fio
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-unit test-lab test-quick deps venv lab clean-lab help bench-transport

help:
	@echo "make demo   - set up everything, build the lab if needed, run the main job"
	@echo "make test   - set up everything, run unit tests and the lab tests"
	@echo "make bench-transport - Python µs per 4 KiB read through the RDMA transport (lab, fake device)"

deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "[nvmeof-roce] installing host packages:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	@echo "[nvmeof-roce] creating $(VENV)"
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q -e '.[dev,plot]'
	@touch $@

venv: $(VENV)/.installed

lab: deps venv
	$(NVMEOF) lab build

test-unit: venv
	$(PYTEST) -m "not lab" tests/unit

test-quick: venv
	$(PYTEST) -m "not lab and not fuzz" tests/unit

test-lab: lab
	$(NVMEOF) lab run --timeout $(LAB_TIMEOUT) -- python3 -m pytest -p no:cacheprovider -m lab tests/lab

# Both tiers always run; their summaries are repeated last; the make fails if either failed.
test: deps venv lab
	$(VENV)/bin/python tests/tiers.py $(VENV)/bin/python $(LAB_TIMEOUT)

demo: deps venv lab
	$(NVMEOF) demo

clean-lab: venv
	$(NVMEOF) lab clean

# Python µs per 4 KiB read through the RDMA transport (a fake device, real pyverbs objects) and the target
# core alone: a benchmark, not a test (docs/benchmarks.md). pyverbs is only in the lab guest, so it runs there;
# `python3 benchmarks/transport_cost.py --stand-ins` runs anywhere, without pyverbs' own costs.
bench-transport: lab
	$(NVMEOF) lab run --timeout 900 -- python3 benchmarks/transport_cost.py
