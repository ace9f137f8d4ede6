"""The fork server of tests/python_process.py: a Python that has imported TensorFlow
(three to four seconds of the five a fresh test interpreter takes here) and forks a
child per request, which then runs like `python -c CODE ARGS` or `python SCRIPT ARGS`.

It runs as `python -c <this file's text>`, so that its `__main__` and `sys.path[0]` are a
`-c` program's. It never imports tf_ophandlers and never runs an op: each child starts
with no handler, no patch and no eager context, as a new process does. Requests come as
one JSON line each on stdin: {"argv": [...], "code": str or null, "path": str or null,
"environ": {...}, "stdout": file, "stderr": file} (the environment differs from the
server's in no variable read at import, such as PYTEST_CURRENT_TEST); for each it writes two JSON lines: {"pid": child} when
forked, {"returncode": n} when the child ended (negative: killed by that signal, as
subprocess reports it).

A child leaves by SystemExit through the top level of this program, so the interpreter
ends as a fresh one would: atexit handlers, non-daemon threads joined, finalization."""
import json
import os
import sys
import warnings

# Python 3.12 warns when a process that has threads forks (the import leaves one
# OpenBLAS worker); the child is single-threaded until TensorFlow starts its pools.
warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
_FORK_WARNING_FILTER = warnings.filters[0]
import tensorflow  # noqa: E402,F401  pylint: disable=unused-import,wrong-import-position

_requests = sys.stdin.buffer
_replies = os.fdopen(os.dup(1), "wb", buffering=0)


def _child(request):
    """Runs in the forked child: the request's files become fd 1 and 2, stdin is
    /dev/null, then the code runs as `__main__` with the request's argv."""
    import runpy  # pylint: disable=import-outside-toplevel
    import types  # pylint: disable=import-outside-toplevel
    for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _replies.close()
    warnings.filters.remove(_FORK_WARNING_FILTER)  # (the code's own warnings are its)
    getattr(warnings, "_filters_mutated", lambda: None)()  # (as filterwarnings does)
    os.environ.clear()
    os.environ.update(request["environ"])
    sys.argv = list(request["argv"])
    try:
        if request["path"] is not None:
            sys.path[0] = os.path.dirname(os.path.abspath(request["path"]))
            runpy.run_path(request["path"], run_name="__main__")
        else:
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)  # pylint: disable=exec-used
    except SystemExit:
        raise
    except BaseException:  # pylint: disable=broad-except
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1)  # pylint: disable=raise-missing-from
    raise SystemExit(0)


for line in _requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        _child(request)
    _replies.write(b'{"pid": %d}\n' % pid)
    _, status = os.waitpid(pid, 0)
    _replies.write(b'{"returncode": %d}\n' % os.waitstatus_to_exitcode(status))
