"""Hooks set on a handler instance (`h.execute = ...`, `h.copy_on = ...`) are called:
the stack's fields (core/stack.py) marked them "default" from the class's hooks, so
the C++ path forwarded ops without the instance's execute and moved inputs without its
copy_on, silently. Results are compared with TensorFlow."""
import numpy as np
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core.stack import next_stack


def test_an_instance_execute_is_called():
    c = tf.constant([1.0, 2.0])
    for _ in range(3):  # (fresh handlers: the stack templates and shared decisions)
        h = oh.OpHandler()
        seen = []

        def execute(op, inputs, seen=seen):
            seen.append(op.type)
            return next_stack().execute(op, inputs)
        h.execute = execute
        with h:
            y = tf.sin(c) * 2.0
        assert seen == ["Sin", "Mul"]
        np.testing.assert_allclose(y.numpy(), (tf.sin(c) * 2.0).numpy(), rtol=1e-6)
        with oh.OpHandler():  # a plain one between them keeps the default
            z = tf.sin(c)
        assert seen == ["Sin", "Mul"]
        np.testing.assert_allclose(z.numpy(), tf.sin(c).numpy(), rtol=1e-6)


def test_an_instance_copy_on_is_called():
    c = tf.constant([1.0, 2.0])
    for _ in range(3):
        h = oh.OpHandler()
        copied = []

        def copy_on(tensor, h=h, copied=copied):
            copied.append(tensor.dtype)
            return oh.OpHandler.copy_on(h, tensor)
        h.copy_on = copy_on
        with h:
            y = tf.sin(c)
        assert copied == [tf.float32]
        np.testing.assert_allclose(y.numpy(), tf.sin(c).numpy(), rtol=1e-6)
