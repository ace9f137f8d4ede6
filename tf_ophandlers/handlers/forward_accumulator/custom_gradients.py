"""`ForwardAccumulator` (handlers/forward_accumulator/handler.py): JVPs of gradients recorded from
Python (`record.record_operation`: tf.custom_gradient, tf.recompute_grad, a forward
function), computed when the operation is recorded, as TensorFlow's accumulators do.

Without a forward function the JVP is the backward function transposed (`transposed`):
its gradient with respect to the output gradients, weighted by the input tangents. The
accumulator is paused meanwhile, as TensorFlow's is while it computes a JVP, and
`forwardprop_util.push_forwardprop_state` called by that backward function resumes it
(a patch registered here, installed on first use).
"""
import contextlib
import threading

import tensorflow as tf

from tf_ophandlers.extend import current_stack, state, tf_patches
from tf_ophandlers.handlers.forward_accumulator.jvp import FLOAT_ENUMS, dtype_enum

# The module of tf.custom_gradient's (and tf.recompute_grad's) eager backward function.
_CUSTOM_GRADIENT_MODULE = "tensorflow.python.ops.custom_gradient"


def has_jvp_to_compute(backward_function, forward_function):
    """Whether a record's JVP is the accumulator's to compute: a custom gradient's, or
    one with a forward function (a tf.function call's or a copy's ops reached it)."""
    return forward_function is not None or getattr(
        backward_function, "__module__", None) == _CUSTOM_GRADIENT_MODULE


def transposed(backward_function, outputs, tangents):
    """The output tangents of an op given only its backward function: the gradient of the
    backward function (linear in the output gradients) with respect to those, weighted by
    the input tangents (TensorFlow's construction for recorded operations)."""
    with tf.GradientTape(watch_accessed_variables=False) as transpose_tape:
        aids = [tf.ones_like(o) if dtype_enum(o) in FLOAT_ENUMS else None for o in outputs]
        transpose_tape.watch([a for a in aids if a is not None])
        grads = backward_function(*aids)
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    pairs = [(g, t) for g, t in zip(grads, tangents) if g is not None and t is not None]
    sources = [a for a in aids if a is not None]
    if not pairs or not sources:
        return [None] * len(outputs)
    found = iter(transpose_tape.gradient(
        [g for g, _ in pairs], sources, output_gradients=[t for _, t in pairs]))
    return [None if a is None else next(found) for a in aids]


# The accumulators transposing a recorded operation's backward function on this thread,
# innermost last, as (accumulator, the stack the transposition runs in, hook depth): the
# tf.GradientTape doing it is no user's (no warning about tensors it cannot see), and
# push_forwardprop_state resumes them.
_local = threading.local()


def transposition_runs():
    runs = getattr(_local, "runs", None)
    if runs is None:
        runs = _local.runs = []
    return runs


_original_push_state = [None]


@contextlib.contextmanager
def _push_forwardprop_state():
    """TensorFlow's push_forwardprop_state, which lets an accumulator that is computing a
    JVP record again for a while (TensorFlow's accumulators ignore the ops of their own
    JVP computations until then): called by the custom gradient function an accumulator
    transposes (not from a hook below it), it resumes that accumulator."""
    with _original_push_state[0]():
        runs = transposition_runs()
        run = runs[-1] if runs else None
        if run is None or current_stack() is not run[1] or len(state.frames) != run[2]:
            yield
            return
        accumulator = run[0]
        runs.pop()
        accumulator._resume_recording(True)  # pylint: disable=protected-access
        try:
            yield
        finally:
            accumulator._resume_recording(False)  # pylint: disable=protected-access
            runs.append(run)


def _wrap_push_state(original):
    _original_push_state[0] = original
    return _push_forwardprop_state


tf_patches.subscribe("forwardprop_util.push_forwardprop_state", "forwardprop state",
                     _wrap_push_state)


def ensure_push_state_patch():
    tf_patches.ensure("forwardprop state")
