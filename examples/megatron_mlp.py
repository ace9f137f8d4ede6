"""A Transformer block (Keras MultiHeadAttention + MLP) trained with data x model
parallelism on a 2x2 ("batch", "model") mesh of four logical CPUs with `oh.Mesh`:
Megatron-LM's layouts (attention heads and MLP hidden units split over "model", the
batch over "batch"), gradients from `oh.GradientTape`, and the same losses as the same
model trained on one device.

    python examples/megatron_mlp.py
"""
import numpy as np
import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

import keras  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

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


def main(steps=6, lr=0.1):
    mesh = oh.Mesh({"batch": 2, "model": 2}, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with mesh:  # weights created in the mesh's scope are mesh variables
        model = Block()
        model(np.zeros((B, T, D), "float32"))
    for variable, layout in megatron_layouts(model):
        mesh.shard_variable(variable, layout)  # each device now holds half of it
    single = Block()
    single(np.zeros((B, T, D), "float32"))
    single.set_weights(model.get_weights())

    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, D)).astype("float32")
    y = rng.normal(size=(B, T, D)).astype("float32")
    for step in range(steps):
        with mesh:
            xs = mesh.shard(x, ("batch", None, None))
            ys = mesh.shard(y, ("batch", None, None))
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xs) - ys))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(lr * g)  # g has v's layout: a local update per device
        with tf.GradientTape() as tape:
            ref = tf.reduce_mean(tf.square(single(x) - y))
        for v, g in zip(single.trainable_variables,
                        tape.gradient(ref, single.trainable_variables)):
            v.assign_sub(lr * g)
        print("step %2d  mesh loss %.6f  single-device loss %.6f" % (step, loss, ref))
        assert abs(float(loss) - float(ref)) <= 1e-5 * max(1., abs(float(ref)))
    kernel = model.f1.kernel
    print("f1 kernel", kernel.shape, "layout", mesh.layout_of(kernel), "shards",
          [s.shape.as_list() for s in mesh.unpack(kernel.value)])
    print("ops gathered for lack of a rule:", dict(mesh.fallbacks) or "none")


if __name__ == "__main__":
    main()
