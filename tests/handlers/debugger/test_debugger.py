"""DebuggerHandler against tf.debugging.experimental.enable_dump_debug_info: the same
programs dumped by both (TensorFlow's in a subprocess, so its op callbacks never run in
the test process), read back with TensorFlow's DebugDataReader."""
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.debug.lib import debug_events_reader

import tf_ophandlers as oh
from conftest import assert_close
from python_process import run_python

# The programs both dumps run: a Keras CNN whose Lambda layer produces NaN (log of
# negative numbers) run eagerly, and a tf.function with a cond and a while loop called
# three times (the third call takes the other branch).
_PROGRAMS = textwrap.dedent("""
    import numpy as np, tensorflow as tf, keras

    def make_cnn():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Lambda(lambda t: tf.math.log(t - 1.0)),
            keras.layers.Flatten(),
            keras.layers.Dense(3)])

    CNN_INPUT = np.random.RandomState(0).rand(2, 8, 8, 1).astype("float32")

    @tf.function
    def looped(x):
        y = tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2.0, lambda: x - 1.0)
        _, y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 1.5),
                             [tf.constant(0), y])
        return tf.sqrt(y)

    def call_looped():
        return [looped(tf.constant([1.0, 2.0]) * s) for s in (1.0, 1.0, -1.0)]

    def summary(root):
        from tensorflow.python.debug.lib import debug_events_reader
        with debug_events_reader.DebugDataReader(root) as reader:
            reader.update()
            executions = [[e.op_type, [None if v is None else list(v)
                                       for v in (e.debug_tensor_values or [])]]
                          for e in reader.executions()]
            ops = sorted([d.op_type for d in reader.graph_op_digests()])
            traces = sorted([t.op_type for t in reader.graph_execution_traces()])
        return {"executions": executions, "graph_ops": ops, "traces": traces}
""")

_TF_DUMP = _PROGRAMS + textwrap.dedent("""
    import json, sys
    cnn = make_cnn()
    x = tf.constant(CNN_INPUT)
    cnn(x)  # builds the model outside the dump, as the handler's test does
    dump = tf.debugging.experimental
    dump.enable_dump_debug_info(sys.argv[1], tensor_debug_mode="FULL_HEALTH",
                                circular_buffer_size=-1)
    cnn(x)
    dump.disable_dump_debug_info()
    dump.enable_dump_debug_info(sys.argv[2], tensor_debug_mode="CURT_HEALTH",
                                circular_buffer_size=-1)
    call_looped()
    dump.disable_dump_debug_info()
    print(json.dumps([summary(sys.argv[1]), summary(sys.argv[2])]))
""")

# Graph nodes that never reach handlers (constants, placeholders, control-flow and call
# ops stay with the replay); TensorFlow's callback records them at trace time.
_NOT_SEEN_BY_HANDLERS = {"Const", "Placeholder", "NoOp", "If", "StatelessIf", "While",
                         "StatelessWhile", "PartitionedCall", "StatefulPartitionedCall"}


@pytest.fixture(scope="module")
def programs():
    namespace = {}
    exec(compile(_PROGRAMS, "debugger_programs", "exec"), namespace)  # pylint: disable=exec-used
    return namespace


@pytest.fixture(scope="module")
def tf_dumps(tmp_path_factory):
    roots = [str(tmp_path_factory.mktemp("tf_cnn")), str(tmp_path_factory.mktemp("tf_fn"))]
    return json.loads(run_python(_TF_DUMP, args=roots, timeout=240).strip().splitlines()[-1])


def _reader(root):
    reader = debug_events_reader.DebugDataReader(root)
    reader.update()
    return reader


def _nan_outputs(executions):
    """(execution index, op type, output slot) of every output FULL_HEALTH counts NaN in
    (FULL_HEALTH: [id, device, dtype, rank, size, -inf, +inf, nan, -, 0, +])."""
    return [(i, op_type, slot) for i, (op_type, values) in enumerate(executions)
            for slot, v in enumerate(values) if v is not None and v[7] > 0]


def test_eager_keras_cnn_matches_enable_dump_debug_info(programs, tf_dumps, tmp_path):
    cnn = programs["make_cnn"]()
    x = tf.constant(programs["CNN_INPUT"])
    expected = cnn(x)
    with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="FULL_HEALTH",
                            circular_buffer_size=-1):
        got = cnn(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert_close(np.nan_to_num(got), np.nan_to_num(expected))
    ours = programs["summary"](str(tmp_path))["executions"]
    theirs = tf_dumps[0]["executions"]
    assert [e[0] for e in ours] == [e[0] for e in theirs]
    assert "Conv2D" in [e[0] for e in ours] and "MatMul" in [e[0] for e in ours]
    nan = _nan_outputs(ours)
    assert nan == _nan_outputs(theirs)
    assert nan[0][1:] == ("Log", 0)  # the Lambda layer's log is the first NaN
    # Every health summary is TensorFlow's (same kernel, same values).
    assert ours == theirs


def test_function_called_three_times_matches_enable_dump_debug_info(programs, tf_dumps,
                                                                     tmp_path):
    expected = programs["call_looped"]()
    with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="CURT_HEALTH",
                            circular_buffer_size=-1):
        got = programs["call_looped"]()
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g.numpy(), e.numpy())
    ours, theirs = programs["summary"](str(tmp_path)), tf_dumps[1]

    def calls(summary):
        return [re.sub(r"_\d+$", "", e[0]) for e in summary["executions"]]

    assert calls(ours) == calls(theirs) == ["Mul", "__inference_looped"] * 3
    assert ours["graph_ops"] == sorted(
        t for t in theirs["graph_ops"] if t not in _NOT_SEEN_BY_HANDLERS)
    # Traces of every output of every executed node, per call and loop iteration, with
    # the cond branch each call took.
    assert ours["traces"] == sorted(
        t for t in theirs["traces"] if t not in _NOT_SEEN_BY_HANDLERS)
    # CURT_HEALTH's first element is the symbolic tensor id the op's creation recorded
    # (the cond branches and the loop body are seen twice while replaying).
    reader = _reader(str(tmp_path))
    traces = reader.graph_execution_traces()
    assert traces
    for t in traces:
        assert t.debug_tensor_value[0] == reader.graph_execution_trace_to_tensor_id(t)


def test_reader_shows_graph_ops_and_three_executions(tmp_path):
    f = tf.function(lambda a, b: tf.nn.relu(tf.matmul(a, b)) * 2.0)
    a, b = tf.ones([2, 3]), tf.fill([3, 2], -0.5)
    with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="FULL_TENSOR"):
        results = [f(a, b * s) for s in (1.0, -1.0, -2.0)]
    reader = _reader(str(tmp_path))
    calls = [e for e in reader.executions() if e.graph_id]
    assert len(calls) == 3
    name = f.get_concrete_function(a, b).name.decode()
    assert {e.op_type for e in calls} == {name}
    graph = reader.graph_by_id(calls[0].graph_id)
    assert graph.name == name and {e.graph_id for e in calls} == {graph.graph_id}
    ops = [d for d in reader.graph_op_digests() if d.graph_id == graph.graph_id]
    assert sorted(d.op_type for d in ops) == ["Identity", "MatMul", "Mul", "Relu"]
    mul = next(d for d in ops if d.op_type == "Mul")
    assert mul.input_names[0] == next(d for d in ops if d.op_type == "Relu").op_name + ":0"
    _, frames = reader.read_graph_op_creation_stack_trace(mul)
    assert frames[-1][0] == __file__  # the line that created the node when traced
    traces = reader.graph_execution_traces(digest=True)
    assert [t.op_type for t in traces] == ["MatMul", "Relu", "Mul"] * 3  # no Identity
    values = [reader.graph_execution_trace_to_tensor_value(t) for t in traces]
    for i, result in enumerate(results):
        np.testing.assert_array_equal(values[3 * i + 2], result.numpy())
        np.testing.assert_array_equal(values[3 * i], tf.matmul(a, b * (1.0, -1.0, -2.0)[i]))


def test_every_fit_step_is_traced(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.random.RandomState(1).rand(10, 4).astype("float32")
    y = np.random.RandomState(2).rand(10, 1).astype("float32")
    initial = model.get_weights()
    plain = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    model.set_weights(initial)
    with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="CONCISE_HEALTH"):
        dumped = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                           shuffle=False).history["loss"]
    assert_close(dumped, plain, tol=1e-5)
    reader = _reader(str(tmp_path))
    steps = [e for e in reader.executions() if e.graph_id]
    assert len(steps) == 6  # 2 epochs of 3 batches (the last one partial)
    traces = reader.graph_execution_traces(digest=True)
    matmuls = [t for t in traces if t.op_type == "MatMul"]
    # Per step: two forward MatMuls and the backward ones (the last one partial batch).
    assert len(matmuls) % 6 == 0 and len(matmuls) >= 12


def test_per_step_scopes_append_to_one_run(tmp_path):
    f = tf.function(lambda t: tf.reduce_sum(t * t))
    for step in range(3):
        data = tf.ones([step + 1])
        with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="SHAPE"):
            f(data)
            tf.sin(data)
    reader = _reader(str(tmp_path))
    assert len([n for n in os.listdir(str(tmp_path)) if n.endswith(".metadata")]) == 1
    ops = [e.op_type for e in reader.executions()]
    assert [o for o in ops if not o.startswith("__inference")] == ["Sin"] * 3
    assert len([o for o in ops if o.startswith("__inference")]) == 3
    # SHAPE: [id, device, dtype, rank, size, shape...] of the product in each step.
    shapes = [v for t in reader.graph_execution_traces(digest=True) if t.op_type == "Mul"
              for v in [reader.graph_execution_trace_to_tensor_value(t)]]
    assert [v[4] for v in shapes] == [1, 2, 3]


@pytest.mark.parametrize("order", ["debugger_outside", "debugger_inside"])
def test_composes_with_gradient_tape(tmp_path, order):
    v = tf.Variable([1.0, 2.0])
    f = tf.function(lambda a: tf.reduce_sum(tf.sin(a) * a))
    with tf.GradientTape() as expected_tape:
        expected_loss = f(v) + tf.reduce_sum(v * v)
    expected = expected_tape.gradient(expected_loss, v)
    debugger = oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="CURT_HEALTH")
    tape = oh.GradientTape()
    outer, inner = (debugger, tape) if order == "debugger_outside" else (tape, debugger)
    with outer:
        with inner:
            loss = f(v) + tf.reduce_sum(v * v)
        if order == "debugger_outside":
            grad = tape.gradient(loss, v)  # the backward ops run on the debugger too
    if order == "debugger_inside":
        grad = tape.gradient(loss, v)
    assert_close(loss, expected_loss)
    assert_close(grad, expected)
    ops = [e.op_type for e in _reader(str(tmp_path)).executions()]
    assert "ReadVariableOp" in ops and "AddV2" in ops
    assert any(o.startswith("__forward_") for o in ops)  # the tape's forward function
    backward = any(o.startswith("__inference___backward") for o in ops)
    assert backward == (order == "debugger_outside")


def test_composes_with_check_numerics(tmp_path):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="CheckNumericsHandler: op Log produced"):
        with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="CURT_HEALTH"):
            with oh.CheckNumericsHandler():
                tf.math.log(tf.constant([0.0, 1.0]))
    ops = [e.op_type for e in _reader(str(tmp_path)).executions()]
    assert ops[0] == "Log"  # dumped by the debugger before the check raised


def test_op_regex_and_dtypes_filter_values_not_events(tmp_path):
    with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="FULL_TENSOR",
                            op_regex="^(Sin|Cast)$", tensor_dtypes=[tf.float32]):
        y = tf.sin(tf.constant([1.0, 2.0]))
        tf.cos(y)
        tf.cast(y, tf.int32)
    reader = _reader(str(tmp_path))
    executions = reader.executions()
    assert [e.op_type for e in executions] == ["Sin", "Cos", "Cast"]
    _, frames = reader.read_execution_stack_trace(executions[1])
    here = (__file__, "test_op_regex_and_dtypes_filter_values_not_events")
    assert (frames[-1][0], frames[-1][2]) != here  # TensorFlow's own frames come last
    assert here in [(f[0], f[2]) for f in frames]  # below the user's line
    assert not any("tf_ophandlers" + os.sep in f[0] for f in frames)  # no dispatcher frames
    assert_close(reader.execution_to_tensor_values(executions[0])[0], np.sin([1.0, 2.0]))
    assert reader.execution_to_tensor_values(executions[1]) == []
    assert reader.execution_to_tensor_values(executions[2]) == []  # int32: not listed


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"DebuggerHandler: invalid tensor_debug_mode "
                                         r"'HEALTHY'.*NO_TENSOR.*FULL_TENSOR"):
        oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="HEALTHY")
    with pytest.raises(ValueError, match="DebuggerHandler: dump_root"):
        oh.DebuggerHandler("")
    with pytest.raises(ValueError, match="DebuggerHandler: invalid op_regex"):
        oh.DebuggerHandler(str(tmp_path), op_regex="(")
    with pytest.raises(TypeError, match="DebuggerHandler: circular_buffer_size"):
        oh.DebuggerHandler(str(tmp_path), circular_buffer_size="10")
    oh.DebuggerHandler(str(tmp_path), circular_buffer_size=10)
    with pytest.raises(ValueError, match="DebuggerHandler: dump root .* circular_buffer_size"):
        oh.DebuggerHandler(str(tmp_path), circular_buffer_size=20)


def _free_port():
    import socket  # pylint: disable=import-outside-toplevel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url):
    import urllib.request  # pylint: disable=import-outside-toplevel
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


def test_tensorboard_debugger_plugin_lists_the_run(tmp_path):
    pytest.importorskip("tensorboard.plugins.debugger_v2")
    import time  # pylint: disable=import-outside-toplevel
    import urllib.error  # pylint: disable=import-outside-toplevel
    root = str(tmp_path / "dump")
    f = tf.function(lambda t: tf.reduce_sum(tf.sqrt(t)))
    with oh.DebuggerHandler(root, tensor_debug_mode="FULL_HEALTH"):
        tf.math.log(tf.constant([-1.0, 1.0]))    # NaN: an alert
        f(tf.constant([1.0, 4.0]))
    port = _free_port()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    log = tmp_path / "tensorboard.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", root, "--host",
             "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    plugin = "http://127.0.0.1:%d/data/plugin/debugger-v2" % port
    run = "__default_debugger_run__"
    try:
        deadline = time.time() + 120
        runs, digests, alerts = {}, {}, {}
        while time.time() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                runs = _get_json(plugin + "/runs")
                if run in runs:
                    query = "?run=%s&begin=0&end=-1" % run
                    digests = _get_json(plugin + "/execution/digests" + query)
                    alerts = _get_json(plugin + "/alerts" + query)
                    if digests.get("num_digests") == 2 and alerts.get("num_alerts"):
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        assert run in runs, runs
        assert [d["op_type"] for d in digests["execution_digests"]] == [
            "Log", f.get_concrete_function(tf.constant([1.0, 4.0])).name.decode()]
        assert alerts["num_alerts"] == 1 and alerts["alerts"][0]["op_type"] == "Log"
        traces = _get_json(plugin + "/graph_execution/digests?run=%s&begin=0&end=-1" % run)
        assert [d["op_type"] for d in traces["graph_execution_digests"]] == ["Sqrt", "Sum"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=20)


def test_handlers_sharing_a_dump_root_keep_their_modes(tmp_path):
    x = tf.constant([1.0, -1.0])
    for mode in ("NO_TENSOR", "FULL_HEALTH", "NO_TENSOR"):
        with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode=mode):
            tf.sqrt(x)  # the same line, so the same Python stack, each time
    executions = _reader(str(tmp_path)).executions()
    modes = [e.tensor_debug_mode for e in executions]
    assert modes == [1, 4, 1]  # TensorDebugMode: NO_TENSOR = 1, FULL_HEALTH = 4
    assert [len(e.debug_tensor_values or []) for e in executions] == [0, 1, 0]
    assert executions[1].debug_tensor_values[0][7] == 1.0  # one NaN


def test_dtypes_without_a_summary_kernel_are_summarized_widened(tmp_path):
    float8 = tf.dtypes.experimental.float8_e4m3fn
    f = tf.function(lambda t: tf.cast(t * 2.0, float8))
    with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="CONCISE_HEALTH"):
        eager = tf.cast(tf.constant([1.0, np.nan, np.inf]), float8)
        traced = f(tf.constant([np.nan, 1.0]))
    assert eager.dtype == traced.dtype == float8
    reader = _reader(str(tmp_path))
    cast = reader.executions()[0]
    assert cast.op_type == "Cast"
    # CONCISE_HEALTH: [id, size, -inf, +inf, nan]; float8_e4m3fn has no Inf (it saturates
    # to NaN), so TensorFlow's cast gives two NaNs.
    assert cast.debug_tensor_values[0][1:] == [3.0, 0.0, 0.0, 2.0]
    trace = next(t for t in reader.graph_execution_traces() if t.op_type == "Cast")
    assert list(trace.debug_tensor_value[1:]) == [2.0, 0.0, 0.0, 1.0]


class _RefusingSummaries(oh.OpHandler):
    def execute(self, op, inputs):
        if op.type == "DebugNumericSummaryV2":
            raise tf.errors.InvalidArgumentError(None, None, "no summaries here")
        return self.next.execute(op, inputs)


def test_a_failing_summary_names_the_handler_the_mode_and_the_op(tmp_path):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="DebuggerHandler: cannot compute the SHAPE debug values of op "
                             "Sin: no summaries here"):
        with _RefusingSummaries():
            with oh.DebuggerHandler(str(tmp_path), tensor_debug_mode="SHAPE"):
                tf.sin(tf.constant(1.0))


def test_saved_model_function_calls_are_traced(tmp_path):
    module = tf.Module()
    module.w = tf.Variable([[2.0], [-1.0]])
    module.f = tf.function(lambda x: tf.nn.softplus(tf.matmul(x, module.w)),
                           input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "model"))
    loaded = tf.saved_model.load(str(tmp_path / "model"))
    x = tf.constant([[1.0, 3.0], [0.5, 0.5]])
    expected = loaded.f(x)
    root = str(tmp_path / "dump")
    with oh.DebuggerHandler(root, tensor_debug_mode="FULL_TENSOR"):
        got = [loaded.f(x), loaded.f(x[:1])]
    assert_close(got[0], expected)
    assert_close(got[1], expected[:1])
    reader = _reader(root)
    calls = [e for e in reader.executions() if e.graph_id]
    assert len(calls) == 2
    traces = [t for t in reader.graph_execution_traces(digest=True)
              if t.op_type == "Softplus"]
    assert [reader.graph_execution_trace_to_tensor_value(t).shape for t in traces] == [
        (2, 1), (1, 1)]  # each call's own values
