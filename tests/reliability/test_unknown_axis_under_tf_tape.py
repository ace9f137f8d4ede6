"""A tensor with an unknown axis length (an oh.ParallelHandler tensor whose components
have different shapes) recorded by TensorFlow's own tape or accumulator: TensorFlow's C++
tape needs every axis length and aborted the process (tensor_shape.cc "Check failed:
size >= 0"). Now a ValueError naming the handler and the op; oh.GradientTape, and no
tape at all, keep working. Runs in a subprocess: before the fix it killed the process.
"""
from python_process import run_python


_SCRIPT = r'''
import numpy as np
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_ophandlers as oh

p = oh.ParallelHandler(["CPU:0", "CPU:1"])
a, b = tf.constant([[1., 2., 3.], [4., 5., 6.]]), tf.constant([[7., 8., 9.]])
with p:
    x = p.pack([a, b])
    assert x.shape.as_list() == [None, 3], x.shape  # no tape: the unknown axis is None
    for tape_type in ("tf.GradientTape", "tf.autodiff.ForwardAccumulator"):
        try:
            if tape_type == "tf.GradientTape":
                with tf.GradientTape() as t:
                    t.watch(x)
                    y = tf.reduce_sum(x * 2.)
            else:
                with tf.autodiff.ForwardAccumulator(x, p.pack([tf.ones([2, 3]), tf.ones([1, 3])])):
                    y = tf.reduce_sum(x * 2.)
        except ValueError as e:
            msg = str(e)
            assert "ParallelHandler" in msg and "op Mul" in msg and "axis 0" in msg, msg
            assert "oh.GradientTape" in msg, msg
            print("REFUSED", tape_type)
        else:
            raise AssertionError("%s recorded a tensor of unknown axis length" % tape_type)
    # State is intact: the same program runs under oh.GradientTape, per component as
    # TensorFlow gives it on each component alone.
    with oh.GradientTape() as t:
        t.watch(x)
        y = tf.reduce_sum(x * x)
    got = [c.numpy() for c in p.unpack(t.gradient(y, x))]
for g, c in zip(got, (a, b)):
    with tf.GradientTape() as t:
        t.watch(c)
        y = tf.reduce_sum(c * c)
    np.testing.assert_allclose(g, t.gradient(y, c).numpy())
print("OK")
'''


def test_tf_tape_on_an_unknown_axis_is_an_error_not_an_abort():
    stdout = run_python(_SCRIPT, timeout=300)
    lines = stdout.split()
    assert lines.count("REFUSED") == 2 and lines[-1] == "OK", stdout
