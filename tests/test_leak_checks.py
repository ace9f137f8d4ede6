"""The leak checks the autodiff tests run under (conftest.tf_leak_checked) still catch
a tensor the test keeps alive with the pre-test heap frozen out of their view, and leave
the collector as they found it."""
import gc

import pytest
import tensorflow as tf

from conftest import tf_leak_checked

_kept = []


def test_a_tensor_kept_alive_by_the_test_fails_the_check():
    @tf_leak_checked
    def leaks():
        _kept.append(tf.constant([1.0, 2.0]) * 3.0)
    try:
        with pytest.raises(AssertionError):
            leaks()
    finally:
        _kept.clear()


def test_a_clean_test_passes_and_the_heap_is_unfrozen_after():
    @tf_leak_checked
    def clean():
        return float(tf.reduce_sum(tf.constant([1.0, 2.0]) * 3.0))
    clean()
    assert gc.get_freeze_count() == 0
