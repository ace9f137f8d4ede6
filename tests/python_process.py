"""Runs Python code or a script in a new process, for tests of what only a new process
shows (import-time state, installed patches, crashes, the examples as users run them).

The checkout comes first on the path and is the working directory, so the code imports
this package from the checkout whether it is installed or not."""
import atexit
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tail(output):
    # TimeoutExpired carries bytes even for a text-mode run.
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return (output or "")[-2000:]


def run_python(code_or_path, timeout=300, check=True, env=None, args=(), fresh=False):
    """Runs `code_or_path` (source text, dedented, or a `pathlib.Path` of a script) with
    command-line arguments `args`.

    `env`: extra environment variables. A run past `timeout` seconds fails the test as a
    hang. With `check`, asserts that it exits with 0 (the tails of its output in the
    message) and returns its stdout; else returns the `subprocess.CompletedProcess`.

    The run is forked from a Python that has already imported TensorFlow in the same
    environment (tests/fork_server.py), which saves the import's seconds per run; the
    child has no handler, patch or eager context, as a new process. `fresh` runs a new
    interpreter instead: for what depends on importing TensorFlow itself (import order,
    import-time state)."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    full_env.update(env or {})
    argv = [sys.executable, str(code_or_path)] if isinstance(code_or_path, pathlib.Path) \
        else [sys.executable, "-c", textwrap.dedent(code_or_path)]
    argv += [str(a) for a in args]
    proc = None
    if not fresh and os.environ.get("OH_TEST_FORK_SERVER", "1") != "0":
        proc = _fork_server(full_env).run(argv, full_env, timeout)
    if proc is None:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=timeout, env=full_env, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            pytest.fail("the subprocess hung: no exit in %d s; its output so far: %s%s" % (
                timeout, _tail(e.stdout), _tail(e.stderr)))
    if not check:
        return proc
    assert proc.returncode == 0, "exit %d: %s" % (
        proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout


# The servers of this test process, by environment (without PYTEST_CURRENT_TEST: pytest
# names the running test there, which TensorFlow's import does not read); the two used
# last are kept.
_SERVERS = {}
_SERVERS_KEPT = 2


def _fork_server(env):
    key = tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
    server = _SERVERS.pop(key, None) or _ForkServer()
    _SERVERS[key] = server  # (last in the dict: the most recent)
    while len(_SERVERS) > _SERVERS_KEPT:
        _SERVERS.pop(next(iter(_SERVERS))).close()
    return server


@atexit.register
def _close_servers():
    while _SERVERS:
        _SERVERS.popitem()[1].close()


class _ForkServer:
    """A tests/fork_server.py, started at its first run, restarted if it died; None from
    `run` means: run it fresh."""

    def __init__(self):
        self._proc = None
        self._buffer = b""

    def _start(self, env):
        self.close()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", (ROOT / "tests" / "fork_server.py").read_text()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, cwd=ROOT)
        self._buffer = b""

    def close(self):
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stdout.close()
            self._proc = None

    def _reply(self, deadline):
        """The server's next JSON line, or None at its end or past `deadline`."""
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, env, timeout):
        """Runs `argv` (`python -c CODE ARGS` or `python SCRIPT ARGS`) as a child."""
        if self._proc is None or self._proc.poll() is not None:
            self._start(env)
        code = argv[2] if argv[1] == "-c" else None
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": ["-c"] + argv[3:] if code is not None else argv[1:],
                       "code": code, "path": None if code is not None else argv[1],
                       "environ": env, "stdout": out, "stderr": err}
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self.close()
                return None
            # (the server imports TensorFlow before its first reply)
            started = self._reply(time.monotonic() + 120)
            if started is None:
                self.close()
                return None
            ended = self._reply(time.monotonic() + timeout)
            if ended is None:
                try:
                    os.kill(started["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if self._reply(time.monotonic() + 30) is None:  # (the server's reply)
                    self.close()
                pytest.fail("the subprocess hung: no exit in %d s; its output so far: %s%s" % (
                    timeout, _tail(_read(out)), _tail(_read(err))))
            return subprocess.CompletedProcess(argv, ended["returncode"], _read(out), _read(err))


def _read(name):
    try:
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""

