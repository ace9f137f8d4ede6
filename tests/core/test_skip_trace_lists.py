"""List and tuple inputs in the op fast path without TensorFlow's stack capture
(cc/fast/fast_trace.cc skip_trace_execute): `tf.transpose(x, (0, 2, 3, 1))`, `tf.reshape(x,
[1, C, 1, 1])`, `reduce_mean(x, axis=[2, 3])` (Keras's channels-first layers). TensorFlow's
fast path refuses them and its generated Python fallback converts them (and captures the
stack twice); under a handler scope they are converted as that fallback does and run
without the capture: same values and dtypes as eager, same exception types. Likewise
Keras variables (their `__tf_tensor__`), the other input Keras's layers pass that the
fast path refuses; resource variables stay with TensorFlow's function."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_array_ops
from tensorflow.python.ops import gen_math_ops

import tf_ophandlers as oh
import tf_ophandlers._C as _C
from conftest import ops_left_to_tensorflow

HANDLERS = {"OpHandler": oh.OpHandler, "Lazy": oh.Lazy, "PassThrough": oh.native.PassThrough}

_X = tf.reshape(tf.range(24, dtype=tf.float32), [2, 3, 4]) * 0.5
_I = tf.reshape(tf.range(6), [2, 3])
_Z = tf.zeros([0])
_Z1 = tf.zeros([1, 3, 1])
_KV = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4) * 0.25)
_X0 = _X[0, :3]  # (TF backend)
_KI = keras.Variable(np.arange(6, dtype="int32").reshape(2, 3))
_RV = tf.Variable(_X)

# (description, fn): each one op, taking a list or tuple input next to EagerTensors.
TAKEN = [
    ("transpose tuple", lambda: gen_array_ops.transpose(_X, (0, 2, 1))),
    ("transpose list", lambda: tf.transpose(_X, [2, 0, 1])),
    ("reshape tuple", lambda: tf.reshape(_X, (1, 3, 1, 8))),
    ("reshape -1", lambda: tf.reshape(_X, [-1])),
    ("reshape int64 shape", lambda: gen_array_ops.reshape(_Z, [2 ** 40, 0])),
    ("mean axes", lambda: gen_math_ops.mean(_X, [0, 2], keep_dims=False)),
    ("sum axes keepdims", lambda: gen_math_ops._sum(_X, (1,), keep_dims=True)),  # pylint: disable=protected-access
    ("tile", lambda: tf.tile(_I, [2, 1])),
    ("pad nested", lambda: gen_array_ops.pad(_I, [[1, 0], [0, 2]])),
    ("mul float list", lambda: gen_math_ops.mul(_X, [1.5, 2, -3, 0.25])),
    ("add int list to int", lambda: gen_math_ops.add_v2([1, 2, 3], _I)),
    ("add two lists", lambda: gen_math_ops.add_v2([1, 2], [3, 4])),
    ("fill", lambda: gen_array_ops.fill([2, 2], tf.constant(1.5))),
    ("keras variable times tensor", lambda: gen_math_ops.mul(_X0, _KV)),
    ("reshape keras variable by tuple", lambda: gen_array_ops.reshape(_KV, (1, 4, 3))),
    ("keras int variable plus list", lambda: gen_math_ops.add_v2(_KI, [1, 2, 3])),
    # An attribute given as None takes its default, as in the fast path (Keras's squeeze).
    ("squeeze None", lambda: gen_array_ops.squeeze(_Z1, None)),
    ("matmul None",
     lambda: gen_math_ops.mat_mul(_X0, _X0, transpose_a=None, transpose_b=True)),
]

# Calls TensorFlow's function keeps (numbers without a dtype, lists with a tensor or a
# bool, numpy values), or which raise: each gives eager's exception type.
OTHER = [
    ("bad perm", lambda: tf.transpose(_X, (0, 0, 1))),
    ("short perm", lambda: gen_array_ops.transpose(_X, [1, 0])),
    ("float perm", lambda: gen_array_ops.transpose(_X, (0, 1.5, 2))),
    ("bool in perm", lambda: gen_array_ops.transpose(_X, (0, True, 2))),
    ("ragged shape", lambda: gen_array_ops.reshape(_X, [[1, 2], [3]])),
    ("huge shape", lambda: gen_array_ops.reshape(_X, [2 ** 70])),
    ("shape past int64", lambda: gen_array_ops.reshape(_X, [2 ** 63, 1])),
    ("wrong size", lambda: tf.reshape(_X, (5, 5))),
    ("empty perm", lambda: gen_array_ops.transpose(_X, [])),
    ("float list to int", lambda: gen_math_ops.add_v2(_I, [1.5, 2, 3])),
    ("mixed lists", lambda: gen_math_ops.add_v2([1, 2], [1.5, 2.5])),
    ("list as x", lambda: gen_array_ops.transpose([[1, 2], [3, 4]], (1, 0))),
    ("tensor in list", lambda: gen_array_ops.reshape(_X, [tf.constant(24)])),
    ("numpy in list", lambda: gen_array_ops.reshape(_X, [np.int32(24)])),
    ("mean bad axis", lambda: gen_math_ops.mean(_X, [3])),
    ("keras variable dtype mismatch", lambda: gen_math_ops.add_v2(_I, _KV)),
    ("keras variable shape mismatch", lambda: gen_math_ops.mul(_X, _KV)),
    ("resource variable and tuple", lambda: gen_array_ops.reshape(_RV, (4, 6))),
    ("None, no default", lambda: tf.raw_ops.Conv2D(input=tf.reshape(_X, [1, 2, 3, 4]),
                                                   filter=tf.ones([1, 1, 4, 1]), strides=None,
                                                   padding="SAME")),
]


def _taken():
    return _C.skip_trace_stats()["taken"]


def _outcome(fn, make=None):
    try:
        if make is None:
            t = fn()
            return "ok", t.dtype, t.numpy()
        with make():
            t = fn()
            return "ok", t.dtype, t.numpy()
    except Exception as e:  # pylint: disable=broad-except
        return "err", type(e), str(e)


@pytest.mark.parametrize("handler", sorted(HANDLERS))
@pytest.mark.parametrize("desc, fn", TAKEN, ids=[d for d, _ in TAKEN])
def test_list_inputs_skip_the_capture_and_equal_eager(handler, desc, fn):
    want = _outcome(fn)
    assert want[0] == "ok", (desc, want)
    before = _taken()
    got = _outcome(fn, HANDLERS[handler])
    reads = 1 if "keras" in desc else 0  # (the variable's ReadVariableOp, taken too)
    assert _taken() - before == 1 + reads, desc  # run without TensorFlow's function
    assert got[0] == "ok", (desc, got)
    assert got[1] == want[1], (desc, got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("handler", sorted(HANDLERS))
@pytest.mark.parametrize("desc, fn", OTHER, ids=[d for d, _ in OTHER])
def test_other_list_inputs_give_eagers_outcome(handler, desc, fn):
    want = _outcome(fn)
    got = _outcome(fn, HANDLERS[handler])
    if handler == "Lazy" and want[0] == "err" and got[0] == "err" and \
            issubclass(want[1], tf.errors.OpError) and issubclass(got[1], tf.errors.OpError):
        return  # a kernel's error, found by oh.Lazy's graph (checked elsewhere)
    assert got[:2] == want[:2], (desc, got, want)
    if want[0] == "ok":
        np.testing.assert_array_equal(got[2], want[2])


def test_tensorflows_function_sees_no_list_input():
    """The ops taken here never reach TensorFlow's function (which would capture)."""
    with oh.OpHandler():
        with ops_left_to_tensorflow() as seen:
            for _, fn in TAKEN:
                fn()
            gen_array_ops.transpose(_X, np.array([1, 0, 2]))  # (checks the counting)
    assert seen == ["Transpose"]
