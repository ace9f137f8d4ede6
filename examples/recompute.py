"""Gradient checkpointing with no annotation: `oh.Recompute()` inside `oh.GradientTape()`.

A subclassed Keras MLP of 48 Dense layers trained for a few steps; the handler groups the ops into
about sqrt(n) segments that the tape records as one op each, whose gradient recomputes
them. The gradients equal tf.GradientTape's; the peak memory of a step (TensorFlow's BFC
CPU allocator, enabled below before TensorFlow starts) drops several times.

Also in a tf.function step (graph mode): the segments are put into the traced graph; and
for a tf.function called inside the scope, whose forward function runs as a rewrite.

Run: python examples/recompute.py
"""
import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # peak bytes from TensorFlow's allocator
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402


class DeepMLP(keras.Model):
    """A subclassed model: `call` keeps only the current activation. (A functional or
    Sequential model holds every layer's output until its call returns, so its forward
    pass's peak cannot drop below their sum.)"""

    def __init__(self, depth):
        super().__init__()
        self.hidden = [keras.layers.Dense(64, activation="tanh") for _ in range(depth)]
        self.head = keras.layers.Dense(1)

    def call(self, x):
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)


keras.utils.set_random_seed(0)
model = DeepMLP(48)
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


def oh_step():
    with oh.GradientTape() as tape:
        loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


recompute = oh.Recompute()  # reused every step: from the second, it knows the model's size


def recompute_step():
    with oh.GradientTape() as tape:
        with recompute:
            loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


plain_step(), oh_step(), recompute_step(), recompute_step()  # warm up
plain_peak, (loss0, grads0) = peak(plain_step)
oh_peak, _ = peak(oh_step)
ckpt_peak, (loss1, grads1) = peak(recompute_step)
for g0, g1 in zip(grads0, grads1):
    np.testing.assert_allclose(g1.numpy(), g0.numpy(), rtol=1e-5, atol=1e-7)
print("tf.GradientTape:               peak %5.1f MB" % (plain_peak / 1e6))
print("oh.GradientTape:               peak %5.1f MB" % (oh_peak / 1e6))
print("oh.GradientTape + Recompute(): peak %5.1f MB  (%.1fx lower than tf.GradientTape), "
      "%d segments, same gradients" % (ckpt_peak / 1e6, plain_peak / ckpt_peak,
                                        recompute.stats["segments"]))

for step in range(3):  # training: the optimizer applies the checkpointed gradients
    loss, grads = recompute_step()
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    print("step %d: loss %.4f" % (step, float(loss)))

# A memory budget halfway between the minimum and the whole computation: the cheapest
# tensors are recomputed first (bias adds, tanh); MatMuls only as far as the budget needs
# (`stats["recomputed"]` counts the recomputed ops by type).
budget = oh.Recompute(memory_budget=(recompute.minimum_budget()
                                     + recompute.stats["computed"]) // 2)


def budget_step():
    with oh.GradientTape() as tape:
        with budget:
            loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


budget_step()  # the first scope measures the computation; the next ones plan
budget_peak, (_, grads2) = peak(budget_step)
for g0, g2 in zip(plain_step()[1], grads2):  # (the weights changed: a fresh reference)
    np.testing.assert_allclose(g2.numpy(), g0.numpy(), rtol=1e-5, atol=1e-7)
print("memory_budget=%.1f MB: peak %.1f MB, recomputed ops %s" % (
    budget.memory_budget / 1e6, budget_peak / 1e6, budget.stats["recomputed"]))

# Graph mode: opened inside a traced step, the handler puts its segments into the graph
# (their gradients recompute them in the backward pass), so a tf.function step saves
# memory too; `model.fit` opened inside `with oh.Recompute():` does the same for the
# train step it traces there.
graph_recompute = oh.Recompute()


@tf.function
def graph_step(use_recompute):
    with tf.GradientTape() as tape:
        if use_recompute:
            with graph_recompute:
                loss = loss_fn()
        else:
            loss = loss_fn()
    return loss, tape.gradient(loss, model.trainable_variables)


graph_plain, graph_ckpt = graph_step.get_concrete_function(False), \
    graph_step.get_concrete_function(True)
graph_plain_peak, (_, g_plain) = peak(graph_plain)
graph_ckpt_peak, (_, g_ckpt) = peak(graph_ckpt)
for a, b in zip(g_plain, g_ckpt):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-7)
print("tf.function step: peak %.1f MB, with oh.Recompute() inside %.1f MB (%d segments)"
      % (graph_plain_peak / 1e6, graph_ckpt_peak / 1e6,
         graph_recompute.stats["segments"]))

# A tf.function *called* inside an eager scope: its forward function runs as a rewrite
# whose segments are recomputed in the backward pass (stats["call_segments"]).
forward = tf.function(loss_fn)
called = oh.Recompute()


def call_step(handler):
    with oh.GradientTape() as tape:
        if handler is None:
            loss = forward()
        else:
            with handler:
                loss = forward()
    return loss, tape.gradient(loss, model.trainable_variables)


call_step(None), call_step(called)  # warm-up: traces
call_plain_peak, (_, g_plain) = peak(lambda: call_step(None))
call_ckpt_peak, (_, g_ckpt) = peak(lambda: call_step(called))
for a, b in zip(g_plain, g_ckpt):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-7)
print("called tf.function: peak %.1f MB, inside oh.Recompute() %.1f MB (%d segments)"
      % (call_plain_peak / 1e6, call_ckpt_peak / 1e6, called.stats["call_segments"]))
