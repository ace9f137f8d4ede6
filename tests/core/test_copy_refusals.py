"""A CopyOffError refusing a copy off a handler stack: the stack above re-runs the copy
as an op on the next stack only for that stack's *own* refusal (a handler that keeps
values below, per example, and takes copy ops: vectorized_map). A refusal from further
down propagates, after each copy_off hook on the way ran once (it ran twice: a hook's
side effects, a counter or a log, were repeated)."""
import pytest
import tensorflow as tf

import tf_ophandlers as oh


class _Refuses(oh.OpHandler):
    def copy_off(self, value, device):
        raise oh.CopyOffError("_Refuses: this value stays here")


class _Counts(oh.OpHandler):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def copy_off(self, value, device):
        self.calls.append("copy_off")
        return value


class _TakesCopies(oh.OpHandler):
    def __init__(self, calls=None):
        super().__init__()
        self.calls = calls

    def handles_copy(self, op):  # pylint: disable=unused-argument
        return True

    def copy_off(self, value, device):
        if self.calls is not None:
            self.calls.append("refused")
            raise oh.CopyOffError("_TakesCopies: kept per example")
        return value

    def execute(self, op, inputs):
        if self.calls is not None and op.type == "CopyOff":
            self.calls.append("copy op")
            return [tf.identity(inputs[0])]  # on the next stack: copied off from there
        return super().execute(op, inputs)


def test_refusal_below_runs_each_copy_off_hook_once():
    calls = []
    with _Refuses(), _Counts(calls), _TakesCopies(), oh.OpHandler():
        x = tf.constant([1.0, 2.0]) * 2.0
        with pytest.raises(oh.CopyOffError, match="_Refuses"):
            oh.copy_off(x)
    assert calls == ["copy_off"]


def test_next_stacks_own_refusal_runs_the_copy_op_there():
    calls = []
    with _Counts(calls), _TakesCopies(calls), oh.OpHandler():
        x = tf.constant([1.0, 2.0]) * 2.0
        y = oh.copy_off(x)
    assert calls == ["refused", "copy op"]  # the value stays on _TakesCopies' stack
    assert oh.stack_of(y) is not None
