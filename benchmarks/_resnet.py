"""The seeded ResNet50 workload shared by benchmarks/recompute.py and recompute_resnet.py
(a module of its own, so that neither script imports the other for it)."""
import numpy as np
import tensorflow as tf


def resnet50(batch, size):
    """keras.applications.ResNet50(weights=None) (seeded) on a `batch` of `size`x`size`
    inputs: ``(model, x, y, loss_fn)``."""
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                        classes=10)
    x = tf.random.normal([batch, size, size, 3])
    y = tf.constant(np.arange(batch) % 10)
    return model, x, y, keras.losses.SparseCategoricalCrossentropy()
