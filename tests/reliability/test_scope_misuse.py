"""Scope misuse: each scope closes exactly itself or
raises a clear error and leaves the scopes as they were; tf.py_function under a
pass-through handler runs its body below the handler."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core.state import state
from python_process import run_python


class RaisesOnEnter(oh.OpHandler):
    def scope_entered(self):
        raise KeyError("no entry")


def test_scope_entered_that_raises_leaves_no_scope_open():
    h = RaisesOnEnter()
    with pytest.raises(KeyError, match="no entry"):
        with h:
            pass
    assert state.current is oh.PHYSICAL and not state.scopes
    assert oh.handler_of(tf.constant(1.0) * 2.0) is None


def test_scope_entered_raising_in_a_nest_closes_only_what_it_opened():
    log, seen = oh.OpLogHandler(), []

    class Hears(oh.OpHandler):
        def scope_exited(self):
            seen.append("exited")

    with log:
        with pytest.raises(KeyError):
            with _Nest(Hears(), RaisesOnEnter()):
                pass
        assert state.current.handler is log
        tf.constant(1.0) * 2.0
    assert seen == ["exited"]
    assert [r.op_type for r in log.records] == ["Mul"]


class _Nest:
    """Opens two handlers in one scope (a stack re-entered): the second one refuses."""

    def __init__(self, a, b):
        self.handlers = (a, b)

    def __enter__(self):
        stack = oh.current_stack()
        from tf_ophandlers.core.stack import HandlerStack
        s = stack
        for h in self.handlers:
            s = HandlerStack.merged(h, s)
        self._scope = oh.handler(s)
        return self._scope.__enter__()

    def __exit__(self, *exc):
        return self._scope.__exit__(*exc)


def test_second_tape_exit_is_tolerated_and_keeps_the_outer_scope():
    log = oh.OpLogHandler()
    x = tf.constant(3.0)
    with log:
        tape = oh.GradientTape()
        tape.__enter__()
        tape.watch(x)
        y = x * x
        tape.__exit__(None, None, None)
        tape.__exit__(None, None, None)  # tf.GradientTape tolerates this too
        assert state.current.handler is log
        tf.constant(1.0) + 1.0
    assert float(tape.gradient(y, x)) == 6.0
    assert state.current is oh.PHYSICAL
    assert "AddV2" in [r.op_type for r in log.records]


def test_exit_twice_or_without_enter_raises_and_changes_nothing():
    log, h = oh.OpLogHandler(), oh.OpHandler()
    with pytest.raises(oh.HandlerError, match="not open"):
        h.__exit__(None, None, None)
    with log:
        h.__enter__()
        h.__exit__(None, None, None)
        with pytest.raises(oh.HandlerError, match="not open"):
            h.__exit__(None, None, None)
        assert state.current.handler is log
    assert state.current is oh.PHYSICAL


def test_out_of_order_exit_raises_and_changes_nothing():
    a, b = oh.OpLogHandler(), oh.OpHandler()
    a.__enter__()
    b.__enter__()
    try:
        with pytest.raises(oh.HandlerError, match="reverse order"):
            a.__exit__(None, None, None)
        assert state.current.handler is b
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
    assert state.current is oh.PHYSICAL


def test_handler_closing_its_scope_inside_execute_raises():
    class ClosesItself(oh.OpHandler):
        def execute(self, op, inputs):
            self.__exit__(None, None, None)
            return self.next.execute(op, inputs)

    h = ClosesItself()
    with pytest.raises(oh.HandlerError, match="cannot be closed inside"):
        with h:
            tf.constant(1.0) * 2.0
    assert state.current is oh.PHYSICAL and not state.scopes and not state.frames


PY_FUNCTION = """
import numpy as np, tensorflow as tf, tf_ophandlers as oh
class CopyOnly(oh.OpHandler):
    def copy_off(self, value, device):
        return value
for make in (oh.OpHandler, CopyOnly):
    with make():
        for i in range(30):
            y = tf.py_function(lambda a: a * 2.0, [tf.constant([1.0, float(i)])], tf.float32)
            z = tf.numpy_function(lambda a: a + 1.0, [tf.constant([1.0, 2.0])], tf.float32)
    np.testing.assert_allclose(y.numpy(), [2.0, 58.0])
    np.testing.assert_allclose(z.numpy(), [2.0, 3.0])
print("ok")
"""


def test_py_function_under_pass_through_handler_does_not_crash():
    assert run_python(PY_FUNCTION, timeout=240).strip() == "ok"


def test_py_function_body_runs_below_the_handler():
    log = oh.OpLogHandler()
    with log:
        y = tf.py_function(lambda a: tf.sin(a), [tf.constant([1.0])], tf.float32)
    np.testing.assert_allclose(y.numpy(), np.sin([1.0]), rtol=1e-6)
    assert "Sin" not in [r.op_type for r in log.records]  # the body is not the handler's


def test_scope_entered_that_opens_a_scope_and_raises_leaves_nothing_open():
    inner = oh.OpLogHandler()

    class OpensThenRaises(oh.OpHandler):
        def scope_entered(self):
            inner.__enter__()  # left open by the failing hook
            raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        with OpensThenRaises():
            pass
    assert state.current is oh.PHYSICAL and not state.scopes
    assert oh.handler_of(tf.constant(1.0) * 2.0) is None
