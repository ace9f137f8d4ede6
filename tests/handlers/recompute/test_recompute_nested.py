"""Nested checkpointing inside a segment's gradient function (recompute/nested.py): a
segment narrowing inside (a bottleneck block) is differentiated in two parts, the
second part first down to the narrow values, then the first part computed again; and
a broadcast Mul's gradient computing the reduced operand's first (conv_grads.py)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.recompute import conv_grads, nested
from tf_ophandlers.handlers.recompute import segments as recompute_segments
import recompute_helpers


def _bottleneck_net(rng, blocks=3, wide=32, narrow=8):
    """Residual bottleneck blocks (1x1 down, 3x3, 1x1 up, each with a per-channel scale
    and shift like an inference batch norm, and a relu), ResNet's stage in small: each
    block is wide at its ends and narrow inside."""
    def var(*shape, scale=1.0):
        return tf.Variable((rng.standard_normal(shape) * scale
                            / np.sqrt(np.prod(shape[:-1]))).astype(np.float32))

    def norm(c):
        return (tf.Variable((1 + 0.1 * rng.standard_normal((1, 1, 1, c))).astype(np.float32)),
                tf.Variable((0.1 * rng.standard_normal((1, 1, 1, c))).astype(np.float32)))
    stem = var(3, 3, 3, wide)
    layers = [(var(1, 1, wide, narrow), norm(narrow), var(3, 3, narrow, narrow), norm(narrow),
               var(1, 1, narrow, wide, scale=0.5), norm(wide)) for _ in range(blocks)]

    def f(x):
        h = tf.nn.relu(tf.nn.conv2d(x, stem, 1, "SAME"))
        for w1, n1, w2, n2, w3, n3 in layers:
            u = tf.nn.relu(tf.nn.conv2d(h, w1, 1, "SAME") * n1[0] + n1[1])
            u = tf.nn.relu(tf.nn.conv2d(u, w2, 1, "SAME") * n2[0] + n2[1])
            h = tf.nn.relu(h + (tf.nn.conv2d(u, w3, 1, "SAME") * n3[0] + n3[1]))
        return tf.reduce_mean(h * h)
    variables = [stem] + [v for layer in layers for item in layer
                          for v in (item if isinstance(item, tuple) else (item,))]
    return f, variables


def _built_functions(monkeypatch):
    """The segment gradient functions built from now on (the cache emptied first)."""
    built = []
    original = recompute_segments._GradientFunction.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)
    monkeypatch.setattr(recompute_segments._GradientFunction, "__init__", spy)
    recompute_segments._gradients.clear()
    return built


@pytest.mark.parametrize("split", [True, False])
def test_bottleneck_gradients_equal_tensorflows_split_or_not(monkeypatch, split):
    """Gradients of a stack of bottleneck blocks under oh.Recompute equal
    tf.GradientTape's; with the nested split on (the default), gradient functions of
    segments holding a block are built split at a narrow place, with it off none is."""
    rng = np.random.default_rng(3)
    f, variables = _bottleneck_net(rng)
    x = tf.constant(rng.standard_normal((4, 16, 16, 3)).astype(np.float32))
    with tf.GradientTape() as ref:
        want = f(x)
    expected = [g.numpy() for g in ref.gradient(want, variables)]
    if not split:
        monkeypatch.setattr(recompute_segments._GradientFunction, "split_nested", False)
    built = _built_functions(monkeypatch)
    rc = oh.Recompute()
    for _ in range(2):  # (the second scope plans its segments on the first's sizes)
        with oh.GradientTape() as tape:
            with rc:
                loss = f(x)
        recompute_helpers.assert_grads(expected,
                                       [g.numpy() for g in tape.gradient(loss, variables)])
    splits = [fn.split for fn in built if fn.split is not None]
    assert built, "no segment gradient function was built"
    assert bool(splits) == split, ([fn.split for fn in built], split)
    recompute_segments._gradients.clear()  # (functions built while monkeypatched)


class _Op:  # a node's op: `cut` reads only the nodes' refs
    pass


def _chain(widths, outputs=None):
    """Nodes of a chain (node j reads node j - 1; node 0 an input) whose values have
    `widths` float32 elements, with their output specs, for `nested.cut`."""
    nodes = [(_Op(), ((-1, 0),))] + [(_Op(), ((j - 1, 0),)) for j in range(1, len(widths))]
    results = [[tf.TensorSpec([w], tf.float32)] for w in widths]
    return nodes, results, outputs or [(len(widths) - 1, 0)]


def test_cut_is_after_the_narrowest_value_of_a_balanced_split():
    # wide, wide, narrow, wide, wide: the frontier after node 2 (100 elements) is the
    # narrowest; after node 0 or 3 a wide value (1000) crosses
    assert nested.cut(*_chain([1000, 1000, 100, 1000, 1000])) == 3
    # two narrow places: the one whose smaller part is larger (after node 6: 7 nodes
    # before, 3 after; after node 2 the prefix has 3)
    assert nested.cut(*_chain([1000, 1000, 100, 1000, 1000, 1000, 100, 1000, 1000,
                               1000])) == 7


def test_cut_declines_without_a_narrow_balanced_place():
    assert nested.cut(*_chain([1000, 1000, 1000, 1000, 1000])) is None  # no narrow place
    # narrow only after the first node: the prefix (a tenth of the bytes) saves little
    assert nested.cut(*_chain([100, 3000, 3000, 3000, 3000])) is None
    # a narrow value that is also an output read after the cut: its gradient would be
    # needed before the suffix's backward ran
    nodes, results, _ = _chain([1000, 1000, 100, 1000, 1000])
    assert nested.cut(nodes, results, [(4, 0), (2, 0)]) is None
    assert nested.cut(*_chain([1000, 100, 1000])) is None  # too few nodes


@pytest.mark.parametrize("x_shape,y_shape", [
    ((2, 4, 4, 3), (1, 1, 1, 3)), ((3,), (2, 4, 3)), ((2, 4, 4, 3), (3,)),
    ((2, 3), (2, 3)), ((2, 1, 3), (1, 4, 3))])
def test_lean_mul_gradients_equal_tensorflows(x_shape, y_shape):
    """The broadcast Mul gradient of the segments' gradient functions equals
    TensorFlow's (same-shape and two-sided broadcasts use TensorFlow's); where one
    operand is full-size, the full operand's gradient waits for the reduced one's."""
    rng = np.random.default_rng(len(x_shape) * 10 + len(y_shape))
    a = tf.constant(rng.standard_normal(x_shape).astype(np.float32))
    b = tf.constant(rng.standard_normal(y_shape).astype(np.float32))
    with tf.GradientTape() as ref:
        ref.watch([a, b])
        want = tf.reduce_sum(tf.sin(a * b))
    expected = ref.gradient(want, [a, b])
    conv_grads.register()
    ordered = []

    @tf.function(autograph=False)
    def lean(a, b):
        graph = tf.compat.v1.get_default_graph()
        with graph.gradient_override_map(conv_grads.OVERRIDES):
            y = a * b
        grads = tf.gradients(tf.reduce_sum(tf.sin(y)), [a, b])
        ordered.append(any(g.op.control_inputs for g in grads))
        return grads
    for g, e in zip(lean(a, b), expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
    one_sided = x_shape != y_shape and (
        np.broadcast_shapes(x_shape, y_shape) in (x_shape, y_shape))
    assert ordered == [one_sided], (ordered, x_shape, y_shape)


_PEAK_CODE = """
    import sys
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_ophandlers as oh
    from tf_ophandlers.handlers.recompute import segments
    sys.path[:0] = [%r, %r]
    import recompute_helpers
    from test_recompute_nested import _bottleneck_net
    segments._GradientFunction.split_nested = %r
    rng = np.random.default_rng(0)
    f, variables = _bottleneck_net(rng, blocks=4, wide=128, narrow=32)
    x = tf.constant(rng.standard_normal((8, 32, 32, 3)).astype(np.float32))
    expected = recompute_helpers.reference_gradients(f, variables, x)
    peaks = recompute_helpers.step_peaks(f, variables, x, oh.Recompute(), expected, 3)
    print(min(peaks[1:]), max(peaks[1:]))
"""


@pytest.mark.slow
def test_nested_split_lowers_the_step_peak_of_bottleneck_blocks():
    """BFC peaks, each configuration in fresh subprocesses with one thread: a stack of
    bottleneck blocks under oh.Recompute with the nested split and without; the step's
    peak is lower with it, and gradients equal tf.GradientTape's in both. A process's
    peaks repeat step after step, but between processes they take one of a few values
    some MB apart (the allocator's best fit among equal-sized free chunks follows their
    addresses, which move between processes): the lowest of four processes each."""
    paths = (recompute_helpers.REPO + "/tests/handlers/recompute",
             recompute_helpers.REPO + "/tests")
    lowest = {}
    for on in (False, True):
        runs = [[int(v) for v in recompute_helpers.run_bfc(
            _PEAK_CODE % (paths + (on,))).split()] for _ in range(4)]
        lowest[on] = min(low for low, _ in runs)
    # (by more than the spread of one configuration's lowest peaks, some 100 KB)
    assert lowest[True] < lowest[False] - (1 << 20), lowest
