"""Error types and the mapping of handler exceptions through TensorFlow.

A handler's exception raised inside a dispatcher callback cannot cross TensorFlow's C
API as a Python object: only a status (code, message) can. The C++ callback therefore
*stashes* the exception here and puts a marker ``[tf_ophandlers#N]`` into the status
message. TensorFlow's status-to-exception conversion is wrapped (the use
"status_to_exception" of core/tf_patches/) so that when the status reaches Python again,
the user receives the original exception object, with its type, message and traceback.

Where TensorFlow turns a status into an exception in C++ (the shape and summary accessors
of an EagerTensor: `t.shape`, `len(t)`, `repr(t)`, which call a handler's `num_dims`,
`dim` and `tensor_debug_string`), it instantiates a registered exception class
(`tf.errors.UnknownError`, ..., or `_NotOkStatusException`) from the status message and
no Python code of TensorFlow converts it: the patches give those classes a `__new__` that
returns the stashed exception instead, for exceptions of those hooks only (stashed with
`accessor=True`). Python then gives the exception a traceback that starts where the
accessor was called (the hook's own frames are not kept). Exceptions from `execute` and
the copy hooks keep going through the conversions above, which keep their traceback.

The marker is the *last* `[tf_ophandlers#N]` of a message (a handler's own message may
contain marker text), and the message is always valid UTF-8 (an exception whose message
has lone surrogates or whose `__str__` fails is still stashed and found again).
"""
import collections
import re
import threading
import warnings

from tensorflow.python.framework import errors as _tf_errors

from tf_ophandlers.core import tf_patches

_MARKER = re.compile(r"\[tf_ophandlers#(\d+)\]")
_MAX_STASHED = 256  # exceptions whose status TensorFlow dropped must not pile up

_lock = threading.Lock()
_stash = collections.OrderedDict()
_counter = [0]


class HandlerError(RuntimeError):
    """Base class of errors raised by the tf-ophandlers runtime itself.

    Examples:
        >>> issubclass(oh.PlacementError, oh.HandlerError)
        True
    """


class PlacementError(HandlerError, ValueError):
    """An op's inputs live on handler stacks that cannot be combined.

    Examples:
        >>> a, b = oh.OpHandler(), oh.OpHandler()
        >>> with a:
        ...     x = tf.constant(1.0) * 1.0
        >>> with b:
        ...     y = tf.constant(1.0) * 1.0
        >>> try:
        ...     x + y                          # two stacks that do not nest
        ... except oh.PlacementError:
        ...     print("PlacementError")
        PlacementError
    """


class HandlerOutputError(HandlerError, TypeError):
    """A handler returned outputs that do not satisfy the op's OpDef.

    Examples:
        >>> class Wrong(oh.OpHandler):
        ...     def execute(self, op, inputs):
        ...         return []                  # the op has one output
        >>> try:
        ...     with Wrong():
        ...         tf.constant(1.0) + 1.0
        ... except oh.HandlerOutputError:
        ...     print("HandlerOutputError")
        HandlerOutputError
    """


class CopyOffError(HandlerError):
    """A handler refused to copy a tensor off its stack.

    Examples:
        >>> with oh.ShapeInference():
        ...     y = tf.ones([2]) * 2.0
        >>> try:
        ...     y.numpy()                      # no value exists
        ... except oh.CopyOffError:
        ...     print("CopyOffError")
        CopyOffError
    """


def _tf_code_for(exc):
    if isinstance(exc, _tf_errors.OpError):
        return exc.error_code
    if isinstance(exc, (ValueError, TypeError, IndexError, KeyError)):
        return _tf_errors.INVALID_ARGUMENT
    if isinstance(exc, NotImplementedError):
        return _tf_errors.UNIMPLEMENTED
    return _tf_errors.UNKNOWN


def _text(exc):
    """str(exc) as valid UTF-8, whatever its __str__ does."""
    try:
        text = str(exc)
    except BaseException:  # pylint: disable=broad-except
        text = "<%s object: str() failed>" % type(exc).__name__
    if not isinstance(text, str):
        text = "<%s object>" % type(exc).__name__
    # Lone surrogates cannot cross the C API (UTF-8): show them escaped.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def stash_error(exc, accessor=False):
    """Called by the C++ boundary: keeps `exc`, returns (TF code, status message).

    `accessor`: raised by a hook TensorFlow calls from an EagerTensor accessor (num_dims,
    dim, tensor_debug_string). Never fails for any exception object (the message is built
    defensively)."""
    with _lock:
        _counter[0] += 1
        key = _counter[0]
        _stash[key] = (exc, accessor)
        while len(_stash) > _MAX_STASHED:
            _stash.popitem(last=False)
    try:
        code = _tf_code_for(exc)
    except BaseException:  # pylint: disable=broad-except
        code = _tf_errors.UNKNOWN
    return code, "%s: %s [tf_ophandlers#%d]" % (type(exc).__name__, _text(exc), key)


def original_error(message, accessor_only=False):
    """Returns (and forgets) the stashed exception a status message refers to, or None.

    The dispatcher appends its marker last, so the last marker is the one that counts.
    With `accessor_only`, only an exception stashed with `accessor=True` is returned."""
    if not isinstance(message, str) or "tf_ophandlers#" not in message:
        return None
    keys = _MARKER.findall(message)
    if not keys:
        return None
    key = int(keys[-1])
    with _lock:
        entry = _stash.get(key)
        if entry is None or (accessor_only and not entry[1]):
            return None
        del _stash[key]
    return entry[0]


def hook_output_error(stack, hook, op_type, detail):
    """A HandlerOutputError for a hook result the C++ boundary or the dispatcher rejected.

    Names the handler of `stack`, the hook and, when known, the op (`op_type`, a str or
    None). Never fails."""
    try:
        name = stack.handler.debug_string()
    except BaseException:  # pylint: disable=broad-except
        name = "a handler"
    where = (" for op %s" % op_type) if op_type else ""
    return HandlerOutputError("tf_ophandlers: %s.%s returned %s%s" % (name, hook, detail, where))


def invalid_outputs(stack, op, kind, detail):
    """The HandlerOutputError for outputs of `op` that break the execute contract (`kind`
    "count", "dtype" or "type"), eager (the dispatcher's check, cc/boundary/device.cc) or while a
    function is replayed (HandlerStack.execute): one text for both."""
    return HandlerOutputError(
        "tf_ophandlers: %s returned invalid outputs for op %s (%s mismatch: %s; the "
        "OpDef requires dtypes %s)" % (
            stack if stack is not None else "a handler", op.type, kind, detail,
            [d.name for d in (op.output_dtypes or [])]))


def raise_from_code(code, message):
    """Raises the exception for a failed TFE_Execute (used by the C++ boundary)."""
    exc = original_error(message)
    if exc is not None:
        raise _named_by_tensorflow(exc, message)
    try:
        exc = _tf_errors.exception_type_from_error_code(code)(None, None, message)
    except KeyError:
        exc = _tf_errors.UnknownError(None, None, message, code)
    # TensorFlow's own error (a kernel's, the runtime's), raised where a handler's Python
    # ran the op: when it reaches the user through the op the user called, it gets the
    # name TensorFlow gives that op's errors (_named_by_tensorflow).
    exc._oh_unnamed = True  # pylint: disable=protected-access
    raise exc


def _named_by_tensorflow(exc, message):
    """`exc`, the exception stashed under the marker of status `message`. If it is an
    error of TensorFlow's runtime that a handler's Python path passed on (marked by
    `raise_from_code`), it gets what TensorFlow appended to the status after the marker
    (`` [Op:AddV2] name: ``), once: the text the error has when no Python hook is
    between (the C paths pass the status itself), as eager TensorFlow's error."""
    if exc.__dict__.pop("_oh_unnamed", False) and isinstance(exc, _tf_errors.OpError):
        found = None
        for found in _MARKER.finditer(message):
            pass
        suffix = message[found.end():] if found is not None else ""
        if suffix.startswith(" [Op:"):
            exc._message += suffix  # pylint: disable=protected-access
    return exc


def _wrap_status_to_exception(original):
    def _status_to_exception(status):
        message = getattr(status, "message", None)
        exc = original_error(message)
        if exc is not None:
            return _named_by_tensorflow(exc, message)
        return original(status)
    return _status_to_exception


def _wrap_raising(fn):
    """TFE_Py_Execute (function calls, slow-path op wrappers) raises the typed OpError
    itself instead of going through _status_to_exception: `fn` with those mapped too."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _tf_errors.OpError as e:
            exc = original_error(e.message)
            if exc is None:
                raise
            raise _named_by_tensorflow(exc, e.message) from None
    run.__doc__, run.__name__ = fn.__doc__, fn.__name__
    return run


def _recover_on_new(message_index):
    """`wrap` for a registered class's `__new__` (EagerTensor's C++ accessors raise it
    directly from the status: PyErr_SetObject(cls, (None, None, message)) or (message,
    code, payloads)): `cls(...)` returns the stashed exception its message refers to.

    CPython 3.11 keeps the registered class as the exception *type* next to the returned
    instance and may instantiate it again from that instance (`cls(exc)`, a call that
    would otherwise fail with a TypeError): that call returns `exc` as well. `except`
    clauses and pytest match the instance, so the user sees the original exception."""
    def wrap(base_new):
        def __new__(klass, *args, **kwargs):
            if len(args) > message_index:
                exc = original_error(args[message_index], accessor_only=True)
                if exc is not None:
                    return _keep_as_is(exc, klass)
            if len(args) == 1 and not kwargs and isinstance(args[0], BaseException):
                return _keep_as_is(args[0], klass)
            return base_new(klass, *args, **kwargs)
        return staticmethod(__new__)
    return wrap


def _keep_as_is(exc, klass):
    """`exc`, returned from `klass.__new__`. If it is an instance of `klass` (a handler
    hook raised a tf.errors class), Python then runs its `__init__` with the arguments of
    the call: with the status message it replaced the exception's message by the marked
    status text, and with `(exc)` alone (CPython re-instantiating the type) it raised
    ``TypeError: InternalError.__init__() missing 1 required positional argument: 'op'``
    in place of the error. The flag makes that one `__init__` keep the exception as is."""
    if isinstance(exc, klass) and isinstance(exc, _tf_errors.OpError):
        exc._oh_keep_as_is = True  # pylint: disable=protected-access
    return exc


def _skip_reinit(init):
    """A tf.errors class's `__init__` that honours `_keep_as_is`."""
    def __init__(self, *args, **kwargs):
        if self.__dict__.pop("_oh_keep_as_is", False):
            return
        init(self, *args, **kwargs)
    __init__.__doc__, __init__.__name__ = init.__doc__, "__init__"
    return __init__


_USE = "status_to_exception"
tf_patches.subscribe("core._status_to_exception", _USE, _wrap_status_to_exception)
tf_patches.subscribe("execute.quick_execute", _USE, _wrap_raising)
tf_patches.subscribe("execute.execute_with_cancellation", _USE, _wrap_raising)
tf_patches.subscribe("OpError.__new__", _USE, _recover_on_new(2))
tf_patches.subscribe("_NotOkStatusException.__new__", _USE, _recover_on_new(0))
tf_patches.subscribe("tf.errors classes' __init__", _USE, _skip_reinit)


def with_message(error, message):
    """An exception of `error`'s class (a tf.errors class keeps node_def, op and error
    code; the base `tf.errors.OpError` needs its code) with `message`, for a handler that
    adds its name to an error it re-raises. Never fails: an exception class whose
    constructor takes other arguments gives a `HandlerError` with the message."""
    try:
        if type(error) is _tf_errors.OpError:
            return _tf_errors.OpError(error.node_def, error.op, message, error.error_code)
        if isinstance(error, _tf_errors.OpError):
            return type(error)(error.node_def, error.op, message)
        return type(error)(message)
    except Exception:  # pylint: disable=broad-except
        return HandlerError(message)


_warned_causes = set()  # bounded by the handlers' warning kinds times the op registry


def warn_once(cause, message, category=RuntimeWarning, stacklevel=2):
    """Warns `message` the first time `cause` (a hashable naming the kind of problem and
    the op, not the shapes) occurs in this process. A diagnostic that fires on every step
    of a training loop, once per tensor, buries the one line users need; Python's own
    "default" filter repeats it for every distinct message text."""
    if first_time(cause):
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def first_time(cause):
    """Whether `cause` occurs for the first time in this process (`warn_once`'s test, for
    diagnostics reported otherwise than by `warnings`, e.g. a logger's warning)."""
    if cause in _warned_causes:
        return False
    _warned_causes.add(cause)
    return True
