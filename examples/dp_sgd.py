"""Per-example gradients with clipping (DP-SGD style): `oh.vectorized_map` over
`oh.GradientTape`.

Each example's gradient is computed by the same eager code you would write for one
example; `oh.vectorized_map` runs it once for the whole batch (every op batched), then
each gradient is clipped to norm 1, averaged, and noised before the update.

    python examples/dp_sgd.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
N = 500  # the last batch of 64 has 52 examples
x = rng.standard_normal((N, 10)).astype(np.float32)
y = (x[:, :3].sum(axis=1) > 0).astype(np.int32)
model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(2)])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.SGD(0.5)
CLIP, NOISE = 1.0, 0.05


def example_gradient(example):
    features, label = example
    with oh.GradientTape() as tape:
        loss = loss_fn(label[None], model(features[None]))
    grads = tape.gradient(loss, model.trainable_variables)
    norm = tf.linalg.global_norm(grads)
    return [g * tf.minimum(1., CLIP / (norm + 1e-6)) for g in grads]  # clip per example


def dp_step(features, labels):
    per_example = oh.vectorized_map(example_gradient, (features, labels))  # [B, ...] each
    batch = tf.cast(tf.shape(features)[0], tf.float32)  # also a None dim in a tf.function
    noisy = [tf.reduce_mean(g, axis=0) + tf.random.normal(g.shape[1:], stddev=NOISE * CLIP / batch)
             for g in per_example]
    optimizer.apply_gradients(zip(noisy, model.trainable_variables))


# The per-example gradients equal a loop of tf.GradientTape over the examples.
check = oh.vectorized_map(example_gradient, (x[:4], y[:4]))
for i in range(4):
    with tf.GradientTape() as tape:
        loss = loss_fn(y[i:i + 1], model(x[i:i + 1]))
    grads = tape.gradient(loss, model.trainable_variables)
    scale = min(1., CLIP / (float(tf.linalg.global_norm(grads)) + 1e-6))
    assert all(np.allclose(c[i], g * scale, atol=1e-5) for c, g in zip(check, grads))
print("per-example clipped gradients match a loop of tf.GradientTape")

for epoch in range(5):
    for i in range(0, N, 64):
        dp_step(x[i:i + 64], y[i:i + 64])
    accuracy = np.mean(np.argmax(model(x), axis=1) == y)
    print("epoch %d  accuracy %.3f" % (epoch, accuracy))
