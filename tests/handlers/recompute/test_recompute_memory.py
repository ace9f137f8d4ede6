"""What oh.Recompute's step holds during the backward pass: a non-persistent
oh.GradientTape frees each record once its gradient ran (as TensorFlow's tape erases its
entries), and a segment's gradient function runs its convolution backprops one at a time
(their CPU kernels each allocate a scratch buffer of up to 30 MB)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.recompute import segments as recompute_segments
import recompute_helpers

RNG = np.random.default_rng(0)


_run = recompute_helpers.run_bfc


@pytest.mark.slow
def test_non_persistent_tape_frees_records_during_the_backward_pass():
    """A chain of 12 elementwise ops on 4 MB values whose first op's gradient allocates
    40 MB: TensorFlow's tape has freed the chain's saved values by then, so must ours
    (before, it held them all to the end: about 50 MB more). A persistent tape keeps
    them (it may be asked again). BFC allocator peaks, in a subprocess."""
    out = _run("""
        import numpy as np, tensorflow as tf, tf_ophandlers as oh
        info = tf.config.experimental.get_memory_info
        x = tf.constant(np.random.default_rng(0).standard_normal(1 << 20), tf.float32)

        @tf.custom_gradient
        def first(v):
            def grad(dy):
                big = tf.fill([10 << 20], 1.0)  # 40 MB of working memory
                return dy * tf.reduce_mean(big)
            return v * 1.0, grad

        def step(make):
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = info("CPU:0")["current"]
            with make() as tape:
                tape.watch(x)
                h = first(x)
                for _ in range(6):
                    h = tf.sin(tf.exp(h * 0.1))
                loss = tf.reduce_sum(h)
            g = tape.gradient(loss, x)
            return info("CPU:0")["peak"] - base, g.numpy()

        res = {}
        for name, make in (("tf", tf.GradientTape), ("oh", oh.GradientTape),
                           ("persistent", lambda: oh.GradientTape(persistent=True))):
            step(make)
            res[name] = step(make)
        np.testing.assert_allclose(res["oh"][1], res["tf"][1], rtol=1e-5)
        print(res["tf"][0], res["oh"][0], res["persistent"][0])
    """)
    tf_peak, oh_peak, persistent_peak = (int(v) for v in out.split())
    mb = 1 << 20
    assert oh_peak <= tf_peak + 20 * mb, (tf_peak, oh_peak)  # (134 MB before)
    # Since records keep only what gradients read (as TensorFlow's), a persistent tape
    # keeps fewer of the chain's 4 MB values to the end (measured 20 MB more; 30+ before).
    assert persistent_peak >= oh_peak + 12 * mb, (oh_peak, persistent_peak)


def test_failed_gradient_after_the_scope_cannot_be_retried_with_wrong_values():
    calls = []

    @tf.custom_gradient
    def flaky(v):
        def grad(dy):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("first call fails")
            return dy * 3.
        return tf.identity(v), grad

    x = tf.constant(1.)
    with oh.GradientTape() as tape:
        tape.watch(x)
        y = tf.sin(flaky(x))
    with pytest.raises(ValueError, match="first call fails"):
        tape.gradient(y, x)
    # Its records were freed as the pass ran: a retry says so instead of returning a
    # partial (wrong) gradient.
    with pytest.raises(RuntimeError, match="only be used to compute one set"):
        tape.gradient(y, x)


def _conv_net():
    tf.keras.utils.set_random_seed(0)
    layers = [tf.keras.layers.Conv2D(8, 3, padding="same", activation="relu")
              for _ in range(6)]
    x = tf.random.normal([2, 12, 12, 3])

    def run(v):
        h = v
        for layer in layers:
            h = layer(h)
        return tf.reduce_sum(h * h)
    run(x)
    return run, x, [w for layer in layers for w in layer.trainable_variables]


def test_segment_gradient_functions_chain_their_convolution_backprops():
    run, x, variables = _conv_net()
    with tf.GradientTape() as tape:
        loss = run(x)
    expected = tape.gradient(loss, variables)
    recompute_segments._gradients.clear()  # pylint: disable=protected-access
    rc = oh.Recompute()
    for _ in range(2):  # the second scope uses the sqrt(n) segments of the first's size
        with oh.GradientTape() as tape:
            with rc:
                loss = run(x)
        got = tape.gradient(loss, variables)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
    functions = list(recompute_segments._gradients.values())  # pylint: disable=protected-access
    assert functions
    chained = 0
    for fn in functions:
        heavy = [op for op in fn.function.graph.get_operations()
                 if op.type in recompute_segments.HEAVY_GRADIENT_OPS]
        for earlier, later in zip(heavy, heavy[1:]):
            assert earlier in later.control_inputs, (earlier.name, later.name)
            chained += 1
    assert chained > 0  # a segment of several convolutions was recorded


def test_serialize_heavy_orders_only_heavy_ops():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 4, 4, 2])
        w = tf.compat.v1.placeholder(tf.float32, [3, 3, 2, 2])
        y = tf.nn.conv2d(x, w, 1, "SAME")
        start = len(graph.get_operations())
        gx, gw = tf.gradients(tf.reduce_sum(tf.sin(y)), [x, w])
        ops = graph.get_operations()[start:]
        before = {op.name: list(op.control_inputs) for op in ops}
        recompute_segments.serialize_heavy(ops)
    heavy = [op for op in ops if op.type in recompute_segments.HEAVY_GRADIENT_OPS]
    assert len(heavy) == 2 and heavy[0] in heavy[1].control_inputs
    assert heavy[1].control_inputs == before[heavy[1].name] + [heavy[0]]
    assert all(op.control_inputs == before[op.name] for op in ops if op is not heavy[1])
    with tf.compat.v1.Session(graph=graph) as sess:
        xv = RNG.standard_normal([1, 4, 4, 2]).astype(np.float32)
        wv = RNG.standard_normal([3, 3, 2, 2]).astype(np.float32)
        a, b = sess.run([gx, gw], {x: xv, w: wv})
    xt, wt = tf.constant(xv), tf.Variable(wv)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        loss = tf.reduce_sum(tf.sin(tf.nn.conv2d(xt, wt, 1, "SAME")))
    ex, ew = tape.gradient(loss, [xt, wt])
    np.testing.assert_allclose(a, ex.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, ew.numpy(), rtol=1e-5, atol=1e-6)
