"""A SavedModel loaded and differentiated under handlers.

A Keras model is exported with `model.export`, loaded back with
`tf.saved_model.load`, and differentiated with `oh.GradientTape` (with respect to the
inputs and to the loaded variables); the gradients equal those of the original model.
Under an `OpLogHandler` the loaded function is replayed through the handler, which sees
the ops of its body (once: the replay is cached), and `CheckNumericsHandler` checks every
op of the loaded model inside the cached function.

    python examples/saved_model_gradients.py
"""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(2)])
path = os.path.join(tempfile.mkdtemp(), "model")
model.export(path, verbose=False)
loaded = tf.saved_model.load(path)

x = tf.constant(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
with oh.GradientTape(persistent=True) as tape:
    tape.watch(x)
    loss = tf.reduce_sum(loaded.serve(x) ** 2)
dx = tape.gradient(loss, x)
dw = tape.gradient(loss, loaded.variables)

with tf.GradientTape(persistent=True) as reference:
    reference.watch(x)
    ref_loss = tf.reduce_sum(model(x) ** 2)
ref_dx = reference.gradient(ref_loss, x)
ref_dw = reference.gradient(ref_loss, model.trainable_variables)
print("max |d loss / d x| difference against the original model: %.2e"
      % float(tf.reduce_max(tf.abs(dx - ref_dx))))
print("max |d loss / d weights| difference: %.2e" % max(
    float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(dw, ref_dw)))

log = oh.OpLogHandler()
with log:
    loaded.serve(x)
print("ops the log saw:", log.op_types_seen())

bad = x + np.float32(np.inf)  # an input the model turns into NaN (inf - inf)
with oh.CheckNumericsHandler():
    try:
        loaded.serve(bad)
    except tf.errors.InvalidArgumentError as e:
        print("CheckNumericsHandler:", e.message.splitlines()[0][:100])
