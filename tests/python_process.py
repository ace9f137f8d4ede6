"""Runs Python code or a script in a fresh interpreter, for tests of what only a new
process shows (import-time state, installed patches, the examples as users run them).

The checkout comes first on the path and is the working directory, so the code imports
this package from the checkout whether it is installed or not."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tail(output):
    # TimeoutExpired carries bytes even for a text-mode run.
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return (output or "")[-2000:]


def run_python(code_or_path, timeout=300, check=True, env=None, args=()):
    """Runs `code_or_path` (source text, dedented, or a `pathlib.Path` of a script) with
    command-line arguments `args`.

    `env`: extra environment variables. A run past `timeout` seconds fails the test as a
    hang. With `check`, asserts that it exits with 0 (the tails of its output in the
    message) and returns its stdout; else returns the `subprocess.CompletedProcess`."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    full_env.update(env or {})
    argv = [sys.executable, str(code_or_path)] if isinstance(code_or_path, pathlib.Path) \
        else [sys.executable, "-c", textwrap.dedent(code_or_path)]
    try:
        proc = subprocess.run(argv + [str(a) for a in args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail("the subprocess hung: no exit in %d s; its output so far: %s%s" % (
            timeout, _tail(e.stdout), _tail(e.stderr)))
    if not check:
        return proc
    assert proc.returncode == 0, "exit %d: %s" % (
        proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout
