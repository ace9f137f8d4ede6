"""Quantization-aware training with a handler: fake-quantize every matmul's inputs.

`FakeQuant` runs each forward float32 `MatMul` (and `Conv2D`) on the 8-bit fake
quantization of its inputs, `tf.quantization.fake_quant_with_min_max_vars`, whose
gradient is TensorFlow's straight-through estimator (the incoming gradient inside
[min, max], zero outside). It changes what ops compute, so it keeps the default
`changes_computation = True`, and a compiled `model.fit` gets the gradient of what ran:
its train step holds gradient ops built when Keras traced it for the float matmuls, so
under the handler the step's Python body is traced again, and the tape inside records
the fake-quant ops the handler ran.

The handler leaves the backward pass alone: the ops a tape's gradient functions build
(under TensorFlow's "gradient_tape/" name scope) are not quantized, as in a model written
with fake-quant ops, which this script trains side by side and compares (losses and
weights). (Eagerly, `run_eagerly=True`, TensorFlow's tape keeps no output of a MatMul to
find what ran by: that raises `oh.HandlerError`; use `oh.GradientTape` there.)

    python examples/fake_quant_handler.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

LOW, HIGH, BITS = -2.0, 2.0, 8


def fake_quant(t):
    return tf.quantization.fake_quant_with_min_max_vars(
        t, tf.constant(LOW), tf.constant(HIGH), num_bits=BITS)


class FakeQuant(oh.OpHandler):
    """Fake-quantizes the float32 inputs of forward matmuls and convolutions."""

    OPS = ("MatMul", "Conv2D")

    def __init__(self):
        self.quantized = 0  # ops quantized (once per replay in a compiled step)

    def execute(self, op, inputs):
        backward = tf.get_current_name_scope().startswith("gradient_tape")
        if op.type in self.OPS and op.attrs["T"] == tf.float32 and not backward:
            self.quantized += 1
            return self.next.execute(op, [fake_quant(t) for t in inputs])  # on self.next
        return self.next.execute(op, inputs)


class FakeQuantDense(keras.layers.Dense):
    """The same layer written by hand with the fake-quant ops."""

    def call(self, inputs):
        y = tf.matmul(fake_quant(inputs), fake_quant(self.kernel)) + self.bias
        return self.activation(y)


def train(layer, handler=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), layer(16, activation="tanh"), layer(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    r = np.random.default_rng(0)
    x = r.standard_normal((64, 6)).astype(np.float32)
    y = (x[:, :1] * 0.7 - x[:, 1:2] ** 2 * 0.3).astype(np.float32)
    if handler is None:
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    else:
        with handler:
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return history.history["loss"], model.get_weights()


by_hand, by_hand_weights = train(FakeQuantDense)
plain, _ = train(keras.layers.Dense)
handler = FakeQuant()
losses, weights = train(keras.layers.Dense, handler)
print("fit under FakeQuant:                losses %s (%d matmuls quantized in the "
      "re-traced step)" % (np.round(losses, 5), handler.quantized))
print("model written with fake-quant ops:  losses %s" % np.round(by_hand, 5))
print("float model:                        losses %s" % np.round(plain, 5))
np.testing.assert_allclose(losses, by_hand, rtol=1e-6, atol=1e-7)
for got, want in zip(weights, by_hand_weights):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
assert not np.allclose(losses, plain, rtol=1e-4)  # quantization did change training
