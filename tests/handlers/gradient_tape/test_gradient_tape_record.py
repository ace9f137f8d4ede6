"""oh.GradientTape's recording off the Python path: `OpHandler.after_execute`
(the C++ fast path forwards the op and makes that one call) and the tape's C
implementation of it (cc/handlers/gradient_tape/tape_record.h), each against its Python reference and against
tf.GradientTape."""

import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import record

import tf_ophandlers as oh
import tf_ophandlers._C as _C
from tf_ophandlers.handlers.gradient_tape.handler import _SWEEP_MIN
from conftest import assert_close, assert_same_tensors, package_frames


class PythonRecordingTape(oh.GradientTape):
    """The tape with its Python recording (the reference of cc/handlers/gradient_tape/tape_record.cc)."""

    after_execute = oh.GradientTape._after_execute_python  # pylint: disable=protected-access


class Forwarding(oh.OpHandler):
    """A level below the tape whose execute runs in Python: physical inputs must then be
    copied on through it, so every op of a tape above it takes the Python path."""

    transparent = True

    def execute(self, op, inputs):
        return self.next.execute(op, inputs)


class Seen(oh.OpHandler):
    """A handler with only an after_execute hook."""

    transparent = True

    def __init__(self, fail_on=None):
        self.seen = []
        self.fail_on = fail_on

    def after_execute(self, op, inputs, outputs):
        if op.type == self.fail_on:
            raise ValueError("Seen() refuses %s after it ran" % op.type)
        assert oh.next_stack() is self.next
        self.seen.append((op.type, len(inputs), [o.dtype for o in outputs]))


def _chain(h, c):
    for _ in range(5):
        h = tf.sin(h) * c
    return h


def _recorded_chain():
    """(x, result, package frames entered, fast-path ops counted, tape) of the chain
    recorded by oh.GradientTape, after a warm-up run."""
    x = tf.random.stateless_uniform([4, 4], seed=[3, 4])
    c = tf.constant(1.01)
    with oh.GradientTape() as tape:
        tape.watch(x)
        _chain(x, c)  # each (stack, op type) is decided once, in Python
        before = _C.fast_stats()["fast_ops"]
        y, calls = package_frames(lambda: _chain(x, c))
        ran_fast = _C.fast_stats()["fast_ops"] - before
    return x, c, y, calls, ran_fast, tape


def test_recorded_chains_give_tensorflows_values_and_gradients():
    x, c, y, _, _, tape = _recorded_chain()
    with tf.GradientTape() as ref:
        ref.watch(x)
        want = _chain(x, c)
    assert_close(y, want, tol=0)
    assert_same_tensors(ref.gradient(want, x), tape.gradient(y, x))


@pytest.mark.requires_c_paths("recording an op enters no Python frame")
def test_recording_an_op_enters_no_python_frame():
    _, _, _, calls, ran_fast, _ = _recorded_chain()
    assert calls == []
    assert ran_fast == 10


def test_records_are_the_python_references():
    """The C recording makes the records the Python one makes (types, order, skipped
    inputs, stacks), including ops with integer outputs, no tracked input, a variable
    read and a gather."""
    v = tf.Variable(tf.random.stateless_normal([5, 3], seed=[1, 1]))
    x = tf.random.stateless_normal([2, 3], seed=[2, 2])

    def program(tape):
        tape.watch(x)
        a = tf.matmul(x, v, transpose_b=True)  # reads v: watched as it is read
        i = tf.argmax(a, axis=1)  # integer output: not recorded
        g = tf.gather(v, i)  # ResourceGather
        u = tf.ones([2, 3]) * 2.0  # no tracked input
        return tf.reduce_sum(tf.tanh(a)) + tf.reduce_sum(g * x * u)

    out = {}
    for cls in (oh.GradientTape, PythonRecordingTape):
        with cls(persistent=True) as tape:
            y = program(tape)
        records = sorted(tape._producer.values(), key=lambda r: r.seq)  # pylint: disable=protected-access
        kinds = [(r.seq, r.op_type, r.skip, r.stack, len(r.inputs), len(r.outputs))
                 for r in dict((r.seq, r) for r in records).values()]
        out[cls] = (y, tape.gradient(y, [x, v]), kinds)
    with tf.GradientTape() as ref:
        want = program(ref)
    want_grads = ref.gradient(want, [x, v])
    (y_c, g_c, k_c), (y_py, g_py, k_py) = out[oh.GradientTape], out[PythonRecordingTape]
    assert k_c == k_py and len(k_c) >= 6
    for y_, g_ in ((y_c, g_c), (y_py, g_py)):
        assert_close(y_, want)
        assert_same_tensors(want_grads, g_)
        assert [type(g) for g in g_] == [type(g) for g in want_grads]  # dense vs IndexedSlices


@pytest.mark.parametrize("below", [None, Forwarding])
def test_fast_and_python_paths_agree_on_second_order_nested_and_tf_tapes(below):
    x = tf.constant([0.3, -1.2, 2.0])

    def f(x):
        return tf.reduce_sum(tf.sin(x) * tf.exp(x) * 1.5)

    def run(outer_cls, inner_cls):
        with contextlib_scope(below):
            with outer_cls() as outer:
                outer.watch(x)
                with inner_cls() as inner:
                    inner.watch(x)
                    y = f(x)
                g = inner.gradient(y, x)
            return y, g, outer.gradient(g, x)

    want = run(tf.GradientTape, tf.GradientTape)
    combos = [(tf.GradientTape, oh.GradientTape), (oh.GradientTape, tf.GradientTape),
              (tf.GradientTape, PythonRecordingTape)]
    combos += [(oh.GradientTape, oh.GradientTape), (PythonRecordingTape, oh.GradientTape),
               (oh.GradientTape, PythonRecordingTape)]
    for outer_cls, inner_cls in combos:
        got = run(outer_cls, inner_cls)
        for a, b in zip(got, want):
            assert_close(a, b)


@pytest.mark.parametrize("below", [oh.OpHandler, Forwarding])
def test_two_oh_tapes_above_a_handler_second_order(below):
    x = tf.constant([0.3, -1.2, 2.0])
    with below():
        with oh.GradientTape() as outer:
            outer.watch(x)
            with oh.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(tf.sin(x) * tf.exp(x) * 1.5)
            g = inner.gradient(y, x)
        h = outer.gradient(g, x)
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.sin(x) * tf.exp(x) * 1.5)
        g_tf = inner.gradient(y, x)
    assert h is not None  # was None (fixed on main: BackwardPass._record_on_enclosing_tapes)
    np.testing.assert_allclose(np.asarray(h), outer.gradient(g_tf, x).numpy(), rtol=1e-5)


class contextlib_scope:  # noqa: N801  (a handler scope or nothing)
    def __init__(self, cls):
        self.handler = cls() if cls is not None else None

    def __enter__(self):
        if self.handler is not None:
            self.handler.__enter__()

    def __exit__(self, *exc):
        if self.handler is not None:
            return self.handler.__exit__(*exc)
        return False


def test_keras_model_gradients_eager_and_in_a_fresh_function():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    x = tf.random.stateless_normal([5, 4], seed=[5, 6])  # a partial batch (5)
    model(x)

    def step(tape_cls):
        with tape_cls() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return loss, tape.gradient(loss, model.trainable_variables)

    want = step(tf.GradientTape)
    for cls in (oh.GradientTape, PythonRecordingTape):
        got = step(cls)
        assert_close(got[0], want[0])
        assert_same_tensors(want[1], got[1])
    got_fn = tf.function(lambda: step(oh.GradientTape))()
    assert_close(got_fn[0], want[0])
    assert_same_tensors(want[1], got_fn[1])


def test_stop_recording_and_tf_stop_recording_are_respected():
    x = tf.constant(2.0)
    with oh.GradientTape(persistent=True) as tape:
        tape.watch(x)
        with tape.stop_recording():
            a = tf.sin(x)
        with record.stop_recording():
            b = tf.sin(x)  # TensorFlow's tape set is stopped (custom_gradient does)
        c = tf.sin(x)
    assert tape.gradient(a, x) is None
    assert tape.gradient(b, x) is None
    assert_close(tape.gradient(c, x), tf.cos(x))


@pytest.mark.parametrize("below", [None, Forwarding])
def test_after_execute_hook_sees_every_op_on_both_paths(below):
    a0 = tf.random.stateless_normal([3, 3], seed=[1, 2])
    h = Seen()
    with contextlib_scope(below):
        with h:
            got = tf.matmul(tf.tanh(a0) * 2.0, a0)
            n = tf.shape(got)
    assert_close(got, tf.matmul(tf.tanh(a0) * 2.0, a0))
    assert [t for t, _, _ in h.seen][-4:] == ["Tanh", "Mul", "MatMul", "Shape"]
    assert h.seen[-1] == ("Shape", 1, [tf.int32])
    assert n.numpy().tolist() == [3, 3]


@pytest.mark.parametrize("below", [None, Forwarding])
def test_an_after_execute_error_reaches_the_user_unchanged(below):
    a0 = tf.random.stateless_normal([3, 3], seed=[1, 2])
    with contextlib_scope(below):
        with Seen(fail_on="Cos"):
            s = tf.sin(a0)
            with pytest.raises(ValueError, match=r"^Seen\(\) refuses Cos after it ran$"):
                tf.cos(a0)
    assert_close(s, tf.sin(a0))


def test_handles_ops_limits_after_execute_too():
    a0 = tf.random.stateless_normal([3, 3], seed=[1, 2])
    h = Seen()
    h.handles_ops = frozenset({"Tanh"})
    with h:
        tf.sin(tf.tanh(a0))
    assert [t for t, _, _ in h.seen] == ["Tanh"]


def test_a_gather_alone_gives_indexed_slices_as_tensorflow():
    v = tf.Variable(tf.random.stateless_normal([6, 2], seed=[7, 8]))
    for cls in (oh.GradientTape, tf.GradientTape):
        with cls() as tape:
            loss = tf.reduce_sum(tf.gather(v, [4, 1, 4]) ** 2)
        g = tape.gradient(loss, v)
        assert isinstance(g, tf.IndexedSlices), cls
        if cls is oh.GradientTape:
            got = g
    assert_same_tensors(g, got)


def test_record_type_is_read_only_and_named():
    x = tf.constant(1.0)
    with oh.GradientTape() as tape:
        tape.watch(x)
        tf.sin(x)
    (record,) = tape._producer.values()  # pylint: disable=protected-access
    assert record.op_type == "Sin" and record.seq == 1 and record.skip == ()
    assert record.backward is None and record.op.type == "Sin"
    with pytest.raises(AttributeError):
        record.seq = 2
    with pytest.raises(TypeError, match="TapeRecord"):
        type(record)(1, 2)
    # Sin's gradient reads its input, not its output: the record keeps only the input.
    assert record.outputs == [None] and float(record.inputs[0]) == 1.0
    assert record.ids == ((-1,), (1 << 20,), None)


@pytest.mark.parametrize("cls", [oh.GradientTape, PythonRecordingTape])
def test_a_long_persistent_tape_drops_tracking_of_outputs_gone(cls):
    """`_tracked` forgets recorded outputs nobody holds any more (it kept an entry for
    each until the tape was cleared, or a new tensor happened to take its key), and
    keeps the ones still held: their gradients stay TensorFlow's.

    The contract is amortized: whenever `_tracked` reaches `_sweep_at` it is swept of every
    dead entry, and `_sweep_at` becomes twice what remains. The test checks each sweep
    rather than the map's final size: `_tracked` is keyed by TensorFlow handle, and a new
    tensor whose handle reuses a dead one's address takes over its entry, so the size at
    any moment depends on the allocator (CI's full suite and a lone run differ)."""
    x = tf.random.stateless_uniform([3], seed=[5, 6])
    c = tf.constant(1.01)

    def program(tape):
        tape.watch(x)
        burst = [x * c for _ in range(3000)]  # held only by this list (Mul reads inputs)
        del burst
        kept = []
        for i in range(5000):  # each Mul output stays, held by the Reshape's record
            h = tf.reshape(x * c, [1, 3])
            if i % 1000 == 0:
                kept.append(h)
        return tf.add_n(kept), kept

    sweeps = []

    def dead_entries(tracked):
        return sum(1 for ref, _ in tracked.values()
                   if type(ref) is weakref.ref and ref() is None)  # pylint: disable=unidiomatic-typecheck

    with cls(persistent=True) as tape:
        sweep = tape._sweep_tracked  # pylint: disable=protected-access

        def observed_sweep():
            tracked = tape._tracked  # pylint: disable=protected-access
            before = (len(tracked), tape._sweep_at)  # pylint: disable=protected-access
            sweep()
            sweeps.append(before + (len(tracked), dead_entries(tracked),
                                    tape._sweep_at))  # pylint: disable=protected-access

        # Both the C++ recorder and the Python one look the method up on the instance.
        tape._sweep_tracked = observed_sweep  # pylint: disable=protected-access
        y, kept = program(tape)
    tracked = tape._tracked  # pylint: disable=protected-access
    # Sweeps at 1024 and 2048 entries while the burst lives; the 5000 Mul outputs held
    # later need 5000 distinct keys, so the map reaches 4096 again after the burst died
    # (however many of its keys they took over). Without the sweep none would run.
    assert len(sweeps) >= 3, sweeps
    for size, at, after, dead_left, next_at in sweeps:
        assert size >= max(at, _SWEEP_MIN)  # a sweep runs only when the map has doubled
        assert dead_left == 0  # and drops every dead entry
        assert next_at == max(_SWEEP_MIN, 2 * after)
    assert len(tracked) < max(tape._sweep_at, _SWEEP_MIN)  # pylint: disable=protected-access
    with tf.GradientTape(persistent=True) as ref:
        want, want_kept = program(ref)
    assert_close(y, want)
    assert_same_tensors(ref.gradient(want, x), tape.gradient(y, x))
    assert_same_tensors(ref.gradient(want, want_kept[1:]), tape.gradient(y, kept[1:]))


def _attr_program(tape, x):
    tape.watch(x)
    a = tf.transpose(x, perm=[1, 0])
    b = tf.reduce_sum(a, axis=1, keepdims=True)
    c = tf.cast(b, tf.float64)
    d = tf.matmul(x, x, transpose_b=True)
    return tf.reduce_sum(c) + tf.cast(tf.reduce_sum(d), tf.float64)


def test_records_keep_the_attributes_of_their_op_scope_after_scope():
    """Over PHYSICAL a record's Op keeps the TFE_Op that ran (cc/fast/fast_record.cc) and
    released ones are reused by later ops (cc/boundary/op.cc PoolOp): scope after scope, each
    record's attributes are those the copying path (a Python level below) records, and
    the gradients are TensorFlow's."""
    x = tf.random.stateless_normal([3, 4], seed=[5, 6])
    with tf.GradientTape() as ref:
        want = _attr_program(ref, x)
    want_grad = ref.gradient(want, x)
    seen = {}
    for below in (None, Forwarding):
        for _ in range(3):  # later scopes run on ops released by the earlier ones
            tape = oh.GradientTape()
            if below is None:
                with tape:
                    y = _attr_program(tape, x)
            else:
                with below(), tape:
                    y = _attr_program(tape, x)
            records = sorted(set(tape._producer.values()), key=lambda r: r.seq)  # pylint: disable=protected-access
            attrs = [(r.op_type, dict(r.op.attrs)) for r in records]
            assert_same_tensors(want_grad, tape.gradient(y, x))
            assert seen.setdefault(below, attrs) == attrs
    copies = ("CopyOn", "CopyOff")  # the Python level's own records
    assert seen[None] == [(t, a) for t, a in seen[Forwarding] if t not in copies]
    assert ("Cast", {"SrcT": tf.float32, "DstT": tf.float64, "Truncate": False}) in seen[None]
    assert any(t == "MatMul" and a["transpose_b"] and not a["transpose_a"]
               for t, a in seen[None])


def test_an_after_execute_set_on_the_tape_instance_is_the_one_called():
    """The C recording is taken only when `after_execute` is the class's: one set on the
    instance is called instead (as attribute lookup says)."""
    x = tf.constant([1.0, 2.0])
    seen = []
    tape = oh.GradientTape()
    tape.after_execute = lambda op, inputs, outputs: seen.append(op.type)
    with tape:
        tape.watch(x)
        tf.sin(x)
    assert "Sin" in seen and not tape._producer  # pylint: disable=protected-access
