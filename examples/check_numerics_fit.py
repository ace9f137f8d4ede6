"""`model.fit` wrapped by `CheckNumericsHandler`: a diverging run stops at the first Inf.

The learning rate below is far too large, so the loss overflows within a few steps.
Without the handler, Keras keeps training on NaNs; with it, the first non-finite float
output raises `InvalidArgumentError`. `fit`'s train step is a `tf.function`: it is replayed
through the handler once, with a check after every op of the step (layers, loss, gradients,
optimizer) that runs at every step, so the error names the op, its graph node
(`sequential/dense/MatMul`) and the line of your code that created it when the step was
traced (here the `fit` call below; in a custom layer, the line in its `call`).

    python examples/check_numerics_fit.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.standard_normal((250, 8)).astype(np.float32)  # fit's last batch has 26
y = (x.sum(axis=1, keepdims=True) * 100.).astype(np.float32)


def make_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")  # diverges
    return model


history = make_model().fit(x, y, epochs=3, batch_size=32, verbose=0)
print("without the handler, the losses were:", history.history["loss"])

try:
    with oh.CheckNumericsHandler():
        make_model().fit(x, y, epochs=3, batch_size=32, verbose=0)
    print("no divergence caught")
except tf.errors.InvalidArgumentError as error:
    print("with the handler, training stopped:", str(error).splitlines()[0])
