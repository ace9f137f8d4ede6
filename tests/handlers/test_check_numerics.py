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
    """Inside model.fit (a replayed tf.function) the error named only
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


# -- complex and float8 outputs ---------------------------------------------------

from tensorflow.python.framework import dtypes as _dtypes  # noqa: E402

_FLOAT8 = [_dtypes.float8_e4m3fn, _dtypes.float8_e5m2]


@pytest.mark.parametrize("dtype", [tf.complex64, tf.complex128])
def test_finite_complex_outputs_pass_unchanged(dtype):
    # Before: "Value for attr 'T' of complex64 is not in the list of allowed values".
    signal = tf.cast(tf.constant([1., 2., 3., 4.]), dtype)
    want = tf.signal.ifft(tf.signal.fft(signal) * 2.)
    with oh.CheckNumericsHandler():
        got = tf.signal.ifft(tf.signal.fft(signal) * 2.)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy())


@pytest.mark.parametrize("bad, kind", [(complex(float("nan"), 1.), "NaN"),
                                       (complex(1., float("nan")), "NaN"),
                                       (complex(1., float("inf")), "Inf")])
def test_nan_or_inf_in_a_complex_part_is_caught(bad, kind):
    values = tf.constant([1 + 1j, bad], tf.complex64)
    # Plain TensorFlow's check, on the parts, finds it too.
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.debugging.check_numerics(tf.stack([tf.math.real(values), tf.math.imag(values)]), "")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"op AddV2 produced %s in output 0 \(complex64\)" % kind):
        with oh.CheckNumericsHandler():
            values + tf.constant(2 + 0j, tf.complex64)


@pytest.mark.parametrize("dtype", _FLOAT8)
def test_float8_outputs_are_checked_as_float32(dtype):
    x = tf.constant([0.5, 1., -2.])
    want = tf.cast(tf.cast(x, dtype), tf.float32)
    with oh.CheckNumericsHandler():
        eight = tf.cast(x, dtype)
        got = tf.cast(eight, tf.float32)
    assert eight.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"op Cast produced NaN in output 0 \(%s\)" % dtype.name):
        with oh.CheckNumericsHandler():
            tf.cast(tf.constant([1., float("nan")]), dtype)


def test_outputs_the_kernel_cannot_check_are_left_alone():
    with oh.CheckNumericsHandler():
        s = tf.strings.as_string(tf.constant([1, 2]))
        b = tf.constant([1., 2.]) > 1.
        q = tf.cast(tf.constant([1, 2]), tf.uint8) + 1
    assert s.numpy().tolist() == [b"1", b"2"] and b.numpy().tolist() == [False, True]
    assert q.dtype == tf.uint8 and q.numpy().tolist() == [2, 3]


def test_replayed_function_with_complex_and_float8_outputs():
    """A replayed tf.function checks complex and float8 outputs as eagerly (the
    replay branch built CheckNumericsV2 on complex64 and failed)."""
    f = tf.function(lambda x: (tf.complex(x, x * 2.), tf.cast(x, _FLOAT8[0])))
    x = tf.constant([1.0, 2.0])
    want = f(x)
    with oh.CheckNumericsHandler():
        got = f(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(tf.cast(g, tf.complex64).numpy(),
                                      tf.cast(w, tf.complex64).numpy())
    bad = tf.function(lambda x: tf.complex(x, tf.math.log(x - 5.)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="op Log produced"):
        with oh.CheckNumericsHandler():
            bad(x)
