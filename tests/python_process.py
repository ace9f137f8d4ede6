"""Runs Python code or a script in a fresh interpreter, for tests of what only a new
process shows (import-time state, installed patches, the examples as users run them).

The checkout comes first on the path and is the working directory, so the code imports
this package from the checkout whether it is installed or not."""
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_python(code_or_path, timeout=300, check=True, env=None):
    """Runs `code_or_path` (source text, dedented, or a `pathlib.Path` of a script).

    `env`: extra environment variables. With `check`, asserts that it exits with 0 (the
    tails of its output in the message) and returns its stdout; else returns the
    `subprocess.CompletedProcess`."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    full_env.update(env or {})
    args = [sys.executable, str(code_or_path)] if isinstance(code_or_path, pathlib.Path) \
        else [sys.executable, "-c", textwrap.dedent(code_or_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=ROOT)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
