"""RFC placement policy, copies (CopyOn/CopyOff and their gradients), representations."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import RecordingHandler, assert_close


def test_type_based_dispatch_follows_handler_inputs(x):
    seen = []
    with RecordingHandler("h", seen):
        y = tf.sin(x)
    z = y * 3.0 + x  # no scope: runs on y's stack, x is copied on
    assert oh.handler_of(z) is oh.handler_of(y)
    assert seen == [("h", "Sin"), ("h", "Mul"), ("h", "AddV2")]
    assert_close(z, np.sin(x.numpy()) * 3.0 + x.numpy())


def test_unrelated_stacks_are_an_error_naming_both_and_the_op(x):
    with oh.OpLogHandler():
        a = tf.sin(x)
    with RecordingHandler("other", []):
        b = tf.cos(x)
    with pytest.raises(oh.PlacementError) as info:
        tf.add(a, b)
    message = str(info.value)
    assert "AddV2" in message
    assert oh.handler_of(a).name in message and oh.handler_of(b).name in message


def test_related_stacks_run_on_the_larger_one(x):
    seen = []
    outer = RecordingHandler("outer", seen)
    with outer:
        a = tf.sin(x)
        with RecordingHandler("inner", seen):
            b = tf.cos(x)
    seen.clear()
    c = a + b
    assert oh.handler_of(c) is oh.handler_of(b)
    assert seen == [("inner", "AddV2"), ("outer", "AddV2")]
    assert_close(c, np.sin(x.numpy()) + np.cos(x.numpy()))


class Scaled(oh.OpHandler):
    """Represents t by 2*t on the next stack (a linear copy-on); only elementwise adds."""

    def __init__(self):
        self.copies_on = 0
        self.copies_off = 0

    def copy_on(self, tensor):
        self.copies_on += 1
        return tf.multiply(super().copy_on(tensor), 2.0)

    def copy_off(self, value, device):
        self.copies_off += 1
        return tf.multiply(value, 0.5)

    def execute(self, op, inputs):
        if op.type not in ("AddV2", "Sub", "Identity"):
            raise NotImplementedError("Scaled handles only AddV2/Sub/Identity, not %s" % op.type)
        return self.next.execute(op, inputs)


def test_copy_on_and_copy_off_hooks_define_the_representation(x):
    h = Scaled()
    with h:
        y = x + x
    assert h.copies_on == 2
    assert oh.handler_of(y).unwrap(y).numpy().tolist() == (4 * x).numpy().tolist()
    assert_close(y, 2 * x)  # .numpy() copies off through copy_off
    assert h.copies_off == 1
    with tf.device("CPU:0"):
        z = tf.sin(y)  # explicit physical placement copies off
    assert oh.handler_of(z) is None
    assert_close(z, np.sin(2 * x.numpy()))


def test_copy_on_of_an_own_tensor_from_an_earlier_merge_is_direct(x):
    log = oh.OpLogHandler()
    with log:
        y = tf.sin(x)
    first = oh.handler_of(y)
    seen = []
    with RecordingHandler("outer", seen):
        with log:  # a new merge of the same handler
            z = y + 1.0
    assert oh.handler_of(z) is not first
    assert_close(z, np.sin(x.numpy()) + 1.0)
    # y was taken directly (its value moved onto the new next), not copied off `log`.
    assert ("outer", "AddV2") in seen


def test_copy_ops_place_and_remove_tensors(x):
    log = oh.OpLogHandler()
    with log:
        y = oh.copy_on(x)
    assert oh.handler_of(y) is not None
    assert_close(y, x)
    z = oh.copy_off(y, "/job:localhost/replica:0/task:0/device:CPU:0")
    assert oh.handler_of(z) is None
    assert_close(z, x)
    # Outside handlers the copy ops are the identity.
    assert_close(oh.copy_on(x), x)


def test_copy_op_gradients_follow_the_rfc(x):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = oh.copy_on(x) * 3.0
        z = oh.copy_off(x) * 5.0
        with tf.GradientTape() as inner:
            inner.watch(x)
            w = tf.reduce_sum(oh.copy_on(x) ** 2)
        dw = inner.gradient(w, x)
    assert_close(tape.gradient(y, x), 3.0 * np.ones((2, 2)))
    assert_close(tape.gradient(z, x), 5.0 * np.ones((2, 2)))
    assert_close(dw, 2 * x)
    assert_close(tape.gradient(dw, x), 2.0 * np.ones((2, 2)))  # second order through CopyOnGrad


def test_copy_op_gradients_under_a_handler(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        with oh.OpLogHandler():
            y = tf.reduce_sum(oh.copy_on(x) * x)
    assert_close(tape.gradient(y, x), 2 * x)


def test_copy_off_refused_by_handler(x):
    class NoCopyOff(oh.OpHandler):
        def copy_off(self, value, device):
            raise oh.CopyOffError("NoCopyOff cannot copy off; use its unpack op")

    with NoCopyOff():
        y = tf.sin(x)
    with pytest.raises(oh.CopyOffError, match="use its unpack op"):
        y.numpy()
    with pytest.raises(oh.CopyOffError):
        with tf.device("CPU:0"):
            tf.cos(y)
    # The stack is intact: more ops on it still work.
    z = y * 2.0
    assert oh.handler_of(z) is oh.handler_of(y)


class Box:
    """A representation that is not a tensor."""

    def __init__(self, tensor):
        self.tensor = tensor


class Boxing(oh.OpHandler):
    def copy_on(self, tensor):
        return Box(super().copy_on(tensor))

    def copy_off(self, value, device):
        return value.tensor

    def execute(self, op, inputs):
        outs = self.next.execute(op, [b.tensor for b in inputs])
        return [Box(o) for o in outs]

    def value_dtype(self, value):
        return value.tensor.dtype

    def num_dims(self, value):
        return value.tensor.shape.rank

    def dim(self, value, index):
        return value.tensor.shape[index]


def test_non_tensor_representation_uses_shape_and_dtype_hooks(x):
    with Boxing():
        y = tf.matmul(x, tf.ones([2, 3]))
    assert isinstance(oh.handler_of(y).unwrap(y), Box)
    assert y.shape == (2, 3) and y.dtype == tf.float32
    assert_close(y, tf.matmul(x, tf.ones([2, 3])))


def test_needs_copy_hook_receives_raw_inputs(x):
    raw = []

    class Peek(oh.OpHandler):
        def needs_copy(self, op, index):
            return op.type != "Identity"

        def execute(self, op, inputs):
            if op.type == "Identity":
                raw.append(oh.handler_of(inputs[0]))
                return [super().copy_on(inputs[0])]
            return self.next.execute(op, inputs)

    with Peek():
        y = tf.identity(x)
    assert raw == [None]
    assert_close(y, x)


def test_static_value_hook_answers_get_static_value(x):
    class Opaque(oh.OpHandler):
        def copy_off(self, value, device):
            raise oh.CopyOffError("Opaque cannot copy off")

        def static_value(self, value):
            return np.full([2, 2], 7.0, np.float32)

    with Opaque():
        y = tf.sin(x)
    assert tf.get_static_value(y).tolist() == [[7.0, 7.0], [7.0, 7.0]]
    with oh.OpLogHandler():
        z = tf.sin(x)
    assert_close(tf.get_static_value(z), np.sin(x.numpy()))  # default: the value's
    assert tf.get_static_value(x).tolist() == x.numpy().tolist()  # ordinary tensors unchanged
