"""Lifetimes of handler states, async execution, threads and interpreter exit."""
import gc
import os
import textwrap
import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close, run_threads
from python_process import run_python


def _rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_handler_lives_while_a_tensor_refers_to_it(x):
    h = oh.OpLogHandler()
    ref = weakref.ref(h)
    with h:
        y = tf.sin(x)
    stack_ref = weakref.ref(oh.handler_of(y))
    del h
    gc.collect()
    assert ref() is not None  # y keeps its stack, the stack keeps the handler
    assert_close(y * 2.0, 2 * np.sin(x.numpy()))  # and it is still usable
    del y
    gc.collect()
    assert stack_ref() is None and ref() is None


def test_merged_stack_keeps_outer_handlers_alive(x):
    outer, inner = oh.OpLogHandler(), oh.OpHandler()
    refs = [weakref.ref(outer), weakref.ref(inner)]
    with outer:
        with inner:
            y = tf.sin(x)
    del outer, inner
    gc.collect()
    assert all(r() is not None for r in refs)
    del y
    gc.collect()
    assert all(r() is None for r in refs)


def test_tensorflow_caches_do_not_keep_handlers_alive(x):
    h = oh.OpHandler()
    ref = weakref.ref(h)
    with h:
        # zeros_like/ones_like and Python scalars go through TensorFlow's tensor caches.
        y = tf.sin(x) * 2.0 + 1.0
        tf.zeros_like(y)
        tf.ones_like(y)
        z = float(tf.reduce_sum(y))
    del h, y
    gc.collect()
    assert ref() is None
    assert z == pytest.approx(float(tf.reduce_sum(tf.sin(x) * 2.0 + 1.0)), rel=1e-6)


def test_variable_created_under_a_handler_does_not_keep_it_alive():
    h = oh.OpLogHandler()
    ref = weakref.ref(h)
    v = None
    for _ in range(3):
        with h:
            if v is None:
                v = tf.Variable(1.0)
            v.assign_sub(0.25)
    del h
    gc.collect()
    assert ref() is None
    assert float(v) == 0.25


def test_async_execution_with_py_function_does_not_deadlock(x):
    tf.config.experimental.set_synchronous_execution(False)
    try:
        log = oh.OpLogHandler()
        with log:
            y = tf.py_function(lambda a: a * 2.0, [x], tf.float32)
            z = tf.sin(y)
            shape = z.shape  # a shape query on a pending tensor
            w = tf.py_function(lambda a: a + 1.0, [z], tf.float32)
        result = w.numpy()
    finally:
        tf.config.experimental.set_synchronous_execution(True)
    assert shape == (2, 2)
    assert_close(result, np.sin(2 * x.numpy()) + 1.0)
    assert [r.op_type for r in log.records] == ["EagerPyFunc", "Sin", "EagerPyFunc"]


def test_async_handler_error_surfaces(x):
    class Boom(oh.OpHandler):
        def execute(self, op, inputs):
            raise ValueError("Boom handler rejects %s" % op.type)

    tf.config.experimental.set_synchronous_execution(False)
    try:
        with pytest.raises(ValueError, match="rejects Sin"):
            with Boom():
                tf.sin(x)
    finally:
        tf.config.experimental.set_synchronous_execution(True)


def test_two_threads_use_handlers_at_once():
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            log = oh.OpLogHandler()
            acc = tf.constant(float(i))
            barrier.wait()
            with log:
                for _ in range(300):
                    acc = acc + 1.0
            results[i] = (float(acc), len(log.records), oh.handler_of(acc).handler is log)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)

    run_threads([lambda i=i: work(i) for i in range(2)])
    assert not errors
    assert results == {0: (300.0, 300, True), 1: (301.0, 300, True)}


def test_scopes_are_per_thread(x):
    inside = threading.Event()
    release = threading.Event()
    other = {}

    def work():
        with oh.OpLogHandler():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=work)
    t.start()
    inside.wait(30)
    other["y"] = tf.sin(x)  # the other thread's scope does not apply here
    release.set()
    t.join(30)
    assert oh.handler_of(other["y"]) is None


def test_interpreter_exit_with_live_handler_tensors():
    script = textwrap.dedent("""
        import tensorflow as tf, tf_ophandlers as oh
        class Holder(oh.OpHandler):
            pass
        h = Holder()
        with h:
            keep = [tf.sin(tf.constant([1.0, 2.0])) for _ in range(10)]
        with oh.OpLogHandler():
            more = keep[0] * 2.0
        print("ok", float(tf.reduce_sum(more)))
    """)
    assert run_python(script, timeout=240).startswith("ok")


@pytest.mark.slow
def test_100k_short_lived_handlers_keep_memory_flat(x):
    def run(n):
        for _ in range(n):
            with oh.OpHandler():
                y = tf.sin(x) + 1.0
            del y

    run(5000)
    gc.collect()
    before = _rss_kb()
    run(100_000)
    gc.collect()
    growth = _rss_kb() - before
    assert growth < 20_000, "RSS grew by %d KiB over 100k handlers" % growth


def test_non_transient_handler_owns_variables_it_places():
    """RFC "Placement of resource handles": a handler that keeps resource handles owns
    the variable, and the variable keeps it alive. (TF 2.21 frees an eager variable's
    resource with its last handle; no DestroyResourceOp runs.)"""

    class Owner(oh.OpHandler):
        transient = False

        def __init__(self, seen):
            self.seen = seen

        def execute(self, op, inputs):
            self.seen.append(op.type)
            return self.next.execute(op, inputs)

    seen = []
    h = Owner(seen)
    ref = weakref.ref(h)
    with h:
        v = tf.Variable([1.0, 2.0])
    assert oh.handler_of(v) is not None and oh.handler_of(v).handler is h
    r = v.read_value()  # type-based dispatch through the resource handle
    v.assign_add([1.0, 1.0])
    assert oh.handler_of(r) is not None
    assert_close(v.read_value(), [2.0, 3.0])
    assert "ReadVariableOp" in seen and "AssignAddVariableOp" in seen
    del h, r
    gc.collect()
    assert ref() is not None
    del v
    gc.collect()
    assert ref() is None
