# nvmeof-roce: the two commands a new machine needs are `make demo` and `make test`.
# Everything they need (apt packages, the venv, the lab image) is set up here.

VENV      ?= .venv
PYTHON    ?= python3
NVMEOF    := $(VENV)/bin/nvmeof-roce
PYTEST    := $(VENV)/bin/python -m pytest
LAB_TIMEOUT ?= 3000

# Host packages: QEMU (software emulation), debootstrap, e2fsprogs, cpio and zstd (6.12 kernel) build the lab image;
# fio runs the benchmark job files in the unit tests; gcc and make build the lab's siw.ko when a run asks for it
# (lab run --siw, lab/siw.py); the -dev packages build the native data path (csrc/, setup.py, docs/native.md).
# BUILD_PACKAGES alone build a wheel (`make dist`: pip, and what setup.py compiles the native module with).
BUILD_PACKAGES := python3-pip gcc python3-dev libibverbs-dev librdmacm-dev liburing-dev
# Ceph (ceph-mon, ceph-osd, ceph-common, python3-rbd, python3-rados, librbd-dev) runs the RBD tests' development
# cluster (nvmeof_roce/ceph/devcluster.py).
APT_PACKAGES := qemu-system-x86 debootstrap e2fsprogs cpio xz-utils zstd fio gcc make \
	python3-dev libibverbs-dev librdmacm-dev liburing-dev \
	ceph-mon ceph-osd ceph-common python3-rbd python3-rados librbd-dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: dist deps-build demo test test-extended test-unit test-lab test-long test-quick test-two-node test-reload-fuzz test-auth-rotation test-trixie test-unit-py313 test-blktests deps venv lab clean-lab help bench-transport bench-native bench-qd1-load test-native test-native-fuzz soak

# A wheel of this checkout in dist/ (pip install dist/nvmeof_roce-*.whl gives the `nvmeof-roce` command): only the
# build dependencies, no venv, no lab tools, no plot extras (a production host builds it as it is).
dist: deps-build
	rm -rf dist build
	$(PYTHON) -m pip wheel -q --no-deps -w dist .
	@ls dist/*.whl

help:
	@echo "make demo   - set up everything, build the lab if needed, run the main job"
	@echo "make test   - set up everything, run unit tests and the lab tests"
	@echo "make dist   - build a wheel into dist/ (installs only the build dependencies)"
	@echo "make test-extended - iWARP, systemd workers, QoS/visibility/persist, initiator bench, live namespace changes in the lab (about 25 min)"
	@echo "make test-long - the long lab scenarios (16-vCPU guest), not part of make test or CI"
	@echo "make test-trixie - the Debian 13 lab tier: trixie's kernel host (nvme-cli 2.13) against our native target and nvmet"
	@echo "make test-unit-py313 - the unit tier on Debian 13's Python 3.13, in a chroot of the trixie lab image (no guest)"
	@echo "make test-auth-rotation - rotate a host key by reload and by RPC under fio verify (6.12 lab guest)"
	@echo "make test-reload-fuzz - 10,000 broken configs reloaded into a running loopback target (about a minute)"
	@echo "make test-blktests - blktests' nvme group, kernel nvmet vs the userspace target (6.1 and 6.12; >1 h each)"
	@echo "make bench-transport - Python µs per 4 KiB read through the RDMA transport (lab, fake device)"
	@echo "make bench-native - instructions and allocations per 4 KiB I/O, native vs Python data path (callgrind)"
	@echo "make bench-qd1-load - QD1 latency, ours (interrupt, adaptive) vs nvmet, BENCH_QD1_HOG busy loops beside (lab)"
	@echo "make test-native - the native data path's tests under ASan/UBSan, TSan (poll groups) and valgrind memcheck"
	@echo "make test-native-fuzz - the differential fuzz of the native data path: corpus, NATIVE_FUZZ_CAPSULES (100,000) capsules under ASan/UBSan, a TSan pass on poll-group threads"
	@echo "make soak   - bench --jobs soak in the lab: SOAK_IOS (default 10^7) verified 4 KiB commands on the native path, a live change every 3 s; RSS growth per 10^6 commands"

# The host packages of a list not yet installed, installed (apt-get, once).
install_missing = @missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "[nvmeof-roce] installing host packages:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

deps:
	$(call install_missing,$(APT_PACKAGES))

deps-build:
	$(call install_missing,$(BUILD_PACKAGES))

$(VENV)/.installed: pyproject.toml constraints.txt | deps
	@echo "[nvmeof-roce] creating $(VENV)"
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev,plot]'
	@touch $@

# The native extension, rebuilt in place when its sources change (the lab guest imports it from the checkout).
NATIVE_SOURCES := $(wildcard csrc/*.c csrc/*.h) setup.py
NATIVE_STAMP := build/.native-built
$(NATIVE_STAMP): $(VENV)/.installed $(NATIVE_SOURCES)
	$(VENV)/bin/python setup.py -q build_ext --inplace
	@mkdir -p build && touch $@

venv: $(VENV)/.installed $(NATIVE_STAMP)

# Both kernel generations: 6.1 (Debian 12's own) for the lab tier, 6.12 for interoperability and authentication.
lab: deps venv
	$(NVMEOF) lab build --kernel 6.1
	$(NVMEOF) lab build --kernel 6.12

test-unit: venv
	$(PYTEST) -m "not lab" tests/unit

test-quick: venv
	$(PYTEST) -m "not lab and not fuzz" tests/unit

test-lab: lab
	$(NVMEOF) lab run --timeout $(LAB_TIMEOUT) -- python3 -m pytest -p no:cacheprovider -m "lab and not long and not extended" tests/lab
	$(NVMEOF) lab run --kernel 6.12 --timeout $(LAB_TIMEOUT) -- python3 -m pytest -p no:cacheprovider -m "lab and not long and not extended" \
	  $$($(VENV)/bin/python -c 'import sys; sys.path.insert(0, "tests"); import tiers; print(*tiers.LAB_612_TESTS)')

# Scenarios that need a bigger guest (16 vCPUs under TCG on this machine's cores): slow, so not in `make test`.
LONG_CPUS ?= 16
LONG_MEMORY ?= 4G
test-long: lab
	$(NVMEOF) lab run --cpus $(LONG_CPUS) --memory $(LONG_MEMORY) --timeout $(LAB_TIMEOUT) -- \
	  python3 -m pytest -p no:cacheprovider -m long tests/lab

# Lab scenarios of several minutes each on the normal guest, kept out of `make test` to hold it under 30 minutes:
# iWARP (tests/lab/test_siw.py: the kernel host and our initiator over siw against both targets), the systemd
# unit's commands with --workers 2 (tests/lab/test_systemd_workers.py), the QoS cap under fio, per-host visibility
# and --persist across a restart (tests/lab/test_service_features.py), and the initiator's native/Python/fio
# bench (tests/lab/test_initiator_native.py), ANA inaccessible moving I/O between multipath paths and the
# workers' scaling bench, live namespace resizes and replacements.  About 25 minutes in one boot (tests/README.md).
test-extended: lab
	$(NVMEOF) lab run --siw --timeout $(LAB_TIMEOUT) -- python3 -m pytest -p no:cacheprovider -m "lab and extended" tests/lab

# Debian 13 (trixie's 6.12 kernel, nvme-cli 2.13, rdma-core 56, Python 3.13): `lab run` builds the native module
# for its Python (once per image and sources, in a chroot of the image), then the kernel host runs against our target on the native data path (fio crc32c verify,
# discovery, DH-HMAC-CHAP, multipath failover with --workers), the `host` wrapper's commands, and nvmet
# (tests/tiers.py LAB_TRIXIE_TESTS).  Its own image, built here on first use.
test-trixie: deps venv
	$(NVMEOF) lab build --kernel trixie
	$(VENV)/bin/python tests/tiers.py $(VENV)/bin/python $(LAB_TIMEOUT) trixie

# The unit tier on Python 3.13 without a guest: a chroot of the trixie image's rootfs (read-only, under an
# overlay), a copy of this checkout built there for its Python (nvmeof_roce/lab/chroot.py).  Needs root.
test-unit-py313: deps venv
	$(VENV)/bin/python -m nvmeof_roce.lab.chroot --kernel trixie

# A host's DH-HMAC-CHAP key rotated by SIGHUP, by RPC and by its key file replaced while a second kernel host runs
# fio verify (6.12 guest; tests/lab/test_auth.py, marked long: over a minute under emulation, so not in `make test`).
test-auth-rotation: lab
	$(NVMEOF) lab run --kernel 6.12 --timeout $(LAB_TIMEOUT) -- python3 -m pytest -p no:cacheprovider -q -m long \
	  tests/lab/test_auth.py -k rotate

# 10,000 broken configs reloaded into a running loopback target while a host does verified I/O
# (tests/unit/reload_fuzz.py); the unit tier runs 300 of them.  Prints the refusals by kind.
RELOAD_FUZZ_COUNT ?= 10000
test-reload-fuzz: venv
	RELOAD_FUZZ_COUNT=$(RELOAD_FUZZ_COUNT) $(PYTEST) -p no:cacheprovider -s -m fuzz tests/unit/test_reload_fuzz.py

# blktests' nvme group (a pinned upstream revision, cached beside the lab images, seeded once from
# BLKTESTS_SRC=a clone of linux-blktests/blktests) against kernel nvmet and against the userspace target through
# its NVME_TARGET_CONTROL script, one boot per kernel, tables under results/ (docs/conformance.md).  More than an
# hour per kernel on 2 cores, so not part of `make test`; it holds the lab lock.
BLKTESTS_SRC ?=
BLKTESTS_TIMEOUT ?= 7200
test-blktests: lab
	flock /tmp/nvmeof-lab.lock $(NVMEOF) lab blktests --kernel 6.1 $(if $(BLKTESTS_SRC),--source $(BLKTESTS_SRC)) \
	  --timeout $(BLKTESTS_TIMEOUT) --out results/blktests-6.1
	flock /tmp/nvmeof-lab.lock $(NVMEOF) lab blktests --kernel 6.12 --timeout $(BLKTESTS_TIMEOUT) --out results/blktests-6.12

# Two guests on a virtual wire (docs/two-node.md): perftest, the kernel host against both targets, a decoded
# capture, a lossy link, an MTU mismatch.  Boots two guests per scenario (about 8 min in all on 2 cores), so it
# holds the lab lock and is not part of `make test`.
test-two-node: lab
	flock /tmp/nvmeof-lab.lock env NVMEOF_TWO_NODE=1 $(PYTEST) -p no:cacheprovider -m twonode tests/twonode

# All tiers always run (unit, lab on 6.1, lab subset on 6.12); their summaries are repeated last; the make
# fails if any failed.
test: deps venv lab
	$(VENV)/bin/python tests/tiers.py $(VENV)/bin/python $(LAB_TIMEOUT)

demo: deps venv lab
	$(NVMEOF) demo

clean-lab: venv
	$(NVMEOF) lab clean

# Python µs per 4 KiB read through the RDMA transport (a fake device, real pyverbs objects) and the target
# core alone: a benchmark, not a test (docs/benchmarks.md). pyverbs is only in the lab guest, so it runs there;
# `python3 -m nvmeof_roce.bench.cost.transport --stand-ins` runs anywhere, without pyverbs' own costs.
bench-transport: lab
	$(NVMEOF) lab run --timeout 900 -- python3 -m nvmeof_roce.bench.cost.transport

# The native data path's cost through the fake verbs provider (docs/native.md): callgrind, no lab needed.
bench-native: venv
	$(VENV)/bin/python -m nvmeof_roce.bench.cost.native

# The native data path's tests under AddressSanitizer + UBSan (a separate build of the extension, loaded through
# NVMEOF_ROCE_NATIVE_SO; Python itself is not instrumented, so libasan is preloaded and leak checking is off),
# then the poll groups' tests under ThreadSanitizer (-s: a report is printed before the exit, not captured), then
# under valgrind memcheck (the normal build; Python's allocator set to malloc so memcheck sees every block).
# -DNQ_CHECKED compiles in the check of every request state change against csrc/nq_hot.c's nq_next (an abort names it).
NATIVE_SAN_DIR := build/sanitize
NATIVE_SAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -DNQ_CHECKED
# ThreadSanitizer for the poll groups' threads (csrc/pollgroup.c) against the event loop's calls on their queues
NATIVE_TSAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=thread -DNQ_CHECKED
# One sanitizer build of the extension (flags, file name under NATIVE_SAN_DIR), and the environment that loads it,
# shared by test-native and test-native-fuzz.
native_san_build = gcc -shared -fPIC -std=gnu11 -Wall -Wextra -Wno-unused-parameter $(1) \
	  $$($(VENV)/bin/python -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])") \
	  -o $(NATIVE_SAN_DIR)/$(2) csrc/*.c -libverbs -lrdmacm -Wl,-Bstatic -luring -Wl,-Bdynamic
NATIVE_ASAN_ENV = NVMEOF_ROCE_NATIVE_SO=$(NATIVE_SAN_DIR)/_native.so NVMEOF_FAKEPROV_CFLAGS="$(NATIVE_SAN_FLAGS)" \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
NATIVE_TSAN_ENV = NVMEOF_ROCE_NATIVE_SO=$(NATIVE_SAN_DIR)/_native_tsan.so NVMEOF_FAKEPROV_CFLAGS="$(NATIVE_TSAN_FLAGS)" \
	  LD_PRELOAD="$$(gcc -print-file-name=libtsan.so)" TSAN_OPTIONS=halt_on_error=1:report_signal_unsafe=0
test-native: venv
	rm -rf $(NATIVE_SAN_DIR) && mkdir -p $(NATIVE_SAN_DIR)
	$(call native_san_build,$(NATIVE_SAN_FLAGS),_native.so)
	$(NATIVE_ASAN_ENV) \
	  $(PYTEST) -q -p no:cacheprovider tests/unit/test_native_queue.py tests/unit/test_native_poll.py \
	  tests/unit/test_native_faults.py tests/unit/test_native_trace.py tests/unit/test_native_hostq.py \
	  tests/unit/test_native_live.py tests/unit/test_native_cm.py tests/unit/test_fencing.py \
	  tests/unit/test_native_reservations.py tests/unit/test_rbd_native.py
	$(call native_san_build,$(NATIVE_TSAN_FLAGS),_native_tsan.so)
	$(NATIVE_TSAN_ENV) \
	  $(PYTEST) -q -s -p no:cacheprovider tests/unit/test_native_poll.py tests/unit/test_native_trace.py \
	  tests/unit/test_rbd_native.py
	PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 --errors-for-leak-kinds=definite \
	  --leak-check=full --show-leak-kinds=definite --suppressions=tests/native/python.supp \
	  $(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_native_queue.py tests/unit/test_native_poll.py \
	  tests/unit/test_native_faults.py tests/unit/test_native_trace.py tests/unit/test_native_live.py \
	  tests/unit/test_native_cm.py tests/unit/test_fencing.py tests/unit/test_rbd_native.py -k "not identically"

# The differential fuzz of the native data path (tests/unit/native_fuzz.py, docs/native.md): seeded batches of
# 8-32 capsules, live changes and injected faults, every CQE and byte compared with the Python path.  The
# extension built as for test-native (ASan + UBSan): the corpus of cases that once failed and the unit tier's
# sample, then NATIVE_FUZZ_CAPSULES capsules of widened cases (hosts A and B, reservations and preempts during
# batches, ended controllers, host and file namespace changes: tests/unit/native_fuzz.py); then the TSan build with
# the native queues on two poll-group threads for NATIVE_FUZZ_TSAN_CAPSULES.  Each run prints its counts and time,
# and both are printed again at the end (NATIVE_FUZZ_SUMMARY).
NATIVE_FUZZ_CAPSULES ?= 100000
NATIVE_FUZZ_TSAN_CAPSULES ?= 10000
NATIVE_FUZZ_SUMMARY := build/native-fuzz-summary.txt
test-native-fuzz: venv
	rm -rf $(NATIVE_SAN_DIR) $(NATIVE_FUZZ_SUMMARY) && mkdir -p $(NATIVE_SAN_DIR)
	$(call native_san_build,$(NATIVE_SAN_FLAGS),_native.so)
	$(NATIVE_ASAN_ENV) \
	  NATIVE_FUZZ_CAPSULES=$(NATIVE_FUZZ_CAPSULES) NATIVE_FUZZ_SUMMARY=$(NATIVE_FUZZ_SUMMARY) \
	  $(PYTEST) -q -s -p no:cacheprovider -m "fuzz or not fuzz" tests/unit/test_native_fuzz.py
	$(call native_san_build,$(NATIVE_TSAN_FLAGS),_native_tsan.so)
	$(NATIVE_TSAN_ENV) \
	  NATIVE_FUZZ_CAPSULES=$(NATIVE_FUZZ_TSAN_CAPSULES) NATIVE_FUZZ_GROUPS=2 NATIVE_FUZZ_SEED=500000 \
	  NATIVE_FUZZ_SUMMARY=$(NATIVE_FUZZ_SUMMARY) \
	  $(PYTEST) -q -s -p no:cacheprovider -m fuzz tests/unit/test_native_fuzz.py -k scale
	@echo "[nvmeof-roce] test-native-fuzz summary (ASan/UBSan, then TSan on poll-group threads):"
	@cat $(NATIVE_FUZZ_SUMMARY)

# The soak (docs/benchmarks.md): our target alone in the lab guest, SOAK_IOS 4 KiB commands at QD32 (random writes
# read back and verified by fio) on the native data path while a scratch namespace is added, resized and removed by
# RPC every SOAK_CHANGE_INTERVAL seconds; bench.json under SOAK_OUT has the RSS growth per 10^6 commands, the verify
# errors, the live changes and the event loop's longest pass, and a progress line a minute.  10^7 commands took
# 40-45 minutes under emulation on this 2-core machine (SOAK_IOS=1000000 for a first look); it holds the lab lock.
SOAK_IOS ?= 10000000
SOAK_CHANGE_INTERVAL ?= 3
SOAK_OUT ?= results/soak-$(SOAK_IOS)
soak: lab
	flock /tmp/nvmeof-lab.lock $(NVMEOF) lab run --timeout $$(( $(SOAK_IOS) / 1000 + 1800 )) -- python3 -m nvmeof_roce \
	  bench --targets userspace --jobs soak --no-perftest --no-plots --ns-size 128M --size 64M \
	  --soak-ios $(SOAK_IOS) --soak-change-interval $(SOAK_CHANGE_INTERVAL) --soak-timeout 14400 --out $(SOAK_OUT)

# QD1 latency on a loaded host (docs/benchmarks.md, "QD1 on a loaded host"): BENCH_QD1_HOG busy loops (0: an idle
# machine) run on this machine, started before the guest boots and stopped after it, through every target's turns;
# the kernel target, ours in interrupt mode and ours with --poll adaptive (200 and 1000 µs spins), 5 repeats of
# QD1 random reads (fio through nvme-rdma, and our initiator).  It holds the lab lock, and the CPU lock exclusively
# so that no unit tier runs beside it.
BENCH_QD1_HOG ?= 1
BENCH_QD1_OUT ?= results/qd1-hog$(BENCH_QD1_HOG)
bench-qd1-load: lab
	flock /tmp/nvmeof-lab.lock flock -x /tmp/nvmeof-cpu.lock sh -c 'hogs=""; \
	  for i in $$(seq 1 $(BENCH_QD1_HOG)); do sh -c "while :; do :; done" & hogs="$$hogs $$!"; done; \
	  $(NVMEOF) lab run --timeout $(LAB_TIMEOUT) -- python3 -m nvmeof_roce bench \
	    --targets kernel,userspace,native-adaptive,native-adaptive-1000us \
	    --jobs randread-4k-qd1,uinit-randread-4k-qd1 --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots \
	    --out $(BENCH_QD1_OUT); \
	  rc=$$?; [ -z "$$hogs" ] || kill $$hogs; exit $$rc'
