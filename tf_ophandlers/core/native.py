"""Handlers written in C or C++ against the public C ABI (cc/include/tf_ophandlers/handler.h).

`load_handler_library(path)` loads a compiled handler library (like
`tf.load_op_library`) and returns a `HandlerLibrary`; `handler_types()` maps each
registered type name to a Python class, a subclass of `NativeHandler` (and so of
`OpHandler`). An instance is a handler like any other: `with` scopes, nesting with
Python handlers in either order, function replay, `oh.testing.check_handler`.

Where the C hooks are called from (cc/native/native.h): an eager op placed by a scope on the
native handler's stack, with its inputs already there (or physical tensors it takes as
they are), runs from the dispatcher's C++ callback without any Python frame; every other
op reaches `NativeHandler.execute` through the stack like a Python hook, which calls the
same C hook.
"""
import os

import tf_ophandlers._C as _C
from tf_ophandlers.core import errors
from tf_ophandlers.core.cache import BoundedCache
from tf_ophandlers.core.handler import OpHandler
from tf_ophandlers.core.stack import PHYSICAL, move_onto
from tf_ophandlers.core.state import state

# What the C++ execute path reads (the per-thread state and the bottom stack). Only
# references are stored: this starts nothing.
_C.native_setup(state, PHYSICAL)


def _frame():
    """The stack whose hook is running (call_hook pushed it)."""
    return state.frames[-1]


def _plain(value):
    """The tensor of the next stack a representation is: a `_C.NativeValue` (a value with
    handler data, ABI version 3 `tensor_set_data`) carries it as `.tensor`."""
    return value.tensor if type(value) is _C.NativeValue else value


class NativeHandler(OpHandler, _C.NativeHandlerBase):
    """Base of the classes `HandlerLibrary.handler_types()` returns.

    ``cls(config="")`` creates a handler state with the type's `create` hook; the state
    is deleted (`delete_state`) when the handler and all its tensors are gone. Its
    representation of a tensor is a tensor of the next stack, so it is transparent
    (tensors show their physical device).

    Examples:
        >>> with oh.native.PassThrough():
        ...     y = tf.constant([1.0, 2.0]) * 2.0
        >>> isinstance(oh.handler_of(y).handler, oh.NativeHandler), y.numpy().tolist()
        (True, [2.0, 4.0])
    """

    transparent = True
    _oh_type = None  # the type's capsule, set on each generated class
    _oh_hooks = {}

    def __init__(self, config=""):
        if self._oh_type is None:
            raise TypeError("NativeHandler is abstract: use a class from "
                            "load_handler_library(path).handler_types()")
        if not isinstance(config, str):
            raise TypeError("%s(config) takes a str, not %s"
                            % (type(self).__name__, type(config).__name__))
        self._oh_native_init(self._oh_type, config)

    def debug_string(self):
        return self._oh_debug_string()

    def execute(self, op, inputs):
        frame = _frame()
        return self._oh_execute(frame, frame.next, op, inputs)

    def num_dims(self, value):
        rank = self._oh_shape(value)
        return super().num_dims(value) if rank is None else rank

    def dim(self, value, index):
        length = self._oh_shape(value, index)
        return super().dim(value, index) if length is None else length

    def tensor_debug_string(self, value):
        text = self._oh_value_text(0, value)
        if text is None:
            return super().tensor_debug_string(_plain(value))
        return text.decode("utf-8", "backslashreplace")

    def copy_off(self, value, device):
        return _plain(value)  # handler data does not leave the handler

    def static_value(self, value):
        return super().static_value(_plain(value))


def _copy_on(self, tensor):
    frame = _frame()
    return self._oh_copy(0, frame, frame.next, move_onto(self, frame.next, tensor))


def _copy_off(self, value, device):
    frame = _frame()
    return _plain(self._oh_copy(1, frame, frame.next, value, device or ""))


def _function_input(self, value):
    return self._oh_value_text(1, value), [_plain(value)]


def _function_output(self, summary, tensors):
    (tensor,) = tensors
    return self._oh_function_output(summary or b"", tensor)


def _function_cache_key(self):
    return ("tf_ophandlers.native", type(self).__name__, self._oh_cache_key())


def _static_value(self, value):
    result = self._oh_static_value(value)
    if result is None or result is NotImplemented:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None and not shape.is_compatible_with(result.shape):
        raise errors.HandlerOutputError(
            "tf_ophandlers: %s.static_value returned a value of shape %s for a tensor of "
            "shape %s" % (self.debug_string(), result.shape, shape))
    return result.numpy()


class HandlerLibrary:
    """A loaded handler library: `handler_types()` -> {name: class}.

    Examples:
        >>> lib = oh.native.library()
        >>> issubclass(lib.handler_types()["PassThrough"], oh.NativeHandler)
        True
    """

    def __init__(self, path, types):
        self.path = path
        self._types = types

    def handler_types(self):
        """The handler classes the library registered, by name."""
        return dict(self._types)

    def __getattr__(self, name):
        types = self.__dict__.get("_types", {})
        if name in types:
            return types[name]
        raise AttributeError("handler library %s has no handler type %r (it has %s)"
                             % (self.__dict__.get("path"), name, sorted(types)))

    def __repr__(self):
        return "<HandlerLibrary %s: %s>" % (self.path, ", ".join(sorted(self._types)))


def _handles_ops(self):
    """The type's executes_op hook as `handles_ops` (op_type -> bool)."""
    return self._oh_executes_op


def _make_class(name, doc, capsule, hooks):
    namespace = {
        "__doc__": doc or "Handler type %s from a handler library." % name,
        "__module__": "tf_ophandlers.native_library",
        "_oh_type": capsule,
        "_oh_hooks": dict(hooks),
        "TYPE_NAME": name.upper(),
    }
    # Hooks the type leaves out keep OpHandler's defaults, so the stacks keep their fast
    # paths (a default copy_on needs no hook frame).
    if not hooks.get("execute", True):  # ABI version 4: executes no op (forwards all)
        namespace["execute"] = OpHandler.execute
    elif hooks.get("executes_op"):  # ABI version 4: executes only the ops it names
        namespace["handles_ops"] = property(_handles_ops)
    if hooks.get("copy_on"):
        namespace["copy_on"] = _copy_on
    if hooks.get("copy_off"):
        namespace["copy_off"] = _copy_off
    if hooks.get("function_input_summary") or hooks.get("function_output"):
        namespace["function_input"] = _function_input
    if hooks.get("function_output"):  # ABI version 3
        namespace["function_output"] = _function_output
    if hooks.get("static_value"):  # ABI version 2
        namespace["static_value"] = _static_value
    if hooks.get("function_cache_key"):  # ABI version 3
        namespace["function_cache_key"] = _function_cache_key
    return type(name, (NativeHandler,), namespace)


_libraries = BoundedCache("native.libraries", 256)  # realpath -> HandlerLibrary


def load_handler_library(path):
    """Loads the handler library at `path` (a shared library exporting
    ``TFOH_InitHandlerLibrary``) once per process and returns its `HandlerLibrary`.
    Raises OSError when it cannot be loaded or is not a handler library, and
    RuntimeError with the library's message when its registration fails.

    Examples:
        >>> import glob, os
        >>> path = glob.glob(os.path.join(os.path.dirname(oh.__file__), "_native_handlers*.so"))[0]
        >>> lib = oh.load_handler_library(path)
        >>> sorted(lib.handler_types())[:2]
        ['OpCounter', 'PassThrough']
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise OSError("tf_ophandlers: handler library %s does not exist" % path)
    key = os.path.realpath(path)
    library = _libraries.get(key)
    if library is None:
        types = {name: _make_class(name, doc, capsule, hooks)
                 for name, doc, capsule, hooks in _C.load_handler_library(key)}
        library = _libraries[key] = HandlerLibrary(path, types)
    return library


def query(handler, key):
    """`handler.query(key)` of a native handler, with a clear error for others."""
    if not isinstance(handler, NativeHandler):
        raise errors.HandlerError("%r is not a native handler" % (handler,))
    return handler.query(key)
