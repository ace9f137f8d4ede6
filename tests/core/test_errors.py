"""Handler exceptions reach the user unchanged; bad handler outputs are clear errors."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close


class Failing(oh.OpHandler):
    def __init__(self, exc, op_type="Sin"):
        self.exc = exc
        self.op_type = op_type

    def execute(self, op, inputs):
        if op.type == self.op_type:
            raise self.exc
        return self.next.execute(op, inputs)


class MyError(Exception):
    pass


@pytest.mark.parametrize("exc", [KeyError("no Sin here"), ValueError("bad value"),
                                 MyError("custom"), NotImplementedError("later")])
def test_handler_exception_type_and_message_reach_the_user(x, exc):
    with pytest.raises(type(exc)) as info:
        with Failing(exc):
            tf.sin(x)
    assert info.value is exc


def test_exception_from_an_inner_handler_crosses_outer_handlers(x):
    exc = MyError("inner failure")
    with pytest.raises(MyError) as info:
        with oh.OpLogHandler():
            with oh.OpHandler():
                with Failing(exc):
                    tf.sin(x)
    assert info.value is exc
    # The traceback points into the handler that raised.
    assert any(f.name == "execute" for f in __import__("traceback").extract_tb(info.tb))


def test_exception_from_an_outer_handler_crosses_inner_handlers(x):
    exc = MyError("outer failure")
    with pytest.raises(MyError):
        with Failing(exc):
            with oh.OpLogHandler():
                tf.sin(x)


def test_exception_in_type_based_dispatch(x):
    h = Failing(MyError("dispatch"), op_type="Cos")
    with h:
        y = tf.sin(x)
    with pytest.raises(MyError, match="dispatch"):
        tf.cos(y)


def test_state_survives_a_handler_error(x):
    log = oh.OpLogHandler()
    with log:
        y = tf.sin(x)
        with pytest.raises(MyError):
            with Failing(MyError("x")):
                tf.sin(y)
        z = tf.cos(y)
    assert [r.op_type for r in log.records] == ["Sin", "Cos"]
    assert_close(z, np.cos(np.sin(x.numpy())))
    v = tf.Variable(1.0)
    with pytest.raises(MyError):
        with Failing(MyError("assign"), op_type="AssignAddVariableOp"):
            v.assign_add(5.0)
    assert float(v) == 1.0


def test_wrong_output_count_is_a_python_error(x):
    class TooMany(oh.OpHandler):
        def execute(self, op, inputs):
            return list(self.next.execute(op, inputs)) * 2

    with pytest.raises(oh.HandlerOutputError) as info:
        with TooMany():
            tf.sin(x)
    assert "Sin" in str(info.value) and "TooMany" in str(info.value)
    assert "expected 1 outputs, got 2" in str(info.value)


def test_too_few_outputs_is_a_python_error(x):
    class TooFew(oh.OpHandler):
        def execute(self, op, inputs):
            return []

    with pytest.raises(oh.HandlerOutputError, match="expected 2 outputs, got 0"):
        with TooFew():
            tf.unique(tf.constant([1, 2, 1]))


def test_wrong_output_dtype_is_a_python_error(x):
    class WrongDtype(oh.OpHandler):
        def execute(self, op, inputs):
            return [tf.cast(o, tf.int32) for o in self.next.execute(op, inputs)]

    with pytest.raises(oh.HandlerOutputError) as info:
        with WrongDtype():
            tf.sin(x)
    assert "expected float32, got int32" in str(info.value)
    assert "WrongDtype" in str(info.value)


def test_execute_returning_none_is_a_python_error(x):
    class ReturnsNone(oh.OpHandler):
        def execute(self, op, inputs):
            self.next.execute(op, inputs)

    with pytest.raises(oh.HandlerOutputError, match="returned None for op Sin"):
        with ReturnsNone():
            tf.sin(x)


def test_non_tensor_outputs_are_a_python_error(x):
    class ReturnsNumbers(oh.OpHandler):
        def execute(self, op, inputs):
            return [1.0]

    with pytest.raises(oh.HandlerOutputError, match="ReturnsNumbers.*not a tensor"):
        with ReturnsNumbers():
            tf.sin(x)


def test_tensorflow_errors_keep_their_type(x):
    with pytest.raises(tf.errors.InvalidArgumentError):
        with oh.OpLogHandler():
            tf.matmul(x, tf.ones([3, 3]))


def test_handler_exception_from_a_tf_function_call_keeps_its_type():
    # Function calls go through TFE_Py_Execute, which raises typed OpErrors itself.
    class Refuses(oh.OpHandler):
        replays_functions = False  # takes call ops whole

        def execute(self, op, inputs):
            if op.output_dtypes is None:
                raise KeyError("no functions here")
            return self.next.execute(op, inputs)

    f = tf.function(lambda a: a * 2.)
    with pytest.raises(KeyError, match="no functions here"):
        with Refuses():
            f(tf.constant(1.))


def test_handler_exception_while_replaying_a_function_keeps_its_type():
    class RefusesMul(oh.OpHandler):
        def execute(self, op, inputs):
            if op.type == "Mul":
                raise KeyError("no Mul here")
            return self.next.execute(op, inputs)

    f = tf.function(lambda a: tf.sin(a) * 2.)
    with pytest.raises(KeyError, match="no Mul here"):
        with RefusesMul():
            f(tf.constant(1.))
    with RefusesMul():  # the failed replay left no state behind
        assert float(tf.function(lambda a: tf.sin(a) + 2.)(tf.constant(0.))) == 2.0
