"""A subclass of a handler declaring `physical_copy_on` (oh.VectorizedMap) that overrides
`copy_on`: the C++ path (cc/fast/fast_hook.cc RunHook) must call the subclass's copy_on for a
physical input, not the inherited `physical_copy_on`, which stands in for the parent's
copy_on only (the inherited one must not silently replace it). The same for a `copy_on`
set on an instance, and an instance's own `physical_copy_on` is used; one
function decides (core/fast_decision.py `physical_copy_of`)."""
import numpy as np
import pytest
import tensorflow as tf

from tf_ophandlers.core.fast_decision import physical_copy_of
from tf_ophandlers.core.stack import PHYSICAL, next_stack, representation_of, stack_of
from tf_ophandlers.handlers.vectorized_map.batching_rules import Batched
from tf_ophandlers.handlers.vectorized_map.handler import VectorizedMap


class _Shifted(VectorizedMap):
    """Copies a physical input on as a batched value, example k shifted by k."""

    def copy_on(self, tensor):
        if stack_of(tensor) is None and next_stack() is PHYSICAL:
            shift = tf.reshape(tf.range(self.size, dtype=tensor.dtype),
                               [self.size] + [1] * tensor.shape.rank)
            return Batched(tensor[None] + shift, True)
        return super().copy_on(tensor)


def test_subclass_copy_on_is_called_for_physical_inputs():
    assert physical_copy_of(_Shifted(3)) is None
    assert physical_copy_of(VectorizedMap(3)) is VectorizedMap.physical_copy_on is not None
    c = tf.constant([10.0, 20.0])
    want = np.sin(np.array([[10.0, 20.0], [11.0, 21.0], [12.0, 22.0]], np.float32))
    for _ in range(3):  # (the C++ path's decisions are made at the first runs)
        h = _Shifted(3)
        with h:
            y = tf.sin(c)
        found, value = representation_of(h, y)
        assert found and value.batched
        np.testing.assert_allclose(value.value.numpy(), want, rtol=1e-6)


def _shifted_copy_on(h):
    """`_Shifted.copy_on` as an instance's own function (a plain VectorizedMap's)."""
    return lambda tensor: _Shifted.copy_on(h, tensor)


def test_instance_copy_on_is_called_for_physical_inputs():
    c = tf.constant([10.0, 20.0])
    want = np.sin(np.array([[10.0, 20.0], [11.0, 21.0], [12.0, 22.0]], np.float32))
    plain = np.sin(np.array([[10.0, 20.0]] * 3, np.float32))
    for _ in range(3):
        h = VectorizedMap(3)
        h.copy_on = _shifted_copy_on(h)
        assert physical_copy_of(h) is None
        with h:
            y = tf.sin(c)
        found, value = representation_of(h, y)
        assert found and value.batched
        np.testing.assert_allclose(value.value.numpy(), want, rtol=1e-6)
        # Stacks of plain instances between them keep the class's shortcut.
        h = VectorizedMap(3)
        with h:
            y = tf.sin(c)
        found, value = representation_of(h, y)
        assert found and not value.batched
        np.testing.assert_allclose(np.broadcast_to(value.value.numpy(), (3, 2)), plain,
                                   rtol=1e-6)


class _OwnCopyOn(VectorizedMap):
    """Sets its own copy_on (so the class's physical_copy_on no longer stands in for it):
    a physical input as an unbatched value, as VectorizedMap's."""

    def copy_on(self, tensor):
        if stack_of(tensor) is None and next_stack() is PHYSICAL:
            return Batched(tensor, False)
        return super().copy_on(tensor)


def _with_own_physical_copy_on():
    """Runs Sin of a physical tensor under _OwnCopyOn instances that set their own
    `physical_copy_on`, counting its calls (as the contract says, it gives what their
    copy_on gives): [(handler, result, calls)]."""
    c = tf.constant([10.0, 20.0])
    runs = []
    for _ in range(3):
        h = _OwnCopyOn(3)
        assert physical_copy_of(h) is None
        calls = []
        h.physical_copy_on = lambda tensor, calls=calls: (calls.append(1),
                                                          Batched(tensor, False))[1]
        assert physical_copy_of(h) is h.physical_copy_on
        with h:
            y = tf.sin(c)
        runs.append((h, y, calls))
    return runs


def test_instance_physical_copy_on_gives_the_copy_ons_values():
    for h, y, _ in _with_own_physical_copy_on():
        found, value = representation_of(h, y)
        assert found and not value.batched
        np.testing.assert_allclose(value.value.numpy(), np.sin([10.0, 20.0]), rtol=1e-6)


@pytest.mark.requires_c_paths("the C++ path calls physical_copy_on for copy_on")
def test_instance_physical_copy_on_is_used():
    for _, _, calls in _with_own_physical_copy_on():
        assert calls


class _CountingCopies(VectorizedMap):
    """`physical_copy_on` as a method reading the instance (it counts its calls; as the
    contract says, it runs no ops)."""

    def __init__(self, size):
        super().__init__(size)
        self.copies = 0

    def physical_copy_on(self, tensor):
        self.copies += 1
        return Batched(tensor, False)


def _counting_handlers():
    """Three _CountingCopies, each running Sin of a physical tensor: [(handler, result)]."""
    c = tf.constant([10.0, 20.0])
    runs = []
    for _ in range(3):
        h = _CountingCopies(2)
        with h:
            y = tf.sin(c)
        runs.append((h, y))
    return runs


def test_a_physical_copy_on_method_gives_each_handler_its_values():
    for h, y in _counting_handlers():
        found, value = representation_of(h, y)
        assert found and not value.batched
        np.testing.assert_allclose(value.value.numpy(), np.sin([10.0, 20.0]), rtol=1e-6)


@pytest.mark.requires_c_paths("the C++ path calls physical_copy_on for copy_on")
def test_a_physical_copy_on_method_is_bound_to_each_stacks_handler():
    # final read: the stack's shared per-class fields held the first handler's bound
    # method, so a later handler's physical inputs went to the first handler's method.
    assert [h.copies for h, _ in _counting_handlers()] == [1, 1, 1]
