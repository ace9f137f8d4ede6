"""Checkpoint thinning (recompute/thinning.py): checkpoints early in the forward pass,
kept by the tape's records through most of the backward pass while the weight gradients
accumulate, are dropped and computed again from the previous segment's inputs when the
segment using them runs its gradient."""

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.recompute import thinning
import recompute_helpers


def _widening_net(rng, blocks=4, ch=16, size=16, dense=512, dense_blocks=3):
    """A CNN whose activations are largest first and whose weights are largest last (a
    residual convolution stage, then residual dense blocks): ResNet's shape in small."""
    def var(*shape, scale=1.0):
        return tf.Variable((rng.standard_normal(shape) * scale
                            / np.sqrt(np.prod(shape[:-1]))).astype(np.float32))
    stem = var(3, 3, 3, ch)
    convs = [(var(3, 3, ch, ch), var(3, 3, ch, ch, scale=0.5)) for _ in range(blocks)]
    proj = var(ch * (size // 4) ** 2, dense)
    dense_ws = [var(dense, dense, scale=0.5) for _ in range(dense_blocks)]

    def f(x):
        h = tf.nn.relu(tf.nn.conv2d(x, stem, 1, "SAME"))
        for w1, w2 in convs:
            h = tf.nn.relu(h + tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(h, w1, 1, "SAME")),
                                            w2, 1, "SAME"))
        h = tf.nn.avg_pool2d(h, 4, 4, "VALID")
        h = tf.nn.relu(tf.reshape(h, [tf.shape(h)[0], -1]) @ proj)
        for w in dense_ws:
            h = tf.nn.relu(h + h @ w)
        return tf.reduce_mean(h * h)
    return f, [stem] + [v for b in convs for v in b] + [proj] + dense_ws


def _net_and_reference(seed, batch_shape, **net):
    """A `_widening_net`, its variables, an input of `batch_shape` and tf.GradientTape's
    gradients of the net on it."""
    rng = np.random.default_rng(seed)
    f, variables = _widening_net(rng, **net)
    x = tf.constant(rng.standard_normal(batch_shape).astype(np.float32))
    with tf.GradientTape() as ref:
        want = f(x)
    return f, variables, x, ref.gradient(want, variables)


def _recipe_runs(monkeypatch):
    """A list that gets, for each `Recipe.tensor()` call, whether the checkpoint was
    computed again (nothing else held it)."""
    runs = []
    original = thinning.Recipe.tensor

    def spy(self):
        runs.append(self.ref is None or self.ref() is None)
        return original(self)
    monkeypatch.setattr(thinning.Recipe, "tensor", spy)
    return runs


def test_plan_drops_the_early_checkpoints_kept_while_weight_gradients_accumulate():
    """The simulated backward pass: four segments, the first three computing large
    checkpoints and reading no weights, the last reading large weights. Dropping the
    checkpoints the last segment's backward does not read lowers the peak there; the
    budget bounds how many are dropped (each costs its producer's forward again), and
    a dropped checkpoint is computed again from kept ones (no chains)."""
    class C:  # a checkpoint as `checkpoints` finds them
        def __init__(self, nbytes, producer, consumer):
            self.bytes, self.producer, self.consumers = nbytes, producer, {consumer}
            self.node = self.index = 0
    fwd, weights, outs = [10, 10, 10, 10], [0, 0, 0, 100], [1, 1, 1, 1]
    cks = [C(8, 0, 1), C(8, 1, 2), C(8, 2, 3)]
    # Every checkpoint kept: at the last segment's backward, 100 + 24 + 7.5 + 1.
    assert thinning.plan(fwd, weights, outs, cks, budget=0) == set()
    # One producer's forward again: the first or the second checkpoint (not the third:
    # the last segment reads it, so dropping it saves nothing at its backward).
    one = thinning.plan(fwd, weights, outs, cks, budget=10)
    assert len(one) == 1 and one < {0, 1}, one
    # Not both: the second one's recomputation would need the first one's (a chain).
    assert len(thinning.plan(fwd, weights, outs, cks, budget=1000)) == 1


def test_thinned_gradients_equal_tensorflows_and_recompute_the_dropped_checkpoints(
        monkeypatch):
    """With a budget large enough to drop checkpoints, gradients (twice, on a persistent
    tape) equal tf.GradientTape's, and the dropped checkpoints were computed again."""
    f, variables, x, expected = _net_and_reference(3, (2, 8, 8, 3), blocks=4, ch=4,
                                                   size=8, dense=64)
    runs = _recipe_runs(monkeypatch)
    rc = oh.Recompute()
    rc.checkpoint_thinning = 2.0
    rc.evict_min_bytes = 16
    for _ in range(2):  # the second step plans with the first one's size
        with oh.GradientTape(persistent=True) as tape:
            with rc:
                loss = f(x)
        assert rc.stats["thinned"] >= 1, rc.stats
        runs.clear()
        recompute_helpers.assert_grads(expected, tape.gradient(loss, variables))
        recompute_helpers.assert_grads(expected, tape.gradient(loss, variables))
        assert runs and all(runs), runs  # (computed again: nothing else held them)
        del tape


def test_thinning_uses_a_dropped_checkpoint_the_program_still_holds(monkeypatch):
    """A dropped checkpoint the program still references is used as it is (not computed
    again): the program keeps every ReLU's output here."""
    f, variables, x, expected = _net_and_reference(4, (2, 16, 16, 3), blocks=6, ch=8,
                                                   size=16, dense=256, dense_blocks=0)
    runs = _recipe_runs(monkeypatch)
    relu = tf.nn.relu
    kept = []

    def keeping_relu(v):  # the program holds every ReLU's output
        out = relu(v)
        kept.append(out)
        return out
    monkeypatch.setattr(tf.nn, "relu", keeping_relu)
    rc = oh.Recompute()
    rc.checkpoint_thinning = 2.0
    rc.evict_min_bytes = None  # (eviction would give held values new tensors)
    for step in range(2):  # the second plans with the first one's size
        kept.clear()
        with oh.GradientTape() as tape:
            with rc:
                loss = f(x)
        assert rc.stats["thinned"] >= 1, rc.stats
        runs.clear()
        recompute_helpers.assert_grads(expected, tape.gradient(loss, variables))
        if step:  # (segments end at the ReLUs after the residual adds: checkpoints)
            assert runs and not any(runs), runs


@pytest.mark.slow
def test_thinning_lowers_the_step_peak_of_a_widening_cnn():
    """BFC peaks, in a subprocess: the CNN of `_widening_net` (its checkpoints first, its
    weights last) under oh.Recompute with thinning and without (`checkpoint_thinning =
    0`, as before): the step's peak is lower (the best of four steps; with one thread
    the peaks repeat to the byte), and gradients equal tf.GradientTape's in both."""
    out = recompute_helpers.run_bfc("""
        import sys
        import numpy as np
        import tensorflow as tf
        # One thread each: the executor runs a gradient function's ops in one order, so
        # a step's peak repeats (with more threads it varies by about a checkpoint).
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        import tf_ophandlers as oh
        sys.path[:0] = [%r, %r]
        import recompute_helpers
        from test_recompute_thinning import _widening_net
        rng = np.random.default_rng(0)
        f, variables = _widening_net(rng, blocks=6, ch=64, size=32, dense=1024)
        x = tf.constant(rng.standard_normal((8, 32, 32, 3)).astype(np.float32))
        expected = recompute_helpers.reference_gradients(f, variables, x)
        for share in (0.0, 0.25):
            rc = oh.Recompute()
            rc.checkpoint_thinning = share
            peaks = recompute_helpers.step_peaks(f, variables, x, rc, expected, 5)
            print(min(peaks[1:]), rc.stats["thinned"], rc.stats["thinned_bytes"])
    """ % (recompute_helpers.REPO + "/tests/handlers/recompute",
           recompute_helpers.REPO + "/tests"))
    (plain, none, _), (thin, count, dropped) = (
        [int(v) for v in line.split()] for line in out.split("\n") if line.strip())
    assert none == 0 and count >= 1, out
    assert thin < plain, (plain, thin, dropped)
