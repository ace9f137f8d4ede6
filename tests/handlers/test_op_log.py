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


def _fit(n_examples, log=None):
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.linspace(-1., 1., n_examples * 4, dtype=np.float32).reshape(n_examples, 4)
    y = np.ones((n_examples, 1), np.float32)
    if log is None:
        return model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"]
    with log:
        return model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"]


_STEP_OPS = ("MatMul", "BiasAdd", "BiasAddGrad")  # ops only the train step runs


def test_every_call_records_each_step_of_fit():
    """Around model.fit the step's ops were recorded once per replay.
    OpLogHandler(every_call=True) records them at every step; the default still records
    them once, as TensorFlow's op callbacks see the traced step once."""
    from tensorflow.python.framework import op_callbacks  # pylint: disable=import-outside-toplevel
    traced = []

    def callback(op_type, *args, **kwargs):  # pylint: disable=unused-argument
        op_type = op_type.decode() if isinstance(op_type, bytes) else op_type
        if op_type in _STEP_OPS:
            traced.append(op_type)

    op_callbacks.add_op_callback(callback)
    try:
        plain = _fit(12)  # 3 steps, the step traced once
    finally:
        op_callbacks.remove_op_callback(callback)
    per_step = sorted(traced)
    assert per_step and "MatMul" in per_step

    once, every = oh.OpLogHandler(op_types=_STEP_OPS), oh.OpLogHandler(
        op_types=_STEP_OPS, every_call=True)
    assert_close(_fit(12, once), plain)
    assert_close(_fit(12, every), plain)
    assert sorted(once.op_types_seen()) == per_step
    assert sorted(every.op_types_seen()) == sorted(per_step * 3)
    one_step = oh.OpLogHandler(op_types=_STEP_OPS, every_call=True)
    _fit(4, one_step)
    assert len(every.records) == 3 * len(one_step.records)
    assert every.records[0].output_dtypes == [tf.float32]


def test_every_call_eagerly_and_in_loops():
    """Eagerly every_call records like the default; in a replayed tf.while_loop body it
    records each iteration (the replay's probe trace of the body adds nothing)."""
    eager = oh.OpLogHandler(every_call=True)
    with eager:
        tf.sin(tf.constant([1.0]))
    assert eager.op_types_seen() == ["Sin"]

    @tf.function
    def f(x):
        return tf.while_loop(lambda i, v: i < 4, lambda i, v: (i + 1, tf.sin(v)), (0, x))[1]

    x = tf.constant([0.5])
    log = oh.OpLogHandler(op_types=["Sin"], every_call=True)
    with log:
        y1 = f(x)
        y2 = f(x)
    assert_close(y1, f(x))
    assert_close(y2, f(x))
    assert log.op_types_seen() == ["Sin"] * 8


def test_at_every_call_runs_per_call_and_only_for_the_branch_taken():
    """The general mechanism (oh.per_call, core/functions/per_call.py) for a handler author: a Python counter
    updated at every call of a replayed function, per branch actually taken."""
    per_call = oh.per_call

    class CountOps(oh.OpHandler):
        def __init__(self):
            self.counts = {}
            self.replayed = []

        def _add(self, op_types):
            for t in op_types:
                self.counts[t] = self.counts.get(t, 0) + 1

        def execute(self, op, inputs):
            outputs = self.next.execute(op, inputs)
            self.replayed.append(per_call.replaying())
            if op.type in ("Sin", "Cos"):
                per_call.at_every_call(self, op.type, self._add)
            return outputs

    @tf.function
    def f(x, p):
        return tf.cond(p, lambda: tf.sin(x), lambda: tf.cos(x))

    x = tf.constant([0.5])
    counter = CountOps()
    with counter:
        results = [f(x, tf.constant(p)) for p in (True, True, False, True)]
    for r, p in zip(results, (True, True, False, True)):
        assert_close(r, f(x, tf.constant(p)))
    assert counter.counts == {"Sin": 3, "Cos": 1}
    assert any(counter.replayed)
    with counter:
        tf.sin(x)  # eagerly: at once
    assert counter.counts == {"Sin": 4, "Cos": 1}
    assert not counter.replayed[-1]
