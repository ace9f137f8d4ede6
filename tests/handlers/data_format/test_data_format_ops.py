"""oh.DataFormat op by op: channels-first raw-op programs (what a SavedModel exported on a
GPU contains) against their channels-last twins, the layout rules of the agnostic ops
against plain TensorFlow on the logical tensor, 3-D ops, and errors."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from layout_probe import refused_on_cpu
from tf_ophandlers.handlers.data_format.rules import Permuted

TOL = 1e-4


def all_close(xs, ys, tol=TOL):
    assert len(xs) == len(ys)
    scale = max([1.0] + [float(np.abs(np.asarray(y)).max()) for y in ys])
    for x, y in zip(xs, ys):
        assert x is not None and y is not None
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, (x.shape, y.shape)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * scale)


def _params():
    rng = np.random.RandomState(0)

    def p(*shape, scale=0.3):
        return tf.constant(rng.normal(0, scale, shape).astype("float32"))

    return {"w1": p(3, 3, 3, 8), "b1": p(8), "gamma": 1 + p(8), "beta": p(8),
            "mean": p(8), "var": 1 + tf.abs(p(8)), "dw": p(3, 3, 8, 2), "wt": p(3, 3, 6, 24),
            "w2": p(3, 3, 6, 5), "b2": p(5)}


def net(x, p, fmt, training):
    """Conv2D (stride 2), BiasAdd, FusedBatchNormV3, Relu6, MaxPool, DepthwiseConv2dNative
    (multiplier 2), ConcatV2 on channels, Pad, AvgPool, Conv2DBackpropInput (a
    transposed conv), Conv2D with explicit padding, Mean."""
    cf = fmt == "NCHW"
    c_axis = 1 if cf else 3

    def spatial(a, b):  # a per-axis list in the format's order
        return [1, 1, a, b] if cf else [1, a, b, 1]

    h = tf.nn.conv2d(x, p["w1"], 2, "SAME", data_format=fmt)
    h = tf.nn.bias_add(h, p["b1"], data_format=fmt)
    h, _, _ = tf.compat.v1.nn.fused_batch_norm(
        h, p["gamma"], p["beta"], mean=None if training else p["mean"],
        variance=None if training else p["var"], is_training=training, data_format=fmt)
    h = tf.nn.relu6(h)
    h = tf.nn.max_pool2d(h, 3, 2, "SAME", data_format=fmt)
    d = tf.nn.depthwise_conv2d(h, p["dw"], spatial(1, 1), "SAME", data_format=fmt)
    h = tf.concat([h, d], axis=c_axis)  # 24 channels
    pads = [[0, 0], [0, 0], [1, 0], [0, 1]] if cf else [[0, 0], [1, 0], [0, 1], [0, 0]]
    h = tf.pad(h, pads)
    h = tf.nn.avg_pool2d(h, 2, 2, "VALID", data_format=fmt)
    n = tf.shape(h)[0]
    hw = 2 * h.shape[2 if cf else 1]
    out_shape = tf.stack([n, 6, hw, hw]) if cf else tf.stack([n, hw, hw, 6])
    h = tf.nn.conv2d_transpose(h, p["wt"], out_shape, 2, "SAME", data_format=fmt)
    h = tf.nn.conv2d(h, p["w2"], 1, [[0, 0], [0, 0], [1, 1], [2, 2]] if cf else
                     [[0, 0], [1, 1], [2, 2], [0, 0]], data_format=fmt)
    h = tf.nn.bias_add(tf.nn.elu(h), p["b2"], data_format=fmt)
    return tf.reduce_mean(tf.square(h), axis=[2, 3] if cf else [1, 2])


@pytest.fixture(scope="module")
def data():
    x = tf.random.stateless_normal([2, 3, 16, 16], seed=[3, 4])
    return x, _params()


def _trained(p):
    """The parameters that get gradients (not the batch-norm statistics)."""
    return [v for k, v in sorted(p.items()) if k not in ("mean", "var")]


def _twin(x, p, training):
    xl = tf.transpose(x, [0, 2, 3, 1])
    with tf.GradientTape() as tape:
        tape.watch([xl] + _trained(p))
        y = net(xl, p, "NHWC", training)
        loss = tf.reduce_sum(y * tf.range(1., 6.))
    grads = tape.gradient(loss, [xl] + _trained(p))
    return y, [tf.transpose(grads[0], [0, 3, 1, 2])] + grads[1:]


def test_raw_program_fails_without_the_handler(data):
    x, p = data
    with refused_on_cpu():
        net(x, p, "NCHW", False)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("tape_inside", [False, True], ids=["tape_outside", "tape_inside"])
def test_raw_program_values_and_gradients(data, training, mode, tape_inside):
    """With the tape outside, a tf.function called inside the scope is recorded as its
    replayed (channels-last) function (core/functions/call_records.py)."""
    x, p = data
    ref, ref_grads = _twin(x, p, training)
    fn = (lambda a, q: net(a, q, "NCHW", training))
    if mode == "function":
        fn = tf.function(fn)
    sources = [x] + _trained(p)
    log = oh.OpLogHandler()
    if tape_inside:
        with log, oh.DataFormat() as df:
            with oh.GradientTape() as tape:
                tape.watch(sources)
                y = fn(x, p)
                loss = tf.reduce_sum(y * tf.range(1., 6.))
            grads = tape.gradient(loss, sources)
    else:
        with log:
            with oh.GradientTape() as tape:
                tape.watch(sources)
                with oh.DataFormat() as df:
                    y = fn(x, p)
                    loss = tf.reduce_sum(y * tf.range(1., 6.))
            grads = tape.gradient(loss, sources)
    all_close([y], [ref])
    all_close(grads, ref_grads)
    seen = set(log.op_types_seen())
    assert {"Conv2D", "FusedBatchNormV3", "MaxPool", "AvgPool", "DepthwiseConv2dNative",
            "Conv2DBackpropInput", "Conv2DBackpropFilter", "BiasAddGrad"} <= seen
    assert all(r.attrs is None for r in log.records)
    assert dict(df.fallbacks) == {}


def test_converted_ops_run_channels_last(data):
    x, p = data
    log = oh.OpLogHandler(record_attrs=True)
    with log, oh.DataFormat():
        net(x, p, "NCHW", True)
    formats = {r.op_type: r.attrs["data_format"] for r in log.records
               if r.attrs and "data_format" in r.attrs}
    assert formats and all(f == b"NHWC" for f in formats.values()), formats
    # The data is transposed once on the way in; the output [N, C] needs none.
    assert log.op_types_seen().count("Transpose") == 1


def test_dilated_and_strided_attributes_are_reordered():
    """Per-axis attributes (dilations, strides, ksize, explicit paddings) and MaxPoolV2's
    per-axis inputs follow the data to channels-last (forward only: TensorFlow's CPU
    kernels have no dilated Conv2D gradient in either layout)."""
    x = tf.random.stateless_normal([2, 3, 11, 9], seed=[6, 6])
    w = tf.random.stateless_normal([3, 2, 3, 4], seed=[7, 7])
    xl = tf.transpose(x, [0, 2, 3, 1])
    ref = tf.nn.conv2d(xl, w, 1, [[0, 0], [2, 1], [0, 3], [0, 0]], dilations=[2, 3])
    ref = tf.raw_ops.MaxPoolV2(input=ref, ksize=[1, 3, 2, 1], strides=[1, 2, 1, 1],
                               padding="VALID")
    with oh.DataFormat():
        y = tf.nn.conv2d(x, w, 1, [[0, 0], [0, 0], [2, 1], [0, 3]], dilations=[2, 3],
                         data_format="NCHW")
        y = tf.raw_ops.MaxPoolV2(input=y, ksize=[1, 1, 3, 2], strides=[1, 1, 2, 1],
                                 padding="VALID", data_format="NCHW")
    all_close([y], [tf.transpose(ref, [0, 3, 1, 2])])


def test_three_d_ops_and_space_to_depth():
    x = tf.random.stateless_normal([2, 3, 4, 8, 8], seed=[5, 6])
    w = tf.random.stateless_normal([3, 3, 3, 3, 4], seed=[7, 8])
    b = tf.constant([0.1, -0.2, 0.3, 0.5])

    def f3(a, kernel, fmt):
        h = tf.nn.conv3d(a, kernel, [1] * 5, "SAME", data_format=fmt)
        h = tf.nn.bias_add(h, b, data_format="NCHW" if fmt == "NCDHW" else "NHWC")
        h = tf.nn.max_pool3d(h, 2, 2, "VALID", data_format=fmt)
        return tf.nn.avg_pool3d(tf.nn.relu(h), [1, 2, 2], [1, 2, 2], "VALID", data_format=fmt)

    xl = tf.transpose(x, [0, 2, 3, 4, 1])
    with tf.GradientTape() as tape:
        tape.watch([xl, w])
        ref = tf.transpose(f3(xl, w, "NDHWC"), [0, 4, 1, 2, 3])
        loss = tf.reduce_sum(ref * ref)
    ref_grads = tape.gradient(loss, [xl, w])
    with refused_on_cpu(tf.errors.InvalidArgumentError):
        f3(x, w, "NCDHW")
    with oh.DataFormat():
        with oh.GradientTape() as tape:
            tape.watch([x, w])
            y = f3(x, w, "NCDHW")
            loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, [x, w])
    all_close([y], [ref])
    all_close(grads, [tf.transpose(ref_grads[0], [0, 4, 1, 2, 3]), ref_grads[1]])

    s = tf.random.stateless_normal([2, 4, 6, 6], seed=[9, 9])
    sl = tf.transpose(s, [0, 2, 3, 1])
    ref = tf.transpose(tf.nn.depth_to_space(tf.nn.space_to_depth(sl, 2) * 2.0, 2),
                       [0, 3, 1, 2])
    with oh.DataFormat():
        y = tf.nn.depth_to_space(tf.nn.space_to_depth(s, 2, data_format="NCHW") * 2.0, 2,
                                 data_format="NCHW")
    all_close([y], [ref])


# -- layout rules: a permuted tensor against plain TensorFlow on its logical value -------

def _permuted_pair():
    """(logical NCHW numpy value, a function making the same tensor under the handler
    stored channels-last)."""
    nhwc = tf.random.stateless_normal([2, 5, 6, 4], seed=[1, 1])
    return tf.transpose(nhwc, [0, 3, 1, 2]).numpy(), lambda: tf.transpose(nhwc, [0, 3, 1, 2])


RULE_CASES = {
    "sum_keepdims": lambda t: tf.reduce_sum(t, [0, 2], keepdims=True),
    "mean_drop": lambda t: tf.reduce_mean(t, [-1, 1]),
    "max_all": lambda t: tf.reduce_max(t),
    "argmax_channels": lambda t: tf.argmax(t, axis=1),
    "concat_channels": lambda t: tf.concat([t, t * 2.0], axis=1),
    "concat_plain": lambda t: tf.concat([t, tf.ones([2, 4, 5, 6])], axis=-1),
    "split": lambda t: tf.split(t, 2, axis=1)[1],
    "split_v": lambda t: tf.split(t, [1, 4], axis=2)[1],
    "pad": lambda t: tf.pad(t, [[0, 0], [1, 2], [0, 1], [3, 0]]),
    "slice": lambda t: tf.slice(t, [0, 1, 2, 0], [2, 2, 3, 5]),
    "strided_slice": lambda t: t[:, 1:3, ::2, -2:],
    "tile": lambda t: tf.tile(t, [1, 2, 1, 3]),
    "transpose": lambda t: tf.transpose(t, [3, 1, 0, 2]),
    "shape": lambda t: tf.shape(t),
    "size_rank": lambda t: tf.stack([tf.size(t), tf.rank(t)]),
    "flatten": lambda t: tf.reshape(t, [2, -1]),
    "reshape_same": lambda t: tf.reshape(t, [2, 4, 5, 6]),
    "squeeze": lambda t: tf.squeeze(tf.reduce_sum(t, [2], keepdims=True), [2]),
    "expand_dims": lambda t: tf.expand_dims(t, 2),
    "bias_like_rank3": lambda t: t + tf.reshape(tf.range(4.), [4, 1, 1]),
    "rank1_operand": lambda t: t * tf.range(6.),
    "plain_rank4_operand": lambda t: t - tf.reshape(tf.range(240.), [2, 4, 5, 6]),
    "softmax_last": lambda t: tf.nn.softmax(t),
    "softmax_channels": lambda t: tf.nn.softmax(t, axis=1),
    "add_n_where": lambda t: tf.where(t > 0, tf.add_n([t, t, t]), tf.clip_by_value(t, -.5, 0.)),
    "broadcast_to": lambda t: tf.broadcast_to(tf.reduce_sum(t, [2, 3], keepdims=True), t.shape),
    "matmul": lambda t: tf.matmul(t, tf.ones([2, 4, 6, 3])),
    "identity_n": lambda t: tf.identity_n([t, t + 1.0])[1],
    "bias_add_nhwc": lambda t: tf.nn.bias_add(t, tf.range(6.)),
    "bias_add_nchw": lambda t: tf.nn.bias_add(t, tf.range(4.), data_format="NCHW"),
}


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_layout_rules_match_tensorflow(name):
    value, make = _permuted_pair()
    f = RULE_CASES[name]
    ref = f(tf.constant(value))
    with oh.DataFormat() as df:
        t = make()
        found, rep = oh.representation_of(df, t)
        assert found and type(rep) is Permuted  # stored channels-last
        y = f(t)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_rules_in_a_replayed_function_with_unknown_dims():
    w = tf.random.stateless_normal([3, 3, 4, 4], seed=[2, 2])

    @tf.function(input_signature=[tf.TensorSpec([None, 4, None, None])])
    def f(t):
        h = tf.nn.relu(tf.nn.conv2d(t, w, 1, "SAME", data_format="NCHW"))
        h = tf.concat([h, h * 0.5], axis=1) + tf.reshape(tf.range(8.), [8, 1, 1])
        h = tf.pad(h, [[0, 0], [0, 0], [1, 1], [1, 1]]) * tf.cast(tf.shape(h)[1], tf.float32)
        return tf.reduce_max(h, axis=1), tf.reshape(h, [tf.shape(h)[0], -1])

    def twin(t):
        h = tf.nn.relu(tf.nn.conv2d(tf.transpose(t, [0, 2, 3, 1]), w, 1, "SAME"))
        h = tf.transpose(h, [0, 3, 1, 2])
        h = tf.concat([h, h * 0.5], axis=1) + tf.reshape(tf.range(8.), [8, 1, 1])
        h = tf.pad(h, [[0, 0], [0, 0], [1, 1], [1, 1]]) * 8.0
        return tf.reduce_max(h, axis=1), tf.reshape(h, [tf.shape(h)[0], -1])

    for shape in ([2, 4, 6, 5], [1, 4, 3, 7]):
        x = tf.random.stateless_normal(shape, seed=[0, shape[2]])
        with oh.DataFormat():
            got = f(x)
        all_close(got, twin(x))


def test_variables_hold_the_logical_value():
    value, make = _permuted_pair()
    v = tf.Variable(tf.zeros([2, 4, 5, 6]))
    with oh.DataFormat():
        v.assign(make() * 2.0)
    np.testing.assert_allclose(v.numpy(), value * 2.0, rtol=1e-6)


def test_copy_off_printing_and_static_value_are_logical():
    value, make = _permuted_pair()
    with oh.DataFormat():
        t = make()
        text = str(t)
    np.testing.assert_array_equal(t.numpy(), value)
    assert "shape=(2, 4, 5, 6)" in text
    assert str(value[0, 0, 0, 0])[:5] in text
    with oh.DataFormat():
        c = tf.transpose(tf.reshape(tf.range(24), [1, 2, 3, 4]), [0, 3, 1, 2])
    np.testing.assert_array_equal(tf.get_static_value(c),
                                  np.arange(24).reshape(1, 2, 3, 4).transpose(0, 3, 1, 2))


def test_errors_name_the_handler_and_the_op():
    with pytest.raises(ValueError, match="oh.DataFormat"):
        oh.DataFormat(target="channels_first")
    x = tf.ones([1, 3, 8, 8])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"oh\.DataFormat: op Conv2D"):
        with oh.DataFormat():
            tf.nn.conv2d(x, tf.ones([3, 3, 5, 4]), 1, "SAME", data_format="NCHW")


def test_channels_last_programs_pass_through_unchanged():
    x = tf.random.stateless_normal([2, 8, 8, 3], seed=[4, 4])
    w = tf.ones([3, 3, 3, 2])
    ref = tf.nn.max_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 2, 2, "VALID")
    log = oh.OpLogHandler()
    with log, oh.DataFormat():
        y = tf.nn.max_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 2, 2, "VALID")
    np.testing.assert_array_equal(y.numpy(), ref.numpy())
    assert log.op_types_seen() == ["Conv2D", "MaxPool"]


def test_layout_cache_is_keyed_by_type_attributes_and_rank():
    """Conversions are cached per (op type, attributes) and, for ops whose channel axis
    is 1 at any rank (BiasAdd), per rank: the same attributes on 4-D and 5-D data, other
    strides, and other shapes each get their own conversion, equal to TensorFlow's
    channels-last result."""
    from tf_ophandlers.handlers.data_format import handler as df_module
    b = tf.constant([0.5, -1.0, 2.0])
    w = tf.random.stateless_normal([3, 3, 3, 2], seed=[1, 3])
    for step, shape in enumerate(([2, 3, 6, 5], [1, 3, 4, 4, 2], [3, 3, 9, 7], [2, 3, 6, 5])):
        x = tf.random.stateless_normal(shape, seed=[step, 9])
        rank = len(shape)
        to_last = [0] + list(range(2, rank)) + [1]
        to_first = [0, rank - 1] + list(range(1, rank - 1))
        xl = tf.transpose(x, to_last)
        with oh.DataFormat():
            y = tf.nn.bias_add(tf.nn.relu(x), b, data_format="NCHW" if rank == 4 else "NCDHW")
            if rank == 4:
                for stride in (1, 2):
                    z = tf.nn.conv2d(y, w, stride, "SAME", data_format="NCHW")
                    ref = tf.nn.conv2d(tf.nn.bias_add(tf.nn.relu(xl), b), w, stride, "SAME")
                    all_close([z], [tf.transpose(ref, to_first)])
        all_close([y], [tf.transpose(tf.nn.bias_add(tf.nn.relu(xl), b), to_first)])
    layouts = [v for k, v in df_module._layouts.items() if k[0] in ("BiasAdd", "Conv2D")
               and v is not None]
    conv = [v for v in layouts if v.type == "Conv2D"]
    assert len({id(v) for v in conv}) >= 2  # strides 1 and 2: two attribute sets
    bias = [v for v in layouts if v.type == "BiasAdd"]
    assert any({4, 5} <= set(v._ops) for v in bias)  # one attribute set, two ranks


def _python_frames(fn):
    """The (file, function) of every Python frame of tf_ophandlers entered by `fn()`."""
    import sys
    seen = []

    def profile(frame, event, arg):
        if event == "call" and "tf_ophandlers" in frame.f_code.co_filename:
            path = "/".join(frame.f_code.co_filename.rsplit("/", 2)[-2:])
            seen.append((path, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.requires_c_paths("forwarded ops run no Python frame (values: the other tests)")
def test_plain_ops_with_outside_inputs_run_without_python():
    """Variable reads and ops on tensors made outside the scope (a constant shape, the
    model's input) run as they are: the handler keeps OpHandler's copy_on, so the C++
    per-op path forwards them, with no hook and no Python copy-on."""
    v = tf.Variable(tf.ones([3, 3, 3, 4]))
    x = tf.ones([4, 6])
    shape = tf.constant([6, 4])
    with oh.DataFormat():
        for _ in range(2):  # the first op of a type asks the stack once (_oh_fast)
            frames = _python_frames(lambda: (v.read_value(), tf.raw_ops.Reshape(
                tensor=x, shape=shape), tf.raw_ops.Relu(features=x)))
    assert [f for f in frames if f[0] in ("data_format/handler.py", "data_format/rules.py",
                                          "core/stack.py")] == []


def test_a_layout_survives_re_entering_the_handler_on_another_stack():
    """A channels-last result of the handler used under the same handler merged onto
    another stack (a log below it) keeps its layout (core.stack.move_onto moves a
    `Permuted` by its function_input parts): no transpose, the logical value."""
    x = tf.random.stateless_normal([2, 3, 8, 8], seed=[5, 6])
    w = tf.random.stateless_normal([3, 3, 3, 4], seed=[6, 7])
    df = oh.DataFormat()
    with df:
        y = tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")
    log = oh.OpLogHandler()
    with log, df:
        z = tf.nn.relu(y) + 1.0
        assert z.shape == (2, 4, 8, 8)
    assert log.op_types_seen() == ["Relu", "AddV2"]
    ref = tf.nn.relu(tf.nn.conv2d(tf.transpose(x, [0, 2, 3, 1]), w, 1, "SAME")) + 1.0
    all_close([z], [tf.transpose(ref, [0, 3, 1, 2])])


def test_transposes_run_at_the_lowest_rank(monkeypatch):
    """The handler's transposes merge axes that stay adjacent (NCHW [N, C, H, W] to NHWC
    is [N, C, H*W] -> [N, H*W, C], which TensorFlow's CPU kernel runs faster): equal to
    tf.transpose for every perm of ranks 2-5 (length-1 axes included), eagerly (with
    eager lowering switched on) and in a replayed function."""
    from tf_ophandlers.handlers.data_format import rules
    monkeypatch.setattr(rules, "_COLLAPSE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(rules, "_COLLAPSE_EAGERLY", True)
    assert rules.collapsed_transpose([16, 3, 56, 56], (0, 2, 3, 1)) == (
        [16, 3, 3136], (0, 2, 1), [16, 56, 56, 3])
    assert rules.collapsed_transpose([None, 3, 56, 56], (0, 2, 3, 1)) == (
        [-1, 3, 3136], (0, 2, 1), [-1, 56, 56, 3])
    assert rules.collapsed_transpose([2, 3, 4], (2, 0, 1)) == ([6, 4], (1, 0), [4, 2, 3])
    assert rules.collapsed_transpose([2, 3, 4], (1, 0, 2)) is None  # nothing merges
    assert rules.collapsed_transpose([None, None, 4, 5], (0, 2, 3, 1)) is None
    rng = np.random.RandomState(0)
    import itertools
    for rank in (2, 3, 4, 5):
        for q in itertools.permutations(range(rank)):
            dims = [int(rng.choice([1, 2, 3])) for _ in range(rank)]
            x = tf.constant(rng.normal(size=dims).astype("float32"))
            got = rules.transpose(oh.PHYSICAL, x, q)
            np.testing.assert_array_equal(got.numpy(), tf.transpose(x, q).numpy())

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 5, 4])])
    def f(t):  # NCHW in, a Flatten-like reshape that needs the logical layout
        return tf.reshape(tf.nn.relu(tf.nn.avg_pool2d(t, 1, 1, "VALID", data_format="NCHW")),
                          [-1, 60])

    x = tf.random.stateless_normal([2, 3, 5, 4], seed=[8, 8])
    log = oh.OpLogHandler()
    with log, oh.DataFormat():
        y = f(x)
    np.testing.assert_array_equal(y.numpy(), tf.reshape(tf.nn.relu(x), [-1, 60]).numpy())
    transposes = [r for r in log.records if r.op_type == "Transpose"]
    assert [r.input_shapes[0].as_list()[1:] for r in transposes] == [[3, 20], [20, 3]]
