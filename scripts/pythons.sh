# Sourced by scripts/build_wheels.sh and scripts/smoke_matrix.sh.
#
# SUPPORTED_PYTHONS: the Pythons TensorFlow 2.21 ships wheels for (tensorflow-cpu 2.21.0
# has cp310, cp311, cp312 and cp313 wheels for manylinux x86_64; none for 3.14).
# Override with PYTHONS="3.12 3.13" to build or check a subset.
SUPPORTED_PYTHONS="3.10 3.11 3.12 3.13"
PYTHONS=${PYTHONS:-$SUPPORTED_PYTHONS}
# Build venvs (TensorFlow + setuptools for `pip wheel --no-build-isolation`), reused
# between runs; wheels go to dist/.
VENVS=${VENVS:-.venvs}
DIST=${DIST:-dist}
TF_REQUIREMENT=${TF_REQUIREMENT:-tensorflow-cpu==2.21.*}

# find_python 3.X: prints an interpreter of exactly that version, or fails. Looks in
# pyenv's versions directory first (the newest 3.X.* there), then for python3.X on PATH
# (a pyenv shim of a version that is not selected fails the version check and is skipped).
find_python() {
  local want=$1 cand root
  root=${PYENV_ROOT:-$HOME/.pyenv}
  for cand in $(ls -d "$root"/versions/"$want".*/bin/python"$want" 2>/dev/null | sort -V -r) \
              $(command -v "python$want" 2>/dev/null); do
    if "$cand" -c "import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" \
        >/dev/null 2>&1; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}

# venv_name 3.13 -> py313
venv_name() { echo "py${1/./}"; }

# now: seconds since the epoch (for timings)
now() { date +%s; }
