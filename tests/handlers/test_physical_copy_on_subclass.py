"""A subclass of a handler declaring `physical_copy_on` (oh.VectorizedMap) that overrides
`copy_on`: the C++ path (cc/fast_hook.cc RunHook) must call the subclass's copy_on for a
physical input, not the inherited `physical_copy_on`, which stands in for the parent's
copy_on only (review2: the inherited one silently replaced it)."""
import numpy as np
import tensorflow as tf

from tf_ophandlers.core.stack import PHYSICAL, next_stack, representation_of, stack_of
from tf_ophandlers.handlers.batching_rules import Batched
from tf_ophandlers.handlers.vectorized_map import VectorizedMap


class _Shifted(VectorizedMap):
    """Copies a physical input on as a batched value, example k shifted by k."""

    def copy_on(self, tensor):
        if stack_of(tensor) is None and next_stack() is PHYSICAL:
            shift = tf.reshape(tf.range(self.size, dtype=tensor.dtype),
                               [self.size] + [1] * tensor.shape.rank)
            return Batched(tensor[None] + shift, True)
        return super().copy_on(tensor)


def test_subclass_copy_on_is_called_for_physical_inputs():
    assert _Shifted.physical_copy_on is None
    assert VectorizedMap.physical_copy_on is not None
    c = tf.constant([10.0, 20.0])
    want = np.sin(np.array([[10.0, 20.0], [11.0, 21.0], [12.0, 22.0]], np.float32))
    for _ in range(3):  # (the C++ path's decisions are made at the first runs)
        h = _Shifted(3)
        with h:
            y = tf.sin(c)
        found, value = representation_of(h, y)
        assert found and value.batched
        np.testing.assert_allclose(value.value.numpy(), want, rtol=1e-6)
