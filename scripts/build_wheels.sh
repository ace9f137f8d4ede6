#!/usr/bin/env bash
# make wheel: one wheel per available supported Python (3.10-3.13) in dist/.
#
# For each Python (found under pyenv or as python3.X on PATH; a missing one is skipped
# with a message), a build venv .venvs/py3X with tensorflow-cpu 2.21 (reused between
# runs; the wheels it installed are kept in .venvs/wheelhouse-py3X for make smoke;
# VENVS=dir puts both elsewhere), then `pip wheel --no-build-isolation --no-deps` against that TensorFlow, then
# scripts/check_wheel.py: tags cp3X-cp3X-linux_x86_64, the three extension modules, a
# RUNPATH with no absolute path, tensorflow 2.21 required. Exits non-zero if a build or a
# check fails, or if no Python was found.
#   PYTHONS="3.12 3.13" make wheel     # a subset
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pythons.sh

built=0 failed=()
mkdir -p "$DIST" "$VENVS"
for v in $PYTHONS; do
  if ! py=$(find_python "$v"); then
    echo "wheel: Python $v not found (pyenv versions or python$v on PATH): skipped"
    continue
  fi
  venv=$VENVS/$(venv_name "$v")
  wheelhouse=$VENVS/wheelhouse-$(venv_name "$v")
  start=$(now)
  # The venv is reused if it was completed for the same TensorFlow requirement.
  ready=$([ "$(cat "$venv/.ready" 2>/dev/null)" = "$TF_REQUIREMENT" ] \
          && "$venv/bin/python" -c "" 2>/dev/null && echo 1 || echo 0)
  if [ "$ready" = 0 ]; then
    echo "wheel: creating the build venv $venv ($py)"
    "$py" -m venv --clear "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
  fi
  # The wheels go to a wheelhouse first: make smoke installs its fresh venvs from it.
  if [ "$(cat "$wheelhouse/.complete" 2>/dev/null)" != "$TF_REQUIREMENT" ]; then
    "$venv/bin/python" -m pip download -q --only-binary=:all: -d "$wheelhouse" \
      "$TF_REQUIREMENT" "pytest>=7" "setuptools>=64" wheel
    echo "$TF_REQUIREMENT" > "$wheelhouse/.complete"
  fi
  if [ "$ready" = 0 ]; then
    "$venv/bin/python" -m pip install -q --no-index --find-links "$wheelhouse" \
      "$TF_REQUIREMENT" "setuptools>=64" wheel
    echo "$TF_REQUIREMENT" > "$venv/.ready"
  fi
  tag=cp${v/./}
  rm -f "$DIST"/tf_ophandlers-*-"$tag"-"$tag"-*.whl
  echo "wheel: building for Python $v"
  if "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$DIST" . \
      && whl=$(ls "$DIST"/tf_ophandlers-*-"$tag"-"$tag"-*.whl) \
      && "$venv/bin/python" scripts/check_wheel.py "$whl" "$v"; then
    built=$((built + 1))
    echo "wheel: Python $v: $whl ($(( $(now) - start )) s)"
  else
    failed+=("$v")
    echo "wheel: Python $v: FAILED ($(( $(now) - start )) s)"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "wheel: failed for Python ${failed[*]}"
  exit 1
fi
if [ "$built" -eq 0 ]; then
  echo "wheel: no supported Python found ($PYTHONS)"
  exit 1
fi
