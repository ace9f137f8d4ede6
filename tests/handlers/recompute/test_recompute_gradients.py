"""oh.Recompute: gradients with respect to values computed inside the scope (segment
interiors, boundaries, values watched there), kept segments of the budget policy, and a
fuzz test of random programs; everything against tf.GradientTape on the same program."""
import contextlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import recompute_helpers
from test_differential import _same

RNG = np.random.default_rng(1)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same data whatever ran before it (another order, -k, one
    test alone): the module's generator starts afresh for each test."""
    global RNG  # pylint: disable=global-statement
    RNG = np.random.default_rng(1)


_assert_grads = recompute_helpers.assert_grads


def _mlp(layers=12, width=32):
    return recompute_helpers.mlp(RNG, layers, width)


# -- gradients with respect to values computed inside the scope (segment interiors) -------

def _chain(x, w, keep, steps=12):
    """A chain whose every value is also used by the next op (a residual), so any value
    kept by the program is a segment's output that ops of the segment also use."""
    h = x
    for _ in range(steps):
        h = tf.tanh(h @ w) + 0.5 * h
        keep.append(h)
    return tf.reduce_sum(h * h)


def _interior_sources(tape_type, rc, x, w, picks, persistent=False):
    keep = []
    with tape_type(persistent=persistent) as tape:
        tape.watch(x)
        if rc is None:
            loss = _chain(x, w, keep)
        else:
            with rc:
                loss = _chain(x, w, keep)
    sources = [keep[i] for i in picks] + [x, w]
    return tape, loss, sources


@pytest.mark.parametrize("make", [lambda: oh.Recompute(), lambda: oh.Recompute(
    save=("MatMul",))], ids=["sqrt", "save"])
def test_gradient_wrt_interior_values_includes_in_segment_uses(make):
    x = tf.constant(np.linspace(-0.3, 1, 12, dtype=np.float32).reshape(3, 4))
    w = tf.Variable(tf.ones([4, 4]) * 0.3)
    picks = [0, 2, 3, 5, 11]
    tape, loss, sources = _interior_sources(tf.GradientTape, None, x, w, picks, True)
    expected = tape.gradient(loss, sources)
    rc = make()
    tape, loss, sources = _interior_sources(oh.GradientTape, rc, x, w, picks, True)
    assert rc.stats["segments"] >= 2
    _assert_grads(expected, tape.gradient(loss, sources))
    _assert_grads(expected, tape.gradient(loss, sources))  # a persistent tape, twice
    # One at a time too (each source on its own is differentiated through the rest).
    for s, e in zip(sources, expected):
        _assert_grads([e], [tape.gradient(loss, s)])
    # The jacobian (pfor over the recorded gradient functions, and the while loop).
    for pfor in (True, False):
        keep = []
        with tf.GradientTape(persistent=True) as t0:
            _chain(x, w, keep)
            out0 = tf.reduce_sum(keep[-1], axis=1)
        keep1 = []
        with oh.GradientTape(persistent=True) as t1:
            with oh.Recompute():
                _chain(x, w, keep1)
                out1 = tf.reduce_sum(keep1[-1], axis=1)
        _assert_grads(t0.jacobian(out0, [keep[2], w], experimental_use_pfor=pfor),
                      t1.jacobian(out1, [keep1[2], w], experimental_use_pfor=pfor))


def test_gradient_wrt_a_value_watched_inside_the_scope_and_second_order():
    x = tf.constant(np.linspace(-0.3, 1, 12, dtype=np.float32).reshape(3, 4))
    w = tf.Variable(tf.ones([4, 4]) * 0.3)
    results = []
    for rc in (None, oh.Recompute()):
        tape_type = tf.GradientTape if rc is None else oh.GradientTape
        keep = []
        with tape_type() as outer:
            with tape_type() as inner:
                with (rc if rc is not None else tf.name_scope("plain")):
                    h = tf.sin(x * 1.5)
                    a = tf.cos(h) * 2.0
                    inner.watch(a)  # a value computed in the scope, watched there
                    loss = _chain(a, w, keep, steps=8)
            g = inner.gradient(loss, [a, keep[1], w])
            second = tf.reduce_sum(g[0] * g[0]) + tf.reduce_sum(g[1]) + tf.reduce_sum(g[2])
        results.append(g + outer.gradient(second, [w, keep[3]]))
    _assert_grads(results[0], results[1])


def test_gradient_wrt_interior_values_in_a_fresh_function():
    x = tf.constant(np.linspace(-0.3, 1, 12, dtype=np.float32).reshape(3, 4))
    w = tf.Variable(tf.ones([4, 4]) * 0.3)
    expected = None
    for rc in (None, oh.Recompute()):
        @tf.function
        def step(x, rc=rc):
            keep = []
            with (oh.GradientTape() if rc else tf.GradientTape()) as tape:
                with (rc if rc is not None else tf.name_scope("plain")):
                    loss = _chain(x, w, keep)
            return tape.gradient(loss, [keep[1], keep[6], w])
        got = step(x)
        if expected is None:
            expected = got
    _assert_grads(expected, got)


_UNARY = {"tanh": tf.tanh, "sin": tf.sin, "sq": lambda h: 0.3 * h * h,
          "gauss": lambda h: tf.exp(-h * h)}
_BINARY = {"add": tf.add, "mul": lambda a, b: a * b * 0.5, "sub": tf.subtract}


def _random_program(rng, steps):
    """Instructions over numbered values (0: the watched input, 1: an unwatched
    constant): ops on live values, values the program drops, value requests mid-forward
    (records the segments so far) and tape.watch of a fresh untracked value."""
    prog, live, tracked, n = [], [0, 1], {0}, 2
    for _ in range(steps):
        r = rng.random()
        if r < 0.1 and len(live) > 3:
            victim = live[int(rng.integers(2, len(live) - 1))]
            live.remove(victim)
            prog.append(("drop", victim))
            continue
        if r < 0.17:
            prog.append(("flush", live[-1]))
            continue
        recent = live[-4:]
        a = recent[int(rng.integers(len(recent)))]
        b = live[int(rng.integers(len(live)))]
        kind = rng.choice(["unary", "binary", "matmul"])
        if kind == "unary":
            prog.append(("unary", str(rng.choice(list(_UNARY))), a, n))
        elif kind == "binary":
            prog.append(("binary", str(rng.choice(list(_BINARY))), a, b, n))
        else:
            prog.append(("matmul", int(rng.integers(3)), a, n))
        new_tracked = (a in tracked) or (kind == "binary" and b in tracked) or kind == "matmul"
        if new_tracked:
            tracked.add(n)
        elif rng.random() < 0.5:
            prog.append(("watch", n))
            tracked.add(n)
        live.append(n)
        n += 1
    return prog, live


def _run_program(prog, tape, x, c, ws):
    env = {0: x, 1: c}
    for ins in prog:
        if ins[0] == "unary":
            env[ins[3]] = _UNARY[ins[1]](env[ins[2]])
        elif ins[0] == "binary":
            env[ins[4]] = _BINARY[ins[1]](env[ins[2]], env[ins[3]])
        elif ins[0] == "matmul":
            env[ins[3]] = tf.tanh(env[ins[2]] @ ws[ins[1]])
        elif ins[0] == "drop":
            del env[ins[1]]
        elif ins[0] == "flush":
            env[ins[1]].numpy()
        else:
            tape.watch(env[ins[1]])
    loss = sum(tf.reduce_sum(v * (i + 1)) for i, v in env.items() if i >= 2)
    return env, loss


@pytest.mark.parametrize("seed", range(int(os.environ.get("OH_FUZZ_SEEDS", 12))))
def test_fuzz_random_programs_with_interior_sources(seed):
    """Random programs; random live intermediate values (and the input, the weights)
    requested as sources; gradients equal tf.GradientTape's, first and second order."""
    rng = np.random.default_rng(seed)
    prog, live = _random_program(rng, int(rng.integers(12, 30)))
    x = tf.constant(rng.standard_normal((3, 4)).astype(np.float32))
    c = tf.constant(rng.standard_normal((3, 4)).astype(np.float32))
    ws = [tf.Variable(rng.standard_normal((4, 4)).astype(np.float32) * 0.5)
          for _ in range(3)]
    picks = sorted(rng.choice(live[2:], size=min(len(live) - 2, 4), replace=False).tolist()) \
        if len(live) > 2 else []
    policy = seed % 5
    rc = [oh.Recompute(), oh.Recompute(save=("MatMul",)), oh.Recompute(),
          oh.Recompute(memory_budget=10 ** 9), oh.Recompute(memory_budget=10 ** 9)][policy]
    if seed % 2:  # values the program holds are dropped at every segment close (not
        # only those of 4 KB or more) and rematerialized when used (recompute/evict.py)
        rc.evict_min_bytes = 0
    if policy >= 2:  # a reused handler: the second scope plans with the first's size
        # (under a budget above the size: everything in kept segments, not recomputed)
        with oh.GradientTape() as tape:
            tape.watch(x)
            with rc:
                _run_program(prog, tape, x, c, ws)
    if policy == 4:  # a budget between the minimum and the size (selective and kept
        # parts), or the minimum (a part recomputed whole too)
        rc.memory_budget = rc.minimum_budget() + (rc.stats["computed"] // 4 if seed % 10 == 4
                                                  else 0)
    results = []
    for use in (False, True):
        tape_type = oh.GradientTape if use else tf.GradientTape
        with tape_type() as outer:
            with tape_type(persistent=True) as tape:
                tape.watch(x)
                if use:
                    with rc:
                        env, loss = _run_program(prog, tape, x, c, ws)
                else:
                    env, loss = _run_program(prog, tape, x, c, ws)
            sources = [env[i] for i in picks] + [x] + ws
            grads = tape.gradient(loss, sources,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            g2 = tf.add_n([tf.reduce_sum(g * g) for g in grads])
        second = outer.gradient(g2, ws, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # Again with no tape recording the backward pass (kept segments then use their
        # saved values instead of recomputing).
        again = tape.gradient(loss, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        results.append(grads + second + again)
    if policy == 3:
        assert rc.stats["kept"] > 0 or not rc.stats["segments"]
    for e, g in zip(*results):
        scale = 1 + float(np.abs(e.numpy()).max())  # random programs can grow large values
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=2e-5, atol=2e-6 * scale)


def test_watch_after_a_use_gathered_interior_values_and_a_tape_inside_the_scope():
    x = tf.constant(np.linspace(-0.3, 1, 12, dtype=np.float32).reshape(3, 4))
    w = tf.Variable(tf.ones([4, 4]) * 0.3)
    idx = tf.constant([2, 0, 2])
    results = []
    for use in (False, True):
        rc = oh.Recompute()
        with (oh.GradientTape if use else tf.GradientTape)(persistent=True) as tape:
            with (rc if use else tf.name_scope("plain")):
                a = tf.sin(x) * 2.0  # untracked
                b = tf.tanh(a @ w)  # a enters a segment untracked
                tape.watch(a)  # as for TensorFlow: the use above is not seen
                c = tf.tanh(b + a)
                e = tf.gather(c, idx)  # c's gradient from here is IndexedSlices
                d = tf.reduce_sum(e * e) + tf.reduce_sum(tf.sin(c[:1]))
                s = tf.reduce_sum(e) * 3.0
        got = tape.gradient(d, [a, w, c]) + tape.gradient(s, [c, b])
        if use:
            assert rc.stats["segments"] >= 1
        results.append(got)
    _assert_grads(results[0], results[1])  # types too: IndexedSlices where TF gives them
    assert isinstance(results[1][3], tf.IndexedSlices)

    # A tape opened inside the Recompute scope: the handler leaves it alone (no segments),
    # and the gradients are TensorFlow's.
    keep0, keep1 = [], []
    with tf.GradientTape(persistent=True) as t0:
        loss0 = _chain(x, w, keep0)
    with oh.Recompute() as rc:
        for tape_type in (oh.GradientTape, tf.GradientTape):
            keep1 = []
            with tape_type(persistent=True) as t1:
                loss1 = _chain(x, w, keep1)
            _assert_grads(t0.gradient(loss0, [keep0[3], w]), t1.gradient(loss1, [keep1[3], w]))


@pytest.mark.parametrize("fraction", [0.3, 0.7, 3.0])
def test_memory_budget_kept_segments_equal_tf(fraction):
    """Past the part a budget recomputes, kept segments: their gradient functions take the
    forward values (no recomputation); gradients, also of kept interior values and
    through a gather (IndexedSlices), equal tf.GradientTape's."""
    fn, variables = _mlp(layers=12)
    x = tf.constant(RNG.standard_normal((8, 32)).astype(np.float32))
    table = tf.Variable(RNG.standard_normal((10, 32)).astype(np.float32))
    idx = tf.constant([3, 1, 3, 7, 0, 0, 2, 9])

    def program(keep):
        rows = tf.convert_to_tensor(table)  # a kept read; its two gathers are in a segment
        pre = tf.tanh(x @ variables[0]) * 0.1  # (a budget recomputes at least the first op)
        h = tf.gather(rows, idx) * 0.5 + pre + tf.gather(rows, idx[::-1])
        keep.append(h)
        return fn(h) + tf.reduce_sum(tf.gather(h, [1, 2]))

    probe = oh.Recompute()
    with oh.GradientTape():
        with probe:
            program([])
    minimum = probe.minimum_budget()
    budget = int(minimum + fraction * probe.stats["computed"])
    keep0 = []
    with tf.GradientTape() as tape:
        loss = program(keep0)
    g0 = tape.gradient(loss, [keep0[0], table] + variables)
    rc = oh.Recompute(memory_budget=budget)
    for _ in range(2):  # the second scope plans
        keep1 = []
        with oh.GradientTape() as tape:
            with rc:
                loss = program(keep1)
        _assert_grads(g0, tape.gradient(loss, [keep1[0], table] + variables))
    assert isinstance(g0[1], tf.IndexedSlices)  # and so is Recompute's (checked above)
    assert rc.stats["segments"] >= 1


def _budget_steps(program, sources, budget):
    """Two scopes of one budget handler (the second plans); its stats and gradients."""
    rc = oh.Recompute(memory_budget=budget)
    for _ in range(2):
        with oh.GradientTape() as tape:
            with rc:
                loss = program()
        grads = tape.gradient(loss, sources)
    return rc.stats, grads


def test_memory_budget_recomputes_cheap_ops_first():
    """MatMuls alternating with chains of elementwise ops: between the minimum and the
    size, a budget keeps the MatMul outputs and recomputes only elementwise ops; at the
    minimum it must recompute MatMuls too; above the size nothing. Gradients equal
    tf.GradientTape's for each (also in a Keras model)."""
    ws = [tf.Variable(RNG.standard_normal((32, 32)).astype(np.float32) * 0.2)
          for _ in range(12)]
    x = tf.constant(RNG.standard_normal((16, 32)).astype(np.float32))

    def program():
        h = x
        for w in ws:
            h = h @ w
            for _ in range(3):
                h = tf.tanh(h) * 0.9 + 0.1
        return tf.reduce_sum(h * h)

    probe = oh.Recompute()
    with oh.GradientTape():
        with probe:
            program()
    total, minimum = probe.stats["computed"], probe.minimum_budget()
    assert minimum < total
    with tf.GradientTape() as tape:
        loss = program()
    expected = tape.gradient(loss, ws)
    recomputed = {}
    for name, budget in (("min", minimum), ("low", minimum + total // 14),
                         ("mid", (minimum + total) // 2),
                         ("all", 3 * total)):
        stats, grads = _budget_steps(program, ws, budget)
        _assert_grads(expected, grads)
        recomputed[name] = stats["recomputed"]
    # more budget: fewer MatMuls recomputed first (the part recomputed whole shrinks)
    assert recomputed["min"].get("MatMul", 0) > recomputed["low"].get("MatMul", 0) > 0, \
        recomputed
    assert "MatMul" not in recomputed["mid"] and recomputed["mid"].get("Tanh", 0) >= 12, \
        recomputed
    assert sum(recomputed["mid"].values()) < sum(recomputed["min"].values())
    assert recomputed["all"] == {}, recomputed

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((32,))] + [
        layer for _ in range(6) for layer in (
            keras.layers.Dense(32), keras.layers.Activation("tanh"),
            keras.layers.LayerNormalization())])
    variables = model.trainable_variables

    def keras_program():
        return tf.reduce_sum(model(x) ** 2)

    probe = oh.Recompute()
    with oh.GradientTape():
        with probe:
            keras_program()
    with tf.GradientTape() as tape:
        loss = keras_program()
    expected = tape.gradient(loss, variables)
    stats, grads = _budget_steps(
        keras_program, variables,
        (probe.minimum_budget() + probe.stats["computed"]) // 2)
    for e, g in zip(expected, grads):
        # LayerNormalization's graph-speed gradient differs from the eager one by
        # roundoff (about 1e-5 of the largest element, the same for every policy,
        # also with nothing recomputed)
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5,
                                   atol=5e-5 * float(np.abs(e.numpy()).max()))
    assert "MatMul" not in stats["recomputed"] and stats["recomputed"], stats


_UNCONNECTED = {  # f(x, z): gradients wrt x and z computed from no tangent (TensorFlow: None)
    "concat_split": lambda x, z: tf.split(tf.concat([x, z], -1), [6, 2], axis=-1)[1],
    "transpose": lambda x, z: tf.transpose(tf.concat([x, z], 0)),
}


@pytest.mark.parametrize("body", sorted(_UNCONNECTED))
def test_jvp_of_a_gradient_through_recompute_is_none_as_tensorflows(body):
    # Fuzz finding (ForwardAccumulator > GradientTape > Recompute, eager, OH_FUZZ_SEED=85
    # slow case 4, 91 case 42): the JVP of a gradient computed from the output gradients
    # only was zeros where TensorFlow's eager tape (op by op) gives None: the accumulator
    # gave the segment's gradient function TensorFlow's call semantics (zero tangents for
    # its arguments without one). That call now stands for the ops it runs.
    r = np.random.default_rng(4)
    x, z, tx, tz = [tf.constant(r.standard_normal((2, 4)).astype(np.float32))
                    for _ in range(4)]
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        Tape = oh.GradientTape if ours else tf.GradientTape
        with Acc([x, z], [tx, tz]) as acc:
            with Tape() as t:
                t.watch([x, z])
                with oh.Recompute() if ours else contextlib.nullcontext():
                    y = _UNCONNECTED[body](x, z)
            g = t.gradient(y, [x, z])
        results.append([y] + g + [acc.jvp(gi) for gi in g])
    _same(results[0], results[1], "ForwardAccumulator > GradientTape > Recompute, " + body)
