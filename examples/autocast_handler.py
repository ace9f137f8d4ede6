"""Writing your own handler: bfloat16 autocast of every matmul and convolution.

`Autocast` runs float32 `MatMul`, `BatchMatMulV2` and `Conv2D` ops in bfloat16 (simulated
mixed precision) and casts the result back, so the rest of the program is unchanged. It
composes with the other handlers: under `oh.GradientTape` the backward matmuls are
autocast too (they run on the stack of their forward op), and `oh.testing` checks that it
keeps the contracts of every op (dtypes, shapes, copies, lifetimes).

    python examples/autocast_handler.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402


class Autocast(oh.OpHandler):
    """Runs float32 matmuls and convolutions in bfloat16."""

    OPS = ("MatMul", "BatchMatMulV2", "Conv2D")

    def __init__(self):
        self.autocast = 0

    def execute(self, op, inputs):
        if op.type in self.OPS and op.attrs["T"] == tf.float32:
            self.autocast += 1
            low = [tf.cast(t, tf.bfloat16) for t in inputs]  # runs on self.next
            (out,) = self.next.execute(op.replace(T=tf.bfloat16), low)
            return [tf.cast(out, tf.float32)]
        return self.next.execute(op, inputs)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(4)])
x = tf.constant(np.random.default_rng(0).standard_normal((16, 8, 8, 3)).astype(np.float32))

autocast = Autocast()
with autocast:
    with oh.GradientTape() as tape:
        low = model(x)
        loss = tf.reduce_mean(low ** 2)
grads = tape.gradient(loss, model.trainable_variables)
full = model(x)
print("ops autocast (forward and backward): %d" % autocast.autocast)
print("max |bfloat16 - float32| of the outputs: %.4f (outputs of size ~%.2f)"
      % (float(tf.reduce_max(tf.abs(low - full))), float(tf.reduce_mean(tf.abs(full)))))
print("gradient dtypes:", sorted({g.dtype.name for g in grads}))

report = oh.testing.check_handler(Autocast, values=False)
print("oh.testing:", report, report.failures or "all contracts kept")
assert not report.failures
