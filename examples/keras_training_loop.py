"""A custom Keras training loop whose gradients come from `oh.GradientTape`.

`oh.GradientTape` is a drop-in replacement for `tf.GradientTape`: reverse-mode autodiff
written as an op handler. Because it is a handler, it composes with other handlers by
nesting scopes: here an `OpLogHandler` around the tape sees the forward ops *and* the
gradient ops, since each gradient runs on the stack its forward op ran on.

    python examples/keras_training_loop.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.standard_normal((250, 8)).astype(np.float32)
y = (x @ rng.standard_normal((8, 1)) + 0.1 * rng.standard_normal((250, 1))).astype(np.float32)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # the last batch has 26

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.Adam(0.01)
loss_fn = keras.losses.MeanSquaredError()


def train_step(features, labels):
    with oh.GradientTape() as tape:          # was: tf.GradientTape()
        loss = loss_fn(labels, model(features, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return float(loss)


for epoch in range(5):
    losses = [train_step(f, l) for f, l in data]
    print("epoch %d  loss %.4f" % (epoch, np.mean(losses)))

# The same step under a log handler: the backward ops run where the forward ops ran.
log = oh.OpLogHandler()
with log:
    with oh.GradientTape() as tape:
        loss = loss_fn(y[:32], model(x[:32]))
    n_forward = len(log.records)
grads = tape.gradient(loss, model.trainable_variables)  # outside every scope
backward = sorted(set(log.op_types_seen()[n_forward:]))
print("forward ops logged: %d; gradient ops logged afterwards: %s" % (n_forward, backward))

# And the result is what tf.GradientTape gives.
with tf.GradientTape() as reference:
    ref_loss = loss_fn(y[:32], model(x[:32]))
ref = reference.gradient(ref_loss, model.trainable_variables)
print("max |oh - tf| over all gradients: %.2e" % max(
    float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grads, ref)))
