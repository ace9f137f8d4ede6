"""A tape *outside* a replaying handler, watching tensors passed to a `tf.function` called
inside the handler's scope (core/functions/call_records.py): `tf.GradientTape` and
`oh.GradientTape`, persistent or not, with a replaying handler between, against plain
TensorFlow's gradients of the same program."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from layout_probe import refused_on_cpu

TAPES = {"tf": tf.GradientTape, "oh": oh.GradientTape}


def assert_close(xs, ys, tol=1e-4, same_kind=True):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x is not None and y is not None
        if same_kind:
            assert isinstance(x, tf.IndexedSlices) == isinstance(y, tf.IndexedSlices), (x, y)
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (x, y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _conv_net(x, w, b, v):
    """NCHW conv, bias, pool and a mean: channels-first kernels the CPU refuses."""
    h = tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")
    h = tf.nn.relu(tf.nn.bias_add(h, b, data_format="NCHW"))
    h = tf.nn.max_pool2d(h, 2, 2, "VALID", data_format="NCHW")
    return h * v, tf.reduce_mean(h, axis=[2, 3])   # one kept channels-last, one not


def _twin(x, w, b, v):
    xl = tf.transpose(x, [0, 2, 3, 1])
    with tf.GradientTape() as tape:
        tape.watch([xl, w, b])
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(xl, w, 1, "SAME"), b))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        y1, y2 = tf.transpose(h, [0, 3, 1, 2]) * v, tf.reduce_mean(h, axis=[1, 2])
        loss = tf.reduce_sum(y1 * y1) + tf.reduce_sum(y2 * tf.range(1., 5.))
    gx, gw, gb, gv = tape.gradient(loss, [xl, w, b, v])
    return [tf.transpose(gx, [0, 3, 1, 2]), gw, gb, gv]


@pytest.fixture(scope="module")
def conv_data():
    x = tf.random.stateless_normal([2, 3, 8, 8], seed=[1, 1])
    w = tf.random.stateless_normal([3, 3, 3, 4], seed=[2, 2])
    b = tf.random.stateless_normal([4], seed=[3, 3])
    return x, w, b


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("between", [False, True], ids=["direct", "log_between"])
@pytest.mark.parametrize("kind", sorted(TAPES))
def test_data_format_function_call_with_tape_outside(conv_data, kind, between, persistent):
    x, w, b = conv_data
    v = tf.Variable(tf.fill([1, 4, 1, 1], 0.5))
    expected = _twin(x, w, b, v)
    fn = tf.function(_conv_net)
    log = oh.OpLogHandler() if between else contextlib.nullcontext()
    with log, TAPES[kind](persistent=persistent) as tape:
        tape.watch([x, w, b])
        with oh.DataFormat():
            y1, y2 = fn(x, w, b, v)
            loss = tf.reduce_sum(y1 * y1) + tf.reduce_sum(y2 * tf.range(1., 5.))
    grads = tape.gradient(loss, [x, w, b, v])
    assert_close(grads, expected)
    if persistent:  # a second pass over the same record gives the same gradients
        assert_close(tape.gradient(loss, [x, w, b, v]), expected)
        assert_close([tape.gradient(y2, w)], [_twin_y2_grad(x, w, b)])


def _twin_y2_grad(x, w, b):
    xl = tf.transpose(x, [0, 2, 3, 1])
    with tf.GradientTape() as tape:
        tape.watch(w)
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(xl, w, 1, "SAME"), b))
        y2 = tf.reduce_mean(tf.nn.max_pool2d(h, 2, 2, "VALID"), axis=[1, 2])
    return tape.gradient(y2, w)


def test_data_format_keras_function_with_tape_outside(conv_data):
    """A channels-first Keras model called in a tf.function, the tape outside watching
    the input: the input gradient equals the channels-last twin's."""
    import keras
    x = conv_data[0]
    keras.utils.set_random_seed(3)
    first = keras.Sequential([keras.Input((3, 8, 8)),
                              keras.layers.Conv2D(4, 3, data_format="channels_first"),
                              keras.layers.MaxPooling2D(data_format="channels_first"),
                              keras.layers.GlobalAveragePooling2D(data_format="channels_first"),
                              keras.layers.Dense(2)])
    last = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                             keras.layers.MaxPooling2D(), keras.layers.GlobalAveragePooling2D(),
                             keras.layers.Dense(2)])
    last.set_weights(first.get_weights())
    xl = tf.transpose(x, [0, 2, 3, 1])
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(xl)
        ref = tf.reduce_sum(last(xl) ** 2)
    ref_grads = ref_tape.gradient(ref, [xl] + last.trainable_variables)
    ref_grads[0] = tf.transpose(ref_grads[0], [0, 3, 1, 2])
    call = tf.function(lambda a: first(a))
    for kind in sorted(TAPES):
        with TAPES[kind]() as tape:
            tape.watch(x)
            with oh.DataFormat():
                loss = tf.reduce_sum(call(x) ** 2)
        assert_close([loss], [ref])
        assert_close(tape.gradient(loss, [x] + first.trainable_variables), ref_grads)


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("between", [False, True], ids=["direct", "log_between"])
def test_vectorized_map_function_call_with_tape_outside(between, persistent):
    """The same pattern with another representation-changing handler: a tf.function
    called per example inside oh.vectorized_map (batched inside the replay), an
    oh.GradientTape outside (a tf.GradientTape does not differentiate through
    oh.vectorized_map at all, eager ops included: the map's result is a copy off)."""
    elems = tf.random.stateless_normal([5, 3], seed=[4, 4])
    w = tf.Variable(tf.random.stateless_normal([3, 2], seed=[5, 5]))
    f = tf.function(lambda e: tf.tanh(tf.linalg.matvec(w, e, transpose_a=True)) * e[0])

    def loss_of(mapper):
        return tf.reduce_sum(mapper(f, elems) ** 2)

    with tf.GradientTape() as ref_tape:
        ref_tape.watch(elems)
        ref = loss_of(tf.vectorized_map)
    ref_grads = ref_tape.gradient(ref, [elems, w])
    with oh.GradientTape(persistent=persistent) as tape:
        tape.watch(elems)
        with oh.OpLogHandler() if between else contextlib.nullcontext():
            loss = loss_of(oh.vectorized_map)
    assert_close([loss], [ref])
    # Known difference: with a replaying handler between the tape and the devices, the
    # gradient of the examples comes back as IndexedSlices (equal values once dense).
    assert_close(tape.gradient(loss, [elems, w]), ref_grads, same_kind=not between)
    if persistent:
        assert_close(tape.gradient(loss, [elems, w]), ref_grads, same_kind=not between)


def test_function_call_without_handlers_after_a_replayed_one(conv_data):
    """The note of a replayed call is consumed by its record: the same function later
    called without handlers under a tape gets TensorFlow's own record (channels-last
    program here, since the CPU refuses NCHW)."""
    x, w, b = conv_data
    f = tf.function(lambda a, k: tf.reduce_sum(tf.nn.conv2d(a, k, 1, "SAME") ** 2))
    xl = tf.transpose(x, [0, 2, 3, 1])
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(xl)
        ref = f(xl, w)
    ref_grad = ref_tape.gradient(ref, xl)
    with tf.GradientTape() as tape:
        tape.watch(xl)
        with oh.OpLogHandler():
            y = f(xl, w)
    assert_close([tape.gradient(y, xl)], [ref_grad])
    with tf.GradientTape() as tape:
        tape.watch(xl)
        y = f(xl, w)
    assert_close([tape.gradient(y, xl)], [ref_grad])


def test_static_value_of_a_symbolic_handler_tensor_during_replay(conv_data):
    """tf.get_static_value of a symbolic tensor of a handler stack while a function is
    replayed asks its handler (core/tensor.py), as it does eagerly: DataFormat's rules
    read the reduction axes, a tensor of the log below it, without a transpose back."""
    x, w, b = conv_data
    f = tf.function(lambda a: tf.reduce_mean(
        tf.nn.conv2d(a, w, 1, "SAME", data_format="NCHW"), axis=tf.constant([2, 3])))
    xl = tf.transpose(x, [0, 2, 3, 1])
    ref = tf.reduce_mean(tf.nn.conv2d(xl, w, 1, "SAME"), axis=[1, 2])
    seen = []

    class Probe(oh.OpHandler):  # below DataFormat: asks the static value of its inputs
        def execute(self, op, inputs):
            if op.type == "Mean":
                seen.append(tf.get_static_value(inputs[1]))
            return self.next.execute(op, inputs)

    with oh.OpLogHandler(), Probe(), oh.DataFormat() as df:
        y = f(x)
    assert_close([y], [ref])
    assert dict(df.fallbacks) == {}
    assert len(seen) == 1 and list(seen[0]) == [1, 2]  # the axes remapped to NHWC


def test_data_format_saved_model_with_tape_outside(conv_data, tmp_path):
    """A channels-first Keras export loaded with tf.saved_model.load, called inside the
    scope, a tape outside watching the input: its gradient equals the twin's."""
    import keras

    def build(fmt):
        keras.utils.set_random_seed(0)
        cf = fmt == "channels_first"
        inp = keras.Input((3, 8, 8) if cf else (8, 8, 3))
        h = keras.layers.Conv2D(4, 3, data_format=fmt)(inp)
        h = keras.layers.MaxPooling2D(data_format=fmt)(h)
        h = keras.layers.GlobalAveragePooling2D(data_format=fmt)(h)
        return keras.Model(inp, keras.layers.Dense(2)(h))

    first, last = build("channels_first"), build("channels_last")
    last.set_weights(first.get_weights())
    first.export(str(tmp_path / "m"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    x = conv_data[0]
    xl = tf.transpose(x, [0, 2, 3, 1])
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(xl)
        ref = tf.reduce_sum(last(xl) ** 2)
    ref_grad = tf.transpose(ref_tape.gradient(ref, xl), [0, 3, 1, 2])
    with refused_on_cpu():
        loaded.serve(x)  # the CPU refuses the channels-first export (without oneDNN)
    for kind in sorted(TAPES):
        with TAPES[kind]() as tape:
            tape.watch(x)
            with oh.DataFormat():
                loss = tf.reduce_sum(loaded.serve(x) ** 2)
        assert_close([loss], [ref])
        assert_close([tape.gradient(loss, x)], [ref_grad])
