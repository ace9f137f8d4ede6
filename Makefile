# make demo / make test work on a fresh machine: each creates .venv and installs
# TensorFlow 2.21 (CPU wheel) and this package with its compiled extension.
# make wheel: a wheel per available Python 3.10-3.13 in dist/ (build venvs in .venvs/).
# make smoke: each wheel in a fresh venv without a compiler: quickstart + a test subset.
# make c-api: tf_ophandlers/libtf_ophandlers_c.so, the C API (cc/include/tf_ophandlers/c_api.h)
#   for programs using TensorFlow's C API with no Python; make c-api-example builds and runs
#   examples/c_api/ against it (docs/using-handlers-from-c.md).
# make docs: the documentation site (MkDocs + mkdocstrings, pinned in docs/requirements.txt)
#   built with --strict into site/ (git-ignored).
# make bazel: the Bazel build (BUILD, WORKSPACE; Debian's bazel-bootstrap, installed when
#   missing) of the four libraries and examples/cc_handler, then tests/native/test_bazel.py.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test test-slow test-python-path bench build wheel smoke bazel docs clean c-api c-api-programs c-api-example

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Every C++ source and header under cc/, at any depth (a clean clone must rebuild on any change).
CC_FILES := $(shell find cc -name '*.cc' -o -name '*.h')

$(STAMP): $(VPY) setup.py pyproject.toml $(CC_FILES)
	# sybil: tests/docs/test_snippets.py runs the Python blocks of README.md and docs/.
	# pytest-xdist: make test runs the suite in TEST_WORKERS processes.
	$(VPY) -m pip install -q "tensorflow-cpu==2.21.*" "pytest>=7" "sybil==10.1.0" "pytest-xdist==3.8.0" matplotlib tensorboard setuptools wheel
	# --no-deps: the package requires `tensorflow`, which would go in over tensorflow-cpu.
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

build: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

# The suite without the stress tests marked slow (CI runs those too: make test-slow), in
# TEST_WORKERS processes (pytest-xdist; 0: in this one). A test file runs whole in one
# worker (--dist loadfile): module fixtures are built once, and the tests of a file that
# builds into the clone (test_c_api.py's make c-api-programs) never race each other.
# The fuzzers draw a smaller set of cases from a seed that changes daily (OH_FUZZ_SEED,
# tests/fuzz_seed.py; printed at the end); their default seeds' full draws are marked slow.
TEST_WORKERS ?= 0
test: $(STAMP)
	$(VPY) -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

test-slow: $(STAMP)
	$(VPY) -m pytest -q -ra --durations=10 -m slow tests

# The differential tests again with every Python handler's op on the Python path (the
# reference the C paths must agree with; tf_ophandlers/core/fast_decision.py C_PATHS).
test-python-path: $(STAMP)
	OH_FAST_PATH=0 $(VPY) -m pytest -q -ra tests/compositions/test_differential.py \
	    tests/compositions/test_fuzz_stacks.py tests/core/test_python_path_switch.py

bench: $(STAMP)
	$(VPY) benchmarks/overhead.py
	$(VPY) benchmarks/gradient_tape.py
	$(VPY) benchmarks/forward_accumulator.py
	$(VPY) benchmarks/vectorized_map.py
	$(VPY) benchmarks/parallel.py
	$(VPY) benchmarks/functions.py
	$(VPY) benchmarks/lazy.py
	$(VPY) benchmarks/async_execution.py
	$(VPY) benchmarks/recompute.py
	$(VPY) benchmarks/data_format.py
	$(VPY) benchmarks/debugger.py
	$(VPY) benchmarks/small_ops.py
	$(VPY) benchmarks/lazy_chunks.py
	$(VPY) benchmarks/native_handlers.py
	$(VPY) benchmarks/mesh.py
	$(VPY) benchmarks/mesh_communication.py

# The site needs no TensorFlow: mkdocstrings reads the docstrings from the source.
$(DOCS_STAMP): $(VPY) docs/requirements.txt
	$(VPY) -m pip install -q -r docs/requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VPY) -m mkdocs build --strict --site-dir site

wheel:
	bash scripts/build_wheels.sh

smoke: wheel
	bash scripts/smoke_matrix.sh

# The C API library and its example. Flags come from the installed TensorFlow (tf.sysconfig;
# Python runs only here, at build time): the library links libtensorflow_cc.so.2 (TFE_*) and
# libtensorflow_framework.so.2, never libpython.
C_API_LIB := tf_ophandlers/libtf_ophandlers_c.so
C_API_OUT := build/c_api
C_API_SRCS := cc/c_api/c_api.cc cc/c_api/c_runtime.cc cc/c_api/c_native_handlers.cc \
    cc/kernels/op_outputs.cc
C_API_DEPS := $(C_API_SRCS) cc/c_api/c_runtime.h cc/kernels/op_outputs.h \
    cc/native/native_handlers.cc cc/include/tf_ophandlers/*.h
TF_FLAGS = $(C_API_OUT)/tf_flags.mk

$(TF_FLAGS): $(STAMP)
	mkdir -p $(C_API_OUT)
	$(VPY) -c "import tensorflow as tf; \
	  print('TF_CFLAGS := ' + ' '.join(tf.sysconfig.get_compile_flags())); \
	  print('TF_LIB := ' + tf.sysconfig.get_lib())" > $@.tmp 2>/dev/null
	mv $@.tmp $@

# Read only for the C API's targets: remaking it needs the venv, which `make clean` or
# `make wheel` must not build.
ifneq ($(filter c-api% $(C_API_LIB) $(C_API_OUT)/%,$(MAKECMDGOALS)),)
-include $(TF_FLAGS)
endif
TF_C_CFLAGS = $(filter-out --std=c++17,$(TF_CFLAGS))
TF_LDFLAGS = -L$(TF_LIB) -l:libtensorflow_framework.so.2 -l:libtensorflow_cc.so.2 -Wl,-rpath,$(TF_LIB)

$(C_API_LIB): $(C_API_DEPS) $(TF_FLAGS)
	g++ -shared -fPIC -O2 -fvisibility=hidden -Wno-deprecated-declarations $(TF_CFLAGS) \
	    -Icc -Icc/include $(C_API_SRCS) -o $@ $(TF_LDFLAGS) -Wl,--no-undefined

c-api: $(C_API_LIB)

$(C_API_OUT)/op_timer.so: examples/cc_handler/op_timer.cc cc/include/tf_ophandlers/handler.h $(TF_FLAGS)
	g++ -shared -fPIC -O2 $(TF_CFLAGS) -Icc/include $< -o $@ \
	    -L$(TF_LIB) -l:libtensorflow_framework.so.2 -Wl,-rpath,$(TF_LIB)

# Handler libraries the bad-input program loads: one of an ABI version from the future,
# handlers that fail or refuse copies, handlers that break the contract.
C_API_TEST_LIBS := $(C_API_OUT)/bad_abi_handler.so $(C_API_OUT)/failing_handler.so \
    $(C_API_OUT)/c_api_bad_handler.so
$(C_API_OUT)/%.so: tests/native/%.cc cc/include/tf_ophandlers/handler.h $(TF_FLAGS)
	g++ -shared -fPIC -O1 $(TF_CFLAGS) -Icc/include $< -o $@ \
	    -L$(TF_LIB) -l:libtensorflow_framework.so.2 -Wl,-rpath,$(TF_LIB)

C_PROGRAM = gcc -std=c11 -Wall -Wextra -Werror -O1 $(TF_C_CFLAGS) -Icc/include $< -o $@ \
	    -L$(CURDIR)/tf_ophandlers -ltf_ophandlers_c -Wl,-rpath,$(CURDIR)/tf_ophandlers $(TF_LDFLAGS)

$(C_API_OUT)/c_api_example: examples/c_api/c_api_example.c $(C_API_LIB) $(TF_FLAGS)
	$(C_PROGRAM)

# Bad input through the C API (tests/native/test_c_api.py runs it too).
$(C_API_OUT)/c_api_errors: tests/native/c_api_errors.c $(C_API_LIB) $(TF_FLAGS)
	$(C_PROGRAM)

c-api-programs: $(C_API_OUT)/c_api_example $(C_API_OUT)/c_api_errors \
    $(C_API_OUT)/op_timer.so $(C_API_TEST_LIBS)

c-api-example: c-api-programs
	$(C_API_OUT)/c_api_example $(C_API_OUT)/op_timer.so
	$(C_API_OUT)/c_api_errors $(C_API_TEST_LIBS)

# Bazel from Debian (bazel-bootstrap 4.2): apt-get as root, else through sudo. The build
# itself is offline (WORKSPACE). TFOH_BAZEL_BIN makes the test fail, not skip, when a
# library is missing.
BAZEL ?= bazel
bazel: $(STAMP)
	@command -v $(BAZEL) >/dev/null || { \
	  echo "make bazel: installing Debian's bazel-bootstrap"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bazel-bootstrap; }
	./configure.sh $(VPY)
	$(BAZEL) build //...
	TFOH_BAZEL_BIN="$$($(BAZEL) info bazel-bin)" $(VPY) -m pytest -q -ra tests/native/test_bazel.py

clean:
	rm -rf build dist site *.egg-info tf_ophandlers/*.so tf_ophandlers/include
	if [ -L bazel-bin ] && command -v $(BAZEL) >/dev/null; then $(BAZEL) clean; fi
