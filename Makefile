# Tenzro distributed MoE — the two commands: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-installed
TESTDEPS := $(VENV)/.test-installed
KERNELS := $(VENV)/.kernels-installed
ROWWISE := $(VENV)/.rowwise-installed
# The load generator of bench/bench_serving.py (aiperf) lives in its own venv: it pins
# prometheus-client apart from the site's and pulls packages neither the site nor its tests need.
BENCHVENV := .venv-bench
BENCHDEPS := $(BENCHVENV)/.installed

.PHONY: demo test serve worker beat bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(RUNTIME): requirements.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements.txt
	touch $@

# Native quantized kernels (C, runtime SIMD dispatch). A failed build is not fatal: the CPU backend
# logs it and keeps its numba path.
$(KERNELS): native/_kernels.c native/x8_kernels.h native/setup.py native/pyproject.toml $(RUNTIME) $(ROWWISE)
	$(BIN)/python -m pip install -q ./native || echo "tenzro_kernels did not build: quantized matmuls use the numba path"
	touch $@

# The fixed-order dense product (moe.rowwise); without it a numba loop gives the same bits, slower.
$(ROWWISE): native_rowwise/_rowwise.c native_rowwise/setup.py native_rowwise/pyproject.toml $(RUNTIME)
	$(BIN)/python -m pip install -q ./native_rowwise || echo "tenzro_rowwise did not build: dense products use the numba loop"
	touch $@

# llama-cpp-python (the GGUF tests' oracle) compiles llama.cpp: on every core, without its
# multimodal library, tests and examples.
$(TESTDEPS): requirements-test.txt $(RUNTIME) $(KERNELS)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
	  $(BIN)/python -m pip install -q -r requirements-test.txt
	touch $@

install: $(RUNTIME) $(KERNELS)

# The demo keeps its own state in var/demo/ (database included): it migrates that itself.
demo: $(RUNTIME) $(KERNELS)
	$(BIN)/python manage.py tenzro_demo

test: $(TESTDEPS)
	$(BIN)/lint-imports --no-cache
	TENZRO_VAR_DIR=$(CURDIR)/var/test $(BIN)/python -m pytest

# Operators: the site (daphne), one Celery worker, one beat (needs REDIS_URL). Several site processes
# behind a balancer: `make serve PORT=8001 SERVE_ARGS=--proxy-headers` per process (README).
SERVE_ARGS ?=
serve: $(RUNTIME)
	$(BIN)/python manage.py migrate --noinput -v 0
	$(BIN)/python -m tenzro_site.serve $(SERVE_ARGS) -e tcp:port=$${PORT:-8000}:interface=0.0.0.0:backlog=1024

worker: $(RUNTIME)
	$(BIN)/celery -A tenzro_site worker -l info

beat: $(RUNTIME)
	$(BIN)/celery -A tenzro_site beat -l info

$(BENCHDEPS): requirements-bench.txt
	$(PY) -m venv $(BENCHVENV)
	$(BENCHVENV)/bin/python -m pip install -q -r requirements-bench.txt
	touch $@

# llama.cpp's own server, the third column of bench/bench_serving.py: built once from the
# llama.cpp vendored in the sdist of the llama-cpp-python version the tests pin (its wheel leaves
# the server out). Only the llama-server target, statically linked, no web UI (its assets would
# come from the network), no HTTPS. Tens of minutes on 2 cores; an interrupted build resumes.
LLAMACPP_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' requirements-test.txt)
LLAMASRC := $(BENCHVENV)/src/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMABUILD := $(BENCHVENV)/src/llama-build
LLAMASERVER := $(BENCHVENV)/bin/llama-server

$(LLAMASRC)/CMakeLists.txt: requirements-test.txt
	mkdir -p $(BENCHVENV)/src
	$(PY) -m pip download -q --no-binary :all: --no-deps -d $(BENCHVENV)/src llama-cpp-python==$(LLAMACPP_VERSION)
	tar -xzf $(BENCHVENV)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(BENCHVENV)/src
	touch $@

$(LLAMASERVER): $(LLAMASRC)/CMakeLists.txt
	cmake -S $(LLAMASRC) -B $(LLAMABUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
	cmake --build $(LLAMABUILD) --target llama-server -j $$(nproc)
	mkdir -p $(BENCHVENV)/bin
	cp $(LLAMABUILD)/bin/llama-server $@

bench: $(TESTDEPS) $(BENCHDEPS) $(LLAMASERVER)
	@for f in bench/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || { echo "== $$f FAILED (exit $$?)"; exit 1; }; done

clean:
	rm -rf var db.sqlite3 $(BENCHVENV)
