"""A handler's `iterator_element` hook: a replayed function's top-level reads of a dataset
iterator argument run eagerly before the call and enter the replay with known shapes
(core/functions/iterator_reads.py); against the same function without handlers."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from conftest import assert_close


class _Shapes(oh.OpHandler):
    """Forwards every op; notes the shapes of MatMul inputs and the ops it is given."""

    changes_computation = False

    def __init__(self, feeds=True):
        self.matmul_shapes, self.types, self.elements = [], [], []
        if not feeds:
            self.iterator_element = None

    def iterator_element(self, value):
        self.elements.append(value.shape.as_list())
        return value

    def execute(self, op, inputs):
        self.types.append(op.type)
        if op.type == "MatMul":
            self.matmul_shapes.append(inputs[0].shape.as_list())
        return self.next.execute(op, inputs)


def _dataset():
    x = np.arange(30, dtype="float32").reshape(10, 3)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 2)).batch(4)  # 4, 4, 2


W = tf.constant(np.linspace(-1, 1, 6, dtype="float32").reshape(3, 2))


@tf.function
def _step(iterator):
    x, y = iterator.get_next()
    return tf.reduce_sum(tf.matmul(x, W)) + tf.reduce_sum(y)


@tf.function
def _two_reads(iterator):
    a, _ = next(iterator)
    b, _ = next(iterator)
    return tf.reduce_sum(a) - tf.reduce_sum(b)


def test_top_level_reads_are_fetched_with_their_shapes_and_give_tensorflows_values():
    want = [float(_step(it)) for it in [iter(_dataset())] for _ in range(3)]
    handler = _Shapes()
    it = iter(_dataset())
    with handler:
        got = [float(_step(it)) for _ in range(3)]
        with pytest.raises(tf.errors.OutOfRangeError):  # the end, as TensorFlow's call
            _step(it)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # The handler saw the batches' shapes (the traced read's are [None, 3]), and the
    # read itself ran eagerly before each call, not inside the replay.
    assert handler.matmul_shapes == [[4, 3], [2, 3]]  # (the 4-row replay is reused)
    assert handler.elements == [[4, 3], [4, 1], [4, 3], [4, 1], [2, 3], [2, 1]]
    assert handler.types.count("IteratorGetNext") == 4  # 3 batches, then the end


def test_without_the_hook_the_read_is_replayed_with_its_traced_shape():
    handler = _Shapes(feeds=False)
    it = iter(_dataset())
    with handler:
        got = float(_step(it))
    assert_close(got, _step(iter(_dataset())))
    assert handler.matmul_shapes == [[None, 3]]


def test_two_reads_in_order_and_reads_in_branches_stay_in_the_body():
    handler = _Shapes()
    it, ref = iter(_dataset()), iter(_dataset())
    with handler:
        got = float(_two_reads(it))
    assert_close(got, _two_reads(ref))
    assert handler.elements == [[4, 3], [4, 1], [4, 3], [4, 1]]

    @tf.function
    def in_branch(iterator, flag):
        return tf.cond(flag, lambda: tf.reduce_sum(iterator.get_next()[0]),
                       lambda: tf.constant(0.))

    handler = _Shapes()
    it, ref = iter(_dataset()), iter(_dataset())
    with handler:
        got = float(in_branch(it, tf.constant(True)))
    assert_close(got, in_branch(ref, tf.constant(True)))
    assert handler.elements == []
