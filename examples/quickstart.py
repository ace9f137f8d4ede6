"""Quickstart: op handlers intercept every TensorFlow op and compose by nesting scopes.

Run: make demo   (or: python examples/quickstart.py)
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402


class CountFlops(oh.OpHandler):
    """A handler written in a few lines: counts matmul FLOPs, forwards every op.

    Shapes seen in a hook may be partially unknown (`None`): while a `tf.function` (Keras
    `fit`'s train step, whose last batch may be partial) is replayed, a dimension is
    whatever the trace knew. So the count is computed with TensorFlow ops (`tf.shape`,
    `tf.size`) and added to a variable: eagerly it runs at once, in a replayed function
    it becomes part of the function and runs at every call.
    """

    def __init__(self):
        self.flops = tf.Variable(0, dtype=tf.int64, trainable=False)

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type == "MatMul":
            # 2 * (rows * columns of the product) * (the contracted dimension)
            k = tf.shape(inputs[0], out_type=tf.int64)[0 if op.attrs["transpose_a"] else 1]
            self.flops.assign_add(2 * k * tf.size(outputs[0], out_type=tf.int64))
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
    print("matmul FLOPs counted by CountFlops:", int(flops.flops.numpy()))
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
