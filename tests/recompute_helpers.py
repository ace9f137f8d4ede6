"""Shared by the Recompute tests (test_recompute.py, test_recompute_gradients.py): a deep
tanh MLP with its variables, the gradient comparison against tf.GradientTape's, and a
subprocess runner for BFC peak-memory measurements."""
import os

import numpy as np
import tensorflow as tf

from python_process import run_python


def mlp(rng, layers, width=32):
    """`(f, variables)`: f(x) is the mean square of a `layers`-deep tanh MLP's output."""
    ws = [tf.Variable(rng.standard_normal((width, width)).astype(np.float32) / width ** 0.5)
          for _ in range(layers)]
    bs = [tf.Variable(rng.standard_normal(width).astype(np.float32) * 0.1)
          for _ in range(layers)]

    def f(x):
        h = x
        for w, b in zip(ws, bs):
            h = tf.tanh(tf.matmul(h, w) + b)
        return tf.reduce_mean(h * h)
    return f, ws + bs


def assert_grads(expected, got):
    """Every gradient present, of TensorFlow's type (dense vs IndexedSlices), and close."""
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert g is not None
        assert type(e) is type(g), (type(e), type(g))
        # atol 1e-6: float32 gradients near 1e-3 differ by ~2e-7 between the recomputed
        # (graph) and eager kernels where oneDNN's custom ops are on.
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                                   tf.convert_to_tensor(e).numpy(), rtol=1e-5, atol=1e-6)


def reference_gradients(f, variables, x):
    """tf.GradientTape's gradients of `f(x)` with respect to `variables`, as arrays (no
    tensor of the reference step stays alive)."""
    with tf.GradientTape() as ref:
        want = f(x)
    return [g.numpy() for g in ref.gradient(want, variables)]


def step_peaks(f, variables, x, rc, expected, steps):
    """The BFC CPU allocator's peak over the bytes in use before it, of each of `steps`
    training steps: `f(x)` under `rc` (an oh.Recompute) inside an oh.GradientTape, its
    gradients checked against `expected` (run in a process with the BFC allocator:
    `run_bfc`)."""
    import gc  # pylint: disable=import-outside-toplevel
    import tf_ophandlers as oh  # pylint: disable=import-outside-toplevel
    info = tf.config.experimental.get_memory_info
    peaks = []
    for _ in range(steps):
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = info("CPU:0")["current"]
        with oh.GradientTape() as tape:
            with rc:
                loss = f(x)
        grads = tape.gradient(loss, variables)
        peaks.append(info("CPU:0")["peak"] - base)
        assert_grads(expected, [g.numpy() for g in grads])
        del grads, tape, loss
    return peaks


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bfc(code, env=None):
    """Runs `code` in a new process with TensorFlow's BFC CPU allocator (so peak memory
    can be read from its stats) and returns its stdout; a failure shows its output.
    `env`: extra environment variables."""
    return run_python(code, env=dict({"TF_CPU_ALLOCATOR_USE_BFC": "true"}, **(env or {})))
