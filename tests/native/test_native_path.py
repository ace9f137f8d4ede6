"""The C per-op path of C++ handlers (cc/native/native_execute.cc through cc/fast/fast_path.cc):
one-time setup, the output dtype check, and C++ levels under and over Python levels,
each against plain TensorFlow."""
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers import _C
from tf_ophandlers.core.stack import PHYSICAL
from tf_ophandlers.core.state import state

SHARED_NAMES = ("mode", "current", "handler", "next", "device", "execute")
FAST_NAMES = ("_oh_fast", "frames", "value_dtype", "wants_copy", "_copy_on_value",
              "_raise_not_a_list", "_wrap_eager")


def _refcounts(names):
    return [sys.getrefcount(sys.intern(n)) for n in names]


def test_repeated_setup_takes_no_new_references():
    """native_setup and fast_setup (both run at import) intern their attribute names once
    per process: calling them again takes no further references (it used to leak one
    reference per name per call) and keeps one reference to state and PHYSICAL."""
    names = SHARED_NAMES + FAST_NAMES
    for _ in range(3):  # settle anything the first calls create
        _C.native_setup(state, PHYSICAL)
        _C.fast_setup(state, PHYSICAL)
    before = _refcounts(names)
    state_refs, physical_refs = sys.getrefcount(state), sys.getrefcount(PHYSICAL)
    for _ in range(200):
        _C.native_setup(state, PHYSICAL)
        _C.fast_setup(state, PHYSICAL)
    after = _refcounts(names)
    grown = {n: a - b for n, a, b in zip(names, after, before) if a - b >= 100}
    assert not grown, grown
    assert sys.getrefcount(state) == state_refs
    assert sys.getrefcount(PHYSICAL) == physical_refs
    # The paths still run after the repeated setup.
    a = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    with oh.native.PassThrough():
        got = tf.add(tf.identity(a), a)
    np.testing.assert_array_equal(got.numpy(), (a + a).numpy())


def _ops_of_every_output_kind(x, i):
    """Ops whose output dtypes come from a type attribute, a fixed type, a number
    attribute, a type list, or are unrelated to the inputs' dtypes (Cast, Shape)."""
    return [
        tf.add(x, x),                                  # T from the inputs
        tf.cast(x, tf.int32),                          # DstT differs from the input
        tf.shape(x),                                   # out_type, int32
        tf.shape(x, out_type=tf.int64),                # out_type, int64
        tf.math.equal(x, x),                           # fixed bool output
        tf.concat([x, x], axis=0),                     # N inputs, one output
        tf.unstack(x, axis=0)[1],                      # num outputs from an attr
        tf.split(x, 2, axis=1)[0],                     # num_split outputs
        tf.math.argmax(x, axis=1, output_type=tf.int64),
        tf.gather(x, i),                               # Tparams and Tindices
        tf.math.top_k(x[0], k=1).indices,              # a second output of another type
        tf.identity_n([x, i])[1],                      # a type list
        tf.math.bincount(i, minlength=3),              # int32 input, int32 output
    ]


@pytest.mark.parametrize("make", ["PassThrough", "OpCounter"])  # forwarded / a hook
@pytest.mark.parametrize("levels", [1, 2])
def test_output_dtypes_of_every_kind_match_tensorflow(levels, make):
    x = tf.constant([[1.0, -2.0], [3.0, 0.5]])
    i = tf.constant([1, 0, 1])
    want = _ops_of_every_output_kind(x, i)
    handlers = [getattr(oh.native, make)() for _ in range(levels)]

    def run():
        return _ops_of_every_output_kind(tf.identity(x), tf.identity(i))

    for h in handlers:
        h.__enter__()
    try:
        got = run()
        got_fn = tf.function(run)()
    finally:
        for h in reversed(handlers):
            h.__exit__(None, None, None)
    for g, gf, w in zip(got, got_fn, want):
        assert g.dtype == w.dtype and gf.dtype == w.dtype
        assert g.shape == w.shape
        np.testing.assert_array_equal(g.numpy(), w.numpy())
        np.testing.assert_array_equal(gf.numpy(), w.numpy())


def test_output_dtype_check_is_per_op_not_per_op_type():
    """The cached plan of the dtype check is keyed by the OpDef, and the dtypes come
    from each op's own inputs and attributes: one op type with different dtypes in a
    row (float32, float64, int32, complex64) gives each its own dtype."""
    values = [tf.constant([1.5, 2.0]), tf.constant([1.5, 2.0], tf.float64),
              tf.constant([3, 4]), tf.constant([1 + 2j, 3j], tf.complex64)]
    with oh.native.OpCounter() as counter:
        outs = [tf.add(tf.identity(v), v) for v in values]
        casts = [tf.cast(tf.identity(v), d) for v, d in
                 zip(values, (tf.int64, tf.float16, tf.float32, tf.complex128))]
    for o, v in zip(outs, values):
        assert o.dtype == v.dtype
        np.testing.assert_array_equal(o.numpy(), (v + v).numpy())
    assert [c.dtype for c in casts] == [tf.int64, tf.float16, tf.float32, tf.complex128]
    assert counter.counts["AddV2"] == 4 and counter.counts["Cast"] == 4


@pytest.mark.parametrize("order", ["cxx-py-cxx", "py-cxx-py", "cxx-cxx-cxx", "cnt-py-cnt"])
def test_mixed_levels_keras_values_and_gradients(order):
    """C++ levels over, under and between Python levels: a Keras model's values and
    gradients equal plain TensorFlow's, eagerly and in a fresh tf.function, with a
    partial last batch."""
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(3)])
    x = tf.random.stateless_normal([5, 4], seed=[1, 7])
    model(x)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return loss, tape.gradient(loss, model.trainable_variables)

    want = [step(x[:4]), step(x[4:])]
    make = {"cxx": oh.native.PassThrough, "py": oh.OpHandler, "cnt": oh.native.OpCounter}
    for run in (step, tf.function(step)):
        handlers = [make[k]() for k in order.split("-")]
        for h in handlers:
            h.__enter__()
        try:
            got = [run(x[:4]), run(x[4:])]
        finally:
            for h in reversed(handlers):
                h.__exit__(None, None, None)
        for (gl, gg), (wl, wg) in zip(got, want):
            np.testing.assert_allclose(gl.numpy(), wl.numpy(), rtol=1e-6)
            for a, b in zip(gg, wg):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
