"""`CheckNumericsHandler`: raises on the first NaN or Inf an op produces.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> with oh.CheckNumericsHandler():
...     tf.math.log(tf.constant([1.0, 0.0]))      # log(0) = -inf
Traceback (most recent call last):
  ...
tensorflow.python.framework.errors_impl.InvalidArgumentError: CheckNumericsHandler: op Log
produced Inf in output 0 (float32), at example.py:3 in <module>

The check runs TensorFlow's own `CheckNumericsV2` kernel on every floating-point output
on the next stack (as `tf.debugging.enable_check_numerics` does; complex outputs are
checked as their real and imaginary parts, float8 outputs as float32, which that kernel
takes), so it raises the same
error class, `tf.errors.InvalidArgumentError`, and names the op type and the line of the
user's code that ran it. Under asynchronous execution the error surfaces at the next
synchronization point, as TensorFlow's own checks do.

In a replayed function (a `tf.function`, Keras `fit`'s train step) the checks are nodes of
the replayed function and run at every call; their message names the graph node
(`sequential/my_layer/Log`) and the user's line recorded when the function was traced
(`op.traceback`), as `tf.debugging.enable_check_numerics` does.
"""
import os
import sys

import tensorflow as tf

from tf_ophandlers.extend import Op, OpHandler

_LIBRARY_PARTS = (os.sep + "tensorflow" + os.sep, os.sep + "keras" + os.sep,
                  os.sep + "tf_ophandlers" + os.sep)


def _is_user_file(filename):
    filename = os.path.abspath(filename)
    return (not any(part in filename for part in _LIBRARY_PARTS)
            and not filename.endswith("contextlib.py") and not filename.startswith("<"))


def user_location():
    """'file:line in function' of the innermost frame outside TF, Keras, this package and
    contextlib (only computed on the error path)."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        if _is_user_file(frame.f_code.co_filename):
            return "%s:%d in %s" % (frame.f_code.co_filename, frame.f_lineno,
                                    frame.f_code.co_name)
        frame = frame.f_back
    return "<unknown location>"


def traced_location(op):
    """'file:line in function' of the user's code that created `op`'s node when its
    function was traced (the innermost user frame of `op.traceback`), or None."""
    frames = op.traceback
    for frame in reversed(frames or ()):
        if _is_user_file(frame.filename):
            return "%s:%d%s" % (frame.filename, frame.lineno,
                                " in " + frame.name if frame.name else "")
    return None


class CheckNumericsHandler(OpHandler):
    """Checks every floating-point and complex output of every op for NaN and Inf.

    Args:
      op_types_to_skip: op types not checked (e.g. ops that legitimately produce Inf).

    Examples:
        >>> try:
        ...     with oh.CheckNumericsHandler():
        ...         tf.math.log(tf.constant([-1.0]))
        ... except tf.errors.InvalidArgumentError as e:
        ...     print("Log" in str(e))
        True
    """

    transparent = True
    TYPE_NAME = "CHECKNUMERICS"

    def __init__(self, op_types_to_skip=()):
        self.op_types_to_skip = frozenset(op_types_to_skip)
        self._check_ops = {}

    def _check_op(self, dtype, op_type, index):
        key = (dtype, op_type, index)
        op = self._check_ops.get(key)
        if op is None:
            op = Op.create("CheckNumericsV2", T=_CHECKED_DTYPES.get(dtype, dtype),
                           message=_check_message(dtype, op_type, index))
            self._check_ops[key] = op
        return op

    changes_computation = False  # runs each op as it is, then checks its outputs

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type in self.op_types_to_skip:
            return outputs
        nxt = self.next
        if op.node_name is not None and not tf.executing_eagerly():
            # A node of a function being replayed: the check becomes a node of the
            # replayed function and fails when it runs, long after this hook. Its message
            # names the node and the user's line recorded when the function was traced
            # (what tf.debugging.enable_check_numerics reports).
            where = traced_location(op)
            for i, out in enumerate(outputs):
                dtype = out.dtype
                if dtype.is_floating or dtype.is_complex:
                    checked = out
                    view = _checked_view(dtype)  # complex and float8: as eagerly, below
                    if view is not None:
                        (checked,) = nxt.execute(view, [out])
                    nxt.execute(Op.create(
                        "CheckNumericsV2", T=_CHECKED_DTYPES.get(dtype, dtype), message=(
                            "CheckNumericsHandler: op %s produced NaN or Inf in output %d "
                            "(%s), at %s (graph node %s of function %s)" % (
                                op.type, i, dtype.name,
                                where or "<no stack trace recorded>", op.node_name,
                                op.function_name))), [checked])
            return outputs
        for i, out in enumerate(outputs):
            dtype = out.dtype
            if not (dtype.is_floating or dtype.is_complex):
                continue
            try:
                checked = out
                view = _checked_view(dtype)
                if view is not None:
                    # CheckNumericsV2 takes half, bfloat16, float32 and float64 only: a
                    # complex value is checked as its real and imaginary parts, a float8
                    # as float32 (casting keeps NaN and Inf).
                    (checked,) = nxt.execute(view, [out])
                nxt.execute(self._check_op(dtype, op.type, i), [checked])
            except tf.errors.InvalidArgumentError as e:
                if _check_message(dtype, op.type, i) not in e.message:
                    # Not this check's error: under asynchronous execution, the failure
                    # of an earlier queued op (its own message names it) surfaces here.
                    raise
                raise tf.errors.InvalidArgumentError(None, None, (
                    "CheckNumericsHandler: op %s produced %s in output %d (%s), at %s"
                    % (op.type, _kind(e.message), i, dtype.name, user_location()))) from None
        return outputs

    def debug_string(self):
        return "CheckNumericsHandler()"


_NATIVE = frozenset([tf.float16, tf.bfloat16, tf.float32, tf.float64])
# The dtype CheckNumericsV2 checks a value of another floating-point or complex dtype as.
_CHECKED_DTYPES = {tf.complex64: tf.float32, tf.complex128: tf.float64}


def _checked_view(dtype):
    """None if CheckNumericsV2 takes `dtype`, else the op turning a `dtype` value into one
    it takes: complex as its parts (Bitcast adds a last dimension of 2, no copy), other
    floating-point dtypes (float8 variants) cast to float32."""
    if dtype in _NATIVE:
        return None
    if dtype.is_complex:
        return Op.cached("Bitcast", T=dtype, type=_CHECKED_DTYPES[dtype])
    _CHECKED_DTYPES.setdefault(dtype, tf.float32)
    return Op.cached("Cast", SrcT=dtype, DstT=tf.float32, Truncate=False)


def _check_message(dtype, op_type, index):
    """The message of the check of output `index` of `op_type` (CheckNumericsV2's
    `message` attribute, which its error repeats)."""
    return ("CheckNumericsHandler: op %s produced NaN or Inf in output %d (%s)"
            % (op_type, index, dtype.name))


def _kind(message):
    """'NaN', 'Inf' or 'NaN or Inf' from a CheckNumericsV2 error message."""
    tail = message.rsplit("Tensor had", 1)[-1]
    if "NaN" in tail:
        return "NaN"
    if "Inf" in tail:
        return "Inf"
    return "NaN or Inf"
