"""The README's example and the examples/ scripts run as documented."""
import pathlib
import re

import pytest

from python_process import run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_example_runs_and_prints_what_it_says():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    proc = run_python(code, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("1 ['Fill', 'CheckNumericsV2', 'Fill'")
    assert "MatMul" in first


# Users' habits: TensorFlow, Keras and tf_ophandlers imported first, logical devices
# configured afterwards (an example that configures its own later still may: devices
# are initialized by the first op or handler scope, not by the imports).
_HABITS = """
import os, runpy, sys
import tensorflow as tf, keras
import tf_ophandlers as oh
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
sys.argv = [%r]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# Run (half a minute: it starts worker processes) and checked by its own test,
# tests/handlers/parallel/test_two_processes.py.
_OWN_TEST = {"two_process_training.py"}


@pytest.mark.parametrize("script", [p for p in sorted((ROOT / "examples").glob("*.py"))
                                    if p.name not in _OWN_TEST], ids=lambda p: p.name)
def test_example_runs(script):
    """Each example, run after the imports and a device configuration as users write
    them (the examples themselves open a handler per step, feed partial last batches and
    train with model.fit or a custom loop)."""
    proc = run_python(_HABITS % str(script), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_quickstart_count_flops_under_fit_with_a_partial_last_batch():
    """Keras replays the train step with an unknown (None) batch
    dimension; the quickstart's CountFlops multiplied static dims and crashed in fit. It
    must count every step's matmul FLOPs (the partial last batch included) and leave the
    losses equal to plain fit's."""
    code = r'''
import sys
sys.path.insert(0, "examples")
import keras, numpy as np, tensorflow as tf
import tf_ophandlers as oh
from quickstart import CountFlops

def make():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64),
                              keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model

x = np.random.default_rng(0).standard_normal((10, 32)).astype(np.float32)
y = np.ones((10, 10), np.float32)
plain = make().fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
flops = CountFlops()
with flops:
    handled = make().fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
# Per example: forward x@W1 (32x64), h@W2 (64x10); backward dW1 = x^T dh, dh = dy W2^T,
# dW2 = h^T dy (no gradient for the input).
per_example = 2 * (32 * 64 + 64 * 10 + 32 * 64 + 64 * 10 + 64 * 10)
print(int(flops.flops.numpy()), 2 * len(x) * per_example)
print(np.allclose(plain, handled, rtol=1e-6), plain, handled)
'''
    proc = run_python(code, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counted, expected = proc.stdout.splitlines()[0].split()
    assert counted == expected
    assert proc.stdout.splitlines()[1].startswith("True"), proc.stdout
