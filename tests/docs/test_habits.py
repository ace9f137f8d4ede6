"""Users' habits around the handlers (the examples' runs with devices configured after the
imports are in test_readme_and_examples.py): handler objects made at the top of a
program, before its devices are configured; those then still configure, and the
handlers work on the configured devices."""
from python_process import run_python


def test_handlers_made_before_devices_are_configured():
    """oh.DataFormat() listed the GPUs in its constructor, which initialized TensorFlow:
    a program making its handlers before configuring its logical CPUs then failed with
    'Virtual devices cannot be modified after being initialized'."""
    code = r'''
import numpy as np, tensorflow as tf, keras
import tf_ophandlers as oh
made = [oh.OpHandler(), oh.OpLogHandler(), oh.CheckNumericsHandler(), oh.GradientTape(),
        oh.Lazy(), oh.Async(), oh.Recompute(), oh.DataFormat(), oh.TraceAndExecute(),
        oh.ShapeInference(), oh.native.PassThrough()]
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
assert len(tf.config.list_logical_devices("CPU")) == 2
x = tf.constant(np.random.default_rng(0).standard_normal((3, 2, 4, 4)).astype(np.float32))
k = tf.constant(np.random.default_rng(1).standard_normal((3, 3, 2, 5)).astype(np.float32))
with tf.device("CPU:1"):
    want = tf.nn.conv2d(tf.transpose(x, [0, 2, 3, 1]), k, 1, "SAME")
for h in made:
    if isinstance(h, (oh.GradientTape, oh.ShapeInference)):  # no values there
        continue
    with h:
        got = tf.nn.conv2d(x, k, 1, "SAME", data_format="NCHW") if isinstance(
            h, oh.DataFormat) else tf.transpose(tf.nn.conv2d(
                tf.transpose(x, [0, 2, 3, 1]), k, 1, "SAME"), [0, 3, 1, 2])
        got = tf.transpose(got, [0, 2, 3, 1])
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)
with made[3] as tape:
    tape.watch(x)
    y = tf.reduce_sum(tf.sin(x))
np.testing.assert_allclose(tape.gradient(y, x).numpy(), np.cos(x.numpy()), rtol=1e-6)
parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])
with parallel:
    print([float(v) for v in parallel.unpack(tf.reduce_sum(parallel.pack([x, 2 * x])))])
print("ok")
'''
    proc = run_python(code, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout
