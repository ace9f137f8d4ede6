#!/usr/bin/env bash
# make smoke: for each wheel `make wheel` built in dist/ (one per available Python
# 3.10-3.13), a fresh venv with tensorflow-cpu 2.21 and the wheel, everything run with no
# compiler on PATH (PATH is one directory holding only `python` and `pip` of that venv;
# CC/CXX unset; checked with shutil.which before anything is installed):
#   - a tensorflow 2.21 wheel (the declared dependency) exists for that Python,
#   - tensorflow-cpu and the wheel install from wheels only (--only-binary=:all:; from
#     the wheelhouse `make wheel` downloaded into, so each Python downloads TF once),
#   - tf_ophandlers imports from site-packages (not from this checkout),
#   - examples/quickstart.py runs, and a short test subset passes (copied tests, run
#     outside the checkout so that only the installed wheel can be imported).
# Prints per-Python times; exits non-zero if any Python failed or no wheel was found.
#   PYTHONS="3.13" make smoke      # one Python
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pythons.sh
ROOT=$PWD

# The C++ paths these exercise: placement and copies, scopes, the Op API, errors crossing
# the boundary, function replay, and gradients (TensorFlow's tape vs oh.GradientTape,
# custom gradients, tf.function calls, higher order, a Keras training loop); and the
# tests' fork server (tests/fork_server.py) on each Python.
SMOKE_TESTS=(
  tests/core/test_placement_and_copies.py
  tests/core/test_scopes.py
  tests/core/test_op.py
  tests/core/test_errors.py
  tests/core/test_replay.py
  tests/handlers/gradient_tape/test_gradient_tape.py::test_gradients_equal_tf_gradient_tape
  tests/handlers/gradient_tape/test_gradient_tape.py::test_custom_gradient
  tests/handlers/gradient_tape/test_gradient_tape.py::test_tf_function_call_under_the_tape
  tests/handlers/gradient_tape/test_gradient_tape.py::test_second_order
  tests/handlers/gradient_tape/test_gradient_tape.py::test_keras_training_loop_matches_tf
  tests/test_python_process.py
)

work=$(mktemp -d "${TMPDIR:-/tmp}/tf-ophandlers-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
# The tests and examples, without the package: imports can only find the installed wheel.
mkdir -p "$work/src"
cp -r tests examples pyproject.toml "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +

# step NAME COMMAND...: runs COMMAND from the copied sources in the compiler-free
# environment `nocc` (set per Python below) and records its time in `times`.
step() {
  local name=$1 s
  s=$(now)
  shift
  if (cd "$work/src" && "${nocc[@]}" "$@"); then
    times+=("$name $(( $(now) - s ))s")
  else
    times+=("$name FAILED")
    return 1
  fi
}

summary=()
failed=()
found=0
for v in $PYTHONS; do
  tag=cp${v/./}
  whl=$(ls "$DIST"/tf_ophandlers-*-"$tag"-"$tag"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    echo "smoke: no wheel for Python $v in $DIST/ (make wheel): skipped"
    continue
  fi
  if ! py=$(find_python "$v"); then
    echo "smoke: Python $v not found: skipped"
    continue
  fi
  found=$((found + 1))
  whl=$ROOT/$whl
  venv=$work/$(venv_name "$v")
  bin=$work/bin-$(venv_name "$v")
  echo "=== smoke: Python $v ($py), $(basename "$whl")"
  t0=$(now)
  "$py" -m venv "$venv"
  mkdir -p "$bin"
  ln -s "$venv/bin/python" "$bin/python"
  ln -s "$venv/bin/pip" "$bin/pip"
  # Everything below runs with this environment: no compiler can be found.
  nocc=(env -u CC -u CXX -u CPP -u LDSHARED -u LDCXXSHARED PATH="$bin" TF_CPP_MIN_LOG_LEVEL=2)
  times=()
  ok=1
  step no-compiler "$venv/bin/python" -c '
import shutil, sys
found = {n: shutil.which(n) for n in ("gcc", "g++", "cc", "c++", "clang", "clang++", "ld")}
print("smoke: compilers on PATH:", found)
sys.exit(any(found.values()))' || ok=0
  # The declared dependency (tensorflow>=2.21,<2.22; check_wheel.py checked the
  # metadata) has a wheel for this Python: the index lists 2.21 for this interpreter.
  # (A `pip install --dry-run` of the wheel would download tensorflow's 570 MB wheel.)
  [ $ok = 1 ] && { step dependency "$venv/bin/python" -c '
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "tensorflow",
                      "--only-binary=:all:"], capture_output=True, text=True).stdout
line = [l for l in out.splitlines() if l.startswith("Available versions:")]
versions = line[0].split(":", 1)[1].replace(",", " ").split() if line else []
ok = [v for v in versions if v.startswith("2.21.")]
print("smoke: tensorflow wheels for this Python include", ok or versions or out[-300:])
sys.exit(not ok)' || ok=0; }
  # tensorflow-cpu from the wheelhouse `make wheel` filled for this Python, if any.
  wheelhouse=$ROOT/$VENVS/wheelhouse-$(venv_name "$v")
  case $VENVS in /*) wheelhouse=$VENVS/wheelhouse-$(venv_name "$v");; esac
  from=()
  [ -d "$wheelhouse" ] && from=(--no-index --find-links "$wheelhouse")
  [ $ok = 1 ] && { step install "$venv/bin/python" -m pip install -q --only-binary=:all: \
      "${from[@]}" "$TF_REQUIREMENT" "pytest>=7" \
    && step install-wheel "$venv/bin/python" -m pip install -q --only-binary=:all: --no-deps \
      --no-index "$whl" || ok=0; }
  [ $ok = 1 ] && { step import "$venv/bin/python" -c '
import sys, tf_ophandlers as oh, tensorflow as tf
assert "site-packages" in oh.__file__ and oh._C.__file__.startswith(sys.prefix), oh._C.__file__
print("smoke: tf_ophandlers", oh.__version__, "from", oh._C.__file__, "TensorFlow", tf.__version__,
      "Python", sys.version.split()[0])' || ok=0; }
  [ $ok = 1 ] && { step quickstart "$venv/bin/python" examples/quickstart.py || ok=0; }
  [ $ok = 1 ] && { step tests "$venv/bin/python" -m pytest -q -p no:cacheprovider \
      "${SMOKE_TESTS[@]}" || ok=0; }
  total=$(( $(now) - t0 ))
  if [ $ok = 1 ]; then
    summary+=("Python $v: ok in ${total}s (${times[*]})")
  else
    summary+=("Python $v: FAILED after ${total}s (${times[*]})")
    failed+=("$v")
  fi
  rm -rf "$venv" "$bin"
done

echo "=== smoke summary"
for line in "${summary[@]}"; do echo "smoke: $line"; done
if [ "$found" -eq 0 ]; then
  echo "smoke: no wheel found in $DIST/ (make wheel first)"
  exit 1
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "smoke: failed for Python ${failed[*]}"
fi
# A closing line in the plain "N passed, N failed" form, counting Pythons.
echo "smoke: $((found - ${#failed[@]})) passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
