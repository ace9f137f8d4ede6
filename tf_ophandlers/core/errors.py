"""Error types and the mapping of handler exceptions through TensorFlow.

A handler's exception raised inside a dispatcher callback cannot cross TensorFlow's C
API as a Python object: only a status (code, message) can. The C++ callback therefore
*stashes* the exception here and puts a marker ``[tf_ophandlers#N]`` into the status
message. TensorFlow's status-to-exception conversion is wrapped (`install`) so that when
the status reaches Python again, the user receives the original exception object, with
its type, message and traceback.
"""
import collections
import re
import threading

from tensorflow.python.eager import core as _tf_core
from tensorflow.python.framework import errors as _tf_errors

from tf_ophandlers.core import tf_patches

_MARKER = re.compile(r"\[tf_ophandlers#(\d+)\]")
_MAX_STASHED = 256  # exceptions whose status TensorFlow dropped must not pile up

_lock = threading.Lock()
_stash = collections.OrderedDict()
_counter = [0]


class HandlerError(RuntimeError):
    """Base class of errors raised by the tf-ophandlers runtime itself."""


class PlacementError(HandlerError, ValueError):
    """An op's inputs live on handler stacks that cannot be combined."""


class HandlerOutputError(HandlerError, TypeError):
    """A handler returned outputs that do not satisfy the op's OpDef."""


class CopyOffError(HandlerError):
    """A handler refused to copy a tensor off its stack."""


def _tf_code_for(exc):
    if isinstance(exc, _tf_errors.OpError):
        return exc.error_code
    if isinstance(exc, (ValueError, TypeError, IndexError, KeyError)):
        return _tf_errors.INVALID_ARGUMENT
    if isinstance(exc, NotImplementedError):
        return _tf_errors.UNIMPLEMENTED
    return _tf_errors.UNKNOWN


def stash_error(exc):
    """Called by the C++ boundary: keeps `exc`, returns (TF code, status message)."""
    with _lock:
        _counter[0] += 1
        key = _counter[0]
        _stash[key] = exc
        while len(_stash) > _MAX_STASHED:
            _stash.popitem(last=False)
    return _tf_code_for(exc), "%s: %s [tf_ophandlers#%d]" % (type(exc).__name__, exc, key)


def original_error(message):
    """Returns the stashed exception a status message refers to, or None."""
    if not message or "tf_ophandlers#" not in message:
        return None
    m = _MARKER.search(message)
    if m is None:
        return None
    with _lock:
        return _stash.pop(int(m.group(1)), None)


def raise_from_code(code, message):
    """Raises the exception for a failed TFE_Execute (used by the C++ boundary)."""
    exc = original_error(message)
    if exc is not None:
        raise exc
    try:
        cls = _tf_errors.exception_type_from_error_code(code)
        raise cls(None, None, message)
    except KeyError:
        raise _tf_errors.UnknownError(None, None, message, code) from None


_installed = False


def install():
    """Wraps TensorFlow's status-to-exception conversion (idempotent)."""
    global _installed
    if _installed:
        return
    original = _tf_core._status_to_exception

    def _status_to_exception(status):
        exc = original_error(getattr(status, "message", None))
        if exc is not None:
            return exc
        return original(status)

    _tf_core._status_to_exception = _status_to_exception

    # TFE_Py_Execute (function calls, slow-path op wrappers) raises the typed OpError
    # itself instead of going through _status_to_exception: map those too.
    from tensorflow.python.eager import execute as _tf_execute  # pylint: disable=import-outside-toplevel

    def _wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except _tf_errors.OpError as e:
                exc = original_error(e.message)
                if exc is None:
                    raise
                raise exc from None
        run.__doc__, run.__name__ = fn.__doc__, fn.__name__
        return run

    quick = _wrap(_tf_execute.quick_execute)
    if _tf_execute.execute is _tf_execute.quick_execute:
        _tf_execute.execute = quick
    _tf_execute.quick_execute = quick
    _tf_execute.execute_with_cancellation = _wrap(_tf_execute.execute_with_cancellation)
    _installed = True


tf_patches.register(
    "status_to_exception",
    "tensorflow.python.eager.core._status_to_exception, "
    "tensorflow.python.eager.execute.quick_execute/execute/execute_with_cancellation",
    "a handler's exception crosses TensorFlow's C API only as a status; these "
    "conversions give the user the original exception object back (type, message, "
    "traceback). TensorFlow has no hook for status-to-exception conversion.",
    "runtime", install, None)
