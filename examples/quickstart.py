"""Quickstart: op handlers intercept every TensorFlow op and compose by nesting scopes.

Run: make demo   (or: python examples/quickstart.py)
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402


class CountFlops(oh.OpHandler):
    """A handler written in a few lines: counts matmul FLOPs, forwards every op."""

    def __init__(self):
        self.flops = 0

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type == "MatMul":
            (m, k), n = inputs[0].shape, outputs[0].shape[-1]
            self.flops += 2 * m * k * n
        return outputs


def main():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    data = tf.random.stateless_normal([8, 32], seed=[0, 1])

    log, flops = oh.OpLogHandler(), CountFlops()
    with log:                      # outer: sees what the inner handlers send on
        with flops:                # inner: sees each op first
            with oh.CheckNumericsHandler():
                logits = model(data)   # an ordinary Keras call, unchanged

    # The outer log also sees the CheckNumericsV2 ops the innermost handler runs: handlers
    # of outer scopes see executions as transformed by the handlers nested inside them.
    print("ops seen by OpLogHandler:", " ".join(log.op_types_seen()))
    print("matmul FLOPs counted by CountFlops:", flops.flops)
    print("stack of the result:", oh.handler_of(logits))
    print("same values as plain TensorFlow:",
          bool(tf.reduce_all(tf.abs(logits - model(data)) < 1e-6)))

    try:
        with oh.CheckNumericsHandler():
            tf.math.log(tf.constant([1.0, 0.0]))
    except tf.errors.InvalidArgumentError as e:
        print("CheckNumericsHandler caught:", e.message)


if __name__ == "__main__":
    main()
