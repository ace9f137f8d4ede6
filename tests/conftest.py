import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

import benchmark_runs  # noqa: E402  (tests/, on sys.path for this conftest)
import fuzz_seed  # noqa: E402

# Four logical CPUs: two for the parallel handler's tests, a 2x2 mesh for oh.Mesh's. Logical devices must be configured
# before TensorFlow initializes its context; importing tf_ophandlers does not (the first
# handler scope does), so users configure devices after their imports, as here.
_CPUS = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _CPUS[0], [tf.config.LogicalDeviceConfiguration()] * 4)


class RecordingHandler(oh.OpHandler):
    """Pass-through handler that appends (name, op type) to a shared list."""

    def __init__(self, name, seen):
        self.name = name
        self.seen = seen

    def execute(self, op, inputs):
        self.seen.append((self.name, op.type))
        return self.next.execute(op, inputs)

    def debug_string(self):
        return "RecordingHandler(%s)" % self.name


def pytest_runtest_setup(item):
    """`@pytest.mark.requires_c_paths("what it asserts")`: a test of the C fast paths
    themselves (a path ran, no Python frame, a counter moved) is skipped when
    OH_FAST_PATH=0 sends every op of a Python handler through the Python path. A result,
    copy, memory or error property belongs in a test without the mark, which must pass
    both ways (the Python path is the reference)."""
    marker = item.get_closest_marker("requires_c_paths")
    if marker is not None:
        from tf_ophandlers.core import fast_decision  # pylint: disable=import-outside-toplevel
        if not fast_decision.C_PATHS:
            what = marker.args[0] if marker.args else "the C fast paths"
            pytest.skip("OH_FAST_PATH=0 (C fast paths off); this test asserts " + what)


@pytest.fixture
def x():
    return tf.constant([[1.0, 2.0], [3.0, 4.0]])


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """Handlers warn once per cause per process (core.errors.warn_once); each test sees
    its own first occurrence, whatever ran before it."""
    from tf_ophandlers.core import errors  # pylint: disable=import-outside-toplevel
    errors._warned_causes.clear()  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _no_scope_leaks():
    """Every test must leave the thread outside all handler scopes."""
    yield
    from tf_ophandlers.core.state import state
    assert state.current is oh.PHYSICAL, "a handler scope leaked out of the test"
    assert not state.frames


def run_threads(targets, timeout=120):
    """Runs the zero-argument callables `targets` in threads at once and waits for all
    of them (a thread still running after `timeout` seconds fails the test)."""
    import threading  # pylint: disable=import-outside-toplevel
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"


def assert_close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def assert_same_tensors(ref, got, tol=1e-5):
    """`got` matches the reference structure `ref`: None where it is None, else the same
    dtype, shape and values (IndexedSlices are compared dense)."""
    ref, got = tf.nest.flatten(ref), tf.nest.flatten(got)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        if r is None:
            assert g is None
            continue
        assert g is not None
        r, g = tf.convert_to_tensor(r), tf.convert_to_tensor(g)
        assert r.dtype == g.dtype and r.shape == g.shape
        assert_close(g, r, tol)


@contextlib.contextmanager
def ops_left_to_tensorflow():
    """Inside a handler scope: yields the list of op types that `skip_trace_execute`
    (core/skip_trace.py) leaves to TensorFlow's own fast-path function, which captures
    the stack; restores that function on exit."""
    import tf_ophandlers._C as _C  # pylint: disable=import-outside-toplevel
    from tf_ophandlers.core import skip_trace  # pylint: disable=import-outside-toplevel
    seen = []
    original = skip_trace._fast_path_execute  # pylint: disable=protected-access

    def counting(*args):
        seen.append(args[1])
        return original(*args)
    _C.skip_trace_setup(counting)
    try:
        yield seen
    finally:
        _C.skip_trace_setup(original)


def package_frames(fn):
    """``(fn(), names)``: the names of the package's Python functions entered while
    `fn` runs (sys.setprofile), to check that a path runs in C."""
    calls = []

    def profile(frame, event, arg):  # pylint: disable=unused-argument
        if event == "call" and "tf_ophandlers" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls


def pytest_collection_finish(session):
    """Starts the benchmark scripts' smoke runs selected for this session in the
    background (tests/benchmark_runs.py), so they overlap with the other tests."""
    names = [item.callspec.params["name"] for item in session.items
             if item.originalname == "test_benchmark_quick_run" and hasattr(item, "callspec")]
    # Under pytest-xdist every worker collects every test but runs only its share; a
    # run started here would run once per worker. The controller starts them instead
    # (pytest_xdist_node_collection_finished below).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if names and not session.config.option.collectonly:
        benchmark_runs.start(names)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist, in the controller: starts the benchmark smoke runs the workers
    collected (every worker collects the same tests), publishing their results in the
    directory named in the workers' input (tests/benchmark_runs.py)."""
    del node
    # (node ids are relative to the rootdir: match the test's name, not the whole path)
    marker = "test_packaging.py::test_benchmark_quick_run["
    names = [i.split(marker, 1)[1][:-1] for i in ids if marker in i]
    if names:
        benchmark_runs.start(names)


def forget_jvp_dispatch_memos():
    """Empties the dispatch memos of the traced-JVP function caches (TensorFlow's
    forward mode and oh.ForwardAccumulator's).

    Once an op has 32 JVP traces in the process, both trace its JVP for relaxed shapes
    (forwardprop._TRACE_COUNT). A call whose exact signature has no trace of its own is
    then served by a lookup that TensorFlow memoizes (TypeDispatchTable, an LRU of 1024
    entries per cache), and every hit re-keys the entry with the caller's new
    FunctionType: the memo keeps the TensorShapes of the last call of each signature,
    which assert_no_new_tensors counts. Whether a test reached that phase depended on
    how many JVPs the files run before it in its process had traced. The memo holds
    signatures (op names, attributes, shapes, dtypes), never a tensor, and is rebuilt
    from the traces on the next lookup: emptying it changes no result."""
    from tensorflow.python.eager import forwardprop  # pylint: disable=import-outside-toplevel
    from tf_ophandlers.handlers.forward_accumulator import handler  # pylint: disable=import-outside-toplevel
    for cache in (forwardprop._jvp_function_cache, handler._jvp_function_cache):  # pylint: disable=protected-access
        for table in cache._dispatch_dict.values():  # pylint: disable=protected-access
            table._dispatch_cache.clear()  # pylint: disable=protected-access


def tf_leak_checked(test=None, *, warmup=0):
    """Runs a pytest test function under TensorFlow's own leak checks,
    `test_util.assert_no_new_tensors` (no tensor the test created is alive after it, with
    TensorFlow's caches cleared and the garbage collected) and
    `test_util.assert_no_garbage_created` (no uncollectable garbage). Both are written
    for test methods: they get a plain unittest.TestCase as `self`. With `warmup`, the
    test first runs that many times unchecked, as TensorFlow's
    assert_no_new_pyobjects_executing_eagerly does, so that module-level caches filled
    by a first call (traced functions) are not counted; a cache that grows per call
    still fails. Before counting, the JVP functions' dispatch memos are emptied
    (`forget_jvp_dispatch_memos`), as the check empties TensorFlow's zeros and ones
    caches."""
    if test is None:
        return lambda t: tf_leak_checked(t, warmup=warmup)
    import functools  # pylint: disable=import-outside-toplevel
    import gc  # pylint: disable=import-outside-toplevel
    import unittest  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import test_util  # pylint: disable=import-outside-toplevel

    @functools.wraps(test)
    def run(*args, **kwargs):
        for _ in range(warmup):
            test(*args, **kwargs)

        def body(self):  # pylint: disable=unused-argument
            test(*args, **kwargs)
            forget_jvp_dispatch_memos()
        checked = test_util.assert_no_new_tensors(test_util.assert_no_garbage_created(body))
        enabled, flags = gc.isenabled(), gc.get_debug()
        # The checks collect the garbage several times and walk gc.get_objects(); late in
        # the suite the heap holds millions of objects from earlier tests, which made
        # each check take seconds. What was alive before the test cannot be the test's
        # leak, so it is frozen out of their view (collections and get_objects skip it).
        if os.environ.get("OH_LEAK_CHECK_FREEZE", "1") != "0":
            gc.collect()
            gc.freeze()
        try:
            checked(unittest.TestCase())
        finally:  # (the garbage check leaves gc disabled when it fails)
            gc.unfreeze()
            gc.set_debug(flags)
            if enabled:
                gc.enable()
    return run


def pytest_configure(config):
    """A pytest-xdist worker draws the fuzzers' rotating cases from its controller's seed
    (tests/fuzz_seed.py)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and "oh_fuzz_seed" in workerinput:
        fuzz_seed.set_run_seed(workerinput["oh_fuzz_seed"])
    key = benchmark_runs.SHARED_DIR_KEY
    if workerinput is not None and key in workerinput:
        benchmark_runs.use_shared_dir(workerinput[key])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller: passes the run's fuzz seed to each worker, and
    the directory where the controller publishes the benchmark smoke runs' results."""
    node.workerinput["oh_fuzz_seed"] = fuzz_seed.run_seed()
    node.workerinput[benchmark_runs.SHARED_DIR_KEY] = benchmark_runs.shared_dir()


def pytest_terminal_summary(terminalreporter):
    """Names the seed of the fuzzers' rotating draws (tests/fuzz_seed.py), so that a
    failure in this run can be replayed on any day."""
    terminalreporter.write_line(
        "fuzzers' rotating draws: OH_FUZZ_SEED=%d (set it to replay them)" % fuzz_seed.run_seed())
