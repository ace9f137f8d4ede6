"""TensorFlow's traceback-filtering switch while a scope is open (core/traceback_switch.py):
the same answers as without the scope, a program's own setting kept, and TensorFlow's
filtering of a raised error's traceback unchanged."""
import threading
import traceback

import pytest
import tensorflow as tf
from tensorflow.python.util import traceback_utils

import tf_ophandlers as oh

_switch = traceback_utils._ENABLE_TRACEBACK_FILTERING  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def unset_switch():
    """Each test starts with the switch as a fresh thread has it (no value) and leaves
    it so."""
    had = getattr(_switch, "value", None)
    if hasattr(_switch, "value"):
        del _switch.value
    yield
    if hasattr(_switch, "value"):
        del _switch.value
    if had is not None:
        _switch.value = had


def test_default_answer_inside_and_restored_after():
    assert not hasattr(_switch, "value")
    for handler in (oh.OpHandler(), oh.Lazy(), oh.Lazy(jit_compile=True)):
        with handler:
            assert tf.debugging.is_traceback_filtering_enabled()
            y = tf.constant([1.0, 2.0]) * 1.01  # an operator that asks the switch
        assert float(tf.reduce_sum(y)) == pytest.approx(3.03)
        assert tf.debugging.is_traceback_filtering_enabled()
        assert not hasattr(_switch, "value")  # as before the scope


def test_nested_scopes_restore_only_at_the_outermost():
    with oh.OpHandler():
        with oh.Lazy():
            assert _switch.value is True
        assert _switch.value is True  # the outer scope is still open
    assert not hasattr(_switch, "value")


def test_disable_inside_the_scope_is_kept():
    with oh.Lazy():
        tf.debugging.disable_traceback_filtering()
        assert not tf.debugging.is_traceback_filtering_enabled()
    assert not tf.debugging.is_traceback_filtering_enabled()
    assert _switch.value is False


def test_a_setting_from_before_the_scope_is_kept():
    tf.debugging.disable_traceback_filtering()
    with oh.Lazy():
        assert not tf.debugging.is_traceback_filtering_enabled()
    assert _switch.value is False
    tf.debugging.enable_traceback_filtering()
    with oh.OpHandler():
        assert tf.debugging.is_traceback_filtering_enabled()
    assert _switch.value is True  # the program's own value stays after the scope


def test_a_scope_on_another_thread_leaves_this_thread_alone():
    seen = []

    def other():
        with oh.OpHandler():
            seen.append(getattr(_switch, "value", None))
        seen.append(hasattr(_switch, "value"))

    with oh.OpHandler():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert _switch.value is True
    assert seen == [True, False]
    assert not hasattr(_switch, "value")


@pytest.mark.parametrize("disabled", [False, True])
def test_a_raised_error_is_filtered_as_without_the_scope(disabled):
    # TensorFlow's decorated operator raises a TypeError; the frames its traceback keeps
    # depend on the switch: the same with and without a scope.
    if disabled:
        tf.debugging.disable_traceback_filtering()

    def raise_from_operator():
        try:
            tf.constant([1.0]) * "text"
        except (TypeError, ValueError) as e:
            return e
        raise AssertionError("no error")

    plain = raise_from_operator()
    with oh.OpHandler():
        scoped = raise_from_operator()
    with oh.Lazy():
        lazy = raise_from_operator()
    frames = [[(f.filename, f.name) for f in traceback.extract_tb(e.__traceback__)]
              for e in (plain, scoped, lazy)]
    assert type(scoped) is type(plain) and type(lazy) is type(plain)
    assert frames[1] == frames[0] and frames[2] == frames[0]
    # (and the switch decides: filtering drops TensorFlow's inner frames)
    assert (len(frames[0]) > 5) == disabled
