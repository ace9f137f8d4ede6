"""Gradient checkpointing with no annotation: `oh.Recompute()` inside `oh.GradientTape()`.

A Keras MLP of 48 Dense layers trained for a few steps; the handler groups the ops into
about sqrt(n) segments that the tape records as one op each, whose gradient recomputes
them. The gradients equal tf.GradientTape's; the peak memory of a step (TensorFlow's BFC
CPU allocator, enabled below before TensorFlow starts) drops several times.

Run: python examples/recompute.py
"""
import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # peak bytes from TensorFlow's allocator
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,))]
                         + [keras.layers.Dense(64, activation="tanh") for _ in range(48)]
                         + [keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.01)
x = tf.random.normal([512, 64])
y = tf.random.normal([512, 1])


def loss_fn():
    return tf.reduce_mean((model(x) - y) ** 2)


def peak(step):
    """Peak bytes allocated while `step()` runs, above what was in use before."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    result = step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base, result


def plain_step():
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


recompute = oh.Recompute()  # reused every step: from the second, it knows the model's size


def recompute_step():
    with oh.GradientTape() as tape:
        with recompute:
            loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


plain_step(), recompute_step()  # warm up (traces the segments' gradient functions)
plain_peak, (loss0, grads0) = peak(plain_step)
ckpt_peak, (loss1, grads1) = peak(recompute_step)
for g0, g1 in zip(grads0, grads1):
    np.testing.assert_allclose(g1.numpy(), g0.numpy(), rtol=1e-5, atol=1e-7)
print("tf.GradientTape:               peak %5.1f MB" % (plain_peak / 1e6))
print("oh.GradientTape + Recompute(): peak %5.1f MB  (%.1fx lower), %d segments, same gradients"
      % (ckpt_peak / 1e6, plain_peak / ckpt_peak, recompute.stats["segments"]))

for step in range(3):  # training: the optimizer applies the checkpointed gradients
    loss, grads = recompute_step()
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    print("step %d: loss %.4f" % (step, float(loss)))
