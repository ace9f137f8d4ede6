"""Handlers after TensorFlow's eager context is replaced.

The C++ side keeps TFE_Ops for reuse (a thread's cached op, a pool of released ones) and
registers the dispatcher device in one context. Tests and some programs replace the
context (`context._reset_context()`, e.g. to configure devices anew): the runtime must
move to the new context (its device registered there, no op of the old one reused), or
ops placed on handler scopes silently run on the CPU without their handler (the new
context does not know the dispatcher device: soft placement) or in the old context."""
from python_process import run_python

_CHECKS = """
import numpy as np
import tensorflow as tf
import tf_ophandlers as oh
from tensorflow.python.eager import context


class Count(oh.OpHandler):
    def __init__(self):
        self.types = []

    def execute(self, op, inputs):
        self.types.append(op.type)
        return self.next.execute(op, inputs)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def check():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((2, 5, 5, 3)).astype(np.float32))
    w = tf.constant(rng.standard_normal((3, 3, 3, 4)).astype(np.float32))

    def model(x):
        y = tf.concat([x, x * 2.0], axis=-1)  # list inputs: not the capture-free path
        y = tf.nn.conv2d(y, tf.concat([w, w], axis=2), 1, "SAME")
        return tf.reduce_sum(tf.nn.relu(y) * tf.sin(y), axis=[1, 2])

    expected = model(x)
    c = Count()
    with c:
        y = model(x)
        assert oh.handler_of(y) is not None  # a handler tensor, not a physical one
    close(y, expected)
    counted = list(c.types)

    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(model(x) ** 2)
    expected_grad = tape.gradient(loss, x)
    with oh.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(model(x) ** 2)
    close(tape.gradient(loss, x), expected_grad)

    close(oh.vectorized_map(lambda e: model(e[None])[0], x),
          tf.vectorized_map(lambda e: model(e[None])[0], x))

    with oh.Lazy():
        z = model(x)
    close(z, expected)
    with oh.DataFormat():
        z = model(x)
    close(z, expected)
    return counted


before = check()
context._reset_context()
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
assert len(tf.config.list_logical_devices("CPU")) == 2
after = check()
assert after == before, (before, after)  # every op still reaches the handler

# The devices configured anew are the ones handlers run on.
with oh.ParallelHandler(["/cpu:0", "/cpu:1"]) as p:
    v = p.pack([tf.constant(1.0), tf.constant(2.0)])
    u = v * 3.0
close([float(t) for t in p.unpack(u)], [3.0, 6.0])
h = oh.OpHandler()
with h:
    with tf.device("/cpu:1"):
        t = tf.constant([1.0, 2.0]) * 2.0
close(t, [2.0, 4.0])
assert t.device.endswith("device:OPHANDLER:0"), t.device
# (run by a TFE_Op of the old context, it would land on that context's only CPU)
found, value = oh.representation_of(h, t)
assert found and value.device.endswith("device:CPU:1"), value.device

tf.config.experimental.set_synchronous_execution(False)
try:
    assert check() == before
finally:
    tf.config.experimental.set_synchronous_execution(True)

for _ in range(3):  # again, and with the old contexts gone
    context._reset_context()
    import gc
    gc.collect()
    assert check() == before
print("ok", len(before))
"""


def test_handlers_run_after_eager_context_reset():
    stdout = run_python(_CHECKS, timeout=400)
    assert stdout.strip().splitlines()[-1].startswith("ok ")
