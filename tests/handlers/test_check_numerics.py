"""CheckNumericsHandler against plain TensorFlow and tf.debugging.check_numerics."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close


def test_finite_program_is_unchanged(x):
    with oh.CheckNumericsHandler():
        y = tf.math.log(x) * tf.exp(-x)
    assert_close(y, np.log(x.numpy()) * np.exp(-x.numpy()))


def test_inf_raises_naming_op_and_user_line(x):
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        with oh.CheckNumericsHandler():
            tf.math.log(x - 1.0)  # log(0) = -inf
    message = str(info.value)
    assert "op Log" in message and "Inf" in message
    assert "test_check_numerics.py" in message and "test_inf_raises_naming_op" in message


def test_nan_raises(x):
    with pytest.raises(tf.errors.InvalidArgumentError, match="op Sqrt.*NaN"):
        with oh.CheckNumericsHandler():
            tf.sqrt(-x)


def test_integer_outputs_are_not_checked(x):
    with oh.CheckNumericsHandler():
        y = tf.cast(x, tf.int32) // 2
    assert y.numpy().tolist() == [[0, 1], [1, 2]]


def test_skip_list(x):
    with oh.CheckNumericsHandler(op_types_to_skip=["Log"]):
        y = tf.math.log(x - 1.0)
    assert np.isinf(y.numpy()[0, 0])


def test_raises_on_first_bad_op_only(x):
    log = oh.OpLogHandler()
    with pytest.raises(tf.errors.InvalidArgumentError, match="op RealDiv"):
        with log:
            with oh.CheckNumericsHandler():
                a = x / 0.0
                tf.sin(a)  # never reached
    assert "Sin" not in log.op_types_seen()


def test_keras_layer_divergence_is_caught():
    layer = keras.layers.Dense(2, kernel_initializer="ones")
    data = tf.constant([[3e38, 3e38]])  # the sum overflows float32
    with pytest.raises(tf.errors.InvalidArgumentError, match="op (MatMul|BiasAdd|AddV2)"):
        with oh.CheckNumericsHandler():
            layer(data)


class _LogLayer(keras.layers.Layer):
    """A custom layer whose output is NaN (log of a negative number)."""

    def call(self, x):
        return tf.math.log(x - 100.0)


def test_fit_names_the_graph_node_and_the_traced_source_line():
    """Issue 16 item 5: inside model.fit (a replayed tf.function) the error named only
    the op type. It must name the graph node and the user's line recorded when the step
    was traced, as tf.debugging.enable_check_numerics does on the same model."""
    import re  # pylint: disable=import-outside-toplevel
    def make_model():  # the same names in both runs
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="dense"),
                                  _LogLayer(name="nan_log")], name="seq")
        model.compile("sgd", "mse")
        return model

    model = make_model()
    x = np.ones((8, 4), np.float32)
    tf.debugging.enable_check_numerics()
    try:
        with pytest.raises(tf.errors.InvalidArgumentError) as plain:
            model.fit(x, x, epochs=1, batch_size=4, verbose=0)
    finally:
        tf.debugging.disable_check_numerics()
    # TensorFlow's report: the op's input tensor (in the layer's name scope) and the
    # frames of the op's creation, among them this file's line in _LogLayer.call.
    plain_text = str(plain.value)
    scope = re.search(r'Input tensor: Tensor\("(.*/)[^/]*:0"', plain_text).group(1)
    line = re.search(r'File "%s", line (\d+), in call' % re.escape(__file__),
                     plain_text).group(1)
    model = make_model()
    with pytest.raises(tf.errors.InvalidArgumentError) as handled:
        with oh.CheckNumericsHandler():
            model.fit(x, x, epochs=1, batch_size=4, verbose=0)
    message = str(handled.value)
    assert "CheckNumericsHandler: op Log produced NaN" in message, message
    assert "(graph node %sLog of function " % scope in message, message
    assert "%s:%s in call" % (__file__, line) in message, message
    assert "NaN" in message
