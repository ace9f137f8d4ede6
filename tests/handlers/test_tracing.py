"""TraceAndExecute, Lazy and Async, each against eager execution."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from conftest import assert_close, run_threads


def _chain(h, n=50):
    for _ in range(n):
        h = tf.tanh(h) * 1.01
    return h


def _rnn(h, xs, w, u):
    for t in range(xs.shape[0]):
        h = tf.tanh(tf.matmul(xs[t], w) + tf.matmul(h, u))
    return h


def _rnn_inputs():
    w = tf.random.stateless_normal([8, 8], seed=[1, 2]) * 0.1
    u = tf.random.stateless_normal([8, 8], seed=[3, 4]) * 0.1
    xs = tf.random.stateless_normal([6, 4, 8], seed=[5, 6])
    return tf.zeros([4, 8]), xs, w, u


# -- TraceAndExecute ---------------------------------------------------------------------------

def test_trace_executes_eagerly_and_builds_a_function_of_its_inputs():
    x = tf.constant([0.5, -1.0])
    y0 = tf.constant(3.0)
    with oh.TraceAndExecute() as trace:
        z = tf.sin(x) * y0 + 2.0  # 2.0 is a constant of the trace, not an input
    assert_close(z, np.sin([0.5, -1.0]) * 3.0 + 2.0)  # executed eagerly
    assert [t.numpy().tolist() for t in trace.inputs] == [[0.5, -1.0], 3.0]
    f = trace.function(z)
    assert isinstance(f, type(tf.function(lambda: 1).get_concrete_function()))
    assert_close(f(tf.constant([1.0, 2.0]), tf.constant(-1.0)), -np.sin([1.0, 2.0]) + 2.0)
    assert "Sin" in [n.op for n in trace.graph_def(z).node]


def test_a_scalar_cache_clear_forgets_the_python_scalars_of_traces():
    # Python scalars converted under a scope are known by handle address while
    # TensorFlow's scalar cache holds their handles. Once the cache is cleared (as its
    # leak checks do), a freed address can come back as a user tensor of equal value,
    # which a trace would then bake in as a constant. So a clear forgets them all: a
    # tensor converted before the clear (held here, so its address stays its own and
    # the check is deterministic) is an input of a later trace, not a constant.
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    x = tf.constant([0.5, -1.0])
    with oh.TraceAndExecute() as trace:
        c = tf.convert_to_tensor(3.0)
        z = x * c
    assert [t.numpy().tolist() for t in trace.inputs] == [[0.5, -1.0]]  # c: a constant
    context.context()._clear_caches()  # pylint: disable=protected-access
    with oh.TraceAndExecute() as trace:
        z = tf.sin(x) * c
    assert [t.numpy().tolist() for t in trace.inputs] == [[0.5, -1.0], 3.0]
    assert_close(trace.function(z)(tf.constant([0.5, -1.0]), tf.constant(-2.0)),
                 np.sin([0.5, -1.0]) * -2.0)


def test_trace_write_graph_for_tensorboard(tmp_path):
    x = tf.constant([0.5, -1.0])
    with oh.TraceAndExecute() as trace:
        z = tf.nn.relu(tf.sin(x) * 3.0)
    written = trace.write_graph(str(tmp_path), z)
    from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
    events = [e for f in tmp_path.iterdir()
              for e in tf.compat.v1.train.summary_iterator(str(f))]
    graphs = [graph_pb2.GraphDef.FromString(e.graph_def) for e in events if e.graph_def]
    assert len(graphs) == 1 and graphs[0] == written
    ops = [n.op for n in graphs[0].node]
    assert {"Sin", "Mul", "Relu", "Placeholder"} <= set(ops)


def test_trace_of_a_keras_model_captures_variables_and_saves(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])
    x = tf.random.stateless_normal([5, 3], seed=[0, 1])
    with oh.TraceAndExecute() as trace:
        out = model(x)
        loss = tf.reduce_mean(out ** 2)
    assert len(trace.inputs) == 1  # the variables are captured, not arguments
    f = trace.function({"out": out, "loss": loss})
    x2 = tf.random.stateless_normal([5, 3], seed=[2, 3])
    result = f(x2)
    assert_close(result["out"], model(x2))
    assert_close(result["loss"], tf.reduce_mean(model(x2) ** 2))
    module = tf.Module()
    module.f = f
    module.variables_ = model.variables
    tf.saved_model.save(module, str(tmp_path / "traced"))
    loaded = tf.saved_model.load(str(tmp_path / "traced"))
    assert_close(loaded.f(x2)["out"], model(x2))


def test_trace_records_tf_function_calls_and_variable_updates():
    v = tf.Variable(1.0)
    g = tf.function(lambda a: a * 3.0)
    x = tf.constant([1.0, 2.0])
    with oh.TraceAndExecute() as trace:
        v.assign_add(1.0)
        z = g(x) + v.read_value()
    assert_close(z, [5.0, 8.0])
    f = trace.function(z)
    assert_close(f(tf.constant([0.0, 1.0])), [0.0 + 3.0, 3.0 + 3.0])  # v: 2 -> 3
    assert float(v.numpy()) == 3.0


def test_trace_function_of_an_unknown_tensor_is_an_error():
    with oh.TraceAndExecute() as trace:
        tf.sin(tf.constant(1.0))
    with pytest.raises(ValueError, match="neither computed nor used"):
        trace.function(tf.constant(2.0))


# -- Lazy ------------------------------------------------------------------------------------

def test_lazy_defers_until_a_value_is_requested_and_matches_eager():
    x = tf.random.stateless_normal([16, 16], seed=[7, 8])
    lazy = oh.Lazy()
    with lazy:
        h = _chain(x)
        assert lazy.flushes == 0  # nothing ran yet
        assert h.shape == (16, 16) and h.dtype == tf.float32  # inferred, no run
        value = h.numpy()
    # One function, built or found in the process-wide cache.
    assert lazy.flushes == 1 and lazy.compiled + lazy.cache_hits == 1
    assert_close(value, _chain(x))
    x2 = tf.random.stateless_normal([16, 16], seed=[9, 10])
    compiled = lazy.compiled
    with lazy:
        again = _chain(x2).numpy()  # same structure and specs: cached
    assert lazy.compiled == compiled and lazy.compiled + lazy.cache_hits == 2
    assert_close(again, _chain(x2))


def test_lazy_rnn_loop_python_decisions_and_printing():
    h0, xs, w, u = _rnn_inputs()
    with oh.Lazy():
        h = _rnn(h0, xs, w, u)
        total = tf.reduce_sum(h)
        branch = "pos" if total > 0 else "neg"  # a control decision forces the value
        text = repr(h)
    ref = _rnn(h0, xs, w, u)
    assert branch == ("pos" if float(tf.reduce_sum(ref)) > 0 else "neg")
    assert_close(h, ref)
    assert "tf.Tensor" in text or "[" in text


def test_lazy_runs_stateful_ops_in_program_order():
    v = tf.Variable([1.0, 2.0])
    with oh.Lazy():
        a = v.read_value() * 2.0
        v.assign(a + 1.0)
        b = v.read_value() * 10.0
    assert_close(b, [30.0, 50.0])
    assert_close(v, [3.0, 5.0])


def test_lazy_under_a_tape_gives_eager_gradients():
    x = tf.constant([0.3, -0.7])
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref = tf.reduce_sum(_chain(x, 10))
    expected = ref_tape.gradient(ref, x)
    with oh.GradientTape() as tape:
        tape.watch(x)
        with oh.Lazy():
            y = tf.reduce_sum(_chain(x, 10))
    assert_close(y, ref)
    assert_close(tape.gradient(y, x), expected)


def test_lazy_errors_surface_at_the_value_request_naming_the_op():
    with oh.Lazy():
        bad = tf.reshape(tf.ones([2, 3]) * 2.0, [7])  # shape inference fails only if asked
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
            bad.numpy()


def test_lazy_returns_only_referenced_values_and_keeps_them():
    x = tf.random.stateless_normal([4, 4], seed=[1, 1])
    expected_a = tf.tanh(x).numpy()
    lazy = oh.Lazy()
    with lazy:
        a = tf.tanh(x)
        b = a * 3.0
        c = tf.exp(b) - a   # b and a stay referenced: their values are kept too
        del b
        value = c.numpy()
        # a and c leave the function; the dropped b (and exp's result) stay inside it.
        assert len(lazy.last_function.outputs) == 2
        assert_close(a.numpy(), expected_a)
        assert lazy.flushes == 1  # a was computed by the same request
    assert_close(value, tf.exp(tf.tanh(x) * 3.0) - tf.tanh(x))


def test_lazy_value_dropped_by_the_program_but_needed_by_a_pending_op_is_kept():
    x = tf.random.stateless_normal([4, 4], seed=[2, 2])
    expected = (np.tanh(x.numpy()) * 2.0, np.tanh(x.numpy()) * 3.0)
    lazy = oh.Lazy()
    with lazy:
        a = tf.tanh(x)
        b, c = a * 2.0, a * 3.0
        del a
        assert_close(b.numpy(), expected[0])   # computes tanh and b, not c
        assert len(lazy.last_function.outputs) == 2  # b, and tanh's output for c
        assert_close(c.numpy(), expected[1])   # c from the kept value, tanh not rerun
        assert lazy.flushes == 2
        second = lazy.last_function
        assert "Tanh" not in {o.type for o in second.graph.get_operations()}


def test_lazy_values_survive_a_failed_request_and_a_failed_scope_exit():
    x = tf.constant([1.0, 2.0])
    lazy = oh.Lazy()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
        with lazy:
            a = tf.tanh(x)
            b, c = a * 2.0, a * 3.0
            bad = tf.reshape(a, [7])
            del a
    assert_close(b.numpy(), np.tanh([1.0, 2.0]) * 2.0)  # tanh computed for b, kept for c
    assert_close(c.numpy(), np.tanh([1.0, 2.0]) * 3.0)
    with lazy:
        a = tf.tanh(x)
        c = a * 3.0
        bad = tf.reshape(a, [7])
        del a
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
            bad.numpy()
        _ = [tf.ones([1]) + 1.0 for _ in range(300)]  # the failed nodes are pruned
        assert_close(c.numpy(), np.tanh([1.0, 2.0]) * 3.0)
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
            bad.numpy()  # the same error again
        del bad


def test_lazy_op_rejected_when_building_the_function_raises_like_eager_once():
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.unique(tf.ones([2, 2]))  # eager: the kernel rejects a rank-2 input
    lazy = oh.Lazy()
    with lazy:  # the scope's exit does not run the failed computation again
        u = tf.unique(tf.ones([2, 2]))[0]
        with pytest.raises(tf.errors.InvalidArgumentError):
            u.numpy()


def test_lazy_shape_of_a_long_pending_chain():
    with oh.Lazy() as lazy:
        h = tf.ones([4, 4])
        for _ in range(1500):
            h = tf.tanh(h) * 1.01
        assert h.shape == (4, 4)  # inferred through 3000 pending ops, nothing ran
        assert lazy.flushes == 0


def test_lazy_failed_request_raises_again_and_is_not_rerun_at_scope_exit():
    lazy = oh.Lazy()
    with lazy:
        bad = tf.reshape(tf.ones([2, 3]) * 2.0, [7])
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
            bad.numpy()
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
            bad.numpy()  # asked again: the same error, not a stale value
        good = tf.ones([3]) * 2.0
    assert lazy.flushes == 1  # the scope's exit ran `good` only
    assert_close(good, [2.0, 2.0, 2.0])


# -- Async ----------------------------------------------------------------------------------

def test_async_results_equal_eager_and_compose():
    h0, xs, w, u = _rnn_inputs()
    with oh.Async():
        with oh.OpLogHandler() as log:
            h = _rnn(h0, xs, w, u)
    assert_close(h, _rnn(h0, xs, w, u))
    assert "MatMul" in log.op_types_seen()


def test_async_error_surfaces_at_the_next_synchronization_point():
    runner = oh.Async(sync_on_exit=False)
    with runner:
        tf.raw_ops.Reshape(tensor=tf.ones([2, 3]), shape=tf.constant([7]))  # queued
        with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
            runner.sync()
        assert float(tf.reduce_sum(tf.ones([3]))) == 3.0  # usable after the error
    with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
        with oh.Async():
            tf.raw_ops.Reshape(tensor=tf.ones([2, 3]), shape=tf.constant([7]))


class _Gate:
    """A kernel that waits: `take()` is a tensor of 0.1s whose dequeue blocks until
    `release()` (always from another thread: on the async queue itself the release would
    wait behind the dequeue) or until `release_after` seconds have passed. A test that
    finds `released` set where it expects none did wait for the kernel."""

    def __init__(self, shape=(8, 8), release_after=20.0):
        import threading  # pylint: disable=import-outside-toplevel
        self.shape = shape
        self.queue = tf.queue.FIFOQueue(1, tf.float32, shapes=[shape])
        self.value = tf.ones(shape) * 0.1
        self.released = False
        self._lock = threading.Lock()
        self._thread = threading.Thread
        timer = threading.Timer(release_after, self.release)
        timer.daemon = True
        timer.start()

    def take(self):
        return tf.ensure_shape(self.queue.dequeue(), self.shape)

    def release(self):
        with self._lock:  # the timer and the test may both release: enqueue once
            if self.released:
                return
            self.released = True
        t = self._thread(target=self.queue.enqueue, args=(self.value,), daemon=True)
        t.start()
        t.join(20)


def test_async_returns_before_the_kernels_including_inner_handlers_ops():
    # Python code that reads shapes (tf.matmul, the accumulator's JVP rules) keeps issuing
    # ops while a kernel upstream has not run: shapes come from shape inference.
    gate = _Gate()
    w = tf.random.stateless_normal([8, 8], seed=[1, 3])
    tangent = tf.ones([8, 8])
    runner = oh.Async()
    with runner:
        with oh.ForwardAccumulator(w, tangent) as acc:
            with oh.CheckNumericsHandler():
                x = gate.take()
                y = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) * 2.0, axis=1)
                assert y.shape == (8,)  # inferred, not computed
                assert not gate.released  # nothing waited for the gated kernel
                gate.release()
                jvp = acc.jvp(y)
    x_ref = tf.ones([8, 8]) * 0.1
    with tf.autodiff.ForwardAccumulator(w, tangent) as ref_acc:
        ref = tf.reduce_sum(tf.tanh(tf.matmul(x_ref, w)) * 2.0, axis=1)
    assert_close(y, ref)
    assert_close(jvp, ref_acc.jvp(ref))


def test_async_keras_model_issues_without_waiting_and_matches_eager():
    # Keras layers read the kernel's shape (tf.matmul): variable reads get the variable's
    # shape without waiting for the queue.
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    x_ref = tf.ones([8, 8]) * 0.1
    with tf.GradientTape() as ref_tape:
        ref = tf.reduce_sum(model(x_ref))
    ref_grads = ref_tape.gradient(ref, model.trainable_variables)
    gate = _Gate()
    with oh.GradientTape() as tape:
        with oh.Async():
            y = tf.reduce_sum(model(gate.take()))
            assert not gate.released  # issued past the gated kernel
            gate.release()
    assert_close(y, ref)
    for g, r in zip(tape.gradient(y, model.trainable_variables), ref_grads):
        assert_close(g, r)


@pytest.mark.parametrize("assign", ["op", "tf.function"])
def test_async_read_of_a_variable_whose_shape_a_queued_assign_changes(assign):
    v = tf.Variable(tf.zeros([2]), shape=tf.TensorShape(None))
    set_v = v.assign if assign == "op" else tf.function(v.assign)
    gate = _Gate((3, 4), release_after=0.3)
    with oh.Async():
        set_v(gate.take())  # queued behind the gate
        r = v.read_value()
        assert r.shape == (3, 4)  # waited for the queued assign, not the old shape (2,)
        assert gate.released
        assert int(tf.size(r)) == 12
    assert_close(r, np.full([3, 4], 0.1))


def test_async_read_after_a_shape_validated_assign_does_not_wait():
    # Variable.assign on a variable of fully defined shape validates the shape
    # (AssignVariableOp validate_shape=True), in eager code and in a tf.function: the
    # variable's shape is read without waiting for the queue.
    v = tf.Variable(tf.zeros([8, 8]))
    gate = _Gate()
    with oh.Async():
        v.assign(gate.take())
        tf.function(v.assign_add)(tf.ones([8, 8]))
        tf.function(v.assign)(v.read_value() * 2.0)
        r = v.read_value()
        assert r.shape == (8, 8)
        assert not gate.released
        gate.release()
    assert_close(r, np.full([8, 8], 2.2))


def test_async_keras_training_steps_match_eager():
    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(2)])
        return model, keras.optimizers.Adam(0.05)

    x = tf.random.stateless_normal([16, 6], seed=[4, 5])
    y = tf.random.stateless_normal([16, 2], seed=[6, 7])

    def step(model, optimizer):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    ref_model, ref_opt = make()
    ref_losses = [float(step(ref_model, ref_opt)) for _ in range(3)]
    model, opt = make()
    with oh.Async():
        losses = [step(model, opt) for _ in range(3)]  # issued without synchronizing
    assert_close([float(v) for v in losses], ref_losses)
    for a, b in zip(model.weights, ref_model.weights):
        assert_close(a, b)


def test_async_nested_scopes_share_one_queue():
    v = tf.Variable(tf.zeros([2]), shape=tf.TensorShape(None))
    w = tf.Variable(tf.ones([3]))
    gate = _Gate((3, 4), release_after=0.3)
    with oh.Async():
        with oh.Async():
            v.assign(gate.take())
            assert w.read_value().shape == (3,)  # reads another variable without waiting
            r = v.read_value()
            assert r.shape == (3, 4)
    assert_close(r, np.full([3, 4], 0.1))
    # An error queued inside a nested scope that does not synchronize surfaces when the
    # outer one does.
    with pytest.raises(tf.errors.InvalidArgumentError, match="eshape"):
        with oh.Async():
            with oh.Async(sync_on_exit=False):
                tf.raw_ops.Reshape(tensor=tf.ones([2, 3]), shape=tf.constant([7]))


def test_async_errors_stay_with_their_queue_across_nesting_and_threads():
    import threading  # pylint: disable=import-outside-toplevel
    bad = lambda: tf.raw_ops.Reshape(tensor=tf.ones([2, 3]), shape=tf.constant([8]))  # noqa: E731
    inner, outer = oh.Async(), oh.Async(sync_on_exit=False)
    with outer:
        with inner:
            tf.ones([1])
    with outer:
        bad()
    with inner:  # used alone now: outer's queued failure is not its business
        tf.ones([1]) * 2.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="values"):
        outer.sync()
    # One handler used by two threads: each thread has its own queue.
    shared, results = oh.Async(), {}
    a_issued, b_done = threading.Event(), threading.Event()

    def thread_a():
        try:
            with shared:
                bad()
                a_issued.set()
                b_done.wait(20)
            results["A"] = "no error"
        except tf.errors.InvalidArgumentError:
            results["A"] = "raised"

    def thread_b():
        a_issued.wait(20)
        try:
            with shared:
                results["B"] = float(tf.reduce_sum(tf.ones([3]) * 2.0))
        except tf.errors.InvalidArgumentError:
            results["B"] = "raised"
        b_done.set()

    run_threads([thread_a, thread_b], timeout=60)
    assert results == {"A": "raised", "B": 6.0}


def test_async_py_function_reading_a_value_of_the_scope_does_not_deadlock():
    with oh.Async():
        s = tf.reduce_sum(tf.ones([3]))
        y = tf.py_function(lambda t: t * float(s), [tf.ones([2])], tf.float32)
    assert_close(y, [3.0, 3.0])


def test_async_check_numerics_does_not_relabel_a_queued_failure_as_nan():
    # A queued failure (a bad reshape) surfaces at whichever op is issued next: often the
    # issue of a CheckNumerics check. It must keep its own message, not become "op ...
    # produced NaN or Inf". Where it surfaces depends on timing: 20 attempts.
    import gc  # pylint: disable=import-outside-toplevel
    gc.collect()  # variables of earlier tests: their deleters must not run in the window
    x = tf.ones([2, 3])
    for _ in range(20):
        runner = oh.Async(sync_on_exit=False)
        with runner:
            with oh.CheckNumericsHandler():
                with pytest.raises(tf.errors.InvalidArgumentError) as caught:
                    tf.raw_ops.Reshape(tensor=x * 1.0, shape=tf.constant([7]))
                    for _ in range(200):
                        tf.tanh(tf.ones([2]))
                    runner.sync()
        message = str(caught.value)
        assert "eshape" in message and "produced" not in message, message


def test_async_and_lazy_tensors_reused_in_a_later_merge_under_a_tape():
    x = tf.constant([0.3, -0.7])
    ref_b = tf.tanh(x) * 2.0  # computed before the tape: a constant for it
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref = tf.sin(x) * ref_b + ref_b
    expected = ref_tape.gradient(ref, x)
    for handler in (oh.Lazy(), oh.Async()):
        with handler:
            b0 = tf.tanh(x) * 2.0   # a tensor of the handler on physical devices
        with oh.GradientTape() as tape:
            tape.watch(x)
            with handler:           # the handler merged onto the tape: b0 is copied on
                e = tf.sin(x) * b0 + b0
        assert_close(e, ref)
        assert_close(tape.gradient(e, x), expected)


def test_async_shape_that_depends_on_a_pending_value_waits_for_it():
    gate = _Gate(release_after=0.3)
    with oh.Async():
        x = gate.take()
        n = tf.cast(tf.reduce_sum(x) * 0.0, tf.int32) + 3   # 3, known only once computed
        r = tf.range(n)
        assert r.shape == (3,)  # waited for the value
        assert gate.released
    assert_close(r, [0, 1, 2])


def test_async_inner_handler_error_surfaces_at_synchronization_naming_the_op():
    runner = oh.Async(sync_on_exit=False)
    with runner:
        # The error is raised by the next op issued after the check failed, or by sync.
        with pytest.raises(tf.errors.InvalidArgumentError, match="op Log produced NaN"):
            with oh.CheckNumericsHandler():
                y = tf.math.log(tf.constant([-1.0, 1.0]))  # NaN: the check op is queued
                z = y * 2.0
                assert z.shape == (2,)
            runner.sync()
        assert float(tf.reduce_sum(tf.ones([2]))) == 2.0  # the handler keeps working


def test_lazy_shapes_that_depend_on_pending_values_are_computed():
    with oh.Lazy():
        n = tf.reduce_sum(tf.constant([1, 2]))
        k = tf.range(n)
        z = tf.zeros(tf.stack([n, 2]))
        assert k.shape == (3,) and z.shape == (3, 2)
        assert int(tf.size(k)) == 3


def test_error_at_scope_exit_restores_the_device_scope():
    from tensorflow.python.eager import context
    with pytest.raises(tf.errors.InvalidArgumentError):
        with oh.Async():
            tf.raw_ops.Reshape(tensor=tf.range(6), shape=tf.constant([4, 4]))
    assert context.context().device_name == ""
    assert oh.current_stack() is oh.PHYSICAL


# -- a shape is never invented for an op the kernel rejects ------------------------

_X6 = tf.constant([1., 2., 3., 4., 5., 6.])
_BAD_RESHAPES = {
    # a static target the shape function rejects
    "static": lambda: tf.reshape(_X6 * 1., [4]),
    # a computed target: the shape function assumes success and says (6,)
    "computed_target": lambda: tf.reshape(_X6, tf.constant([4]) + 0),
    # an input of unknown size: the shape function assumes success and says (4,)
    "unknown_size_input": lambda: tf.reshape(tf.unique(_X6 // 3.)[0] * 1., [4]),  # 3 values
    "computed_fill": lambda: tf.reshape(tf.fill(tf.constant([2, 2]) + 1, 1.), [8]),
}


@pytest.mark.parametrize("handler", ["Lazy", "Async"])
@pytest.mark.parametrize("case", sorted(_BAD_RESHAPES))
def test_an_invalid_op_raises_eagers_error_never_a_made_up_shape(handler, case):
    fn = _BAD_RESHAPES[case]
    with pytest.raises(Exception) as eager:
        fn()
    shapes = []
    with pytest.raises(type(eager.value), match="reshape"):
        with getattr(oh, handler)():
            y = fn()
            shapes.append(y.shape)  # user code reading the shape goes no further
            (y + 1.).numpy()
    assert type(eager.value) is tf.errors.InvalidArgumentError
    assert shapes == []


@pytest.mark.parametrize("handler", ["Lazy", "Async"])
def test_valid_computed_shapes_are_eagers(handler):
    def fn():
        y = tf.reshape(_X6, tf.constant([2, 3]) + 0)
        z = tf.reshape(tf.unique(_X6 // 2.)[0] * 1., [-1, 1])
        return y, z, tf.fill(tf.constant([2, 2]) + 1, 1.)

    want = fn()
    with getattr(oh, handler)():
        got = fn()
        shapes = [t.shape for t in got]
    assert shapes == [t.shape for t in want]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.numpy(), w.numpy())


# ---- a SavedModel of a traced model with non-trainable variables -------

def _bn_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    x = tf.random.stateless_normal([4, 8], seed=[1, 2])
    model(x, training=True)  # moves the moving statistics away from their initial values
    return model, x


def _save_and_load(fn, variables, tmp_path, name):
    module = tf.Module()
    module.variables_of_model = variables  # tracked, as examples/tracing_handlers.py does
    module.f = fn
    path = str(tmp_path / name)
    tf.saved_model.save(module, path)
    return tf.saved_model.load(path)


def test_traced_batch_norm_model_saves_as_tf_function_does(tmp_path):
    model, x = _bn_model()
    # The same model saved from a tf.function (TensorFlow's own way) works.
    want = _save_and_load(tf.function(model).get_concrete_function(
        tf.TensorSpec(x.shape, x.dtype)), model.variables, tmp_path, "function")
    with oh.TraceAndExecute() as trace:
        y = model(x)
    got = _save_and_load(trace.function(y), model.variables, tmp_path, "traced")
    x2 = tf.random.stateless_normal([4, 8], seed=[5, 6])
    np.testing.assert_allclose(got.f(x2).numpy(), want.f(x2).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.f(x2).numpy(), model(x2).numpy(), rtol=1e-5, atol=1e-6)
    # The function captured the variables themselves: a later update shows in a call.
    model.layers[1].moving_mean.assign(tf.ones([16]))
    np.testing.assert_allclose(trace.function(y)(x2).numpy(), model(x2).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_non_trainable_variable_read_is_captured_as_the_variable(tmp_path):
    v = tf.Variable([1.0, 2.0], trainable=False)
    w = tf.Variable([3.0, 4.0])
    x = tf.constant([0.5, 0.25])
    with oh.TraceAndExecute() as trace:
        # (read in Python, as Keras layers read their weights; a variable used directly as
        # an op input is read by TensorFlow's C fast path, which tells no one: see the
        # guide's limits)
        y = x * v.read_value() + w
    fn = trace.function(y)
    loaded = _save_and_load(fn, [v, w], tmp_path, "plain")
    np.testing.assert_allclose(loaded.f(x).numpy(), (x * v + w).numpy())
    # Outside a trace scope TensorFlow's own function is back (the patch is scoped).
    from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
    assert resource_variable_ops.variable_accessed.__module__ == resource_variable_ops.__name__
