"""Eager `tf.cond`, `tf.switch_case` and `tf.while_loop` on handler tensors without a value.

Eagerly, TensorFlow decides control flow in Python from the predicate's value: `tf.cond`
and `tf.switch_case` run one branch, `tf.while_loop` is a Python `while`. A handler
tensor may have no single value: one per example under `oh.vectorized_map`, one per
device under `oh.ParallelHandler`. TensorFlow 2.21 then raises `TypeError` for
`tf.cond` ("must be decorated with `tf.function`", its parallel-device path) and copies
the value off for the other two. Traced, the same control flow is one If, Case or While
op, which a handler's function replay runs (pfor's way: selects and masked loops). So a
call whose predicate is such a tensor runs as a `tf.function` of that call; every other
call is TensorFlow's, untouched.

A `tf.while_loop` learns this only when its condition returns: the iterations already run
eagerly stay done, and the loop continues staged from the current loop variables (and
the iterations left of `maximum_iterations`), so no body runs twice.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> xs = tf.constant([-1., 2.])
>>> oh.vectorized_map(lambda x: tf.cond(x > 0, lambda: x * 2., lambda: -x), xs).numpy()
array([1., 4.], dtype=float32)
"""
import tensorflow as tf
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import cond as _cond
from tensorflow.python.ops import control_flow_switch_case as _switch_case
from tensorflow.python.ops import tensor_array_ops
from tensorflow.python.ops import while_loop as _while_loop
from tensorflow.python.util import nest

import tf_ophandlers._C as _C
from tf_ophandlers.core import errors, tf_patches

_original_cond = _cond._eager_cond_implementation  # pylint: disable=protected-access
_original_case = _switch_case._indexed_case_helper  # pylint: disable=protected-access
_original_while = _while_loop.while_loop


def _without_value(t):
    """Whether `t` is a handler tensor with no single value (TensorFlow's eager control
    flow cannot decide on it)."""
    return (isinstance(t, _ops.EagerTensor) and _C.stack_of(t) is not None
            and tensor_util.constant_value(t) is None)


def _staged(call):
    # autograph off: the branches and bodies are the user's eager code, which TensorFlow
    # traces as written inside tf.cond/tf.while_loop in a function.
    return tf.function(call, autograph=False)()


def _eager_cond(pred, true_fn, false_fn, strict, name):
    if tf.executing_eagerly():
        pred = _ops.convert_to_tensor(pred)
        if _without_value(pred):
            return _staged(lambda: _cond.cond(pred, true_fn, false_fn, strict=strict,
                                              name=name))
    return _original_cond(pred, true_fn, false_fn, strict, name)


def _indexed_case(branch_fns, default, branch_index, name="case",
                  lower_using_switch_merge=None):
    if (tf.executing_eagerly() and branch_index is not None
            and _without_value(_ops.convert_to_tensor(branch_index))):
        return _staged(lambda: _original_case(branch_fns, default, branch_index, name,
                                              lower_using_switch_merge))
    return _original_case(branch_fns, default, branch_index, name, lower_using_switch_merge)


class _Undecided(Exception):
    """The condition of an eager while loop returned a tensor without a value."""

    def __init__(self, loop_vars):
        super().__init__()
        self.loop_vars = loop_vars


def _decided_with_tensor_arrays(cond):
    """`cond` of an eager loop carrying a tf.TensorArray, with a clear error where it
    returns a tensor that has no single value (copying it off fails): the loop cannot
    be staged (an eager TensorArray is a Python list of tensors, with one length, where
    a staged loop's could differ per example)."""
    def checked(*args):
        pred = cond(*args)
        t = _ops.convert_to_tensor(pred)
        if not _without_value(t):
            return pred
        try:
            # A handler whose tensors have one value (oh.Async, oh.Lazy: pending, not
            # static) copies it off, as TensorFlow's eager loop would.
            return bool(t)
        except errors.CopyOffError as error:
            raise errors.CopyOffError(
                "tf.while_loop (While) under %s: the loop condition has one value per "
                "example (or device) and the loop variables hold an eager tf.TensorArray, "
                "which a staged loop cannot carry (its length could differ per example). "
                "Run the loop in a tf.function (the TensorArray created there), or use "
                "tf.map_fn" % _C.stack_of(t).handler.debug_string()) from error
    return checked


def _while(cond, body, loop_vars, shape_invariants=None, parallel_iterations=10,
           back_prop=True, swap_memory=False, name=None, maximum_iterations=None,
           return_same_structure=False):
    if (not tf.executing_eagerly() or not callable(cond) or not callable(body)
            or any(isinstance(v, tensor_array_ops.TensorArray)
                   for v in nest.flatten(loop_vars))):
        # (An eager TensorArray cannot be captured by a staged loop: TensorFlow's own
        # eager loop runs it, as before; Keras' RNN loops carry them.)
        if tf.executing_eagerly() and callable(cond):
            cond = _decided_with_tensor_arrays(cond)
        return _original_while(cond, body, loop_vars, shape_invariants, parallel_iterations,
                               back_prop, swap_memory, name, maximum_iterations,
                               return_same_structure)
    done = [0]  # bodies run eagerly

    def checked_cond(*args):
        pred = cond(*args)
        if _without_value(_ops.convert_to_tensor(pred)):
            raise _Undecided(args)
        return pred

    def counted_body(*args):
        done[0] += 1
        return body(*args)

    try:
        return _original_while(checked_cond, counted_body, loop_vars, shape_invariants,
                               parallel_iterations, back_prop, swap_memory, name,
                               maximum_iterations, return_same_structure)
    except _Undecided as undecided:
        current = undecided.loop_vars
    if maximum_iterations is not None:
        # In the dtype given (int32 for a Python int): the loop's gradient makes its
        # accumulators with it, and TensorList ops take an int32 maximum only.
        maximum_iterations = _ops.convert_to_tensor(maximum_iterations)
        maximum_iterations -= tf.cast(done[0], maximum_iterations.dtype)
    # The loop variables as TensorFlow passed them to `cond`: unpacked the way the loop
    # was given (one variable, or a list/tuple of them).
    if hasattr(loop_vars, "_fields"):  # a namedtuple
        rest = type(loop_vars)(*current)
    elif isinstance(loop_vars, (list, tuple)):
        rest = type(loop_vars)(current)
    else:
        rest = current
    return _staged(lambda: _original_while(
        cond, body, rest, shape_invariants, parallel_iterations, back_prop, swap_memory,
        name, maximum_iterations, return_same_structure))


def _wrap(name, replacement):
    def wrap(original):
        globals()[name] = original  # (only TensorFlow's function is below: one subscriber)
        return replacement
    return wrap


_USE = "eager control flow"
tf_patches.subscribe("cond._eager_cond_implementation", _USE, _wrap("_original_cond", _eager_cond))
tf_patches.subscribe("control_flow_switch_case._indexed_case_helper", _USE,
                     _wrap("_original_case", _indexed_case))
tf_patches.subscribe("while_loop.while_loop", _USE, _wrap("_original_while", _while))
