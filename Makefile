PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
USERS ?= 16
SPAWN_RATE ?= 4
DURATION ?= 60s
RESULTS ?= results
# the C++/AVX2 kernels compile once (cached by source hash); without them the server runs f16 weights and SDPA
BUILD_KERNELS := $(BIN)/kvserve kernels || echo "kernels unavailable: falling back to f16 weights and SDPA attention"
# --no-compile: byte-compiling all of torch at install costs more than compiling, on first import, the
# modules that are used
PIP_INSTALL := $(BIN)/pip install -q --no-compile
# ...which needs Python to keep what it compiles: a shell with PYTHONDONTWRITEBYTECODE set would compile
# the source of every module the server imports at each start, and start-up would take twice as long
unexport PYTHONDONTWRITEBYTECODE
STAMP_RUN := $(VENV)/.installed
STAMP_TEST := $(VENV)/.installed-test
STAMP_BENCH := $(VENV)/.installed-bench

.PHONY: test test-busy test-fast serve install loadtest bench compare clean system-deps

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e .
	$(BUILD_KERNELS)
	touch $@

# instructor's metadata caps jiter below what the openai SDK needs; at run time it works with the newer one
INSTALL_INSTRUCTOR := $(PIP_INSTALL) --no-deps instructor

$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[test]'
	$(INSTALL_INSTRUCTOR)
	$(BUILD_KERNELS)
	touch $@ $(STAMP_RUN)

$(STAMP_BENCH): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[test,bench]'
	$(INSTALL_INSTRUCTOR)
	$(BUILD_KERNELS)
	touch $@ $(STAMP_TEST) $(STAMP_RUN)

install: $(STAMP_RUN)

# nginx (for the load-balancer test), chromium (for the console's browser tests) and qemu-user (to run the
# kernels' AVX2 path on a CPU with AVX-512) come from Debian's packages
system-deps:
	@{ command -v nginx >/dev/null || test -x /usr/sbin/nginx; } && command -v chromium >/dev/null && \
	  command -v qemu-x86_64 >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light chromium qemu-user >/dev/null; }

# two workers, each taking whole test files, so a module's server is started once
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# tests marked timing compare latencies, so they run after the rest, alone: the other worker's load
# would be in their figures
test: $(STAMP_TEST) system-deps
	$(PYTEST) -m "not timing" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m timing $(PYTEST_ARGS)

# the suite beside other work: one core kept busy by a bounded loop for the whole run
test-busy: $(STAMP_TEST) system-deps
	timeout 7200 $(PY) -c 'while True: pass' & hog=$$!; $(MAKE) test; rc=$$?; kill $$hog; exit $$rc

# the same suite without the long drills (marked slow), for a quick loop while working
test-fast: $(STAMP_TEST) system-deps
	$(PYTEST) -m "not slow and not timing" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m "timing and not slow" $(PYTEST_ARGS)

serve: $(STAMP_RUN)
	$(BIN)/kvserve fetch --model $(MODEL)
	$(BIN)/kvserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# starts a local server, runs locust headless, stops the server; reports land in $(RESULTS)/
loadtest: $(STAMP_BENCH)
	$(BIN)/python bench/loadtest.py --model $(MODEL) --users $(USERS) --spawn-rate $(SPAWN_RATE) \
	  --duration $(DURATION) --results $(RESULTS)

# kvserve against llama.cpp's llama-server (built once from the llama-cpp-python sdist, into the cache)
compare: $(STAMP_BENCH)
	@command -v cmake >/dev/null && command -v g++ >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake g++ >/dev/null; }
	$(BIN)/python bench/compare_llamacpp.py --server $(COMPARE_ARGS)

bench: $(STAMP_BENCH)
	$(BIN)/python bench/model_step.py
	$(BIN)/python bench/serve_bench.py --launch --concurrency 1,8,32 --plot $(RESULTS)

clean:
	rm -rf $(VENV) build *.egg-info
