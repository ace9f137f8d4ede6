# make demo / make test work on a fresh machine: each creates .venv and installs
# TensorFlow 2.21 (CPU wheel) and this package with its compiled extension.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench build clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) setup.py pyproject.toml cc/*.cc cc/*.h cc/include/tf_ophandlers/*.h
	$(VPY) -m pip install -q "tensorflow-cpu==2.21.*" "pytest>=7" matplotlib setuptools wheel
	$(VPY) -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

build: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

test: $(STAMP)
	$(VPY) -m pytest -q -ra tests

bench: $(STAMP)
	$(VPY) benchmarks/overhead.py
	$(VPY) benchmarks/gradient_tape.py
	$(VPY) benchmarks/forward_accumulator.py
	$(VPY) benchmarks/vectorized_map.py
	$(VPY) benchmarks/parallel.py
	$(VPY) benchmarks/functions.py
	$(VPY) benchmarks/lazy.py
	$(VPY) benchmarks/async_execution.py
	$(VPY) benchmarks/native_handlers.py

clean:
	rm -rf build *.egg-info tf_ophandlers/_C*.so tf_ophandlers/_native_handlers*.so tf_ophandlers/include
