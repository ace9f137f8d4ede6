"""oh.Recompute opened inside a traced function (graph mode, recompute/graph.py): the
segments are in the traced step; gradients equal tf.GradientTape's on the same function
without Recompute (fresh tf.function, unknown batch dimension, Keras model.fit with a
custom train_step, tf.cond, Dropout, an Embedding's IndexedSlices, second order); the
recomputation is in the graph; clear errors where a segment would hide a use."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import recompute_helpers

RNG = np.random.default_rng(2)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same data whatever ran before it (another order, -k, one
    test alone): the module's generator starts afresh for each test."""
    global RNG  # pylint: disable=global-statement
    RNG = np.random.default_rng(2)
_assert_grads = recompute_helpers.assert_grads


def _step(fn, sources, rc, tape_type=tf.GradientTape, signature=None, watch=None):
    """A fresh tf.function: loss and gradients of `fn(x)`, with `rc` opened inside."""
    @tf.function(input_signature=signature)
    def step(x):
        with tape_type() as tape:
            if watch:
                tape.watch(x)
            if rc is None:
                loss = fn(x)
            else:
                with rc:
                    loss = fn(x)
        return loss, tape.gradient(loss, sources + ([x] if watch else []))
    return step


@pytest.mark.parametrize("tape_type", [tf.GradientTape, oh.GradientTape], ids=["tf", "oh"])
@pytest.mark.parametrize("make", [lambda: oh.Recompute(), lambda: oh.Recompute(
    save=("MatMul",))], ids=["sqrt", "save"])
def test_mlp_gradients_equal_and_segments_in_the_graph(tape_type, make):
    fn, variables = recompute_helpers.mlp(RNG, 16, 32)
    spec = [tf.TensorSpec([None, 32])]  # unknown batch dimension (a partial last batch)
    rc = make()
    plain = _step(fn, variables, None, signature=spec, watch=True)
    step = _step(fn, variables, rc, tape_type, signature=spec, watch=True)
    for batch in (8, 3):
        x = tf.constant(RNG.standard_normal((batch, 32)).astype(np.float32))
        l0, g0 = plain(x)
        l1, g1 = step(x)
        np.testing.assert_allclose(l1.numpy(), l0.numpy(), rtol=1e-6)
        _assert_grads(g0, g1)
    assert rc.stats["mode"] == "graph" and rc.stats["segments"] >= 3
    assert rc.stats["recomputed"]["Tanh"] == 16
    # The recomputation is in the traced step: each Tanh twice (forward, recomputed),
    # and the segments' inputs are perturbed by a zero derived from the gradient.
    graph = step.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("Tanh") == 32, types.count("Tanh")
    plain_types = [op.type for op in plain.get_concrete_function().graph.get_operations()]
    assert plain_types.count("Tanh") == 16


def test_keras_fit_with_recompute_in_train_step_gives_the_same_losses():
    class Model(keras.Model):
        def __init__(self, recompute):
            super().__init__()
            self.recompute = recompute
            self.a = keras.layers.Dense(16, activation="tanh")
            self.norm = keras.layers.LayerNormalization()
            self.drop = keras.layers.Dropout(0.25)
            self.b = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(1)

        def call(self, x, training=False):
            h = self.norm(self.a(x))
            h = self.drop(h, training=training)
            return self.out(self.b(h) + h)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                if self.recompute is None:
                    loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                else:
                    with self.recompute:
                        loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    def fit(recompute):
        keras.utils.set_random_seed(4)
        model = Model(recompute)
        model.compile(optimizer="adam", loss="mse")
        data = (RNG.standard_normal((22, 6)).astype(np.float32),  # last batch partial
                np.ones((22, 1), np.float32))
        return model.fit(*data, batch_size=8, epochs=2, verbose=0,
                         shuffle=False).history["loss"]
    rc = oh.Recompute()
    expected = fit(None)
    np.testing.assert_allclose(fit(rc), expected, rtol=1e-5)
    assert rc.stats["segments"] >= 1 and rc.stats["mode"] == "graph"


def test_cond_embedding_and_variable_reads():
    emb = tf.Variable(RNG.standard_normal((20, 8)).astype(np.float32))
    w = tf.Variable(RNG.standard_normal((8, 8)).astype(np.float32) / 3)

    def fn(ids):
        h = tf.gather(emb, ids)
        for _ in range(6):
            h = tf.tanh(h @ w) + 0.5 * h
        h = tf.cond(tf.reduce_sum(h) > 0, lambda: h * 2.0, lambda: tf.sin(h))
        for _ in range(4):
            h = tf.tanh(h @ w)
        return tf.reduce_sum(h * h)
    ids = tf.constant([1, 3, 3, 7])
    l0, g0 = _step(fn, [emb, w], None)(ids)
    rc = oh.Recompute()
    l1, g1 = _step(fn, [emb, w], rc)(ids)
    np.testing.assert_allclose(l1.numpy(), l0.numpy(), rtol=1e-6)
    _assert_grads(g0, g1)  # the Embedding's gradient stays IndexedSlices
    assert isinstance(g1[0], tf.IndexedSlices)
    assert rc.stats["segments"] >= 2


def test_second_order_in_graph_mode():
    fn, variables = recompute_helpers.mlp(RNG, 8, 16)
    x = tf.constant(RNG.standard_normal((4, 16)).astype(np.float32))

    def make(rc):
        @tf.function
        def hvp(v):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    if rc is None:
                        loss = fn(x)
                    else:
                        with rc:
                            loss = fn(x)
                g = inner.gradient(loss, variables[0])
                gv = tf.reduce_sum(g * v)
            return outer.gradient(gv, variables[0])
        return hvp
    v = tf.constant(RNG.standard_normal((16, 16)).astype(np.float32))
    np.testing.assert_allclose(make(oh.Recompute())(v).numpy(), make(None)(v).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_interior_values_later_uses_watched_sources_and_errors():
    w = tf.Variable(RNG.standard_normal((8, 8)).astype(np.float32) / 3)
    x = tf.constant(RNG.standard_normal((4, 8)).astype(np.float32))

    def chain(tape, rc, watch, at):
        with rc if rc is not None else _null():
            h = x
            for i in range(16):
                h = tf.tanh(h @ w)
                if i == at:
                    mid = h
                    if watch:
                        tape.watch(mid)
            out = tf.reduce_sum(h)
        return out, mid

    def run(rc, watch, source_mid, at=5):
        @tf.function(autograph=False)  # the error as raised (not wrapped by autograph)
        def f():
            with tf.GradientTape() as tape:
                out, mid = chain(tape, rc, watch, at)
                loss = out + tf.reduce_sum(mid * mid)  # a later use of `mid`
            return tape.gradient(loss, [w, mid] if source_mid else [w])
        return f()
    for at in (3, 6):
        # `mid` is held by the program at the scope's exit: a segment output (a cut).
        _assert_grads(run(None, False, False, at), run(oh.Recompute(), False, False, at))
        _assert_grads(run(None, True, True, at), run(oh.Recompute(), True, True, at))
        _assert_grads(run(None, False, True, at), run(oh.Recompute(), False, True, at))

    def dug_out(rc, back):
        """A gradient with respect to a value found in the graph after the scope (not
        held by the program at its exit): equal, or an error if inside a segment."""
        @tf.function(autograph=False)
        def f():
            with tf.GradientTape() as tape:
                out, _ = chain(tape, rc, False, 0)
                t = out.op.inputs[0]
                for _ in range(back):
                    t = t.op.inputs[0]
            return tape.gradient(out, [w, t])
        return f()
    raised = 0
    for back in (4, 6, 8, 10):
        try:
            got = dug_out(oh.Recompute(), back)
        except oh.HandlerError as e:
            assert "inside a recompute segment" in str(e)
            raised += 1
        else:
            _assert_grads(dug_out(None, back), got)
    assert raised > 0

    def inside(rc):
        @tf.function(autograph=False)
        def f():
            with tf.GradientTape() as tape:
                with rc if rc is not None else _null():
                    loss = tf.reduce_sum(tf.tanh(x @ w))
                    return tape.gradient(loss, w)
        return f()
    # A gradient inside the scope raised HandlerError; the scope's records are made
    # then (test_recompute_windows.py): TensorFlow's gradient.
    _assert_grads([inside(None)], [inside(oh.Recompute())])


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_memory_budget_in_graph_mode_plans_with_static_shapes():
    """Fully known shapes: a larger budget keeps more ops (recorded as usual), gradients
    equal; below the minimum a ValueError names both; an unknown batch dimension falls
    back to sqrt(n) segments."""
    fn, variables = recompute_helpers.mlp(RNG, 12, 32)
    x = tf.constant(RNG.standard_normal((64, 32)).astype(np.float32))
    l0, g0 = _step(fn, variables, None)(x)
    probe = oh.Recompute()
    _step(fn, variables, probe)(x)
    minimum = probe.stats["minimum_budget"]
    assert minimum is not None and probe.stats["budget_plan"] is None
    kept = []
    for extra in (0.1, 2.0):
        rc = oh.Recompute(memory_budget=int(minimum * (1 + extra)))
        l1, g1 = _step(fn, variables, rc)(x)
        np.testing.assert_allclose(l1.numpy(), l0.numpy(), rtol=1e-6)
        _assert_grads(g0, g1)
        kept.append(rc.stats["budget_plan"]["kept_ops"])
    assert kept[0] < kept[1], kept
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes .* minimum feasible .* "
                                         r"about %d bytes" % minimum):
        _step(fn, variables, oh.Recompute(memory_budget=1000))(x)
    rc = oh.Recompute(memory_budget=int(minimum * 1.1))
    step = _step(fn, variables, rc, signature=[tf.TensorSpec([None, 32])])
    _assert_grads(g0, step(x)[1])
    assert rc.stats["budget_plan"] is None and rc.stats["segments"] >= 3


@pytest.mark.slow
def test_memory_budget_in_graph_mode_holds_measured_peaks():
    """Three budgets between the minimum and 1.6x it: the traced step's peak (BFC
    allocator, in a subprocess) stays under each."""
    code = """
        import numpy as np, tensorflow as tf, tf_ophandlers as oh
        ws = [tf.Variable(tf.random.normal([64, 64]) * 0.1) for _ in range(24)]
        x = tf.random.normal([512, 64])
        def make(rc):
            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    h = x
                    with rc:
                        for w in ws:
                            h = tf.tanh(h @ w)
                        loss = tf.reduce_sum(h * h)
                return tape.gradient(loss, ws)
            return step
        def peak(f):
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = tf.config.experimental.get_memory_info("CPU:0")["current"]
            g = f()
            return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base, g
        probe = oh.Recompute()
        make(probe)()
        low = probe.stats["minimum_budget"]
        for budget in (int(low * 1.05), int(low * 1.3), int(low * 1.6)):
            step = make(oh.Recompute(memory_budget=budget))
            step()
            print(budget, peak(step)[0])
    """
    rows = [tuple(int(v) for v in line.split())
            for line in recompute_helpers.run_bfc(code).split("\n") if line]
    assert len(rows) == 3
    for budget, peak in rows:
        assert peak <= budget, (budget, peak)
