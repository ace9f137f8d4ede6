"""A channels-first SavedModel on the CPU with `oh.DataFormat()`.

A model exported from GPU training (or converted from a channels-first framework) has
NCHW convolutions and pools, which TensorFlow's CPU kernels refuse (unless oneDNN's
custom ops take them, see step 2). Under
`oh.DataFormat()` the same loaded function runs: its layout-sensitive ops run as NHWC on
data kept channels-last, and its result is what the channels-first model computes.

    python examples/channels_first_on_cpu.py
"""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import tf_ophandlers as oh  # noqa: E402


def build(data_format):
    keras.utils.set_random_seed(0)
    cf = data_format == "channels_first"
    inp = keras.Input((3, 28, 28) if cf else (28, 28, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", data_format=data_format)(inp)
    h = keras.layers.BatchNormalization(axis=1 if cf else -1)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D(2, data_format=data_format)(h)
    h = keras.layers.Conv2D(32, 1, data_format=data_format)(h)
    h = keras.layers.GlobalAveragePooling2D(data_format=data_format)(h)
    return keras.Model(inp, keras.layers.Dense(5)(h))


# 1. Export a channels-first model (tracing it needs no kernels, so this works on a CPU).
model = build("channels_first")
path = os.path.join(tempfile.mkdtemp(), "channels_first_model")
model.export(path, verbose=False)

# 2. Load it: on the CPU, calling it fails with TensorFlow's own kernels. (Where oneDNN's
#    custom ops are on -- TensorFlow's default on x86 CPUs with AVX-512 VNNI/BF16 or AMX --
#    oneDNN's kernels accept these NCHW ops and the call runs; TF_ENABLE_ONEDNN_OPTS=0
#    shows the refusal there.)
loaded = tf.saved_model.load(path)
images = tf.random.stateless_normal([4, 3, 28, 28], seed=[0, 1])  # NCHW
try:
    loaded.serve(images)
    print("without a handler: this TensorFlow runs it (oneDNN's NCHW kernels)")
except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as e:
    reason = next((line for line in e.message.splitlines() if "NHWC" in line), e.message)
    print("without a handler:", reason.strip()[:100])

# 3. Under oh.DataFormat() it runs (the replayed function is cached: later calls run at
#    graph speed), and an OpLogHandler below it shows one transpose, at the input.
log = oh.OpLogHandler()
with log, oh.DataFormat():
    logits = loaded.serve(images)
print("with oh.DataFormat():", logits.shape, "- transposes:",
      log.op_types_seen().count("Transpose"))

# 4. Same result as the channels-last twin of the model with the same weights.
twin = build("channels_last")
twin.set_weights(model.get_weights())
expected = twin(tf.transpose(images, [0, 2, 3, 1]))
print("max difference to the channels-last twin: %.2e"
      % np.abs(logits.numpy() - expected.numpy()).max())
assert np.allclose(logits.numpy(), expected.numpy(), atol=1e-4)
