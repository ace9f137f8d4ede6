"""Data-parallel training of a Keras MLP over two logical CPUs with `oh.ParallelHandler`.

Each op inside the handler's scope runs once per device. The model's variables live on
the host; used inside the scope they are broadcast to both devices (CopyOn), and the
gradient of that broadcast sums the devices' gradients (CopyOnGrad): an all-reduce,
without any code for it. The step is the one of a single-device loop, with the batch
split by `parallel.pack`.

    python examples/data_parallel.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

# Two logical CPUs, configured after the imports (importing tf_ophandlers does not
# initialize TensorFlow's devices; the first handler scope does).
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
N = 501  # the last batch of 64 has 53 examples: 26 and 27 per device
x = rng.standard_normal((N, 16)).astype(np.float32)
y = rng.integers(0, 4, N)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(4)])
optimizer = keras.optimizers.Adam(0.01)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

DEVICES = ["CPU:0", "CPU:1"]


def train_step(features, labels):
    half = features.shape[0] // 2
    with oh.ParallelHandler(DEVICES) as parallel:  # a handler per step, as a tape
        with oh.GradientTape() as tape:
            xb = parallel.pack([features[:half], features[half:]])   # one shard per device
            yb = parallel.pack([labels[:half], labels[half:]])
            loss = loss_fn(yb, model(xb)) / features.shape[0]
        grads = tape.gradient(loss, model.trainable_variables)  # summed over devices
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return sum(float(part) for part in parallel.unpack(loss))


for epoch in range(5):
    losses = [train_step(x[i:i + 64], y[i:i + 64]) for i in range(0, N, 64)]
    print("epoch %d  loss %.4f" % (epoch, np.mean(losses)))

parallel = oh.ParallelHandler(DEVICES)
with parallel:
    logits = model(parallel.pack([x[:4], x[4:8]]))
print("per-device logits live on:", [t.device for t in parallel.unpack(logits)])
