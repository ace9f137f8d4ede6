"""oh.Recompute drops the values the program still holds (a Keras functional model's
layer outputs) once their segment closed, and rematerializes them when used
(recompute/evict.py): gradients and values against tf.GradientTape and plain TensorFlow
on the same program, kept ops never recomputed, and the BFC peak of a held-value forward
pass."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import recompute_helpers

_assert_grads = recompute_helpers.assert_grads


def _residual_model():
    """A functional CNN with residual adds and a long skip (the first block's output
    added to the last one's: a value read again several segments after it was made)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    first = h
    for _ in range(4):
        r = keras.layers.Conv2D(16, 3, padding="same")(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Conv2D(16, 3, padding="same")(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    h = keras.layers.Add()([h, first])
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(5)(h))


def _grads(tape_type, rc, fn, variables):
    with tape_type() as tape:
        if rc is None:
            loss = fn()
        else:
            with rc:
                loss = fn()
    return loss, tape.gradient(loss, variables)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_keras_residual_model_drops_held_values_gradients_equal(training):
    model = _residual_model()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 12, 12, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 5, 8))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    moving = [v for v in model.non_trainable_variables]
    start = [v.numpy() for v in moving]

    def fn():
        for v, s in zip(moving, start):  # (training mode updates the statistics)
            v.assign(s)
        return loss_fn(y, model(x, training=training))

    loss0, g0 = _grads(tf.GradientTape, None, fn, variables)
    rc = oh.Recompute()
    for step in range(2):  # fresh, then reused (segments planned with the first's size)
        loss1, g1 = _grads(oh.GradientTape, rc, fn, variables)
        np.testing.assert_allclose(loss1.numpy(), loss0.numpy(), rtol=1e-6)
        _assert_grads(g0, g1)
        assert rc.stats["evicted"] > 0, rc.stats
        if step == 0:  # (the long skip at least; planned segments end at residual
            # adds, and the next segment then holds the skip as its input)
            assert rc.stats["rematerialized"] > 0, rc.stats
    rc.evict_min_bytes = None  # off: nothing dropped, same gradients
    loss2, g2 = _grads(oh.GradientTape, rc, fn, variables)
    _assert_grads(g0, g2)
    assert rc.stats["evicted"] == 0 and rc.stats["rematerialized"] == 0


def _program(x, w, v, keep, request=None):
    """A chain of 16 KB values, all kept by the program; `v` changes in the middle
    (its reads are kept ops: a rematerialization must use the value read then), a
    seeded random op (kept: never drawn again) and optionally a value request mid-way."""
    h = x
    for i in range(24):
        if i == 8:
            v.assign_add(1.0)
        h = tf.tanh(h @ w) * v + 0.1 * h
        if i == 12:
            h = h + tf.random.uniform(tf.shape(h), seed=3)
        keep.append(h)
        if request is not None and i == 18:
            request.append(keep[2].numpy())  # dropped by now: rematerialized
    return tf.reduce_sum(keep[-1] * keep[-1])


def test_values_held_by_the_program_equal_after_the_scope_and_mid_forward():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((64, 64)).astype(np.float32))
    w = tf.constant(rng.standard_normal((64, 64)).astype(np.float32) * 0.1)
    picks = [1, 5, 9, 13, 20]
    results = []
    for rc in (None, oh.Recompute()):
        v = tf.Variable(0.5)
        keep, request = [], []
        tf.random.set_seed(7)
        with (tf.GradientTape if rc is None else oh.GradientTape)() as tape:
            tape.watch([x, w])
            if rc is None:
                loss = _program(x, w, v, keep, request)
            else:
                with rc:
                    loss = _program(x, w, v, keep, request)
                stats = rc.stats
        sources = [keep[i] for i in picks] + [x, w, v]
        grads = tape.gradient(loss, sources)
        results.append(([k.numpy() for k in keep], request[0], grads))
    (values0, request0, grads0), (values1, request1, grads1) = results
    assert stats["evicted"] > 0, stats
    assert stats["rematerialized"] > 0, stats  # the request at least
    np.testing.assert_allclose(request1, request0, rtol=1e-6, atol=1e-6)
    for a, b in zip(values1, values0):  # after the scope, every value as computed
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # Gradients with respect to values the program kept (dropped and rematerialized
    # before their segment was recorded) see all their uses.
    _assert_grads(grads0, grads1)


def test_evict_min_bytes_leaves_small_values():
    x = tf.constant(np.ones((4, 4), np.float32))
    w = tf.constant(np.eye(4, dtype=np.float32) * 0.5)
    rc = oh.Recompute()
    keep = []
    with oh.GradientTape() as tape:
        tape.watch(x)
        with rc:
            _program(x, w, tf.Variable(0.5), keep)
    assert rc.stats["segments"] > 1 and rc.stats["evicted"] == 0, rc.stats


@pytest.mark.slow
def test_keras_functional_forward_peak_drops():
    """A functional stack of 48 Dense(512, tanh) layers on a batch of 256 (512 KB per
    value): Keras holds every layer output until the call returns; dropping them halves
    the forward pass's peak or better. BFC allocator peaks, in a subprocess."""
    out = recompute_helpers.run_bfc("""
        import keras, numpy as np, tensorflow as tf, tf_ophandlers as oh
        info = tf.config.experimental.get_memory_info
        keras.utils.set_random_seed(0)
        inputs = keras.Input((512,))
        h = inputs
        for _ in range(48):
            h = keras.layers.Dense(512, activation="tanh")(h)
        model = keras.Model(inputs, h)
        x = tf.random.normal([256, 512])
        res = {}
        for name, min_bytes in (("off", None), ("on", 4096)):
            rc = oh.Recompute()
            rc.evict_min_bytes = min_bytes
            for _ in range(2):
                tf.config.experimental.reset_memory_stats("CPU:0")
                base = info("CPU:0")["current"]
                with oh.GradientTape() as tape:
                    with rc:
                        loss = tf.reduce_mean(model(x) ** 2)
                forward = info("CPU:0")["peak"] - base
                g = tape.gradient(loss, model.trainable_variables)
                step = info("CPU:0")["peak"] - base
            res[name] = (forward, step, [t.numpy() for t in g])
        for a, b in zip(res["on"][2], res["off"][2]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        print(res["off"][0], res["on"][0], res["off"][1], res["on"][1])
    """)
    off_fwd, on_fwd, off_step, on_step = (int(v) for v in out.split())
    assert on_fwd * 2 <= off_fwd, (off_fwd, on_fwd)
    # The step's peak is set in the backward pass (the 48 weight gradients with the last
    # segments' values), which eviction does not shrink: eviction must not raise it. Both
    # step peaks vary by ~1-2 MB from run to run with the allocator's timing, so a
    # strict `<` failed by chance;
    # 3% is well under what keeping the forward's evicted values would add (~20 MB).
    assert on_step <= off_step * 1.03, (off_step, on_step)
