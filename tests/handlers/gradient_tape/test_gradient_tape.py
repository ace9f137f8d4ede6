"""oh.GradientTape against tf.GradientTape, op by op and on Keras models."""
import contextlib
import gc
import logging
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close, assert_same_tensors, tf_leak_checked

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same data whatever ran before it (another order, -k, one
    test alone): the module's generator starts afresh for each test."""
    global RNG  # pylint: disable=global-statement
    RNG = np.random.default_rng(0)


def _rand(*shape, positive=False):
    v = RNG.standard_normal(shape).astype(np.float32)
    return tf.constant(np.abs(v) + 0.5 if positive else v)


def _both(fn, *args):
    """Value and gradients of sum(fn(*args)) under tf.GradientTape and oh.GradientTape."""
    out = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            tape.watch(args)
            y = fn(*args)
        out.append((y, tape.gradient(y, args)))
    return out


# -- op by op (micrograd style: a trusted reference on every op) ---------------------------

OPS = {
    "sin_cos": (lambda a: tf.sin(a) * tf.cos(a), [(3, 4)]),
    "exp_log": (lambda a: tf.exp(a) + tf.math.log(a), [(3, 4, "+")]),
    "tanh_sigmoid_relu": (lambda a: tf.tanh(a) * tf.sigmoid(a) + tf.nn.relu(a), [(5,)]),
    "pow_sqrt_div": (lambda a, b: a ** 3 / tf.sqrt(b) - b ** 0.5, [(4,), (4, "+")]),
    "matmul": (lambda a, b: tf.matmul(a, b, transpose_b=True), [(3, 4), (5, 4)]),
    "batch_matmul_einsum": (lambda a, b: tf.einsum("bij,bjk->bik", a, b), [(2, 3, 4), (2, 4, 5)]),
    "broadcast_add_mul": (lambda a, b: (a + b) * b, [(3, 1), (1, 4)]),
    "reductions": (lambda a: tf.reduce_sum(a, 0) + tf.reduce_mean(a, 0) + tf.reduce_max(a, 0)
                   + tf.reduce_logsumexp(a, 0) + tf.reduce_prod(a, 0), [(4, 3)]),
    "softmax_xent": (lambda a: tf.nn.softmax_cross_entropy_with_logits(
        tf.one_hot([0, 2, 1], 3), a), [(3, 3)]),
    "sparse_xent": (lambda a: tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.constant([0, 2, 1]), a), [(3, 3)]),
    "reshape_transpose_concat": (lambda a, b: tf.concat(
        [tf.transpose(tf.reshape(a, [2, 6])), b], axis=1), [(3, 4), (6, 2)]),
    "slice_gather_split": (lambda a: tf.gather(a, [2, 0, 2])[:, 1:] + sum(tf.split(a, 2, 1)
                                                                          )[:3, :1], [(4, 4)]),
    "where_maximum_clip": (lambda a, b: tf.where(a > 0, a, b) + tf.maximum(a, b)
                           + tf.clip_by_value(a, -0.5, 0.5), [(6,), (6,)]),
    "cumsum_tile_pad": (lambda a: tf.pad(tf.tile(tf.cumsum(a, 1), [2, 1]), [[1, 0], [0, 2]]),
                        [(2, 3)]),
    "conv2d_pool": (lambda a, k: tf.nn.max_pool2d(tf.nn.conv2d(a, k, 1, "SAME"), 2, 2, "VALID")
                    + tf.nn.avg_pool2d(tf.nn.conv2d(a, k, 1, "SAME"), 2, 2, "VALID"),
                    [(1, 6, 6, 2), (3, 3, 2, 3)]),
    "linalg": (lambda a: tf.linalg.inv(a @ tf.transpose(a) + 3. * tf.eye(3))
               + tf.linalg.cholesky(a @ tf.transpose(a) + 3. * tf.eye(3)), [(3, 3)]),
    "norms_and_moments": (lambda a: tf.norm(a) + tf.nn.moments(a, [0])[1] + tf.nn.l2_normalize(a),
                          [(4, 3)]),
    "float64": (lambda a: tf.sin(tf.cast(a, tf.float64)) ** 2, [(3,)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradients_equal_tf_gradient_tape(name):
    fn, shapes = OPS[name]
    args = tuple(_rand(*s[:-1], positive=True) if s and s[-1] == "+" else _rand(*s)
                 for s in shapes)
    (ref_y, ref_g), (y, g) = _both(fn, *args)
    assert y.dtype == ref_y.dtype and y.shape == ref_y.shape
    assert_close(y, ref_y, 1e-5)
    assert_same_tensors(ref_g, g)


@tf_leak_checked(warmup=1)
def test_complex_dtype():
    z = tf.complex(_rand(3), _rand(3))
    (_, ref), (_, got) = _both(lambda a: tf.abs(a * tf.math.conj(a) + a), z)
    assert_same_tensors(ref, got)


# -- the tf.GradientTape API ---------------------------------------------------------------

@tf_leak_checked(warmup=1)
def test_watch_nested_targets_sources_and_output_gradients():
    a, b = _rand(3), _rand(3)
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            tape.watch({"a": a, "b": [b]})
            targets = {"p": a * b, "q": [tf.sin(a)]}
        results.append(tape.gradient(targets, {"a": a, "b": [b]},
                                     output_gradients={"p": tf.ones(3) * 2., "q": [tf.constant([1., -1., 3.])]}))
    ref, got = results
    assert set(got) == {"a", "b"} and isinstance(got["b"], list)
    assert_same_tensors([ref["a"], ref["b"][0]], [got["a"], got["b"][0]])


@tf_leak_checked(warmup=1)
def test_unconnected_gradients():
    a, b = _rand(2), _rand(2)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch([a, b])
        y = a * 2.
    assert tape.gradient(y, b) is None
    assert_close(tape.gradient(y, b, unconnected_gradients="zero"), [0., 0.])
    assert_close(tape.gradient(y, b, unconnected_gradients=tf.UnconnectedGradients.ZERO),
                 [0., 0.])


@tf_leak_checked(warmup=1)
def test_non_persistent_tape_is_single_use_and_persistent_is_not():
    a = _rand(2)
    with oh.GradientTape() as tape:
        tape.watch(a)
        y = a * a
    tape.gradient(y, a)
    with pytest.raises(RuntimeError, match="non-persistent"):
        tape.gradient(y, a)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(a)
        y = a * a
        z = y * a
    assert_close(tape.gradient(z, a), 3 * a.numpy() ** 2)
    assert_close(tape.gradient(y, a), 2 * a.numpy())


@tf_leak_checked(warmup=1)
def test_variables_are_watched_when_read_and_trainable():
    v, frozen = tf.Variable(2.0), tf.Variable(3.0, trainable=False)
    with oh.GradientTape() as tape:
        w = tf.Variable(4.0)  # created inside the tape, as Keras layers do
        y = v * frozen * w
    assert [x.numpy() for x in tape.watched_variables()] == [2.0, 4.0]
    gv, gf, gw = tape.gradient(y, [v, frozen, w])
    assert float(gv) == 12.0 and gf is None and float(gw) == 6.0


def test_watch_accessed_variables_false():
    x, w = tf.Variable(2.0), tf.Variable(5.0)
    with oh.GradientTape(watch_accessed_variables=False, persistent=True) as tape:
        tape.watch(x)
        y = x ** 2
        z = w ** 3
    assert float(tape.gradient(y, x)) == 4.0
    assert tape.gradient(z, w) is None
    assert tape.watched_variables() == (x,)


def test_stop_recording_and_reset():
    a = _rand(2)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(a)
        with tape.stop_recording():
            y = a * a
        z = a * 3.
    assert tape.gradient(y, a) is None
    assert_close(tape.gradient(z, a), [3., 3.])
    with pytest.raises(RuntimeError, match="not recording"):
        with tape.stop_recording():
            pass
    with oh.GradientTape() as tape:
        tape.watch(a)
        loss = a * 2.
        tape.reset()
        tape.watch(a)
        loss += a * 5.
    assert_close(tape.gradient(loss, a), [5., 5.])


def test_tf_stop_gradient_and_record_stop_recording():
    from tensorflow.python.eager import record
    a = _rand(2)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(a)
        y = tf.stop_gradient(a * a) + a
        with record.stop_recording():
            z = a * a
    assert_close(tape.gradient(y, a), [1., 1.])
    assert tape.gradient(z, a) is None


def test_misuse_errors():
    a = _rand(2)
    tape = oh.GradientTape()
    with tape:
        with pytest.raises(ValueError, match="still recording"):
            tape.__enter__()
    with pytest.raises(TypeError, match="target"):
        tape.gradient(None, a)


def test_watching_integers_warns_and_is_ignored(caplog):
    i = tf.constant([1, 2])
    with caplog.at_level(logging.WARNING, logger="tf_ophandlers"):
        with oh.GradientTape() as tape:
            tape.watch(i)
            y = i * 2
    assert "must be floating" in caplog.text
    assert tape.gradient(y, i) is None


@tf_leak_checked(warmup=1)
def test_gradient_inside_scope():
    a = _rand(2)
    # Non-persistent: stops recording, as tf.GradientTape does.
    with oh.GradientTape() as tape:
        tape.watch(a)
        y = a * a
        g = tape.gradient(y, a)
        more = a * 3.  # not recorded (and the tape is used up)
    assert_close(g, 2 * a.numpy())
    assert_close(more, 3 * a.numpy())
    # Persistent: the gradient ops are recorded on the same tape (higher order).
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(a)
        y = a * a * a
        g = tape.gradient(y, a)
    assert_close(tape.gradient(g, a), 6 * a.numpy())


def test_op_without_gradient_raises_lookup_error_naming_op():
    a = _rand(3, 3)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(a)
        lu = tf.linalg.lu(a)[0]
    with pytest.raises(LookupError, match=r"oh\.GradientTape: op Lu has no registered"):
        tape.gradient(lu, a)
    # The tape is intact after the error.
    with tape:
        y = a * 2.
    assert_close(tape.gradient(y, a), np.full((3, 3), 2.))


def test_not_differentiable_op_gives_none():
    a = _rand(4)
    (_, ref), (_, got) = _both(lambda x: tf.cast(tf.argmax(x), tf.float32) + tf.round(x), a)
    assert_same_tensors(ref, got)


def test_gradient_function_error_reaches_user_and_tape_survives():
    @tf.custom_gradient
    def bad(x):
        def grad(dy):
            raise ZeroDivisionError("my gradient failed")
        return tf.identity(x), grad

    a = _rand(2)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(a)
        y = bad(a)
        z = a * 4.
    with pytest.raises(ZeroDivisionError, match="my gradient failed"):
        tape.gradient(y, a)
    assert_close(tape.gradient(z, a), [4., 4.])


# -- custom gradients, recompute_grad, tf.function -----------------------------------------

@tf_leak_checked(warmup=1)
def test_custom_gradient():
    @tf.custom_gradient
    def clip_grad(x):
        return tf.identity(x), lambda dy: tf.clip_by_value(dy, -0.1, 0.1)

    a = _rand(3)
    (_, ref), (_, got) = _both(lambda x: clip_grad(x) * 5., a)
    assert_same_tensors(ref, got)
    assert_close(got[0], [0.1, 0.1, 0.1])


@tf_leak_checked(warmup=1)
def test_custom_gradient_with_variables():
    v = tf.Variable([1., 2.])

    @tf.custom_gradient
    def scaled(x):
        def grad(dy, variables):
            return dy * 10., [dy * 100.]
        return x * v, grad

    a = _rand(2)
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            tape.watch(a)
            y = scaled(a)
        results.append(tape.gradient(y, [a, v]))
    assert_same_tensors(*results)


@tf_leak_checked(warmup=1)
def test_recompute_grad_matches_tf():
    dense = keras.layers.Dense(3)
    dense.build((None, 2))
    f = tf.recompute_grad(lambda z: tf.tanh(dense(z)))
    z = _rand(4, 2)
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            tape.watch(z)
            r = tf.reduce_sum(f(z) ** 2)
        results.append(tape.gradient(r, [z] + dense.trainable_variables))
    assert_same_tensors(*results)


@tf_leak_checked(warmup=1)
def test_tf_function_call_under_the_tape():
    v = tf.Variable([0.5, -1.])

    @tf.function
    def f(a):
        return tf.sin(a) * a * v

    a = _rand(2)
    (_, ref), (_, got) = _both(f, a)
    assert_same_tensors(ref, got)
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            y = f(a)
        results.append(tape.gradient(y, v))
    assert_same_tensors([results[0]], [results[1]])


# -- higher order ----------------------------------------------------------------------------

def _second_derivative(outer_type, inner_type, fn, a):
    with outer_type() as outer:
        outer.watch(a)
        with inner_type() as inner:
            inner.watch(a)
            y = fn(a)
        dy = inner.gradient(y, a)
    return dy, outer.gradient(dy, a)


@pytest.mark.parametrize("outer_type,inner_type", [
    (oh.GradientTape, oh.GradientTape), (tf.GradientTape, oh.GradientTape),
    (oh.GradientTape, tf.GradientTape)], ids=["oh-oh", "tf-oh", "oh-tf"])
@tf_leak_checked(warmup=1)
def test_second_order(outer_type, inner_type):
    def fn(a):
        return tf.exp(a) * tf.tanh(a) + tf.reduce_sum(a * a) * tf.sigmoid(a)
    a = _rand(3)
    ref = _second_derivative(tf.GradientTape, tf.GradientTape, fn, a)
    got = _second_derivative(outer_type, inner_type, fn, a)
    assert_same_tensors(ref, got)


@tf_leak_checked(warmup=1)
def test_third_order_nested_oh_tapes():
    a = tf.constant(0.7)
    with oh.GradientTape() as t3:
        t3.watch(a)
        with oh.GradientTape() as t2:
            t2.watch(a)
            with oh.GradientTape() as t1:
                t1.watch(a)
                y = tf.sin(a) * a
            d1 = t1.gradient(y, a)
        d2 = t2.gradient(d1, a)
    d3 = t3.gradient(d2, a)
    x = 0.7  # d3/dx3 of x sin x = -3 sin x - x cos x
    assert_close(d3, -3 * np.sin(x) - x * np.cos(x), 1e-5)


def test_hessian_via_jacobian_of_gradient():
    a = _rand(3)
    with oh.GradientTape() as outer:
        outer.watch(a)
        with oh.GradientTape() as inner:
            inner.watch(a)
            y = tf.reduce_sum(tf.sin(a) * a[0])
        g = inner.gradient(y, a)
    hessian = outer.jacobian(g, a)
    with tf.GradientTape() as outer:
        outer.watch(a)
        with tf.GradientTape() as inner:
            inner.watch(a)
            y = tf.reduce_sum(tf.sin(a) * a[0])
        g = inner.gradient(y, a)
    assert_close(hessian, outer.jacobian(g, a), 1e-5)


# -- jacobians -----------------------------------------------------------------------------

def test_jacobian_and_batch_jacobian_match_tf():
    x = _rand(3, 2)
    v = tf.Variable(_rand(2, 4))
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type(persistent=True) as tape:
            tape.watch(x)
            y = tf.tanh(x @ v)
        results.append((tape.jacobian(y, [x, v]), tape.batch_jacobian(y, x)))
    (ref_j, ref_b), (got_j, got_b) = results
    assert_same_tensors(ref_j, got_j)
    assert_same_tensors([ref_b], [got_b])
    assert got_j[0].shape == (3, 4, 3, 2) and got_b.shape == (3, 4, 2)


def test_jacobian_unconnected_and_non_persistent():
    x, other = _rand(2), _rand(2)
    with oh.GradientTape() as tape:
        tape.watch([x, other])
        y = x * 3.
    j_x, j_other = tape.jacobian(y, [x, other])
    assert_close(j_x, np.eye(2) * 3.)
    assert j_other is None
    with pytest.raises(RuntimeError, match="non-persistent"):
        tape.jacobian(y, x)


# -- Keras -------------------------------------------------------------------------------------

def _keras_models():
    keras.utils.set_random_seed(1)
    mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                            keras.layers.Dense(16, activation="gelu"), keras.layers.Dense(4)])
    cnn = keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.BatchNormalization(),
        keras.layers.Conv2D(4, 2, padding="same"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3)])
    lstm = keras.Sequential([keras.Input((5, 6)), keras.layers.LSTM(7, return_sequences=True),
                             keras.layers.LSTM(5), keras.layers.Dense(2)])
    embed = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(20, 6),
                              keras.layers.LayerNormalization(), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    return {
        "mlp": (mlp, RNG.random((4, 8), dtype=np.float32)),
        "cnn": (cnn, RNG.random((2, 8, 8, 3), dtype=np.float32)),
        "lstm": (lstm, RNG.random((3, 5, 6), dtype=np.float32)),
        "embedding": (embed, RNG.integers(0, 20, (3, 4)).astype(np.int32)),
    }


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "embedding"])
@pytest.mark.parametrize("training", [False, True])
def test_keras_model_gradients_equal_tf(name, training):
    model, data = _keras_models()[name]
    target = tf.constant(RNG.random((data.shape[0],) + tuple(model.output_shape[1:]),
                                    dtype=np.float32))
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            # Dropout-free models: training=True only changes BatchNormalization.
            loss = tf.reduce_mean(keras.losses.mean_squared_error(
                target, model(data, training=training)))
        results.append((loss, tape.gradient(loss, model.trainable_variables)))
    (ref_loss, ref), (loss, got) = results
    assert_close(loss, ref_loss, 1e-5)
    assert_same_tensors(ref, got)


def test_keras_training_loop_matches_tf():
    losses = {}
    x = tf.constant(RNG.random((16, 4), dtype=np.float32))
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    for tape_type in (tf.GradientTape, oh.GradientTape):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        opt = keras.optimizers.Adam(0.01)
        history = []
        for _ in range(5):
            with tape_type() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            history.append(float(loss))
        losses[tape_type] = history
    assert_close(losses[oh.GradientTape], losses[tf.GradientTape], 1e-5)
    assert losses[oh.GradientTape][-1] < losses[oh.GradientTape][0]


# -- composition with other handlers (RFC) --------------------------------------------------

def test_backward_ops_run_on_the_stack_of_their_forward_op():
    a = _rand(3)
    log = oh.OpLogHandler()
    with log:
        with oh.GradientTape() as tape:
            tape.watch(a)
            y = tf.sin(a)
    forward = list(log.op_types_seen())
    g = tape.gradient(y, a)  # called outside every scope
    assert_close(g, np.cos(a.numpy()))
    backward = log.op_types_seen()[len(forward):]
    assert "Cos" in backward  # the gradient of Sin ran on the log's stack
    assert oh.handler_of(g) is None  # and came back as an ordinary tensor


def test_tape_inside_check_numerics_and_log():
    a = _rand(3, positive=True)
    with oh.CheckNumericsHandler():
        with oh.OpLogHandler():
            with oh.GradientTape() as tape:
                tape.watch(a)
                y = tf.math.log(a) * a
    assert_close(tape.gradient(y, a), np.log(a.numpy()) + 1., 1e-5)


@pytest.mark.parametrize("order", ["tape-inside", "tape-outside"])
def test_keras_gradients_with_the_tape_nested_among_other_handlers(order):
    model, data = _keras_models()["mlp"]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(data) ** 2)
    ref = tape.gradient(loss, model.trainable_variables)
    log, check, tape = oh.OpLogHandler(), oh.CheckNumericsHandler(), oh.GradientTape()
    scopes = (log, check, tape) if order == "tape-inside" else (tape, log, check)
    with scopes[0], scopes[1], scopes[2]:
        loss = tf.reduce_sum(model(data) ** 2)
    assert_same_tensors(ref, tape.gradient(loss, model.trainable_variables))
    # Backward ops run on the stack the forward ops ran on: the log's when the tape is
    # inside it; when the tape is outermost it runs them on the physical device.
    assert ("ReluGrad" in log.op_types_seen()) == (order == "tape-inside")


def test_re_entering_the_tape_on_another_stack():
    # RFC "Re-entering a merged handler stack": the tape records on two stacks; the
    # tensor moves from one merge to the other without a copy off the tape.
    w = tf.constant(0.3)
    tape = oh.GradientTape(persistent=True)
    with tape:
        tape.watch(w)
        x = tf.sin(w)
    with oh.OpLogHandler():
        with tape:
            y = tf.square(x)
    with tape:
        z = y + 1.
    assert_close(tape.gradient(z, w), 2 * np.sin(0.3) * np.cos(0.3), 1e-6)
    assert_close(tape.gradient(y, x), 2 * np.sin(0.3), 1e-6)


class _Duplicate(oh.OpHandler):
    """Test double of a parallel handler: each tensor is two components, stacked."""

    def execute(self, op, inputs):
        outs = [self.next.execute(op, [x[k] for x in inputs]) for k in range(2)]
        return [tf.stack([o0, o1]) for o0, o1 in zip(*outs)]

    def copy_on(self, tensor):
        tensor = self.next.copy_on(tensor)
        return tf.stack([tensor, tensor])  # a broadcast: linear, as CopyOn must be

    def copy_on_grad(self, value, original_device):
        return tf.reduce_sum(value, axis=0)  # the gradient of a broadcast sums

    def copy_off(self, value, device):
        raise oh.CopyOffError("_Duplicate: unpack instead")

    def value_dtype(self, value):
        return value.dtype

    def num_dims(self, value):
        return value.shape.rank - 1

    def dim(self, value, index):
        return value.shape[index + 1]


def test_copy_on_gradient_sums_over_components():
    # RFC "Copies and their gradients": `a` is broadcast onto the handler; its gradient
    # comes back through CopyOnGrad, summed, as an ordinary tensor.
    a = tf.constant(2.)
    dup = _Duplicate()
    with dup:
        with oh.GradientTape() as tape:
            tape.watch(a)
            b = tf.fill([], 3.)
            tape.watch(b)
            c = a * b
    a_grad, b_grad = tape.gradient(c, [a, b])
    assert oh.handler_of(a_grad) is None
    assert float(a_grad) == 6.  # 3 from each component
    assert oh.handler_of(b_grad).handler is dup
    with oh.handler(oh.handler_of(b_grad)):
        assert oh.handler_of(b_grad) is not None


def test_tape_watching_a_tensor_of_another_tape():
    x = _rand(2)
    with oh.GradientTape() as t1:
        t1.watch(x)
        y = tf.sin(x)
    with oh.GradientTape() as t2:
        t2.watch(y)
        z = y * y
    assert_close(t2.gradient(z, y), 2 * np.sin(x.numpy()))
    assert_close(t1.gradient(y, x), np.cos(x.numpy()))


def test_tensor_device_is_the_physical_device():
    a = _rand(2)
    with oh.GradientTape() as tape:
        tape.watch(a)
        y = a * 2.
    assert y.device == a.device
    assert "GRADIENT_TAPE" in oh.handler_of(y).name


# -- lifetimes ---------------------------------------------------------------------------------

def test_non_persistent_tape_frees_what_it_recorded():
    a = _rand(100)
    with oh.GradientTape() as tape:
        tape.watch(a)
        hidden = tf.exp(a)
        y = tf.reduce_sum(hidden * 2.)
    ref = weakref.ref(oh.handler_of(hidden).unwrap(hidden))
    del hidden
    gc.collect()
    assert ref() is not None  # recorded: the gradient of Exp needs it
    tape.gradient(y, a)
    gc.collect()
    assert ref() is None


def test_variable_created_under_the_tape_does_not_keep_it_alive():
    v = None
    refs = []
    for _ in range(3):
        with oh.GradientTape() as tape:
            if v is None:
                v = tf.Variable(1.)
            y = (v - 2.) ** 2.
        v.assign_sub(0.1 * tape.gradient(y, v))
        refs.append(weakref.ref(tape))
        del tape, y
    gc.collect()
    assert all(r() is None for r in refs)
    assert_close(v, 1. + 0.2 + 0.16 + 0.128, 1e-6)


@pytest.mark.slow
def test_a_tape_per_iteration_keeps_memory_flat():
    import resource  # pylint: disable=import-outside-toplevel
    v = tf.Variable(tf.ones([8, 8]))
    x = tf.ones([4, 8])

    def step():
        with oh.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(x @ v))
        v.assign_sub(1e-6 * tape.gradient(loss, v))

    for _ in range(2000):
        step()
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # 30k tapes: a leak of one 8x8 tensor per tape (~1 KB with its Python objects) shows;
    # 100k took 3 minutes of make test.
    for _ in range(30_000):
        step()
    gc.collect()
    growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert growth_kb < 20_000, "RSS grew by %d KB over 30k tapes" % growth_kb


def test_persistent_tape_with_custom_gradient_is_freed_after_reset():
    @tf.custom_gradient
    def double(x):
        return tf.identity(x) * 2., lambda dy: dy * 2.

    a = tf.constant(1.)
    tape = oh.GradientTape(persistent=True)
    with tape:
        tape.watch(a)
        y = double(a)
    assert float(tape.gradient(y, a)) == 2.
    tape.reset()  # documented: breaks the cycle through TensorFlow's backward closure
    ref = weakref.ref(tape)
    del tape, y
    gc.collect()
    assert ref() is None


# -- regressions found in review ---------------------------------------------------------------

def test_source_upstream_of_another_source():
    x = tf.constant([[1., 2., 3.]])
    results = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type() as tape:
            tape.watch(x)
            y = x * x
            z = tf.reduce_sum(tf.sin(y))
        results.append(tape.gradient(z, [y, x]))
    assert_same_tensors(*results)


def test_non_persistent_tape_is_fresh_when_re_entered():
    x = tf.constant(2.)
    tape = oh.GradientTape()
    with tape:
        tape.watch(x)
        y = x * x
    assert float(tape.gradient(y, x)) == 4.
    with tape:
        tape.watch(x)
        y = x * x * x
    assert float(tape.gradient(y, x)) == 12.


def test_failed_gradient_inside_the_scope_can_be_retried():
    @tf.custom_gradient
    def flaky(x):
        calls = []

        def grad(dy):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("first call fails")
            return dy * 3.
        return tf.identity(x), grad

    x = tf.constant(1.)
    with oh.GradientTape() as tape:
        tape.watch(x)
        y = flaky(x)
        with pytest.raises(ValueError, match="first call fails"):
            tape.gradient(y, x)
        assert float(tape.gradient(y, x)) == 3.


def test_gradient_through_a_forward_accumulator_inside():
    # (tf.GradientTape around tf.autodiff.ForwardAccumulator returns None here.)
    x = tf.constant([1., 2.])
    with oh.GradientTape() as tape:
        tape.watch(x)
        with oh.ForwardAccumulator(x, tf.ones_like(x)):
            y = tf.reduce_sum(tf.sin(x) * x)
    assert_close(tape.gradient(y, x), np.cos(x.numpy()) * x.numpy() + np.sin(x.numpy()), 1e-6)


def test_persistent_tape_through_tf_function_and_a_saved_model(tmp_path):
    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable([[1., -2.], [0.5, 3.]])

        @tf.function(input_signature=[tf.TensorSpec([None, 2])])
        def __call__(self, x):
            return tf.tanh(x @ self.w)

    module = Module()
    tf.saved_model.save(module, str(tmp_path / "m"))
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    x = _rand(3, 2)
    results = []
    for tape_type, fn, variables in ((tf.GradientTape, module, [module.w]),
                                     (oh.GradientTape, loaded, [loaded.w]),
                                     (oh.GradientTape, module, [module.w])):
        with tape_type(persistent=True) as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(x) ** 2)
        results.append([tape.gradient(y, x)] + tape.gradient(y, variables))
    assert_same_tensors(results[0], results[1])
    assert_same_tensors(results[0], results[2])


# -- sparse gradients keep their type under other handlers --------------
# Under a handler around the tape, a variable's handle is copied onto the handler's stack
# (a recorded CopyOn); the copy's gradient turned the IndexedSlices of a gather into a
# dense tensor, which optimizers treat differently.

_OTHER_HANDLERS = {
    "op_log": lambda: oh.OpLogHandler(),
    "pass_through": lambda: oh.OpHandler(),
    "check_numerics": lambda: oh.CheckNumericsHandler(),
}


def _assert_same_gradient(ref, got):
    assert type(got) is type(ref), (type(ref), type(got))
    if isinstance(ref, tf.IndexedSlices):
        assert got.values.dtype == ref.values.dtype and got.indices.dtype == ref.indices.dtype
        assert got.values.shape[1:] == ref.values.shape[1:]
        # The same slices (their order may differ: the order gradients are summed in).
        assert sorted(got.indices.numpy().tolist()) == sorted(ref.indices.numpy().tolist())
        assert_close(got.dense_shape, ref.dense_shape)
    assert_same_tensors(ref, got)


@pytest.mark.parametrize("handler", sorted(_OTHER_HANDLERS))
@pytest.mark.parametrize("order", ["tape_outside", "tape_inside"])
@pytest.mark.parametrize("gradient_in_scope", [True, False])
@pytest.mark.parametrize("run", ["eager", "function"])
def test_sparse_gradients_stay_sparse_under_other_handlers(handler, order, gradient_in_scope,
                                                           run):
    v = tf.Variable(_rand(5, 3))
    w = tf.Variable(_rand(3))
    ids = tf.constant([3, 0, 3])

    def loss():
        return tf.reduce_sum(tf.gather(v, ids) * w) + tf.reduce_sum(tf.nn.embedding_lookup(v, [1]))

    if run == "function":
        loss = tf.function(loss)

    with tf.GradientTape() as ref_tape:
        ref_y = loss()
    ref = ref_tape.gradient(ref_y, [v, w])
    assert isinstance(ref[0], tf.IndexedSlices)
    other = _OTHER_HANDLERS[handler]()
    tape = oh.GradientTape()
    outer, inner = (tape, other) if order == "tape_outside" else (other, tape)
    with outer:
        with inner:
            y = loss()
        if gradient_in_scope:
            grads = tape.gradient(y, [v, w])
    if not gradient_in_scope:
        grads = tape.gradient(y, [v, w])
    assert_close(y, ref_y, 1e-6)
    for r, g in zip(ref, grads):
        _assert_same_gradient(r, g)


@pytest.mark.parametrize("handler", sorted(_OTHER_HANDLERS))
@pytest.mark.parametrize("order", ["tape_outside", "tape_inside"])
def test_keras_embedding_adam_step_equals_tensorflow(handler, order):
    def build():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(10, 3),
                                  keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(1)])
        return model, keras.optimizers.Adam(0.1)

    ids = tf.constant([[1, 2, 2, 5], [5, 0, 1, 1]])
    labels = tf.constant([[1.0], [-1.0]])

    def step(model, opt, tape_type, scope):
        tape = tape_type()
        outer, inner = (tape, scope) if order == "tape_outside" else (scope, tape)
        with outer:
            with inner:
                loss = tf.reduce_mean((model(ids) - labels) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    ref_model, ref_opt = build()
    model, opt = build()
    for _ in range(3):
        ref_grads = step(ref_model, ref_opt, tf.GradientTape, contextlib.nullcontext())
        grads = step(model, opt, oh.GradientTape, _OTHER_HANDLERS[handler]())
        for r, g in zip(ref_grads, grads):
            _assert_same_gradient(r, g)
    assert isinstance(ref_grads[0], tf.IndexedSlices)
    for r, w in zip(ref_model.weights, model.weights):
        assert_close(w, r, 1e-6)


# -- non-tensor sources and targets raise as tf.GradientTape does ----

_NOT_TENSORS = {
    "numpy_array": lambda: np.array([1.0, 2.0], np.float32),
    "numpy_scalar_in_list": lambda: [tf.constant(1.0), np.float32(2.0)],
    "python_float": lambda: 1.5,
    "python_int": lambda: 3,
    "none_in_list": lambda: [tf.constant(1.0), None],
    "string": lambda: "abc",
}


def _error_of(call):
    try:
        call()
    except Exception as e:  # pylint: disable=broad-except
        return e
    return None


@pytest.mark.parametrize("bad", sorted(_NOT_TENSORS))
@pytest.mark.parametrize("method", ["gradient_sources", "gradient_target",
                                    "jacobian_sources", "jacobian_target"])
def test_non_tensor_sources_and_targets_raise_like_tensorflow(bad, method):
    x = tf.constant([1.0, 2.0])
    errors = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        with tape_type(persistent=True) as tape:
            tape.watch(x)
            y = x * x
        value = _NOT_TENSORS[bad]()
        name, which = method.split("_")
        fn = getattr(tape, name)
        errors.append(_error_of(lambda: fn(y, value) if which == "sources" else fn(value, x)))
    ref, got = errors
    if ref is None:  # tf.GradientTape.jacobian of a numpy target: None, as here
        assert got is None
        return
    assert got is not None, "oh.GradientTape returned instead of raising %r" % (ref,)
    assert type(got) is type(ref), (ref, got)
    assert "oh.GradientTape.%s" % name in str(got)


def test_non_tensor_source_does_not_use_up_the_tape():
    x = tf.constant(2.0)
    with oh.GradientTape() as tape:
        tape.watch(x)
        y = x * x
    with pytest.raises(TypeError, match="sources"):
        tape.gradient(y, 2.0)
    assert_close(tape.gradient(y, x), 4.0)


@pytest.mark.parametrize("shapes", [((3,), (3,)), ((3, 2), (3,)), ((3,), (3, 2))])
def test_batch_jacobian_of_rank_one_raises_like_tensorflow(shapes):
    t_shape, s_shape = shapes
    errors = []
    for tape_type in (tf.GradientTape, oh.GradientTape):
        x = tf.ones(s_shape)
        with tape_type() as tape:
            tape.watch(x)
            y = tf.reduce_sum(x) * tf.ones(t_shape)
        errors.append(_error_of(lambda: tape.batch_jacobian(y, x)))
    ref, got = errors
    assert isinstance(ref, ValueError) and "must have rank at least 2" in str(ref)
    assert isinstance(got, ValueError) and "must have rank at least 2" in str(got)
    assert "oh.GradientTape.batch_jacobian" in str(got)


class _Box:
    def __init__(self, tensor):
        self.tensor = tensor


class _BoxingHandler(oh.OpHandler):
    """A handler with its own representation (a box around the next stack's tensor)."""

    def execute(self, op, inputs):
        outputs = self.next.execute(op, [_unbox(v) for v in inputs])
        return [_Box(t) for t in outputs]

    def copy_off(self, value, device):
        return _unbox(value)

    def value_dtype(self, value):
        return _unbox(value).dtype

    def num_dims(self, value):
        return _unbox(value).shape.rank

    def dim(self, value, index):
        return _unbox(value).shape[index]


def _unbox(value):
    return value.tensor if isinstance(value, _Box) else value


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("inner", [_BoxingHandler, oh.Recompute])
@pytest.mark.parametrize("below", [oh.OpHandler, oh.Async, oh.native.PassThrough])
def test_value_of_a_representing_handler_used_after_its_scope(below, inner):
    """Found by the stacks fuzzer (via oh.Recompute): over a handler that takes
    inputs from elsewhere as they are (oh.Async), a value of a handler with its own
    representation opened inside the tape's scope, used after that scope, reached the tape
    as that handler's wrapper instead of the tensor the tape recorded, so its gradient was
    None. A tensor of a stack built on the tape's is now always taken in its
    representation there (HandlerStack.execute, cc/fast/fast_hook.cc WantsCopy). The fuzzer's
    case had oh.Recompute as the inner handler; a boxing handler isolates the cause."""
    z = tf.constant([[0.3, -0.7], [1.2, 0.5]])
    with below():
        with oh.GradientTape() as tape:
            tape.watch(z)
            with inner():
                y = tf.nn.softplus(z)
            loss = tf.reduce_sum(y * y)
        g = tape.gradient(loss, z)
    assert g is not None
    np.testing.assert_allclose(g.numpy(), (2 * tf.nn.softplus(z) * tf.sigmoid(z)).numpy(),
                               rtol=1e-5)
