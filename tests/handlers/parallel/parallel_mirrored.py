"""The one `tf.distribute.MirroredStrategy` on the two logical CPUs that the test modules
of this directory compare with. Each MirroredStrategy allocates collective keys from a
counter of its own (group 1, instance 100, ...): a second one in the same process reuses
the first one's keys, and TensorFlow aborts its collective ("Shape mismatch in the
collective instance 100") when the tensors differ."""
import functools

import tensorflow as tf

DEVICES = ["CPU:0", "CPU:1"]


@functools.lru_cache(maxsize=None)
def mirrored_strategy():
    return tf.distribute.MirroredStrategy(DEVICES)
