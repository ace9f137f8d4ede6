"""`parallel.pack` / `parallel.unpack` inside a `tf.function` called in an
oh.ParallelHandler scope. A function call otherwise runs whole on each component; the
pack and unpack ops have a meaning only on the handler (run whole, a local component
failed with FailedPrecondition, and a remote worker's server, which has no
tf_ophandlers, does not know them). Such a function is replayed into stock ops: the
results equal the same program run eagerly in the scope (whose pack/unpack are checked
against TensorFlow's ParallelDevice in test_parallel.py), on local and on remote
components."""

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from python_process import run_python

DEVICES = ["CPU:0", "CPU:1"]


def _pack_program(parallel, x):
    return tf.reduce_sum(parallel.pack([x * 1.0, x * 2.0]) * 3.0 + 1.0, axis=0)


def _unpack_program(parallel, y):
    parts = parallel.unpack(y * 2.0)
    return parts[1] - parts[0]


def _run(parallel, fn, arg, compiled):
    if compiled:
        fn = tf.function(fn)
    with parallel:
        out = fn(arg)
        return [t.numpy() for t in parallel.unpack(out)] if oh.handler_of(out) is not None \
            else [out.numpy()] * len(parallel.components)


def test_pack_and_unpack_in_a_function_match_eager():
    parallel = oh.ParallelHandler(DEVICES)
    x = tf.constant([[1.0, -2.0], [0.5, 4.0]])
    with parallel:
        y = parallel.pack([tf.constant([1.0, 2.0]), tf.constant([10.0, 30.0])])
    for program, arg in ((lambda v: _pack_program(parallel, v), x),
                         (lambda v: _unpack_program(parallel, v), y)):
        eager = _run(parallel, program, arg, compiled=False)
        compiled = _run(parallel, program, arg, compiled=True)
        for e, c in zip(eager, compiled):
            np.testing.assert_allclose(c, e, rtol=1e-6)
    np.testing.assert_allclose(_run(parallel, lambda v: _pack_program(parallel, v), x,
                                    True), [[6.5, 8.0], [11.0, 14.0]])


def test_gradient_through_pack_in_a_function():
    parallel = oh.ParallelHandler(DEVICES)
    x = tf.constant([1.0, -2.0, 3.0])

    def grads(compiled):
        f = (lambda v: parallel.pack([v * v, v * 3.0]))
        f = tf.function(f) if compiled else f
        with parallel:
            with oh.GradientTape() as tape:
                tape.watch(x)
                total = tf.reduce_sum(f(x))
            return [g.numpy() for g in parallel.unpack(tape.gradient(total, x))]

    eager, compiled = grads(False), grads(True)
    for e, c in zip(eager, compiled):
        np.testing.assert_allclose(c, e, rtol=1e-6)
    # The total is sum(x*x) on component 0 and sum(3x) on component 1; x reaches each
    # component once (component i of pack's input i), so its gradient is 2x + 3, not
    # twice that (each input's other component gave nothing to the packed tensor).
    expected = 2.0 * x.numpy() + 3.0
    for g in eager + compiled:
        np.testing.assert_allclose(g, expected, rtol=1e-6)


_REMOTE = r'''
import sys
sys.path.insert(0, "examples")
import two_process_training as example
addresses, workers = example.start_workers(2)
import numpy as np
import tensorflow as tf
import tf_ophandlers as oh
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({"worker": addresses}))
devices = ["/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)]
parallel = oh.ParallelHandler(devices)
x = tf.constant([1.0, -2.0])

@tf.function
def f(v):
    packed = parallel.pack([v, v * 10.0]) + 1.0
    parts = parallel.unpack(packed)
    return packed * 2.0, parts[0] + parts[1]

with parallel:
    packed, total = f(x)
    print("packed:", [t.numpy().tolist() for t in parallel.unpack(packed)])
    print("total:", [t.numpy().tolist() for t in parallel.unpack(total)])
    print("devices:", [t.device for t in parallel.unpack(packed)])
'''


@pytest.mark.slow
def test_pack_and_unpack_in_a_function_on_remote_workers():
    lines = dict(l.split(": ", 1) for l in run_python(_REMOTE, timeout=150).splitlines()
                 if ": " in l)
    assert eval(lines["packed"]) == [[4.0, -2.0], [22.0, -38.0]]  # pylint: disable=eval-used
    assert eval(lines["total"]) == [[13.0, -20.0]] * 2  # pylint: disable=eval-used
    assert eval(lines["devices"]) == [  # pylint: disable=eval-used
        "/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)]


def _cond_program(parallel, x):
    # The predicate differs per component: the replay cannot read it as one value.
    v = parallel.pack([x, -x])
    return tf.cond(v > 0, lambda: v * 2.0, lambda: v * 3.0)


def _while_program(parallel, x):
    # One trip count per component (2 and 4).
    n = parallel.pack([tf.constant(2), tf.constant(4)])
    _, acc = tf.while_loop(lambda i, acc: i < n, lambda i, acc: (i + 1, acc * x),
                           (tf.constant(0), tf.ones_like(x)))
    return acc


@pytest.mark.parametrize("program,arg,expected", [
    (_cond_program, 1.5, [3.0, -4.5]),
    (_cond_program, -0.5, [-1.5, 1.0]),
    (_while_program, [1.5, -0.5], [[2.25, 0.25], [5.0625, 0.0625]]),
])
def test_control_flow_on_a_packed_value_in_a_function(program, arg, expected):
    # Before, the replayed cond/while tried to read the per-component predicate as a
    # numpy value and raised NotImplementedError ("symbolic tf.Tensor").
    parallel = oh.ParallelHandler(DEVICES)
    x = tf.constant(arg)
    eager = _run(parallel, lambda v: program(parallel, v), x, compiled=False)
    compiled = _run(parallel, lambda v: program(parallel, v), x, compiled=True)
    np.testing.assert_allclose(eager, expected, rtol=1e-6)
    np.testing.assert_allclose(compiled, expected, rtol=1e-6)


def test_gradient_through_a_while_loop_on_a_packed_trip_count_in_a_function():
    parallel = oh.ParallelHandler(DEVICES)
    x = tf.constant(1.5)
    f = tf.function(lambda v: _while_program(parallel, v))
    with parallel:
        with oh.GradientTape() as tape:
            tape.watch(x)
            out = f(x)
        grad = tape.gradient(out, x)
    # x^2 on one component, x^4 on the other; x is a broadcast, whose gradient sums
    # the components' (RFC: CopyOnGrad).
    np.testing.assert_allclose(grad.numpy(), 2 * 1.5 + 4 * 1.5 ** 3, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_gradient_through_a_cond_on_a_packed_value(compiled):
    parallel = oh.ParallelHandler(DEVICES)
    x = tf.constant(1.5)
    f = lambda v: _cond_program(parallel, v)
    f = tf.function(f) if compiled else f
    with parallel:
        with oh.GradientTape() as tape:
            tape.watch(x)
            out = f(x)
        grad = tape.gradient(out, x)
    # 2x on component 0 (x > 0), 3 * (-x) on component 1; summed over the components.
    np.testing.assert_allclose(grad.numpy(), 2.0 - 3.0, rtol=1e-6)
    with tf.GradientTape() as reference:  # TensorFlow, one component at a time
        reference.watch(x)
        total = tf.add_n([tf.cond(v > 0, lambda v=v: v * 2.0, lambda v=v: v * 3.0)
                          for v in (x, -x)])
    np.testing.assert_allclose(grad.numpy(), reference.gradient(total, x).numpy(), rtol=1e-6)
