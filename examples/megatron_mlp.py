"""A Transformer block (Keras MultiHeadAttention + MLP) trained with data x model
parallelism on a 2x2 ("batch", "model") mesh of four logical CPUs with `oh.Mesh`:
Megatron-LM's layouts (attention heads and MLP hidden units split over "model", the
batch over "batch"), gradients from `oh.GradientTape`, Keras's Adam (its slot variables
take the layouts of their weights), a dataset whose last batch (3 of 11 examples) does
not divide over "batch" (kept replicated, reported once), and the same losses as the
same model trained on one device.

    python examples/megatron_mlp.py
"""
import keras
import numpy as np
import tensorflow as tf

import tf_ophandlers as oh

# Four logical CPUs, configured after the imports (importing tf_ophandlers does not
# initialize TensorFlow's devices; the first handler scope does).
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

B, T, D, HEADS, HIDDEN = 4, 6, 8, 4, 16


class Block(keras.Model):
    def __init__(self):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=D // HEADS)
        self.ln1, self.ln2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
        self.f1 = keras.layers.Dense(HIDDEN, activation="gelu")
        self.f2 = keras.layers.Dense(D)

    def call(self, x):
        x = self.ln1(x + self.att(x, x))
        return self.ln2(x + self.f2(self.f1(x)))


def megatron_layouts(block):
    heads = {"query/kernel": (None, "model", None), "key/kernel": (None, "model", None),
             "value/kernel": (None, "model", None), "query/bias": ("model", None),
             "key/bias": ("model", None), "value/bias": ("model", None),
             "attention_output/kernel": ("model", None, None)}
    pairs = [(v, layout) for v in block.att.trainable_variables
             for suffix, layout in heads.items() if v.path.endswith(suffix)]
    return pairs + [(block.f1.kernel, (None, "model")), (block.f1.bias, ("model",)),
                    (block.f2.kernel, ("model", None))]


def main(epochs=2, lr=0.01):
    mesh = oh.Mesh({"batch": 2, "model": 2}, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with mesh:  # weights and optimizer state created in the mesh's scope are mesh variables
        model = Block()
        model(np.zeros((B, T, D), "float32"))
        optimizer = keras.optimizers.Adam(lr)
    for variable, layout in megatron_layouts(model):
        mesh.shard_variable(variable, layout)  # each device now holds half of it
    single = Block()
    single(np.zeros((B, T, D), "float32"))
    single.set_weights(model.get_weights())
    single_optimizer = keras.optimizers.Adam(lr)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, T, D)).astype("float32")
    y = rng.normal(size=(11, T, D)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)  # batches of 4, 4 and 3
    for epoch in range(epochs):
        for xb, yb in data:
            with mesh:
                xs = mesh.shard(xb, ("batch", None, None))  # 3 rows: replicated
                ys = mesh.shard(yb, ("batch", None, None))
                with oh.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(xs) - ys))
                grads = tape.gradient(loss, model.trainable_variables)
                # g has v's layout; Adam's slots take it too: a local update per device
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            with tf.GradientTape() as tape:
                ref = tf.reduce_mean(tf.square(single(xb) - yb))
            single_optimizer.apply_gradients(zip(
                tape.gradient(ref, single.trainable_variables), single.trainable_variables))
            print("epoch %d batch of %d  mesh loss %.6f  single-device loss %.6f"
                  % (epoch, xb.shape[0], loss, ref))
            assert abs(float(loss) - float(ref)) <= 1e-4 * max(1., abs(float(ref)))
    kernel = model.f1.kernel
    print("f1 kernel", kernel.shape, "layout", mesh.layout_of(kernel), "shards",
          [s.shape.as_list() for s in mesh.unpack(kernel.value)])
    slot = next(v for v in optimizer.variables if "momentum" in v.path and v.shape == kernel.shape)
    print("its Adam momentum", slot.path, "layout", mesh.layout_of(slot))
    print("ops gathered for lack of a rule:", dict(mesh.fallbacks) or "none")
    print("axes kept replicated (partial batches):", dict(mesh.uneven))


if __name__ == "__main__":
    main()
