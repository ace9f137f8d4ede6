"""Shared by the Recompute tests (test_recompute.py, test_recompute_gradients.py): a deep
tanh MLP with its variables, the gradient comparison against tf.GradientTape's, and a
subprocess runner for BFC peak-memory measurements."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow as tf


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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bfc(code, env=None):
    """Runs `code` in a fresh Python with TensorFlow's BFC CPU allocator (so peak memory
    can be read from its stats) and returns its stdout; a failure shows its output.
    `env`: extra environment variables."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout
