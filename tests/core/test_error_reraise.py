"""A tf.errors exception raised by a handler hook reaches the user with its type and
message, whichever hook raised it (execute, the shape and debug-string accessors, copy
off, a function call), and a handler adding its name to an error keeps the class
(`oh`'s core `with_message`).

Found chasing a reported crash, `InternalError.__init__() missing 1 required positional
argument: 'op'`: an accessor's registered class returned the stashed exception from
`__new__`, and Python then ran the exception's `__init__` again with the status message
(the message became the marked status text) or with the exception alone (the TypeError).
"""
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core.errors import with_message

CLASSES = [tf.errors.InvalidArgumentError, tf.errors.InternalError, tf.errors.NotFoundError,
           tf.errors.UnimplementedError, tf.errors.ResourceExhaustedError,
           tf.errors.FailedPreconditionError, tf.errors.UnknownError,
           tf.errors.OutOfRangeError, tf.errors.AbortedError, tf.errors.CancelledError,
           tf.errors.AlreadyExistsError, tf.errors.PermissionDeniedError,
           tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
           tf.errors.DataLossError, tf.errors.UnauthenticatedError]


class _Box:
    def __init__(self, t):
        self.t = t


class RaisingHandler(oh.OpHandler):
    """Boxes tensors (so that TensorFlow asks its accessor hooks) and raises `cls` from
    the hook `where`."""

    def __init__(self, cls, where):
        self.cls, self.where = cls, where

    def _raise(self, where):
        if self.where == where:
            raise self.cls(None, None, "boom in " + where)

    def copy_on(self, tensor):
        return _Box(self.next.copy_on(tensor))

    def copy_off(self, value, device):
        self._raise("copy_off")
        return value.t

    def value_dtype(self, value):
        return value.t.dtype

    def execute(self, op, inputs):
        if op.type == "Sin":
            self._raise("execute")
        return [_Box(o) for o in self.next.execute(op, [b.t for b in inputs])]

    def num_dims(self, value):
        self._raise("num_dims")
        return value.t.shape.rank

    def dim(self, value, index):
        self._raise("dim")
        return value.t.shape[index]

    def tensor_debug_string(self, value):
        self._raise("tensor_debug_string")
        return repr(value.t)


USES = {
    "execute": lambda y: None,
    "num_dims": lambda y: y.shape.rank,
    "dim": lambda y: y.shape[0],
    "tensor_debug_string": repr,
}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("where", sorted(USES) + ["copy_off"])
def test_a_hook_raising_a_tf_error_keeps_its_type_and_message(cls, where):
    with pytest.raises(cls) as info:
        with RaisingHandler(cls, where):
            y = tf.sin(tf.constant([1., 2.]))
            if where in USES:
                USES[where](y)
        y.numpy()
    assert type(info.value) is cls
    assert info.value.message == "boom in " + where
    assert info.value.error_code == cls(None, None, "").error_code


@pytest.mark.parametrize("cls", [tf.errors.InternalError, tf.errors.InvalidArgumentError])
def test_a_hook_error_in_a_called_function_keeps_its_type(cls):
    class Raising(oh.OpHandler):
        def execute(self, op, inputs):
            if op.type == "Sin":
                raise cls(None, None, "boom in a function")
            return self.next.execute(op, inputs)

    f = tf.function(lambda x: tf.sin(x) * 2.)
    with pytest.raises(cls, match="^boom in a function$"):
        with Raising():
            f(tf.constant([1., 2.]))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_instantiating_an_error_class_from_its_instance_returns_it(cls):
    # What CPython may do with the type and the returned instance: it used to raise
    # "TypeError: <cls>.__init__() missing 1 required positional argument: 'op'".
    with oh.OpHandler():  # installs the conversions
        tf.constant(1.) + 1.
    error = cls(None, None, "original")
    assert cls(error) is error
    assert error.message == "original" and type(error) is cls


@pytest.mark.parametrize("error", [c(None, None, "inner") for c in CLASSES] + [
    tf.errors.OpError(None, None, "inner", tf.errors.UNKNOWN), ValueError("inner"),
    KeyError("inner")], ids=lambda e: type(e).__name__)
def test_with_message_keeps_the_class_and_code(error):
    renamed = with_message(error, "oh.Handler: op Foo: inner")
    assert type(renamed) is type(error)
    if isinstance(error, tf.errors.OpError):
        assert renamed.message == "oh.Handler: op Foo: inner"
        assert renamed.error_code == error.error_code
    else:
        assert "oh.Handler: op Foo" in str(renamed)


def test_with_message_of_an_unconstructible_class_is_a_handler_error():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)
    renamed = with_message(Odd(1, 2), "oh.Handler: op Foo")
    assert isinstance(renamed, oh.HandlerError) and "op Foo" in str(renamed)
