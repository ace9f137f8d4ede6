"""oh.ForwardAccumulator composed with oh.vectorized_map, tf.function replays and a
second accumulator, against TensorFlow (fuzz findings of test_fuzz_stacks)."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None


def _rand(seed, *shape):
    return tf.constant(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _pool(a):
    """The fuzzers' pool_nhwc (SAME, stride 1: MaxPoolGradGrad's input shape is its
    output's) after a relu (ties: zeros)."""
    img = tf.reshape(tf.nn.relu(a), [-1, 2, 2, 1])
    return tf.reshape(tf.nn.max_pool2d(img, 2, 1, "SAME") + tf.nn.avg_pool2d(
        img, 2, 1, "SAME"), [-1, 4])


def _softmax_max_pool(a):
    pooled = tf.nn.max_pool2d(tf.reshape(tf.nn.softmax(a), [-1, 2, 2, 1]), 2, 1, "SAME")
    return tf.reshape(pooled, [-1, 4])


@pytest.mark.parametrize("fn", [_softmax_max_pool, _pool])
def test_max_pool_jvp_in_a_replayed_function_matches_eager(fn):
    # Was an xfail of test_fuzz_compositions: TensorFlow's JVP of MaxPool is
    # MaxPoolGradGrad on the tangent, whose kernel returns zeros in a graph when the
    # tangent is an intermediate (it reuses that buffer for its output). The replay
    # of the tf.function made it one; the accumulator now gathers at the argmax.
    x, v = _rand(0, 3, 4), _rand(1, 3, 4)
    with tf.autodiff.ForwardAccumulator(x, v) as acc:
        want = acc.jvp(fn(x))
    with oh.ForwardAccumulator(x, v) as acc:
        got = acc.jvp(tf.function(fn)(x))
    _same(want, got, "JVP of max_pool in a tf.function")


@pytest.mark.parametrize("padding,strides,ksize", [("SAME", 1, 2), ("VALID", 1, 2),
                                                   ("SAME", 2, 3), ("VALID", 2, 2)])
def test_max_pool_jvp_per_example_in_vectorized_map(padding, strides, ksize):
    # Fuzz finding (vectorized_map > Recompute > ForwardAccumulator, OH_FUZZ_SEED=101
    # slow case 12): the JVP of MaxPool inside the map was zeros (the traced JVP replayed
    # in the map: the MaxPoolGradGrad kernel above). tf.vectorized_map gives those zeros
    # too, so the reference is TensorFlow's accumulator eagerly, one example at a time.
    xs = tf.nn.relu(_rand(2, 2, 3, 5, 5, 2))  # relu: ties in the windows
    v = _rand(3, 3, 5, 5, 2)

    def per_example(Acc):
        def f(x):
            with Acc(x, v) as acc:
                y = tf.nn.max_pool2d(x, ksize, strides, padding)
            return y, acc.jvp(y)
        return f
    want = [tf.stack(list(col)) for col in zip(
        *[per_example(tf.autodiff.ForwardAccumulator)(xs[i]) for i in range(2)])]
    got = oh.vectorized_map(per_example(oh.ForwardAccumulator), xs)
    _same(want, list(got), "JVP of max_pool per example")


def test_max_pool_grad_grad_with_an_unbatched_input_in_vectorized_map():
    # pfor's converted graph of MaxPoolGradGrad with an unbatched gradient gave zeros (the
    # kernel above; tf.vectorized_map too): vectorized_map folds its batch in instead.
    xs, v = _rand(4, 2, 3, 2, 2, 1), _rand(5, 3, 2, 2, 1)
    kw = dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="SAME")

    def f(x):
        y = tf.nn.max_pool2d(x, 2, 1, "SAME")
        return tf.raw_ops.MaxPoolGradGrad(orig_input=x, orig_output=y, grad=v, **kw)
    _same(tf.stack([f(xs[i]) for i in range(2)]), oh.vectorized_map(f, xs),
          "MaxPoolGradGrad under vectorized_map")


_W = _rand(6, 4, 4)
_K = _rand(7, 2, 2, 1, 3)
LINEAR = {
    "matmul_constant": lambda a: tf.matmul(a, _W),
    "conv": lambda a: tf.nn.conv2d(tf.reshape(a, [-1, 2, 2, 1]), _K, 1, "SAME"),
    "add_constant": lambda a: a + _W[:1],
    "reshape_sum": lambda a: tf.reduce_sum(tf.reshape(a, [-1, 2]), axis=0),
    "identity": tf.identity,
    "cast": lambda a: tf.cast(a, tf.float64),
    "maximum": lambda a: tf.maximum(a, _W[:1]),  # TensorFlow's construction, eagerly
    "relu_then_matmul": lambda a: tf.matmul(tf.nn.relu(a), _W),  # (a value: not zero)
}


BETWEEN = {"OpHandler": oh.OpHandler, "PassThrough": lambda: oh.native.PassThrough(),
           # (its representation is no tensor: found through its copy_off; OH_FUZZ_SEED=20
           # case 41, inside vectorized_map)
           "Recompute(save)": lambda: oh.Recompute(save=("MatMul", "Conv2D"))}


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("between", [None] + sorted(BETWEEN))
@pytest.mark.parametrize("name", sorted(LINEAR))
def test_nested_accumulators_jvp_of_a_jvp_linear_in_the_primal(name, between, mode):
    # Fuzz finding (two ForwardAccumulators): the outer's JVP of the inner's JVP of an op
    # linear in its primal was None; TensorFlow's is zeros (its inner JVP is a traced call
    # whose primal input the outer sees). Accumulators below now get zeros there (also
    # in a replayed tf.function: Recompute > OpHandler > OpCounter > ForwardAccumulator >
    # ForwardAccumulator, OH_FUZZ_SEED=5 case 21). With Recompute(save) between, in a
    # function: the inner's replay of the call reached the outer whole (Recompute keeps
    # calls whole), which gave the inner's tangents zero tangents as a call's JVP does:
    # zeros where TensorFlow (nested JVPs op by op in one function) has None. Not now.
    fn = LINEAR[name] if mode == "eager" else tf.function(LINEAR[name])
    x, tx, tz = _rand(8, 3, 4), _rand(9, 3, 4), _rand(10, 3, 4)
    results = []
    for Acc in (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator):
        with Acc(x, tx) as outer:
            handler = None
            if between and Acc is oh.ForwardAccumulator:
                handler = BETWEEN[between]()
                handler.__enter__()
            try:
                with Acc(x, tz) as inner:
                    y = fn(x)
                j = inner.jvp(y)
            finally:
                if handler is not None:
                    handler.__exit__(None, None, None)
        results.append([y, j, outer.jvp(y), outer.jvp(j)])
    _same(results[0], results[1], "nested accumulators, %s" % name)


def test_nested_accumulators_per_example_in_vectorized_map():
    # Fuzz finding (vectorized_map > ForwardAccumulator > OpCounter > ForwardAccumulator,
    # OH_FUZZ_SEED=101 slow case 4): the same None, per example.
    zs, tz = _rand(11, 2, 3, 4), _rand(12, 3, 4)

    def f(Acc):
        def g(z):
            with Acc(z, tz) as outer:
                with Acc(z, tz) as inner:
                    y = tf.reshape(z, [-1, 2, 2]) * 2.0
                j = inner.jvp(y)
            return y, j, outer.jvp(y), outer.jvp(j)
        return g
    want = tf.vectorized_map(f(tf.autodiff.ForwardAccumulator), zs)
    got = oh.vectorized_map(f(oh.ForwardAccumulator), zs)
    _same(list(want), list(got), "nested accumulators in a map")


_BETWEEN = {"PassThrough": lambda: oh.native.PassThrough(), "OpHandler": oh.OpHandler,
            "PassThrough+OpCounter": None}


@pytest.mark.parametrize("between", sorted(_BETWEEN))
@pytest.mark.parametrize("loop", ["vectorized_map", "while_loop"])
def test_loop_variable_given_a_tangent_under_a_handler_in_between(loop, between):
    # Fuzz finding (ForwardAccumulator > PassThrough > vectorized_map > Recompute(save),
    # OH_FUZZ_SEED=20 slow case 48): a loop variable without a tangent that gets one in
    # the body (the gather of a watched variable in pfor's while loop) under a handler
    # between the accumulator and the loop: the replay joined the loop variables at the
    # handler's level only, and the user saw HandlerOutputError "function_coerce gave
    # summary True, not False". The levels below are joined too now (a tangent for
    # `s` in tf.while_loop's body, under an OpHandler: the same error).
    V = tf.Variable(_rand(21, 6, 4))
    tV, ids = _rand(22, 6, 4), tf.constant([[1, 2], [3, 0], [5, 5]])
    x, tx = _rand(23, 3, 2, 4), _rand(24, 3, 2, 4)

    @tf.function(autograph=False)
    def loop_sum(a):  # (TensorFlow's accumulator fails on a variable read in a loop)
        return tf.while_loop(lambda k, s: k < 3, lambda k, s: (
            k + 1, s + tf.sin(a[k]) * tf.cast(k + 1, tf.float32)),
            (tf.constant(0), tf.zeros([2, 4])))[1]
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        vmap = oh.vectorized_map if ours else tf.vectorized_map
        with Acc(*((V, tV) if loop == "vectorized_map" else (x, tx))) as acc, \
                contextlib.ExitStack() as handlers:
            for name in between.split("+") if ours else ():
                handlers.enter_context(
                    oh.native.OpCounter() if name == "OpCounter" else _BETWEEN[name]())
            if loop == "vectorized_map":
                y = vmap(lambda i: tf.sin(tf.gather(V, i)) * 2.0, ids)
            else:
                y = loop_sum(x)
        results.append([y, acc.jvp(y)])
    _same(results[0], results[1], "ForwardAccumulator > %s > %s" % (between, loop))


@pytest.mark.parametrize("in_function", [False, True])
def test_identity_of_a_watched_variable_handle_keeps_its_tangent(in_function):
    # Found with fuzz OH_FUZZ_SEED=28's slow case 7: the JVP of a read of tf.identity(
    # v.handle) was None (TensorFlow: the variable's tangent). A resource output of the
    # accumulator left its tangent behind; in pfor's while loop (a handle passed on by
    # the body's Identity) the loop variable then lost its tangent, and function_coerce
    # raised TypeError (zeros_like of a resource).
    from tensorflow.python.ops import gen_resource_variable_ops as gen  # pylint: disable=import-outside-toplevel
    v, tv = tf.Variable(_rand(30, 2, 3)), _rand(31, 2, 3)

    def f():
        return gen.read_variable_op(tf.identity(v.handle), tf.float32) * 3.0
    g = tf.function(f, autograph=False) if in_function else f
    results = []
    for Acc in (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator):
        with Acc(v, tv) as acc:
            y = g()
        results.append([y, acc.jvp(y)])
    assert results[0][1] is not None
    _same(results[0], results[1], "ForwardAccumulator, identity of a variable handle")


@pytest.mark.parametrize("between", ["", "Recompute"])
def test_two_accumulators_over_vectorized_map_gathering_a_variable(between):
    # Fuzz finding (Async > OpCounter > ForwardAccumulator > Recompute >
    # ForwardAccumulator > vectorized_map, OH_FUZZ_SEED=28 slow case 7): with Recompute
    # between, TypeError from function_coerce (the gather's loop over the examples, see
    # above). Without it, the outer JVP of the inner JVP of a reshape was zeros where
    # TensorFlow's is None: tf.vectorized_map traces the mapped function, where
    # TensorFlow's nested accumulators inline each op's JVP graph (as in a function).
    V, tV = tf.Variable(_rand(32, 6, 4)), _rand(33, 6, 4)
    x, tx = _rand(34, 2, 3, 4), _rand(35, 2, 3, 4)
    ids = tf.constant([[1, 2, 5], [3, 0, 0]])

    def per_example(a):  # (TensorFlow's nesting fails with an elementwise op of a[0])
        return [tf.gather(V, a[1]), tf.reshape(a[0], [-1, 2])]
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        vmap = oh.vectorized_map if ours else tf.vectorized_map
        with Acc([x, V], [tx, tV]) as outer:
            with oh.Recompute() if ours and between else contextlib.nullcontext():
                with Acc([x, V], [tx, tV]) as inner:
                    outs = vmap(per_example, (x, ids))
                outs = outs + [inner.jvp(o) for o in outs]
        results.append(outs + [None if o is None else outer.jvp(o) for o in outs])
    _same(results[0], results[1], "ForwardAccumulator > %s > ForwardAccumulator > "
          "vectorized_map" % (between or "(none)"))


_CALLED = {
    "identity": lambda a, b: [tf.identity(a)],
    "identities": lambda a, b: [tf.identity(a), tf.identity(b)],
    "identity_and_sum": lambda a, b: [tf.identity(a), tf.reduce_sum(b, 0)],
}


@pytest.mark.parametrize("name", sorted(_CALLED))
def test_tape_around_accumulator_gradient_of_a_called_functions_jvp(name):
    # Open finding (oh.GradientTape > oh.ForwardAccumulator around tf.function(
    # tf.identity)): the gradient of the JVP with respect to the primal was zeros where
    # TensorFlow's is None. The tape records the replayed call, whose outputs are the
    # primals' and the tangents', and a call's backward function gives zeros to the
    # inputs its other outputs read. TensorFlow's tapes get the JVP apart from the call.
    # (Here the JVPs do not depend on the primals: TensorFlow's tape in a call gives
    # other second-order values, test_fuzz_stacks' _known_limitation.)
    f = tf.function(tf.autograph.experimental.do_not_convert(_CALLED[name]))
    x, z, tx, tz = _rand(40, 2, 3), _rand(41, 2, 3), _rand(42, 2, 3), _rand(43, 2, 3)
    results = []
    for ours in (False, True):
        Tape = oh.GradientTape if ours else tf.GradientTape
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        with Tape(persistent=True) as tape:
            tape.watch([x, z])
            with Acc([x, z], [tx, tz]) as acc:
                ys = f(x, z)
            jvps = [acc.jvp(y) for y in ys]
        targets = [[t] for t in ys + jvps] + [ys + jvps]
        results.append(ys + jvps + [g for t in targets for g in tape.gradient(t, [x, z])])
    _same(results[0], results[1], "GradientTape > ForwardAccumulator > %s" % name)


@pytest.mark.parametrize("op", ["erf", "avg_pool"])
def test_tape_around_lazy_around_accumulator_op_without_a_jvp_rule(op):
    # Fuzz finding (OH_FUZZ_SEED=89 slow case 4, GradientTape > Lazy >
    # ForwardAccumulator > OpLogHandler, eager): the tape's gradient of Erf or AvgPool (no
    # JVP rule here: TensorFlow's traced JVP call) was None. The call's arguments include
    # the pending Erf output, which Lazy computed inside TensorFlow's call path, where the
    # tape set is stopped, so the tape never recorded Erf. Lazy now restarts recording
    # for pending ops recorded while it was on (handlers/lazy/handler.py `_run`).
    fn = {"erf": tf.math.erf,
          "avg_pool": lambda a: tf.nn.avg_pool2d(tf.reshape(a, [-1, 2, 2, 1]), 2, 1, "SAME")}[op]
    x, tx = _rand(50, 4, 4), _rand(51, 4, 4)
    results = []
    for ours in (False, True):
        Tape = oh.GradientTape if ours else tf.GradientTape
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        with Tape(persistent=True) as tape:
            tape.watch(x)
            with oh.Lazy() if ours else contextlib.nullcontext():
                with Acc(x, tx) as acc:
                    y = fn(x)
                j = acc.jvp(y)
        results.append([y, j, tape.gradient(y, x), tape.gradient(j, x)])
    _same(results[0], results[1], "GradientTape > Lazy > ForwardAccumulator, %s" % op)


_PER_EXAMPLE = {  # e -> an op whose inner JVP reads no outer tangent (TensorFlow: zeros)
    "mul": lambda e: e * 3.0,
    "conv": lambda e: tf.reshape(tf.nn.conv2d(tf.reshape(e, [-1, 2, 2, 1]), tf.reshape(
        tf.range(8.0), [2, 2, 1, 2]) / 8.0, 1, "SAME"), [-1, 8]),
}


@pytest.mark.parametrize("body", sorted(_PER_EXAMPLE))
def test_accumulator_around_vectorized_map_of_an_accumulator(body):
    # Fuzz finding (ForwardAccumulator > vectorized_map > ForwardAccumulator > PassThrough
    # > Recompute, eager, OH_FUZZ_SEED=90 slow case 32): the outer JVP of the inner JVP
    # was None where tf.vectorized_map's (traced: the JVP graph inlined) gives zeros. The
    # zero tangent went on a per-example value, which the map refuses to copy off; it
    # now goes on the map's batched tensor.
    r = np.random.default_rng(5)
    z, t_outer = [tf.constant(r.standard_normal((2, 1, 4)).astype(np.float32))
                  for _ in range(2)]
    t_inner = tf.constant(r.standard_normal((1, 4)).astype(np.float32))
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator

        def per_example(e):
            with Acc([e], [t_inner]) as inner:
                o = _PER_EXAMPLE[body](e)
            return [o, inner.jvp(o)]
        with Acc([z], [t_outer]) as outer:
            outs = (oh.vectorized_map if ours else tf.vectorized_map)(per_example, z)
        results.append(list(outs) + [outer.jvp(o) for o in outs])
    _same(results[0], results[1], "ForwardAccumulator > vectorized_map > " + body)
