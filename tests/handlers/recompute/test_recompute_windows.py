"""The windows an eager oh.Recompute scope opens around the tape scopes of a function
traced inside it (recompute_graph._tape_enter, the Keras fit rule): only for the
program's step, never for a function oh.vectorized_map traces for its own use; a
gradient taken inside a window (an HVP's inner tape, TensorFlow's forward accumulator)
makes the window's records first; a tape opened inside a window gets exactly the records
TensorFlow's tapes would. Also the program's own scopes in a traced function: nested
scopes, an accumulator inside or around a scope, a tape's gradient inside one. Compared
with the same fresh tf.function without Recompute."""
import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None

_QUIET = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class _Setup:
    def __init__(self, seed=3, batch=4):
        r = np.random.default_rng(seed)
        keras.utils.set_random_seed(seed)
        self.x = tf.constant(r.standard_normal((batch, 3)).astype(np.float32))
        self.w = tf.Variable(r.standard_normal((3, 3)).astype(np.float32) * 0.5)
        self.model = keras.Sequential([keras.layers.Input((3,)),
                                       keras.layers.Dense(2, activation="tanh")])

    def variables(self):
        return [self.w] + list(self.model.trainable_variables)

    def loss(self, x):
        h = tf.tanh(tf.tanh(x @ self.w) @ self.w)
        return tf.reduce_sum(self.model(h) ** 2)


def _both(make_step, setup):
    """The step's results without Recompute and traced inside an eager oh.Recompute
    scope (fresh tf.functions, unknown batch dimension)."""
    spec = [tf.TensorSpec([None, 3], tf.float32)]
    ref = tf.function(make_step(setup), input_signature=spec)(setup.x)
    rc = oh.Recompute()
    with rc:
        got = tf.function(make_step(setup), input_signature=spec)(setup.x)
    return ref, got, rc


@_QUIET
@pytest.mark.parametrize("acc_type", [tf.autodiff.ForwardAccumulator,
                                      oh.ForwardAccumulator], ids=["tf", "oh"])
def test_hvp_inside_the_tape_of_a_step_traced_in_an_eager_scope(acc_type):
    # Was HandlerError ("tape.gradient called inside an oh.Recompute scope of a traced
    # function"): the step's tape got a window and the HVP's gradients (the inner tape's,
    # TensorFlow's JVP helper's) ran inside it.
    def make_step(s):
        def step(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with acc_type(s.w, tf.ones_like(s.w)) as acc:
                    with tf.GradientTape() as inner:
                        loss = s.loss(x)
                    g = inner.gradient(loss, s.w)
                hvp = acc.jvp(g)
                total = loss + tf.reduce_sum(hvp * hvp)
            return [loss, g, hvp] + outer.gradient(total, [x] + s.variables())
        return step
    ref, got, _ = _both(make_step, _Setup())
    _same(ref, got, "HVP inside the tape of a step traced in an eager Recompute scope")


@_QUIET
def test_a_tape_opened_inside_a_window_gets_the_records_tensorflow_gives_it():
    # Was HandlerError (the inner tape's gradient runs inside the outer tape's window);
    # with the window's records made only at its exit, the inner tape would have none,
    # and with all of them, the ops before it opened too (h0 -> x below: TensorFlow's
    # inner tape does not see them, so d z / d x is None there).
    def make_step(s):
        def step(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                h0 = tf.tanh(x @ s.w)
                with tf.GradientTape(persistent=True) as inner:
                    inner.watch(x)
                    inner.watch(h0)
                    z = s.loss(h0) + tf.reduce_sum(tf.tanh(h0 @ s.w))
                gz = inner.gradient(z, [x, h0, s.w])
                total = z + tf.reduce_sum(gz[1] ** 2)
            return [z] + gz + outer.gradient(total, [x] + s.variables())
        return step
    ref, got, _ = _both(make_step, _Setup(5))
    assert ref[1] is None  # TensorFlow's answer this checks: h0 came before `inner`
    _same(ref, got, "a tape opened inside a step's window")


@_QUIET
def test_the_step_window_still_recomputes():
    # The rule still applies to the step: segments are recorded (graph_stats) and the
    # gradients are TensorFlow's.
    def make_step(s):
        def step(x):
            with tf.GradientTape() as tape:
                loss = s.loss(x)
            return [loss] + tape.gradient(loss, s.variables())
        return step
    ref, got, rc = _both(make_step, _Setup(7))
    _same(ref, got, "a step traced in an eager Recompute scope")
    assert rc.graph_stats is not None and rc.graph_stats["segments"] > 0


@_QUIET
def test_functions_vectorized_map_traces_get_no_windows():
    # oh.vectorized_map under a tf.GradientTape runs tf.vectorized_map, whose pfor
    # function is traced inside the eager scope: it is not the program's step, its tapes
    # get no window (before: windows, and graph_stats from them).
    s = _Setup(9)

    def per_example(e):
        with tf.GradientTape() as t:
            t.watch(e)
            y = s.loss(e[None])
        return tf.concat([t.gradient(y, e), [y]], 0)

    def run(vmap):
        with tf.GradientTape() as tape:
            out = vmap(per_example, s.x)
            loss = tf.reduce_sum(out ** 2)
        return [out] + tape.gradient(loss, s.variables())

    ref = run(tf.vectorized_map)
    rc = oh.Recompute()
    with rc:
        got = run(oh.vectorized_map)
    _same(ref, got, "Recompute > tf.GradientTape > oh.vectorized_map")
    assert rc.graph_stats is None


# -- the program's own scopes in a traced function: nested, and with an accumulator ------

def _nested_step(rc_count, save):
    def step(y, z):
        with tf.GradientTape(persistent=True) as t:
            t.watch([y, z])
            with contextlib.ExitStack() as scopes:
                for k in range(rc_count):
                    scopes.enter_context(oh.Recompute(save=("Conv2D",)) if save and k == 0
                                         else oh.Recompute())
                a = tf.reshape(y, [2, 2])
                a = tf.split(tf.concat([a, a], -1), [2, 2], axis=-1)[1]
                img = tf.reshape(z, [-1, 2, 2, 1])
                b = tf.nn.conv2d(img, tf.ones([2, 2, 1, 2]), 1, "SAME")
                out = [tf.sin(a), tf.reduce_sum(b * b)]
        return out + t.gradient(out, [y, z])
    return step


@_QUIET
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("outer_tape", [False, True])
def test_nested_scopes_in_a_function(save, outer_tape):
    # Fuzz finding (tf.GradientTape > vectorized_map > GradientTape > Recompute(save) >
    # Recompute, OH_FUZZ_SEED=34 slow case 5; the outer tape makes the map trace): the
    # inner scope's segments were collected by the outer scope's window, so the tape did
    # not know the values the inner's later segments take from its earlier ones, and
    # those segments were not recorded: gradients None. A nested scope now makes its
    # records itself (the outer's records so far first).
    y = tf.constant(np.linspace(-1.0, 1.0, 4, dtype=np.float32))
    z = tf.constant(np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(3, 4))
    results = []
    for count in (0, 2):
        f = tf.function(_nested_step(count, save))
        with tf.GradientTape() if outer_tape else contextlib.nullcontext():
            results.append(f(y, z))
    _same(results[0], results[1], "two nested Recompute scopes")


@_QUIET
def test_nested_scopes_in_vectorized_map_under_a_tape():
    ys = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4) / 4)
    zs = tf.constant(np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 8)
    results = []
    for count, vmap in ((0, tf.vectorized_map), (2, oh.vectorized_map)):
        step = _nested_step(count, True)
        with tf.GradientTape() as t:
            t.watch([ys, zs])
            out = vmap(lambda e, s=step: s(*e), (ys, zs))
        results.append(list(out) + t.gradient(out, [ys, zs]))
    _same(results[0], results[1], "tf.GradientTape > vectorized_map > Recompute x2")


@_QUIET
@pytest.mark.parametrize("acc_type", [tf.autodiff.ForwardAccumulator,
                                      oh.ForwardAccumulator], ids=["tf", "oh"])
@pytest.mark.parametrize("acc_in_scope", [True, False])
def test_accumulator_with_a_scope_in_a_function(acc_type, acc_in_scope):
    # Fuzz finding (tf.GradientTape > vectorized_map > Recompute(save) >
    # ForwardAccumulator, OH_FUZZ_SEED=19 slow case 17): the scope collected the records
    # of the ops the accumulator inside it needed (a window opens when a tape could
    # record: the outer tape) and made them after the accumulator's scope: JVPs None.
    # With the accumulator around the scope (the JVP of a gradient) the segments' records
    # gave silently wrong JVPs. A record carrying tangents now makes the window's records
    # and ends its collection (the scope's ops run as they are, as eagerly above an
    # accumulator).
    s = _Setup()
    v = tf.constant(np.random.default_rng(5).standard_normal((3, 3)).astype(np.float32))

    def make(rc):
        @tf.function
        def step(x):
            with rc if acc_in_scope and rc is not None else contextlib.nullcontext():
                with acc_type(s.w, v) as acc:
                    with tf.GradientTape() as t:
                        with rc if not acc_in_scope and rc is not None else \
                                contextlib.nullcontext():
                            h = x
                            for _ in range(6):  # (segments: enough ops)
                                h = tf.tanh(h @ s.w)
                            loss = tf.reduce_sum(h * h)
                    g = t.gradient(loss, s.w)
            return [loss, g, acc.jvp(loss), acc.jvp(g)]
        return step
    results = []
    for rc in (None, oh.Recompute()):
        # Inside: a tape around (it could record: the scope opens a window). Around: the
        # step's tape opens it (with a tape around, its values were right before).
        with tf.GradientTape() if acc_in_scope else contextlib.nullcontext():
            results.append(make(rc)(s.x))
    _same(results[0], results[1], "accumulator %s a Recompute scope in a function" % (
        "inside" if acc_in_scope else "around"))


@_QUIET
@pytest.mark.parametrize("inside_tape", [False, True])
def test_gradient_inside_a_scope_in_a_function(inside_tape):
    # Fuzz finding (tf.GradientTape > vectorized_map > Recompute(budget) > DataFormat >
    # Recompute(save) > GradientTape, OH_FUZZ_SEED=40 slow case 38): eager code the map
    # traces, a tape and its gradient inside the scope, raised HandlerError ("tape.gradient
    # called inside an oh.Recompute scope of a traced function"). A tape opened or closed
    # inside a scope's window now gets its records then (segments recorded while it
    # records), and a gradient inside the window makes the records and ends collection.
    s = _Setup()

    def make(rc):
        @tf.function
        def step(x):
            with rc if rc is not None else contextlib.nullcontext():
                with tf.GradientTape(persistent=True) as t:
                    t.watch(x)
                    h = x
                    for _ in range(6):
                        h = tf.tanh(h @ s.w)
                    loss = tf.reduce_sum(h * h)
                    if inside_tape:
                        g = t.gradient(loss, [x, s.w])
                if not inside_tape:
                    g = t.gradient(loss, [x, s.w])
            return [loss] + g
        return step
    results = []
    rc = oh.Recompute()
    for r in (None, rc):
        with tf.GradientTape():  # a tape could record: the scope opens a window
            results.append(make(r)(s.x))
    _same(results[0], results[1], "tape.gradient inside a Recompute scope in a function")
    if not inside_tape:
        assert rc.stats["segments"] >= 2  # recorded while the tape recorded


@pytest.mark.parametrize("body", ["sin", "matmul", "gather", "gather_add"])
def test_eager_scope_in_vectorized_map_under_an_oh_tape(body):
    # GradientTape > vectorized_map > Recompute (OH_FUZZ_SEED=81 slow case 38, 137/35):
    # the scope recorded its segments on the tape outside the map, whose inputs are
    # per-example: HandlerError "a per-example tensor cannot be copied off". The scope
    # now runs its ops as they are there (the map batches them; said in a warning).
    r = np.random.default_rng(0)
    V = tf.Variable(r.standard_normal((6, 4)).astype(np.float32))
    W = tf.Variable(r.standard_normal((4, 4)).astype(np.float32))
    x = tf.constant(r.standard_normal((2, 3, 4)).astype(np.float32))
    ids = tf.constant([[1, 2, 3], [0, 0, 5]])
    first = {"sin": lambda xe, i: tf.sin(xe), "matmul": lambda xe, i: tf.matmul(xe, W),
             "gather": lambda xe, i: tf.gather(V, i),
             "gather_add": lambda xe, i: tf.gather(V, i) + xe}[body]

    def run(ours):
        def fn(e):
            with oh.Recompute() if ours else contextlib.nullcontext():
                a = first(*e)
                return tf.round(a * 3.0) * 0.25 + tf.sin(a) * a
        with (oh.GradientTape if ours else tf.GradientTape)() as t:
            t.watch(x)
            out = (oh.vectorized_map if ours else tf.vectorized_map)(fn, (x, ids))
        return [out] + t.gradient(out, [x, V, W])
    want = run(False)
    with pytest.warns(RuntimeWarning, match="vectorized_map is between"):
        got = run(True)
    _same(want, got, "GradientTape > vectorized_map > Recompute, %s" % body)
