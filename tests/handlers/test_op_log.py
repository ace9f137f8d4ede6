"""OpLogHandler against plain TensorFlow, including a Keras model."""
import keras
import numpy as np
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close


def test_records_types_shapes_dtypes_and_stack(x):
    log = oh.OpLogHandler()
    ones = tf.ones([2, 3])
    with log:
        y = tf.matmul(x, ones)
        z = tf.cast(tf.reduce_sum(y, axis=0), tf.int64)
    assert [r.op_type for r in log.records] == ["MatMul", "Sum", "Cast"]
    mm = log.records[0]
    assert mm.input_shapes == [tf.TensorShape([2, 2]), tf.TensorShape([2, 3])]
    assert mm.input_dtypes == [tf.float32, tf.float32]
    assert mm.output_shapes == [tf.TensorShape([2, 3])]
    assert log.records[2].output_dtypes == [tf.int64]
    assert all(r.stack == oh.handler_of(y).name for r in log.records)
    assert z.numpy().tolist() == [10, 10, 10]


def test_record_attrs_and_filter(x):
    log = oh.OpLogHandler(record_attrs=True, op_types=["MatMul"])
    with log:
        tf.sin(tf.matmul(x, x, transpose_a=True))
    assert [r.op_type for r in log.records] == ["MatMul"]
    assert log.records[0].attrs["transpose_a"] is True


def test_nested_logs_see_the_same_program(x):
    outer, inner = oh.OpLogHandler(), oh.OpLogHandler()
    with outer:
        with inner:
            y = tf.nn.relu(x - 2.0)
    assert outer.op_types_seen() == inner.op_types_seen() == ["Sub", "Relu"]
    assert inner.records[0].stack != outer.records[0].stack
    assert_close(y, np.maximum(x.numpy() - 2.0, 0.0))


def test_keras_model_under_op_log_matches_plain():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4),
        keras.layers.Softmax(),
    ])
    data = tf.random.stateless_normal([5, 8], seed=[1, 2])
    expected = model(data)
    log = oh.OpLogHandler()
    with log:
        got = model(data)
    assert_close(got, expected, tol=1e-6)
    types = log.op_types_seen()
    assert types.count("MatMul") == 2 and "Relu" in types and "Softmax" in types
    assert got.shape == (5, 4)


def test_keras_cnn_under_op_log_matches_plain():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])
    data = tf.random.stateless_uniform([2, 8, 8, 1], seed=[3, 4])
    expected = model(data)
    log = oh.OpLogHandler()
    with log:
        got = model(data)
    assert_close(got, expected, tol=1e-5)
    assert "Conv2D" in log.op_types_seen() and "MaxPool" in log.op_types_seen()
