"""A handler that only looks at what ran: `after_execute` (no Python `execute`).

`FlopCounter` counts the multiply-adds of every MatMul a Keras model runs. Defining
`after_execute` instead of `execute` lets the C++ fast path run each op itself and make
just this one Python call (oh.GradientTape records this way, in C). The values are
TensorFlow's; the count is checked against the layer sizes.
"""
import keras
import numpy as np
import tensorflow as tf

import tf_ophandlers as oh


class FlopCounter(oh.OpHandler):
    """Counts MatMul multiply-adds.

    >>> with FlopCounter() as c:
    ...     _ = tf.matmul(tf.ones([2, 3]), tf.ones([3, 4]))
    >>> c.madds
    24
    """

    transparent = True  # tensors show the CPU, as without the handler
    handles_ops = frozenset({"MatMul"})  # other ops: forwarded in C, no Python at all

    def __init__(self):
        self.madds = 0

    def after_execute(self, op, inputs, outputs):
        (out,) = outputs
        m, n = out.shape
        k = inputs[0].shape[0 if op.attrs["transpose_a"] else 1]
        self.madds += int(m) * int(k) * int(n)


def main():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    x = np.random.default_rng(0).standard_normal((7, 32)).astype("float32")  # partial batch
    with FlopCounter() as counter:
        y = model(x)
    np.testing.assert_allclose(y, model(x), rtol=1e-6)  # same values as without it
    assert counter.madds == 7 * (32 * 64 + 64 * 10), counter.madds
    print("MatMul multiply-adds of one forward pass:", counter.madds)


if __name__ == "__main__":
    main()
