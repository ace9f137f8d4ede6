"""TensorFlow collectives inside an oh.ParallelHandler scope: the components of a
collective meet, so they run at the same time (as TensorFlow's ParallelDevice runs
them). Each program runs in a subprocess with a timeout (a regression hangs), under our
handler and under TensorFlow's ParallelDevice, and the results are compared."""
import json

import numpy as np
import pytest
from python_process import run_python

_PROGRAMS = r'''
import json, os, sys
import tensorflow as tf
import tf_ophandlers as oh
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
from tensorflow.python.distribute.parallel_device import parallel_device
from tensorflow.python.eager import context
from tensorflow.python.ops import collective_ops

DEVICES = ["/job:localhost/replica:0/task:0/device:CPU:0",
           "/job:localhost/replica:0/task:0/device:CPU:1"]
KEYS = [100]


def key():
    KEYS[0] += 1
    return KEYS[0]


def all_reduce(x):
    k = key()
    return collective_ops.all_reduce_v2(t=x, group_size=2, group_key=k, instance_key=k,
                                        merge_op="Add", final_op="Id")


def prog_eager(pack):
    return all_reduce(pack([[-1.5, 1.], [3.5, 2.]]))


def prog_function(pack):
    f = tf.function(lambda x: all_reduce(x * 2.) + 1.)
    return f(pack([-1.5, 3.5]))


def prog_async_scope(pack):
    with context.async_scope():
        return tf.identity(all_reduce(pack([-1.5, 3.5])))


def prog_broadcast(pack):
    k = key()

    @tf.function
    def f(x, i):
        return tf.cond(tf.equal(i, 0),
                       lambda: collective_ops.broadcast_send_v2(x, 2, k, k),
                       lambda: collective_ops.broadcast_recv_v2([2], tf.float32, 2, k, k))
    return f(pack([[1., 2.], [5., 6.]]), pack([0, 1]))


def prog_sync_training(pack):
    # A dense layer trained with gradients summed over the components.
    kernel = tf.Variable(tf.ones([5, 1]))
    bias = tf.Variable(tf.ones([5]))
    x = pack([[[-0.5]], [[0.5]]])
    with tf.GradientTape() as tape:
        y = tf.matmul(x, kernel, transpose_b=True) + bias
        loss = (y - tf.range(5.)) ** 2.
    grads = tape.gradient(loss, [kernel, bias])
    for g, v in zip([all_reduce(g) for g in grads], [kernel, bias]):
        v.assign_sub(0.01 * g)
    return tf.concat([tf.reshape(kernel, [-1]), bias], 0)


def loop_all_reduce(x, k, scale=3.):
    # Collectives in a loop body, as Keras runs its step with steps_per_execution > 1.
    def body(i, acc):
        acc = tf.debugging.check_numerics(acc, "bad input")
        return i + 1, collective_ops.all_reduce_v2(
            acc * scale, group_size=2, group_key=k, instance_key=k, merge_op="Add",
            final_op="Id")
    return tf.while_loop(lambda i, acc: i < 3, body, (0, x))[1]


def prog_loop(pack):
    k = key()
    return tf.function(lambda x: loop_all_reduce(x, k))(pack([[1., -2.], [2., 0.5]]))


THREADS = []  # components handed to worker threads by ours()


def ours(prog):
    from tf_ophandlers.handlers.parallel import collectives
    submit = collectives._submit
    collectives._submit = lambda fn, arg, done: (THREADS.append(arg), submit(fn, arg, done))
    parallel = oh.ParallelHandler(DEVICES)
    try:
        with parallel:
            y = prog(lambda values: parallel.pack([tf.constant(v) for v in values]))
            return [t.numpy().tolist() for t in parallel.unpack(tf.identity(y))]
    finally:
        collectives._submit = submit


def theirs(prog):
    device = parallel_device.ParallelDevice(DEVICES)

    def pack(values):
        parts = []
        for d, v in zip(DEVICES, values):
            with tf.device(d):
                parts.append(tf.constant(v))
        return device.pack(parts)

    with tf.device(device._name):  # pylint: disable=protected-access
        y = prog(pack)
        return [t.numpy().tolist() for t in device.unpack(tf.identity(y))]


if sys.argv[1] == "failure":
    # Component 1 fails before the collective that component 0 waits in.
    parallel = oh.ParallelHandler(DEVICES)
    f = tf.function(lambda x: all_reduce(tf.debugging.check_numerics(x, "bad input")))
    with parallel:
        x = parallel.pack([tf.constant(1.), tf.constant(float("nan"))])
        try:
            f(x)
        except tf.errors.InvalidArgumentError as e:
            print(json.dumps({"error": e.message}))
elif sys.argv[1] == "failure_in_loop":
    # Component 1 fails in the loop, before the collective component 0 waits in; the
    # process's collectives still work afterwards.
    parallel = oh.ParallelHandler(DEVICES)
    k = key()
    host = tf.Variable(2.)  # created outside the scope: read from CPU:0 by both
    f = tf.function(lambda x: loop_all_reduce(x, k, host))
    with parallel:
        try:
            f(parallel.pack([tf.constant(1.), tf.constant(float("nan"))]))
            error = kind = None
        except tf.errors.OpError as e:
            error, kind = e.message, type(e).__name__
        try:
            after = [float(t) for t in parallel.unpack(
                f(parallel.pack([tf.constant(1.), tf.constant(2.)])))]
        except tf.errors.OpError as e:
            after = "%s: %s" % (type(e).__name__, e.message[:300])
    print(json.dumps({"error": error, "kind": kind, "after": after}))
elif sys.argv[1] == "all_reduce_in_function":
    # parallel.all_reduce in a tf.function called in the scope, called many times (with
    # a gradient through it, twice in one step, in a loop, on two shapes of one trace),
    # against the same program under MirroredStrategy (ReplicaContext.all_reduce).
    CALLS = 20

    def program(all_reduce, run, pack, unpack, unrolled=False):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = all_reduce(x * x)
                z = all_reduce(y * x)
                loss = tf.reduce_sum(z * tf.range(1., 3.))
            return y, z, tape.gradient(loss, x)

        def looped(x):
            if unrolled:  # MirroredStrategy's all_reduce cannot sit in a loop body
                for _ in range(3):
                    x = all_reduce(x) * 0.5
                return x
            return tf.while_loop(lambda i, acc: i < 3,
                                 lambda i, acc: (i + 1, all_reduce(acc) * 0.5), (0, x))[1]

        step_fn = tf.function(lambda x: run(step, x))
        looped_fn = tf.function(lambda x: run(looped, x))
        relaxed_fn = tf.function(lambda x: run(lambda v: all_reduce(v) - v, x),
                                 reduce_retracing=True)
        out = {"step": [], "looped": [], "relaxed": []}
        for i in range(CALLS):
            x = pack([[1. + i, 2.], [3., -1. - 0.5 * i]])
            out["step"].append([unpack(t) for t in step_fn(x)])
            out["looped"].append(unpack(looped_fn(x)))
            # From the second call on, one trace of unknown length, whose shape varies
            # from call to call.
            out["relaxed"].append(unpack(relaxed_fn(pack([[1.] * (1 + i % 3), [2.] * (1 + i % 3)]))))
        return out

    parallel = oh.ParallelHandler(DEVICES)
    with parallel:
        got = program(parallel.all_reduce, lambda f, x: f(x),
                      lambda v: parallel.pack([tf.constant(c) for c in v]),
                      lambda t: [c.numpy().tolist() for c in parallel.unpack(t)])
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    want = program(
        lambda t: tf.distribute.get_replica_context().all_reduce("sum", t),
        lambda f, x: strategy.run(f, args=(x,)),
        lambda v: strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(v[ctx.replica_id_in_sync_group])),
        lambda t: [c.numpy().tolist() for c in strategy.experimental_local_results(t)],
        unrolled=True)
    print(json.dumps({"ours": got, "tf": want, "threads": len(THREADS)}))
elif sys.argv[1] == "gradient_through_call":
    # A tape outside a tf.function that holds parallel.all_reduce (the gradient goes
    # through the function's call), against the same program with all_reduce run eagerly
    # (no function), call after call, with both tapes, also in a loop.
    parallel = oh.ParallelHandler(DEVICES)

    def chain(x):
        return parallel.all_reduce(x * x) * tf.range(1., 3.)

    def looped(x):
        return tf.while_loop(lambda i, a: i < 2,
                             lambda i, a: (i + 1, parallel.all_reduce(a) * x), (0, x))[1]

    def unrolled(x):
        a = x
        for _ in range(2):
            a = parallel.all_reduce(a) * x
        return a

    out = {}
    with parallel:
        for name, traced, eager in (("call", tf.function(chain), chain),
                                    ("loop", tf.function(looped), unrolled)):
            for tape_name, tape_type in (("tf", tf.GradientTape), ("oh", oh.GradientTape)):
                for i in range(3):
                    x = parallel.pack([tf.constant([1. + i, 2.]), tf.constant([3., -1.])])
                    pair = []
                    for fn in (traced, eager):
                        with tape_type() as tape:
                            tape.watch(x)
                            y = fn(x)
                        g = tape.gradient(y, x)
                        pair.append(None if g is None else
                                    [c.numpy().tolist() for c in parallel.unpack(g)])
                    out.setdefault("%s %s" % (name, tape_name), []).append(pair)
    print(json.dumps(out))
else:
    prog = globals()["prog_" + sys.argv[1]]
    print(json.dumps({"ours": ours(prog), "threads": len(THREADS), "tf": theirs(prog)}))
'''


def _run(program, timeout=120):
    return json.loads(run_python(_PROGRAMS, args=[program], timeout=timeout)
                      .strip().splitlines()[-1])


@pytest.mark.parametrize("program", ["eager", "function", "async_scope", "broadcast",
                                     "sync_training", "loop"])
def test_collective_on_packed_tensor_matches_parallel_device(program):
    result = _run(program)
    np.testing.assert_allclose(result["ours"], result["tf"], rtol=1e-6)
    if program == "loop":
        # One multi-device call, as a function without a loop: no component thread.
        assert result["threads"] == 0, result


def test_all_reduce_in_a_function_matches_mirrored_strategy_call_after_call():
    """`parallel.all_reduce` in a tf.function called in the scope: each call's collective
    has one member per component with a new instance key. It used to run the two-member
    function eager all_reduce uses once per component, two members per device with one
    key, and TensorFlow's rendezvous failed at random ("Second consumer arrived for
    key", then every collective of the process) within a few calls."""
    result = _run("all_reduce_in_function", timeout=240)
    for name in ("step", "looped", "relaxed"):
        assert len(result["ours"][name]) == len(result["tf"][name]) == 20, name
        for i, (ours, theirs) in enumerate(zip(result["ours"][name], result["tf"][name])):
            for a, b in zip(ours if name == "step" else [ours],
                            theirs if name == "step" else [theirs]):
                np.testing.assert_allclose(a, b, rtol=1e-6, err_msg="%s call %d" % (name, i))
    # A function whose body packs or unpacks nothing runs whole per component, as one
    # multi-device call: no component thread.
    assert result["threads"] == 0, result["threads"]


def test_gradient_through_the_call_of_a_function_holding_all_reduce():
    """A tape outside a tf.function that calls `parallel.all_reduce` (in a loop too): the
    gradient through the call equals the eager all_reduce's, call after call, with
    tf.GradientTape and oh.GradientTape. It came back None: TensorFlow recorded the call
    with no outputs, because the gradient's collective took a call-time key of its own."""
    result = _run("gradient_through_call")
    assert len(result) == 4, result  # call and loop, each with both tapes
    for name, pairs in result.items():
        assert len(pairs) == 3, name
        for i, (traced, eager) in enumerate(pairs):
            assert traced is not None and eager is not None, (name, i, pairs)
            np.testing.assert_allclose(traced, eager, rtol=1e-6, err_msg="%s call %d" % (name, i))
    # d/dx of sum_c(all_reduce(x * x) * [1, 2]) on component c: 2 * x_c * (2 * [1, 2]).
    x0 = np.array([[1., 2.], [3., -1.]])
    np.testing.assert_allclose(result["call tf"][0][0],
                               2. * x0 * 2. * np.array([1., 2.]), rtol=1e-6)


def test_component_failing_in_a_loop_is_cancelled_not_aborted():
    """A function whose collectives sit in a loop runs as one call: a component that
    fails cancels the others (no abort of the process's collectives, which then keep
    working), and the error names the handler, the component and the cause.

    The failure comes before the collective's group was ever formed: TensorFlow could
    then cancel the group for good (when the waiting member had joined it already), and
    every later call failed ("Collective ops is aborted by: group is cancelled"). The
    handler forms the groups of a fused function before its first call."""
    result = _run("failure_in_loop")
    message = result["error"]
    assert message is not None and "oh.ParallelHandler" in message, result
    assert "component /job:localhost/replica:0/task:0/device:CPU:1" in message, message
    assert result["kind"] == "InvalidArgumentError", result
    assert "bad input" in message and "Tensor had NaN values" in message, message
    # (1 + 2) * 2 summed: 6; then (6 + 6) * 2: 24; then (24 + 24) * 2: 96.
    assert result["after"] == [96., 96.], result


def test_a_fused_calls_error_names_the_failing_component_not_the_cancelled_one():
    """The runtime may report a fused call's failure as two root errors, the failing
    component's and the cancellation of the one that waited for it in a collective, in
    either order (seen in a full run of the loop test above): the error names the failing
    component and has its cause's type."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_ophandlers as oh  # pylint: disable=import-outside-toplevel
    from tf_ophandlers.handlers.parallel import fused_calls  # pylint: disable=import-outside-toplevel

    class Entry:  # (what the error's reading uses of a fused call's entry: its name)
        name = "oh_parallel_f_x2_0"
    devices = ["/job:localhost/replica:0/task:0/device:CPU:%d" % i for i in (0, 1)]
    handler = oh.ParallelHandler(devices)
    failing = ("(%d) INVALID_ARGUMENT: {{function_node oh_parallel_f_x2_0}} {{function_node "
               "oh_parallel_f_x2_0_component1}} bad input : Tensor had NaN values\n"
               "\t [[{{node while/CheckNumerics}}]]\n\t [[component_1]]\n")
    cancelled = ("(%d) CANCELLED: {{function_node oh_parallel_f_x2_0}} {{function_node "
                 "oh_parallel_f_x2_0_component0}} Operation was cancelled for BufRendezvous "
                 "key 101:101:0:0:0:0:0\n\t [[{{node while/CollectiveReduceV2}}]]\n"
                 "\t [[component_0]]\n")
    for first_code, parts in ((tf.errors.INVALID_ARGUMENT, (failing % 0, cancelled % 1)),
                              (tf.errors.CANCELLED, (cancelled % 0, failing % 1))):
        error = tf.errors.OpError(None, None, "2 root error(s) found.\n  " + "  ".join(parts)
                                  + "0 successful operations.\n0 derived errors ignored.",
                                  first_code)
        assert fused_calls._failed_component(handler, Entry, error) == (  # pylint: disable=protected-access
            devices[1], tf.errors.INVALID_ARGUMENT)
    # One root error: its component and code.
    error = tf.errors.OpError(None, None, failing % 0, tf.errors.INVALID_ARGUMENT)
    assert fused_calls._failed_component(handler, Entry, error) == (  # pylint: disable=protected-access
        devices[1], tf.errors.INVALID_ARGUMENT)
    # No component named: none, the error's own code.
    error = tf.errors.OpError(None, None, "something else", tf.errors.INTERNAL)
    assert fused_calls._failed_component(handler, Entry, error) == (  # pylint: disable=protected-access
        None, tf.errors.INTERNAL)


def test_component_failing_before_a_collective_raises_instead_of_hanging():
    result = _run("failure")
    message = result["error"]
    assert "oh.ParallelHandler" in message and "device:CPU:1" in message, message
    assert "bad input" in message and "Tensor had NaN values" in message, message
