"""The densify flag of a replayed call's records belongs to that call's run
(core/functions/call_records.py, `ReplayRun`), not to the thread: a call replayed
inside the run (by handlers below the tape at the bottom) has its own flag, and records
that are not of a call (a custom gradient a handler records meanwhile) keep their
gradients. A dense call replayed inside tells the enclosing run (the tangents that
reached it reached the enclosing call too). Before, one thread-wide flag was set around
the whole run, so every record made in it was densified."""
import tensorflow as tf

from tf_ophandlers.core.functions import call_records
from tf_ophandlers.core.stack import PHYSICAL


def _sparse_backward(*unused):
    return [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([3, 2]))]


def _kind(op_type):
    grads = call_records.densified(op_type, _sparse_backward)()
    return "IndexedSlices" if isinstance(grads[0], tf.IndexedSlices) else "dense"


def test_the_flag_belongs_to_the_run_of_one_call():
    assert _kind("__forward_f_1") == "IndexedSlices"
    with call_records.replay_run(True):
        assert _kind("__forward_f_1") == "dense"  # the replayed call's record
        assert _kind("CustomGradient-7") == "IndexedSlices"  # not a call's record
        with call_records.replay_run(False):  # a call replayed inside, no tangents
            assert _kind("__forward_g_2") == "IndexedSlices"
        assert _kind("__forward_f_1") == "dense"
    assert _kind("__forward_f_1") == "IndexedSlices"


def test_a_dense_call_replayed_inside_marks_the_enclosing_run():
    with call_records.replay_run(False) as outer:
        with call_records.replay_run(False) as inner:
            call_records.note_replayed_call("__forward_h_3", PHYSICAL, dense=False)
        assert not inner.nested_dense and not outer.nested_dense
        call_records.note_replayed_call("__forward_g_2", PHYSICAL, dense=True)
        assert outer.nested_dense
    call_records._local.noted = None  # pylint: disable=protected-access
