"""ABI version 4 of cc/include/tf_ophandlers/handler.h: ops a C/C++ handler does not
execute. `oh.native.PassThrough` has no execute hook (the runtime forwards every op as a
forwarding level, no hook call per op); tests/native/select_handler.cc's `OnlyMatMul`
names the ops its execute runs with the executes_op hook (asked once per stack and op
type). Each test compares with plain TensorFlow on the same inputs."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers import _C
from test_native_handlers import build_handler_library

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def OnlyMatMul():  # pylint: disable=invalid-name
    path = build_handler_library(os.path.join(HERE, "select_handler.cc"))
    return oh.load_handler_library(path).handler_types()["OnlyMatMul"]


def program(x, w):
    h = tf.tanh(tf.matmul(x, w)) + tf.sin(x[:, :3])
    h = tf.matmul(h, tf.transpose(w[:3, :3])) * 0.5
    return tf.reduce_sum(h * h, axis=1), tf.concat([h, tf.gather(h, [2, 0])], axis=0)


def inputs(n=5):
    return (tf.random.stateless_normal([n, 4], seed=[1, 6]),
            tf.random.stateless_normal([4, 3], seed=[2, 8]))


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def test_pass_through_has_no_execute_hook_and_forwards_in_c():
    assert oh.native.PassThrough._oh_hooks["execute"] is False
    x, w = inputs()
    want = program(x, w)
    stats = _C.fast_stats()
    with oh.native.PassThrough():
        x1 = tf.identity(x)
        got = program(x1, w)
    after = _C.fast_stats()
    assert_same(got, want)
    # Every op after the identity ran on the C fast path, none on the no-GIL hook path
    # (which calls an execute hook).
    assert after["fast_ops"] - stats["fast_ops"] >= 10
    assert after["nogil_ops"] == stats["nogil_ops"]


@pytest.mark.parametrize("levels", [1, 3])
def test_nested_pass_throughs_keras_values_and_gradients(levels):
    tf.keras.utils.set_random_seed(4)
    model = tf.keras.Sequential([tf.keras.layers.Dense(6, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    x = tf.random.stateless_normal([5, 4], seed=[3, 9])
    model(x)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return [loss] + tape.gradient(loss, model.trainable_variables)

    want = [step(x[:4]), step(x[4:])]  # a partial last batch
    for run in (step, tf.function(step)):
        handlers = [oh.native.PassThrough() for _ in range(levels)]
        for h in handlers:
            h.__enter__()
        try:
            got = [run(x[:4]), run(x[4:])]
        finally:
            for h in reversed(handlers):
                h.__exit__(None, None, None)
        for g, w in zip(got, want):
            assert_same([tf.convert_to_tensor(t) for t in g], w)


def test_executes_op_runs_the_hook_only_for_the_ops_it_names(OnlyMatMul):
    assert OnlyMatMul._oh_hooks["executes_op"] is True
    x, w = inputs()
    want = program(x, w)
    h = OnlyMatMul()
    assert h.handles_ops("MatMul") and not h.handles_ops("AddV2")
    with h:
        x1 = tf.identity(x)
        got = program(x1, w)
        got2 = program(x1, w)
    assert_same(got, want)
    assert_same(got2, want)
    assert int(h.query("calls")) == 4  # two MatMuls per program
    # Asked once per (stack, op type) on the C path (the Python path may ask again).
    asked = int(h.query("asked"))
    assert 0 < asked <= 2 * len({"Identity", "MatMul", "Tanh", "StridedSlice", "Sin",
                                 "AddV2", "Transpose", "Mul", "Sum", "ConcatV2",
                                 "GatherV2", "Pack", "Const"})


def test_executes_op_under_python_tape_and_in_a_function(OnlyMatMul):
    x, w = inputs(4)
    with tf.GradientTape() as tape:
        tape.watch(w)
        want = tf.reduce_sum(program(x, w)[0])
    want_g = tape.gradient(want, w)
    h = OnlyMatMul()
    with oh.GradientTape() as tape:
        tape.watch(w)
        with h:
            got = tf.reduce_sum(program(tf.identity(x), w)[0])
    got_g = tape.gradient(got, w)
    assert_same([tf.convert_to_tensor(got), tf.convert_to_tensor(got_g)], [want, want_g])
    assert int(h.query("calls")) == 2

    @tf.function(input_signature=[tf.TensorSpec([None, 4]), tf.TensorSpec([4, 3])])
    def f(a, b):
        return program(a, b)

    h2 = OnlyMatMul()
    with h2:
        for n in (4, 3):  # a partial last batch
            assert_same(f(x[:n], w), program(x[:n], w))
    assert int(h2.query("calls")) >= 2  # the replay runs MatMul through the hook


NO_EXECUTE_V3 = r"""
#include <cstring>
#include "tf_ophandlers/handler.h"
static void* Create(void*, const char*, TF_Status*) { return new int(0); }
static void Delete(void* s) { delete static_cast<int*>(s); }
extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* api,
                                                    TFOH_Library* lib, TF_Status* status) {
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = 3;
  t.struct_size = TFOH_HANDLER_TYPE_V3_SIZE;
  t.name = "NoExecuteV3";
  t.create = Create;
  t.delete_state = Delete;
  api->register_type(lib, &t, status);
}
"""


def test_a_type_without_execute_needs_abi_version_4(tmp_path):
    src = tmp_path / "no_execute_v3.cc"
    src.write_text(NO_EXECUTE_V3)
    with pytest.raises(RuntimeError, match="execute are required"):
        oh.load_handler_library(build_handler_library(str(src)))


@pytest.mark.parametrize("make", [oh.native.PassThrough, oh.OpHandler])
def test_skipped_forwarding_levels_build_their_tensors_when_asked(make):
    """Three nested pass-through levels: the C path runs the op once below the lowest and
    wraps only the outermost level's output; the levels in between are made when Python
    asks for a representation (stack.payload), each a tensor of the stack below."""
    from tf_ophandlers.core.stack import PHYSICAL, payload
    a = tf.constant([[1.0, 2.0], [3.0, -4.0]])
    hs = [make() for _ in range(3)]
    for h in hs:
        h.__enter__()
    try:
        x = tf.identity(a)
        y = tf.nn.relu(x * 2.0) + x  # fast path, levels skipped
        stack, value = payload(y)
        chain = [stack]
        while True:
            p = payload(value)
            if p is None:
                break
            chain.append(p[0])
            value = p[1]
        assert [s.handler for s in chain] == hs[::-1]
        assert chain[-1].next is PHYSICAL and payload(value) is None
        np.testing.assert_array_equal(value.numpy(), (tf.nn.relu(a * 2.0) + a).numpy())
        z = y * y  # an input whose levels were made: still right
        w = tf.concat([z, y], 0)
    finally:
        for h in reversed(hs):
            h.__exit__(None, None, None)
    want_y = tf.nn.relu(a * 2.0) + a
    assert_same([y, z, w], [want_y, want_y * want_y, tf.concat([want_y * want_y, want_y], 0)])
