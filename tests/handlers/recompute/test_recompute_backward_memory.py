"""What a recomputing backward pass allocates besides the weight gradients: a segment's
gradient function computes its convolutions' gradients as matrix products, without the
scratch buffers of TensorFlow's CPU backprop kernels (recompute/conv_grads.py); the tapes'
record of a segment keeps none of its outputs; a sqrt segment ending at a residual add
takes the activation after it in, so the next segment starts from the value it reads."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.recompute import conv_grads
from tf_ophandlers.handlers.recompute import segments as recompute_segments
import recompute_helpers

# (size, in channels, out channels, kernel, stride, padding): the ResNet50 cases (1x1,
# strided 1x1 projections, 3x3 SAME, the 7x7 strided stem) and odd sizes and strides.
CASES = [(16, 8, 4, 1, 1, "SAME"), (16, 8, 4, 1, 2, "VALID"), (15, 8, 4, 1, 2, "VALID"),
         (15, 8, 4, 1, 2, "SAME"), (16, 8, 4, 3, 1, "SAME"), (16, 8, 4, 3, 2, "SAME"),
         (15, 8, 4, 3, 2, "VALID"), (22, 3, 4, 7, 2, "VALID"), (9, 5, 3, 2, 3, "SAME")]


@pytest.mark.parametrize("size,cin,cout,k,stride,padding", CASES)
def test_lean_conv2d_gradients_equal_tensorflows(size, cin, cout, k, stride, padding):
    """Input and filter gradients of the override equal tf.GradientTape's (TensorFlow's
    kernels), up to the order of the sums. The absolute tolerance scales with the
    gradient's largest element: an element is a sum of terms of about that size, whose
    float32 rounding depends on the order of the sums, which differs between TensorFlow's
    kernels (Eigen's, or oneDNN's on CPUs where its custom ops are on by default)."""
    rng = np.random.default_rng(size * 100 + k * 10 + stride)
    x = tf.constant(rng.standard_normal((2, size, size, cin)).astype(np.float32))
    w = tf.constant(rng.standard_normal((k, k, cin, cout)).astype(np.float32))
    with tf.GradientTape() as ref:
        ref.watch([x, w])
        y = tf.nn.conv2d(x, w, stride, padding)
        want = tf.reduce_sum(y * tf.sin(y))
    expected = ref.gradient(want, [x, w])
    conv_grads.register()

    @tf.function(autograph=False)
    def lean(x, w):
        with tf.compat.v1.get_default_graph().gradient_override_map(conv_grads.OVERRIDES):
            y = tf.nn.conv2d(x, w, stride, padding)
        grads = tf.gradients(tf.reduce_sum(y * tf.sin(y)), [x, w])
        types = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        assert "Conv2DBackpropFilter" not in types, types  # (the override ran)
        return grads
    for g, e in zip(lean(x, w), expected):
        e = e.numpy()
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6 * np.abs(e).max())


def _fallback_and_reference(x, w, padding):
    """(the override's gradients of sum(conv(x, w)^2) as a function, which asserts that
    TensorFlow's Conv2DBackpropFilter ran, TensorFlow's tape and its loss) for a case the
    override leaves to TensorFlow's registered gradient."""
    conv_grads.register()

    @tf.function(autograph=False)
    def lean(x, w):
        with tf.compat.v1.get_default_graph().gradient_override_map(conv_grads.OVERRIDES):
            y = tf.nn.conv2d(x, w, 1, padding)
        grads = tf.gradients(tf.reduce_sum(y * y), [x, w])
        types = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        assert "Conv2DBackpropFilter" in types, types
        return grads
    with tf.GradientTape() as ref:
        ref.watch([x, w])
        y = tf.nn.conv2d(x, w, 1, padding)
        want = tf.reduce_sum(y * y)
    return lean, ref, want


def test_lean_conv2d_gradients_fall_back_for_grouped_convolutions():
    """A grouped convolution (filter in-channels a fraction of the input's) keeps
    TensorFlow's registered gradient: the override's function gives what the same
    function without it gives. Where TensorFlow's CPU kernels refuse it (Eigen's), that
    is TensorFlow's own error, not a reshape error of the override (its text differs by
    CPU); where they compute it (oneDNN's custom ops, on by default on some x86 CPUs),
    its values."""
    x = tf.random.stateless_normal((2, 8, 8, 4), seed=(1, 2))
    w = tf.random.stateless_normal((1, 1, 2, 6), seed=(3, 4))
    lean, _, _ = _fallback_and_reference(x, w, "SAME")

    @tf.function(autograph=False)
    def registered(x, w):
        y = tf.nn.conv2d(x, w, 1, "SAME")
        return tf.gradients(tf.reduce_sum(y * y), [x, w])
    try:
        expected = registered(x, w)
    except tf.errors.InvalidArgumentError as tf_error:
        # (the kernel's message: the line before the node that raised it)
        message = str(tf_error).split("[[{{node")[0].strip().splitlines()[-1]
        assert "grouped" in message or "filter_size" in message, message
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
            lean(x, w)
        return
    for g, e in zip(lean(x, w), expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6)


def test_lean_conv2d_gradients_fall_back_outside_their_cases():
    """Explicit padding keeps TensorFlow's registered gradient (and its values)."""
    x = tf.random.stateless_normal((2, 9, 9, 3), seed=(1, 2))
    w = tf.random.stateless_normal((3, 3, 3, 4), seed=(3, 4))
    lean, ref, want = _fallback_and_reference(x, w, [[0, 0], [1, 2], [0, 1], [0, 0]])
    for g, e in zip(lean(x, w), ref.gradient(want, [x, w])):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6)


def _residual_cnn(rng, blocks=6, ch=8, size=12):
    def w(cin, k=3):
        return tf.Variable(rng.standard_normal((k, k, cin, ch)).astype(np.float32)
                           / (k * cin ** 0.5))
    stem = w(3)
    layers = [(w(ch), w(ch, 1)) for _ in range(blocks)]

    def f(x):
        h = tf.nn.relu(tf.nn.conv2d(x, stem, 1, "SAME"))
        for w1, w2 in layers:
            h = tf.nn.relu(h + tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(h, w1, 1, "SAME")),
                                            w2, 1, "SAME"))
        return tf.reduce_mean(h * h)
    return f, [stem] + [v for b in layers for v in b]


def test_segment_gradient_functions_compute_lean_conv_gradients_and_records_keep_no_outputs(
        monkeypatch):
    """On a residual CNN under oh.Recompute: gradients equal tf.GradientTape's; the
    segments' gradient functions contain no Conv2DBackprop kernel; the tape's records of
    segments hold none of their outputs (before, each record held them through its own
    backward call, which recomputes them instead) nor of their inputs (the gradient
    function's closure holds those: checkpoint thinning drops some); segments ending at a residual add
    end after the ReLU that follows it (before: on the add)."""
    rng = np.random.default_rng(0)
    f, variables = _residual_cnn(rng)
    x = tf.constant(rng.standard_normal((4, 12, 12, 3)).astype(np.float32))
    with tf.GradientTape() as ref:
        want = f(x)
    expected = ref.gradient(want, variables)
    ends = []
    split = recompute_segments.split

    def spy(segment, outputs):
        ends.append(segment.nodes[-1][0].type)
        return split(segment, outputs)
    monkeypatch.setattr(recompute_segments, "split", spy)
    rc = oh.Recompute()
    for _ in range(2):  # the second step plans with the first one's size
        ends.clear()
        with oh.GradientTape() as tape:
            with rc:
                loss = f(x)
        records = [r for r in tape._producer.values()  # pylint: disable=protected-access
                   if r.op_type == recompute_segments.SEGMENT_OP_TYPE]
        assert records
        assert all(o is None for r in records for o in r.outputs), \
            [r.outputs for r in records]
        # nor its inputs (its gradient function holds them, or their recipes)
        assert all(i is None for r in records for i in r.inputs), \
            [r.inputs for r in records]
        got = tape.gradient(loss, variables)
        recompute_helpers.assert_grads(expected, got)
    assert rc.stats["segments"] >= 3, rc.stats
    assert "AddV2" not in ends[:-1], ends  # (the last one ends at the loss)
    assert ends.count("Relu") >= 2, ends
    types = {op.type for fn in recompute_segments._gradients.values()  # pylint: disable=protected-access
             for op in fn.function.graph.get_operations()}
    # (3x3 input gradients keep TensorFlow's kernel: its scratch for them is small; so
    # do 3x3 filter gradients where oneDNN's kernels run: conv_grads.overrides)
    assert "MatMul" in types, types
    assert ("Conv2DBackpropFilter" in types) == conv_grads.onednn_kernels(), types


@pytest.mark.parametrize("onednn", ["0", "1"], ids=["eigen_kernels", "onednn_kernels"])
def test_filter_gradients_of_several_taps_take_tensorflows_kernel_only_with_onednn(onednn):
    """In a subprocess with oneDNN's kernels off and on: a 3x3 convolution's filter
    gradient in a segment's gradient function is TensorFlow's kernel only with oneDNN's
    kernels (no Eigen scratch buffer) and only where the executor picks the order; with
    Eigen's kernels, and in a gradient function run in order (`rc.in_order`), it is the
    taps' matrix products. The 1x1 convolution's gradients are matrix products in every
    case. Gradients equal tf.GradientTape's in all four."""
    out = recompute_helpers.run_python("""
        import numpy as np
        import tensorflow as tf
        import tf_ophandlers as oh
        from tf_ophandlers.handlers.recompute import conv_grads, segments
        rng = np.random.default_rng(0)
        w1 = tf.Variable(rng.standard_normal((3, 3, 3, 8)).astype(np.float32) / 5)
        w2 = tf.Variable(rng.standard_normal((1, 1, 8, 8)).astype(np.float32) / 3)
        x = tf.constant(rng.standard_normal((4, 12, 12, 3)).astype(np.float32))

        def f():
            h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME"))
            return tf.reduce_mean(tf.nn.relu(tf.nn.conv2d(h, w2, 1, "SAME")) ** 2)
        with tf.GradientTape() as ref:
            want = ref.gradient(f(), [w1, w2])
        print(int(conv_grads.onednn_kernels()))
        for in_order in (False, True):
            segments._gradients.clear()
            rc = oh.Recompute()
            rc.in_order = in_order
            with oh.GradientTape() as tape:
                with rc:
                    loss = f()
            got = tape.gradient(loss, [w1, w2])
            for g, e in zip(got, want):
                np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
            types = [op.type for fn in segments._gradients.values()
                     for op in fn.function.graph.get_operations()]
            print(int("Conv2DBackpropFilter" in types), types.count("MatMul"))
    """, env={"TF_ENABLE_ONEDNN_OPTS": onednn})
    lines = [[int(v) for v in line.split()] for line in out.split("\n") if line.strip()]
    (on,), (kernel, products), (ordered_kernel, ordered_products) = lines
    assert on == int(onednn)
    assert kernel == on, lines
    assert ordered_kernel == 0, lines
    # 9 taps and the 1x1 filter gradient with the taps; the 1x1's two products else
    assert products >= (2 if on else 10) and ordered_products >= 10, lines


@pytest.mark.parametrize("onednn", ["0", None], ids=["eigen_kernels", "default_kernels"])
def test_lean_conv_gradients_allocate_no_scratch_buffer(onednn):
    """BFC peaks, in a subprocess: the filter and input gradients of a ResNet50 stage-2
    1x1 convolution at batch 32 (8.4 MB input, 2.1 MB output gradient) peak at about 34
    and 42 MB with TensorFlow's Eigen CPU kernels (`TF_ENABLE_ONEDNN_OPTS=0`), at their
    results' size here. oneDNN's kernels, TensorFlow's default on x86 CPUs with
    AVX-512 VNNI/BF16 or AMX, allocate no such buffer: there the override costs at most
    what they cost."""
    out = recompute_helpers.run_bfc("""
        import tensorflow as tf
        from tf_ophandlers.handlers.recompute import conv_grads
        conv_grads.register()
        info = tf.config.experimental.get_memory_info
        h = tf.random.stateless_normal((32, 16, 16, 256), seed=(1, 2))
        k = tf.random.stateless_normal((1, 1, 256, 64), seed=(3, 4))
        g = tf.random.stateless_normal((32, 16, 16, 64), seed=(5, 6))

        def make(lean):
            @tf.function(autograph=False)
            def grads(h, k, g):
                graph = tf.compat.v1.get_default_graph()
                with graph.gradient_override_map(conv_grads.OVERRIDES if lean else {}):
                    o = tf.nn.conv2d(h, k, 1, "VALID")
                return tf.gradients(o, [h, k], grad_ys=g)
            return grads

        for lean in (False, True):
            fn = make(lean)
            fn(h, k, g)
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = info("CPU:0")["current"]
            r = fn(h, k, g)
            del r
            print(info("CPU:0")["peak"] - base)
    """, env=None if onednn is None else {"TF_ENABLE_ONEDNN_OPTS": onednn})
    kernels, lean = (int(v) for v in out.split())
    mb = 1 << 20
    results = (32 * 16 * 16 * 256 + 256 * 64) * 4  # the input and filter gradients
    assert lean <= results + 2 * mb, (lean, kernels)
    if onednn == "0":
        assert kernels >= lean + 10 * mb, (lean, kernels)  # (what the override saves)
    else:
        assert lean <= kernels + mb, (lean, kernels)


def test_strided_one_by_one_convolutions_share_their_input_gradient(monkeypatch):
    """A ResNet downsampling block (its first convolution and its projection shortcut
    both 1x1 with stride 2 on the block's input): gradients equal tf.GradientTape's, and
    the segment's gradient function places the two convolutions' input gradients once
    (one StridedSliceGrad of their sum at the slice's size; before, each was padded to
    the input's size, then summed)."""
    rng = np.random.default_rng(5)

    def var(*shape):
        return tf.Variable((rng.standard_normal(shape)
                            / np.sqrt(np.prod(shape[:-1]))).astype(np.float32))
    stem, w1, w2, w3, ws = (var(3, 3, 3, 8), var(1, 1, 8, 4), var(3, 3, 4, 4),
                            var(1, 1, 4, 16), var(1, 1, 8, 16))

    def f(x):
        h = tf.nn.relu(tf.nn.conv2d(x, stem, 1, "SAME"))
        main = tf.nn.relu(tf.nn.conv2d(h, w1, 2, "VALID"))
        main = tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(main, w2, 1, "SAME")), w3, 1, "VALID")
        h = tf.nn.relu(main + tf.nn.conv2d(h, ws, 2, "VALID"))
        return tf.reduce_mean(h * h)
    variables = [stem, w1, w2, w3, ws]
    x = tf.constant(rng.standard_normal((2, 15, 15, 3)).astype(np.float32))
    with tf.GradientTape() as ref:
        want = f(x)
    expected = ref.gradient(want, variables)
    recompute_segments._gradients.clear()  # pylint: disable=protected-access
    rc = oh.Recompute()
    rc.join_fraction = 100.0  # (one segment: the block's input is inside it)
    rc.join_cap = 100.0
    with oh.GradientTape() as tape:
        with rc:
            loss = f(x)
    recompute_helpers.assert_grads(expected, tape.gradient(loss, variables))
    graphs = [fn.function.graph for fn in recompute_segments._gradients.values()]  # pylint: disable=protected-access
    ops = [op for g in graphs for op in g.get_operations()]
    counts = [[op.type for op in g.get_operations()].count("StridedSliceGrad")
              for g in graphs]
    assert max(counts) == 1, counts  # (in each function reading the block's input)
    # (the per-convolution placement: the gradient at the pixels read, zeros between,
    # as a rank-6 value padded to the input's size)
    assert not any(o.shape.rank == 6 for op in ops for o in op.outputs)
