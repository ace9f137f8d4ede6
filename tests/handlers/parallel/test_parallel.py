"""oh.ParallelHandler on two logical CPUs (configured in conftest.py) and on two
tf.distribute.Server workers."""
import collections
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close, run_threads
from python_process import run_python

CPUS = ["CPU:0", "CPU:1"]


@pytest.fixture
def parallel():
    return oh.ParallelHandler(CPUS)


def test_ops_run_once_per_component_on_its_device(parallel):
    with parallel:
        x = parallel.pack([tf.constant([1., 2.]), tf.constant([3., 4.])])
        y = tf.reduce_sum(x * x) + 1.
    parts = parallel.unpack(y)
    assert [float(p) for p in parts] == [6., 26.]
    assert [p.device.rsplit(":", 1)[-1] for p in parts] == ["0", "1"]
    assert y.shape == () and y.dtype == tf.float32
    assert "ParallelValue" in repr(y) and "CPU:1" in repr(y)


def test_copy_on_broadcasts_and_device_ids(parallel):
    with parallel:
        y = tf.constant(2.) * tf.cast(parallel.device_ids, tf.float32)
    assert [float(p) for p in parallel.unpack(y)] == [0., 2.]
    with parallel:
        same = tf.constant([1., 2.]) + 0.
    assert_close(tf.get_static_value(same), [1., 2.])  # equal components: a static value


def test_copy_off_is_an_error_explaining_unpack(parallel):
    with parallel:
        y = parallel.pack([tf.constant(1.), tf.constant(2.)])
    with pytest.raises(oh.CopyOffError, match=r"unpack"):
        y.numpy()
    with pytest.raises(oh.CopyOffError, match=r"ParallelHandler"):
        with tf.device("CPU:0"):
            tf.identity(y)


def test_pack_validates_its_inputs(parallel):
    with pytest.raises(ValueError, match="3 tensors for 2 components"):
        parallel.pack([tf.constant(1.)] * 3)


def test_rfc_copies_and_their_gradients(parallel):
    # RFC "Copies and their gradients": the gradient of component 1 of b is 0.
    a = tf.constant(2.)
    with parallel:
        with oh.GradientTape() as tape:
            tape.watch(a)
            b = tf.fill(dims=[], value=3.)
            tape.watch(b)
            c = a * b
            first_c = parallel.unpack(c)[0]
    a_grad, b_grad = tape.gradient(first_c, [a, b])
    assert oh.handler_of(a_grad) is None and float(a_grad) == 3.
    assert [float(g) for g in parallel.unpack(b_grad)] == [2., 0.]


def test_rfc_re_entering_a_merged_stack(parallel):
    tape = oh.GradientTape()
    with tape:
        w = tf.constant(1.)
        tape.watch(w)
        x = tf.sin(w)
    with parallel:
        with tape:
            y = tf.square(x)
            y0, y1 = parallel.unpack(y)
    with tape:
        z = y0 + y1
    assert_close(tape.gradient(z, w), 4. * np.sin(1.) * np.cos(1.), 1e-6)


def test_pack_and_unpack_are_differentiable(parallel):
    a, b = tf.constant(3.), tf.constant(4.)
    with oh.GradientTape() as tape:
        tape.watch([a, b])
        with parallel:
            x = parallel.pack([a, b])
            y = x * x
        total = tf.add_n(parallel.unpack(y))
    assert [float(g) for g in tape.gradient(total, [a, b])] == [6., 8.]


def test_all_reduce_with_tensorflow_collectives(parallel):
    with parallel:
        x = parallel.pack([tf.constant([1., 2.]), tf.constant([5., 6.])])
        total = parallel.all_reduce(x)
        again = parallel.all_reduce(total * 0.5)
    assert [p.numpy().tolist() for p in parallel.unpack(total)] == [[6., 8.], [6., 8.]]
    assert [p.numpy().tolist() for p in parallel.unpack(again)] == [[6., 8.], [6., 8.]]
    assert [p.device[-5:] for p in parallel.unpack(total)] == ["CPU:0", "CPU:1"]


def test_all_reduce_gradient(parallel):
    a, b = tf.constant(2.), tf.constant(3.)
    with parallel:
        with oh.GradientTape() as tape:
            tape.watch([a, b])
            x = parallel.pack([a, b])
            y = parallel.all_reduce(x * x)  # y_i = a^2 + b^2 on both components
            first = parallel.unpack(y)[0]
    assert [float(g) for g in tape.gradient(first, [a, b])] == [4., 6.]


def test_tf_function_runs_whole_on_each_component(parallel):
    calls = []

    @tf.function
    def f(t):
        calls.append(1)  # traced once
        return tf.sin(t) * 2. + t

    with parallel:
        y = f(parallel.pack([tf.constant(0.5), tf.constant(1.5)]))
        y = f(parallel.pack([tf.constant(0.5), tf.constant(1.5)]))
    assert len(calls) == 1
    assert_close([float(p) for p in parallel.unpack(y)],
                 [np.sin(.5) * 2 + .5, np.sin(1.5) * 2 + 1.5], 1e-6)


def test_variables_hold_one_buffer_per_component_and_checkpoint(parallel, tmp_path):
    with parallel:
        v = tf.Variable(1.)
        v.assign_add(parallel.pack([tf.constant(0.5), tf.constant(1.5)]))
    assert [float(p) for p in parallel.unpack(v.read_value())] == [1.5, 2.5]
    ckpt = tf.train.Checkpoint(v=v)
    path = ckpt.save(str(tmp_path / "ckpt"))
    with parallel:
        v.assign(parallel.pack([tf.constant(0.), tf.constant(0.)]))
    ckpt.restore(path)
    assert [float(p) for p in parallel.unpack(v.read_value())] == [1.5, 2.5]
    names = [n for n, _ in tf.train.list_variables(path)]
    assert any("component_1" in n for n in names)


def test_data_parallel_keras_training_matches_single_device():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 1))).astype(np.float32)
    parallel = oh.ParallelHandler(CPUS)
    histories = []
    for data_parallel in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        opt = keras.optimizers.SGD(0.05)
        losses = []
        for _ in range(5):
            if data_parallel:
                with parallel:
                    with oh.GradientTape() as tape:
                        xb = parallel.pack([x[:8], x[8:]])
                        yb = parallel.pack([y[:8], y[8:]])
                        loss = tf.reduce_sum((model(xb) - yb) ** 2) / 16.
                    # The variables were broadcast (CopyOn); their gradients sum over
                    # the components (CopyOnGrad): an all-reduce.
                    grads = tape.gradient(loss, model.trainable_variables)
                loss = tf.add_n(parallel.unpack(loss))
            else:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum((model(x) - y) ** 2) / 16.
                grads = tape.gradient(loss, model.trainable_variables)
            assert all(oh.handler_of(g) is None for g in grads)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        histories.append(losses)
    assert_close(histories[1], histories[0], 1e-5)
    assert histories[1][-1] < histories[1][0]


def test_a_tensor_of_another_parallel_handler_is_an_error():
    p2, p1 = oh.ParallelHandler(CPUS), oh.ParallelHandler(["CPU:0"])
    with p2:
        x = p2.pack([tf.constant(1.), tf.constant(2.)])
    with pytest.raises(oh.CopyOffError, match="ParallelHandler.*unpack"):
        with p1:
            x + 1.


_REMOTE = r'''
import socket, tensorflow as tf
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
cluster = tf.train.ClusterSpec({"worker": ["127.0.0.1:%d" % free_port() for _ in range(2)]})
servers = [tf.distribute.Server(cluster, job_name="worker", task_index=i, start=True)
           for i in range(2)]
import tf_ophandlers as oh
tf.config.experimental_connect_to_cluster(cluster)
workers = ["/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)]
parallel = oh.ParallelHandler(workers)
w = tf.Variable([1., -1.])
x = [tf.constant([1., 2.]), tf.constant([3., 4.])]
with parallel:
    with oh.GradientTape() as tape:
        loss = tf.reduce_sum(w * parallel.pack(x)) ** 2
    grad = tape.gradient(loss, w)
print("devices", [t.device for t in parallel.unpack(loss)])
print("grad", grad.numpy().tolist())
# A checkpoint of a variable with a component on each task: TensorFlow restores it in a
# tf.function (tensors on several tasks), called outside the scope.
import os, tempfile
with parallel:
    v = tf.Variable(parallel.pack(x))
path = tf.train.Checkpoint(v=v).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
with parallel:
    v.assign(parallel.pack([tf.zeros([2]), tf.zeros([2])]))
tf.train.Checkpoint(v=v).read(path).assert_consumed()
print("restored", [t.numpy().tolist() for t in parallel.unpack(v.value())])
'''


def test_data_parallel_step_across_two_tensorflow_servers():
    out = run_python(_REMOTE, timeout=300)
    assert "task:0/device:CPU:0" in out and "task:1/device:CPU:0" in out
    # loss_i = (w . x_i)^2 with w.x = -1 and -1: grad = sum_i 2 (w.x_i) x_i
    assert "grad [-8.0, -12.0]" in out
    assert "restored [[1.0, 2.0], [3.0, 4.0]]" in out


# -- regressions found in review ---------------------------------------------------------------

def test_writing_a_host_variable_inside_the_scope_is_refused(parallel):
    w = tf.Variable(1.)
    with pytest.raises(oh.PlacementError, match="AssignAddVariableOp.*once per component"):
        with parallel:
            w.assign_add(1.)
    assert float(w) == 1.
    with parallel:  # reading it is fine
        y = w * parallel.pack([tf.constant(1.), tf.constant(2.)])
    assert [float(t) for t in parallel.unpack(y)] == [1., 2.]


def test_gradient_of_a_host_variable_used_twice_inside_the_scope(parallel):
    w = tf.Variable(3.)
    with parallel:
        with oh.GradientTape() as tape:
            y = parallel.pack([tf.constant(1.), tf.constant(2.)]) * w * w
        g = tape.gradient(y, w)
    assert oh.handler_of(g) is None and float(g) == 18.  # (1 + 2) * 2w


def _gather_loss_gradients(parallel, Tape, function):
    """A variable gathered by per-component ids under `parallel` and `Tape`: the tape's
    gradient, and TensorFlow's gradients for each component's ids (tf.IndexedSlices)."""
    v = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4))
    ids = [tf.constant([0, 2, 2]), tf.constant([1, 5, 0])]
    loss = lambda i: tf.reduce_sum(tf.square(tf.gather(v, i)))  # noqa: E731
    if function:
        loss = tf.function(loss)
    with parallel:
        with Tape() as tape:
            y = loss(parallel.pack(ids))
        got = tape.gradient(y, v)
        if oh.handler_of(got.values if isinstance(got, tf.IndexedSlices) else got):
            got = parallel.unpack(tf.convert_to_tensor(got))  # per component
    want = []
    for i in ids:
        with tf.GradientTape() as ref_tape:
            ref = loss(i)
        want.append(ref_tape.gradient(ref, v))
    return got, want


def test_sparse_gradient_of_a_host_variable_is_summed_over_components(parallel):
    # The components' tf.IndexedSlices gradients are summed dense. Summing their parts
    # (values, indices, dense shape) gave a [12, 4] "gradient" of a [6, 4] variable with
    # added indices (fuzz finding, tests/compositions/test_fuzz_compositions.py).
    got, want = _gather_loss_gradients(parallel, oh.GradientTape, False)
    assert oh.handler_of(got) is None and got.shape == (6, 4) and got.dtype == tf.float32
    assert_close(got, tf.convert_to_tensor(want[0]) + tf.convert_to_tensor(want[1]))


def test_sparse_gradient_with_tf_gradient_tape_stays_per_component(parallel):
    # Documented: tf.GradientTape does not see the broadcast (guide, "With tf.GradientTape").
    got, want = _gather_loss_gradients(parallel, tf.GradientTape, False)
    assert len(got) == 2
    for g, w in zip(got, want):
        assert_close(g, tf.convert_to_tensor(w))


def test_gradient_of_a_host_variable_read_in_a_function_is_summed(parallel):
    # Fuzz finding, fixed: the function call (run whole per component) was recorded with
    # the host variable's handle as its input, so its gradient stayed one per component
    # (copying it off raised); the call now takes the handle's CopyOn, as op by op.
    got, want = _gather_loss_gradients(parallel, oh.GradientTape, True)
    assert not isinstance(got, list), "one gradient per component"
    assert oh.handler_of(got) is None and got.shape == (6, 4) and got.dtype == tf.float32
    assert_close(got, tf.convert_to_tensor(want[0]) + tf.convert_to_tensor(want[1]))


@pytest.mark.parametrize("mode", ["eager", "function", "unknown_batch"])
def test_host_variable_gradients_in_a_function_match_tensorflow(parallel, mode):
    # A dense (matmul) and a sparse (gather) use of host variables, a partial batch in a
    # function with a None batch dim: the summed gradients of TensorFlow's per-component
    # runs, dense, off the handler.
    w = tf.Variable(np.linspace(-1., 1., 12, dtype=np.float32).reshape(4, 3))
    v = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4) / 10.)

    def loss(x, i):
        return tf.reduce_sum(tf.tanh(x @ w) * tf.reduce_sum(tf.gather(v, i), -1,
                                                              keepdims=True))
    if mode == "function":
        loss = tf.function(loss)
    elif mode == "unknown_batch":
        loss = tf.function(loss, input_signature=[tf.TensorSpec([None, 4]),
                                                  tf.TensorSpec([None], tf.int32)])
    r = np.random.default_rng(3)
    for batch in (4, 3):  # a partial last batch, a fresh handler per step
        xs = [tf.constant(r.standard_normal((batch, 4)).astype(np.float32)) for _ in CPUS]
        ids = [tf.constant(r.integers(0, 6, batch).astype(np.int32)) for _ in CPUS]
        step = oh.ParallelHandler(CPUS)
        with step:
            with oh.GradientTape() as tape:
                y = loss(step.pack(xs), step.pack(ids))
            got = tape.gradient(y, [w, v])
        want = []
        for x, i in zip(xs, ids):
            with tf.GradientTape() as ref_tape:
                ref = loss(x, i)
            want.append([tf.convert_to_tensor(g) for g in ref_tape.gradient(ref, [w, v])])
        for g, parts in zip(got, zip(*want)):
            assert not isinstance(g, tf.IndexedSlices) and oh.handler_of(g) is None
            assert g.dtype == tf.float32 and g.shape == parts[0].shape
            assert_close(g, parts[0] + parts[1], 1e-5)


def test_all_reduce_under_tf_gradient_tape_and_a_tape_outside(parallel):
    a0, a1 = tf.constant(1.), tf.constant(2.)
    with tf.GradientTape() as tape:
        tape.watch([a0, a1])
        with parallel:
            y = parallel.all_reduce(parallel.pack([a0, a1]) ** 2)
        first = parallel.unpack(y)[0]
    assert [float(g) for g in tape.gradient(first, [a0, a1])] == [2., 4.]
    with pytest.raises(NotImplementedError, match="open the tape inside the scope"):
        with oh.GradientTape() as outer:
            outer.watch(a0)
            with parallel:
                parallel.all_reduce(parallel.pack([a0, a1]))


def test_parallel_target_of_a_tape_outside_is_a_clear_error(parallel):
    w = tf.constant(3.)
    with oh.GradientTape() as tape:
        tape.watch(w)
        with parallel:
            y = parallel.pack([tf.constant(1.), tf.constant(2.)]) * w
    with pytest.raises(oh.CopyOffError, match="unpack"):
        tape.gradient(y, w)


def test_tf_function_creating_a_variable_and_device_specs(parallel):
    holder = []

    @tf.function
    def f(x):
        if not holder:
            holder.append(tf.Variable(1.))
        holder[0].assign_add(x)
        return holder[0].read_value()

    with parallel:
        y = f(tf.constant(2.))
        with tf.device(tf.DeviceSpec(device_type="CPU", device_index=0)):
            z = y * 2.
    assert [float(t) for t in parallel.unpack(y)] == [3., 3.]
    assert oh.handler_of(z) is not None  # a DeviceSpec keeps the handlers, as a string does


def test_pack_checks_dtypes_and_shapes_may_differ(parallel):
    with pytest.raises(ValueError, match="one dtype"):
        parallel.pack([tf.constant(1.), tf.constant(1)])
    with parallel:
        x = parallel.pack([tf.ones([2]), tf.ones([3])])
    assert x.shape.as_list() == [None]
    other = oh.ParallelHandler(CPUS)
    with pytest.raises(oh.PlacementError, match="does not belong"):
        other.unpack(x)


def test_threads_enter_the_same_handler(parallel):
    errors, results = [], []

    def work(value):
        try:
            with parallel:
                v = tf.Variable(value)
                results.append(type(v).__name__)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)

    run_threads([lambda i=i: work(float(i)) for i in range(4)])
    assert not errors and all(name.startswith("Parallel") for name in results)


# -- reliability: components that cannot all join a collective -------------------

_JOIN = r'''
import sys, tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_ophandlers as oh
components = sys.argv[1].split(",")
try:
    parallel = oh.ParallelHandler(components)
except ValueError as e:
    print("refused:", e)
    sys.exit(0)
with parallel:
    y = parallel.all_reduce(parallel.pack([tf.constant(1.)] * len(components)))
print("reduced", [float(t) for t in parallel.unpack(y)])
'''


def _run(script, *args, timeout=120):
    return run_python(script, args=args, timeout=timeout, check=False)


@pytest.mark.slow  # three subprocesses with a timeout each
@pytest.mark.parametrize("components, message", [
    ("/cpu:0,/cpu:0", r"'/cpu:0' and '/cpu:0' are the same device"),
    ("CPU:1,/job:localhost/replica:0/task:0/device:CPU:1", r"same device"),
    ("/cpu:0,/cpu:7", r"component '/cpu:7' .*CPU:7\) is not a device of this program"),
])
def test_repeated_or_unknown_components_are_refused_not_a_hang(components, message):
    # Before the fix the handler accepted them and all_reduce never returned.
    proc = _run(_JOIN, components)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search("refused: oh.ParallelHandler: .*" + message, proc.stdout), proc.stdout
    # Distinct spellings of the two existing devices still work.
    proc = _run(_JOIN, "/cpu:0,/job:localhost/device:CPU:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reduced [2.0, 2.0]" in proc.stdout


def test_components_are_validated_like_mirrored_strategy():
    with pytest.raises(ValueError, match="ParallelHandler.*same device"):
        oh.ParallelHandler(["CPU:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="ParallelHandler.*'GPU:0'.*not a device"):
        oh.ParallelHandler(["CPU:0", "GPU:0"])
    with pytest.raises(TypeError, match="ParallelHandler.*list of device names"):
        oh.ParallelHandler("CPU:0")
    with pytest.raises(ValueError, match="ParallelHandler.*timeout_seconds"):
        oh.ParallelHandler(CPUS, timeout_seconds=-1)
    # TensorFlow's own strategy refuses the same repeated device (with an assert).
    with pytest.raises(AssertionError, match="No duplicates"):
        tf.distribute.MirroredStrategy(["CPU:0", "CPU:0"])
    assert oh.ParallelHandler(tf.config.list_logical_devices("CPU")).components == \
        oh.ParallelHandler([tf.DeviceSpec(device_type="CPU", device_index=i)
                            for i in range(len(tf.config.list_logical_devices("CPU")))]
                           ).components
    assert oh.ParallelHandler(["cpu:1", "/cpu:0"]).components == (
        "/job:localhost/replica:0/task:0/device:CPU:1",
        "/job:localhost/replica:0/task:0/device:CPU:0")


_NEVER_JOINS = r'''
import time, tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_ophandlers as oh
parallel = oh.ParallelHandler(["CPU:0", "CPU:1"], timeout_seconds=2)
# A member that can never join (what a remote worker that died looks like): both
# collective members on one device, which validation would refuse.
parallel.components = (parallel.components[0],) * 2
start = time.time()
try:
    with parallel:
        parallel.all_reduce(parallel.pack([tf.constant(1.)] * 2))
except tf.errors.DeadlineExceededError as e:
    print("deadline after %.0f s:" % (time.time() - start), e.message.splitlines()[0])
'''


def test_a_collective_that_cannot_complete_times_out():
    proc = _run(_NEVER_JOINS, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"deadline after \d s: oh.ParallelHandler.all_reduce: a component of "
                     r"ParallelHandler\(.*\) did not join the collective within "
                     r"timeout_seconds=2", proc.stdout), proc.stdout


def _os_threads():
    """The process's OS threads by name (`comm`; a thread without a name of its own has
    the name of the thread that started it)."""
    names = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/comm" % task) as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_many_all_reduce_calls_leave_no_sleeping_threads():
    # TensorFlow's collective timeout starts an OS thread per member and run that sleeps
    # out the whole timeout: with local components a custom loop must not pile them up.
    parallel = oh.ParallelHandler(CPUS, timeout_seconds=300)
    with parallel:
        x = parallel.pack([tf.constant([1., 2.]), tf.constant([3., 4.])])
        for _ in range(3):  # TensorFlow's own pools and the handler's threads start
            parallel.all_reduce(x)
        before = _os_threads()
        for _ in range(50):
            y = parallel.all_reduce(x)
        after = _os_threads()
    assert [p.numpy().tolist() for p in parallel.unpack(y)] == [[4., 6.], [4., 6.]]
    # Passing TensorFlow the timeout leaves 2-4 sleeping threads per call (named, as
    # they inherit it, "collective_ops"; about 200 here). TensorFlow's collective work
    # queue itself starts a thread whenever work arrives while none of its threads is
    # idle, so on a loaded machine it grows by a few (6 seen in a full run).
    assert sum((after - before).values()) <= 12, (before, after)


def test_a_component_worker_is_idle_again_before_its_op_returns(monkeypatch):
    # A worker that went back to the idle list only after signalling its component made
    # the next op start a new thread whenever the caller was quicker (seen as threads
    # piling up on a busy machine). A slow return to the list makes that window certain.
    import threading
    import time
    from tf_ophandlers.handlers.parallel import collectives

    class SlowForWorkers:
        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.02)
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    parallel = oh.ParallelHandler(CPUS)
    # A function holding a collective, on a handler below (no fused call): its
    # components run on threads of their own.
    reduce_in_function = tf.function(lambda v: parallel.all_reduce(v))
    with oh.OpHandler(), parallel:
        x = parallel.pack([tf.constant([1., 2.]), tf.constant([3., 4.])])
        reduce_in_function(x)  # traced; the worker for component 1 exists
        monkeypatch.setattr(collectives, "_idle_lock", SlowForWorkers())
        started = []
        original = collectives._Worker.__init__

        def counting_init(self):
            started.append(self)
            original(self)

        monkeypatch.setattr(collectives._Worker, "__init__", counting_init)
        for _ in range(5):
            y = reduce_in_function(x)
    assert [p.numpy().tolist() for p in parallel.unpack(y)] == [[4., 6.], [4., 6.]]
    assert started == []


# -- model.fit inside the scope ---------------------------------------------

def _fit_model(seed=1):
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.Adam(0.01), "mse")
    return model


def _fit_data():
    rng = np.random.RandomState(0)
    x = rng.randn(38, 4).astype(np.float32)  # 38 = 2 full batches of 16 and a partial one
    return x, (x.sum(1, keepdims=True) * 0.5).astype(np.float32)


def test_model_fit_built_inside_the_scope_trains_as_on_one_device():
    x, y = _fit_data()
    want = _fit_model().fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    parallel = oh.ParallelHandler(["/cpu:0", "/cpu:1"])
    with parallel:
        model = _fit_model()
        got = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
        weights = model.get_weights()  # copies off: every component holds the same weights
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    for w in model.weights:  # one buffer per device, equal after all-reduced steps
        parts = parallel.unpack(tf.convert_to_tensor(w))
        assert len(parts) == 2 and parts[0].device != parts[1].device
        np.testing.assert_allclose(parts[0].numpy(), parts[1].numpy())
    assert [w.shape for w in weights] == [w.shape for w in model.weights]


def test_model_fit_of_a_model_built_outside_says_how_to_build_it_inside():
    x, y = _fit_data()
    model = _fit_model()
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # optimizer state exists
    with pytest.raises(oh.PlacementError, match="build and compile it inside the scope"):
        with oh.ParallelHandler(["/cpu:0", "/cpu:1"]):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_optimizer_made_outside_the_scope_fails_before_any_write(parallel):
    """Its `iterations` is a host variable: the step is refused before the weights
    change (it used to fail at that last write, so a retry applied the step twice); a
    new optimizer made in the scope then trains as on one device."""
    w0 = np.array([1., -2.], np.float32)
    outside = keras.optimizers.SGD(0.1)
    with parallel:
        w = tf.Variable(w0)
    for _ in range(2):
        with pytest.raises(oh.PlacementError, match=(
                r"oh.ParallelHandler: SGD.apply would write variable .*iteration.*created "
                r"outside ParallelHandler\(.*\).*nothing was written.*make a new one")):
            with parallel:
                outside.apply_gradients([(2. * w, w)])
        for part in parallel.unpack(tf.convert_to_tensor(w)):
            assert_close(part, w0, 0)
        assert int(outside.iterations.numpy()) == 0
    with parallel:
        opt = keras.optimizers.SGD(0.1)
        opt.apply_gradients([(2. * w, w)])
    ref, ref_opt = tf.Variable(w0), keras.optimizers.SGD(0.1)
    ref_opt.apply_gradients([(2. * ref, ref)])
    for part in parallel.unpack(tf.convert_to_tensor(w)):
        assert_close(part, ref, 1e-6)


def test_all_reduce_of_many_signatures_prints_no_retracing_warning(parallel):
    """The library's own collective function is traced once per signature without
    TensorFlow's "triggered tf.function retracing" warning (the user did nothing wrong)."""
    import logging  # pylint: disable=import-outside-toplevel
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep()
    logging.getLogger("tensorflow").addHandler(keep)
    try:
        with parallel:
            for n, dtype in [(1, tf.float32), (2, tf.float32), (3, tf.float32), (4, tf.float32),
                             (5, tf.float32), (3, tf.float64), (3, tf.int32), (3, tf.int64)]:
                parts = [tf.cast(tf.range(n) + i, dtype) for i in range(2)]
                got = parallel.unpack(parallel.all_reduce(parallel.pack(parts)))
                for g in got:
                    assert g.dtype == dtype
                    assert_close(g, tf.add_n(parts), 0)
    finally:
        logging.getLogger("tensorflow").removeHandler(keep)
    assert not [r for r in records if "retracing" in r], records


@pytest.mark.parametrize("make", [lambda: oh.ParallelHandler(CPUS),
                                  lambda: oh.Mesh({"batch": 2}, CPUS)],
                         ids=["ParallelHandler", "Mesh"])
def test_tape_outside_the_scope_refuses_what_it_cannot_differentiate(make):
    """A tape opened outside the scope records each component's (device's) ops: it gave
    None for a variable made in the scope, silently; now the read raises. Inside the
    scope the tape gives TensorFlow's answers."""
    handler = make()
    name = "Mesh" if isinstance(handler, oh.Mesh) else "ParallelHandler"
    w_host = tf.Variable(1.)
    with handler:
        w_in = tf.Variable(1.)
    with oh.GradientTape() as tape:
        with pytest.raises(NotImplementedError, match=(
                r"oh.%s: op ReadVariableOp reads a variable made in the scope of %s\(.*"
                r"under an oh.GradientTape opened outside that scope.*Open the tape inside"
                % (name, name))):
            with handler:
                w_in * w_host
        with tape.stop_recording():  # the documented way around it
            with handler:
                y = w_in * w_host + 1.
    assert float(handler.unpack(y)[0]) == 2.
    with handler:
        with oh.GradientTape() as tape:
            loss = w_in * w_host
        g_in, g_host = tape.gradient(loss, [w_in, w_host])
    # TensorFlow's answers: per component (device) for the scope's variable; for the
    # host variable, the sum over the components (ParallelHandler: the broadcast's
    # CopyOnGrad) or the one global value (Mesh: a replicated tensor is one value).
    with tf.GradientTape() as ref:
        ref_loss = tf.Variable(1.) * w_host
    want = float(ref.gradient(ref_loss, w_host))
    assert [float(g) for g in handler.unpack(tf.convert_to_tensor(g_in))] == [want, want]
    assert float(g_host) == (want if name == "Mesh" else 2 * want)


def test_parallel_target_with_equal_components_of_a_tape_outside_is_an_error(parallel):
    """Its components are equal, so copying it off used to succeed with component 0:
    the host variable got one replica's gradient (1 instead of 2), silently. The sum of
    the unpacked components is the RFC's target (CopyOnGrad sums the broadcast)."""
    w = tf.Variable(3.)
    with oh.GradientTape(persistent=True) as tape:
        with parallel:
            y = w * 2.
        total = tf.add_n(parallel.unpack(y))
    with pytest.raises(oh.CopyOffError, match=r"cannot be a target of an oh.GradientTape "
                                              r"opened outside the scope.*unpack"):
        tape.gradient(y, w)
    with tf.GradientTape() as ref:  # TensorFlow: the two replicas' losses summed
        ref_total = w * 2. + w * 2.
    assert float(tape.gradient(total, w)) == float(ref.gradient(ref_total, w)) == 4.
