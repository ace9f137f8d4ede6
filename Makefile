# make demo / make test work on a fresh machine: each creates .venv and installs
# TensorFlow 2.21 (CPU wheel) and this package with its compiled extension.
# make wheel: a wheel per available Python 3.10-3.13 in dist/ (build venvs in .venvs/).
# make smoke: each wheel in a fresh venv without a compiler: quickstart + a test subset.
# make bazel: the Bazel build (BUILD, WORKSPACE; Debian's bazel-bootstrap, installed when
#   missing) of the four libraries and examples/cc_handler, then tests/native/test_bazel.py.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-python-path bench build wheel smoke bazel clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) setup.py pyproject.toml cc/*.cc cc/*.h cc/include/tf_ophandlers/*.h
	$(VPY) -m pip install -q "tensorflow-cpu==2.21.*" "pytest>=7" matplotlib tensorboard setuptools wheel
	# --no-deps: the package requires `tensorflow`, which would go in over tensorflow-cpu.
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

build: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

# The suite without the stress tests marked slow (CI runs those too: make test-slow).
test: $(STAMP)
	$(VPY) -m pytest -q -ra --durations=30 -m "not slow" tests

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

wheel:
	bash scripts/build_wheels.sh

smoke: wheel
	bash scripts/smoke_matrix.sh

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
	rm -rf build dist *.egg-info tf_ophandlers/*.so tf_ophandlers/include
	if [ -L bazel-bin ] && command -v $(BAZEL) >/dev/null; then $(BAZEL) clean; fi
