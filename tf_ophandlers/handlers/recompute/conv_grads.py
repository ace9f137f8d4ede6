"""Convolution gradients with a small working set, for `oh.Recompute`'s gradient functions.

TensorFlow's Eigen CPU kernels for `Conv2DBackpropFilter` and `Conv2DBackpropInput`
allocate a scratch buffer of their own (an im2col buffer of up to about 32 MB, the kernels'
`target_working_set_size`), whatever the size of their result: the filter gradient of a
1x1 convolution over a ResNet50 block at batch 32 (8.4 MB input, a 65 KB result) peaks at
34 MB, its input gradient (8.4 MB) at 42 MB. In a recomputing backward pass that scratch
is a large share of what is alive besides the weight gradients, so the segments'
gradient functions (segments.py) compute a `Conv2D`'s gradients here instead, as sums of
matrix products whose only allocations are their results:

- the filter gradient as one `MatMul` per filter tap: the input pixels that tap reads
  (a strided slice of the padded input; for a 1x1 stride-1 convolution the input itself,
  reshaped, no copy) times the output gradient, the taps chained so one slice exists at
  a time. Where oneDNN's kernels run (`TF_ENABLE_ONEDNN_OPTS`, TensorFlow's default on
  x86 CPUs with AVX-512 VNNI/BF16 or AMX), a gradient function that is not run in order
  keeps TensorFlow's kernel for filters of several taps instead (`overrides`): oneDNN's
  has no Eigen scratch buffer, and is faster than the taps;
- the input gradient of a 1x1 convolution as the output gradient times the transposed
  filter (strided: placed at the pixels it read, zeros between); other convolutions
  keep TensorFlow's kernel, whose scratch for them is small (the input gradient of a
  3x3 convolution is about its result's size).

- a strided 1x1 convolution is replayed as a 1x1 convolution of the pixels it reads
  (`replay`: a strided slice of its input, shared by the convolutions reading that
  input with those strides), so the input gradients of a ResNet block's first
  convolution and of its projection shortcut are summed at the slice's size and placed
  once, instead of each being input-sized.

The results are TensorFlow's up to the order of the floating-point sums (relative
differences about 1e-7). Anything else (NCHW, dilations, explicit padding, grouped
convolutions, unknown shapes) uses TensorFlow's registered gradient.
"""
import threading

import tensorflow as tf
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import math_grad, nn_grad
from tensorflow.python.util import _pywrap_util_port

from tf_ophandlers.extend import graph_builder

#: The gradient the segments' gradient functions give `Conv2D` ops
#: (`graph.gradient_override_map`).
LEAN_CONV2D = "OhRecomputeLeanConv2D"
LEAN_CONV2D_KERNEL_FILTER = "OhRecomputeLeanConv2DKernelFilter"
LEAN_MUL = "OhRecomputeLeanMul"
OVERRIDES = {"Conv2D": LEAN_CONV2D, "Mul": LEAN_MUL}
# The same with TensorFlow's filter gradient for kernels of several taps (`overrides`).
KERNEL_FILTER_OVERRIDES = {"Conv2D": LEAN_CONV2D_KERNEL_FILTER, "Mul": LEAN_MUL}
_registered = []
_lock = threading.Lock()


def register():
    """Registers the gradient (once per process)."""
    with _lock:
        if not _registered:
            _ops.RegisterGradient(LEAN_CONV2D)(_lean_conv2d_grad)
            _ops.RegisterGradient(LEAN_CONV2D_KERNEL_FILTER)(
                lambda op, grad: _lean_conv2d_grad(op, grad, kernel_filter=True))
            _ops.RegisterGradient(LEAN_MUL)(_lean_mul_grad)
            _registered.append(True)


def onednn_kernels():
    """Whether TensorFlow runs oneDNN's CPU kernels in this process (read once, at its
    import: `TF_ENABLE_ONEDNN_OPTS`, or the CPU's default)."""
    return bool(_pywrap_util_port.IsMklEnabled())


def overrides(ordered):
    """The gradient override map of a segment's gradient function. With oneDNN's
    kernels, a function whose executor picks the order (not `ordered`) takes
    TensorFlow's filter gradient for convolutions of several taps: oneDNN's kernel
    allocates no Eigen-sized scratch buffer and runs faster than the taps' slices and
    chained small products, at the same step peak. A function run in order keeps the
    taps: there a ResNet50 stage-2 3x3 filter gradient's kernel raised the step peak
    in some steps (figures: docs/handlers/recompute.md, *Running a gradient function in
    order*)."""
    if ordered or not onednn_kernels():
        return OVERRIDES
    return KERNEL_FILTER_OVERRIDES


def _static(tensor):
    shape = tensor.shape
    return shape.as_list() if shape.is_fully_defined() else None


def _pads(size, out, k, s, padding):
    """(before, after) padding of one spatial dimension, as TensorFlow computes it."""
    if padding == b"VALID":
        return 0, max((out - 1) * s + k - size, 0)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def _lean_conv2d_grad(op, grad, kernel_filter=False):
    x, w = op.inputs[0], op.inputs[1]
    xs, ws, gs = _static(x), _static(w), _static(grad)
    strides = list(op.get_attr("strides"))
    padding = op.get_attr("padding")
    if (xs is None or ws is None or gs is None or op.get_attr("data_format") != b"NHWC"
            or list(op.get_attr("dilations")) != [1, 1, 1, 1]
            or padding not in (b"SAME", b"VALID") or strides[0] != 1 or strides[3] != 1
            or x.dtype != grad.dtype or w.dtype != grad.dtype
            or ws[2] != xs[3]):  # grouped (the filter reads a slice of the channels)

        return nn_grad._Conv2DGrad(op, grad)  # pylint: disable=protected-access
    n, h, wd, cin = xs
    kh, kw, _, cout = ws
    _, ho, wo, _ = gs
    sh, sw = strides[1], strides[2]
    g2 = tf.reshape(grad, [-1, cout])
    one_by_one = kh == 1 and kw == 1 and sh == 1 and sw == 1
    if one_by_one:
        dx = tf.reshape(tf.matmul(g2, tf.reshape(w, [cin, cout]), transpose_b=True), xs)
    elif kh == 1 and kw == 1:
        # A strided 1x1 convolution reads the pixels (i * sh, j * sw) (no padding: its
        # SAME padding is 0 before): their gradient, zeros between them.
        dx = tf.matmul(g2, tf.reshape(w, [cin, cout]), transpose_b=True)
        dx = tf.pad(tf.reshape(dx, [n, ho, 1, wo, 1, cin]),
                    [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0]])
        dx = tf.reshape(dx, [n, ho * sh, wo * sw, cin])
        if ho * sh >= h and wo * sw >= wd:
            dx = dx[:, :h, :wd, :]
        else:
            dx = tf.pad(dx[:, :h, :wd, :], [[0, 0], [0, max(h - ho * sh, 0)],
                                            [0, max(wd - wo * sw, 0)], [0, 0]])
    else:
        dx = tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.constant(xs, tf.int32), filter=w, out_backprop=grad,
            strides=strides, padding=padding.decode(), data_format="NHWC")
    if one_by_one:
        dw = tf.reshape(tf.matmul(tf.reshape(x, [-1, cin]), g2, transpose_a=True), ws)
        return [dx, dw]
    if kernel_filter and kh * kw > 1:
        dw = tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=tf.constant(ws, tf.int32), out_backprop=grad,
            strides=strides, padding=padding.decode(), data_format="NHWC")
        return [dx, dw]
    top, bottom = _pads(h, ho, kh, sh, padding)
    left, right = _pads(wd, wo, kw, sw, padding)
    xp = x
    if top or bottom or left or right:
        xp = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
    taps, previous = [], None
    for a in range(kh):
        for b in range(kw):
            part = tf.strided_slice(xp, [0, a, b, 0],
                                    [n, a + sh * (ho - 1) + 1, b + sw * (wo - 1) + 1, cin],
                                    [1, sh, sw, 1])
            if previous is not None:
                # Chained: the executor would otherwise take every tap's slice at once
                # (a `tf.control_dependencies` scope does not reach ops made inside
                # `tf.gradients`).
                part.op._add_control_input(previous.op)  # pylint: disable=protected-access
            previous = tf.matmul(tf.reshape(part, [-1, cin]), g2, transpose_a=True)
            taps.append(previous)
    dw = tf.reshape(tf.stack(taps), ws)
    return [dx, dw]


def _strided_one_by_one(op, ins):
    """(row stride, column stride) of a strided 1x1 NHWC `Conv2D` node on symbolic
    inputs `ins`, or None for any other node."""
    if op.type != "Conv2D":
        return None
    attrs = op.attrs
    strides = list(attrs.get("strides") or ())
    if (attrs.get("data_format") not in (b"NHWC", None)
            or list(attrs.get("dilations") or [1, 1, 1, 1]) != [1, 1, 1, 1]
            or attrs.get("padding") not in (b"SAME", b"VALID") or len(strides) != 4
            or strides[0] != 1 or strides[3] != 1 or strides[1:3] == [1, 1]):
        return None
    xs, ws = _static(ins[0]), _static(ins[1])
    if xs is None or ws is None or ws[0] != 1 or ws[1] != 1 or ws[2] != xs[3]:
        return None
    return strides[1], strides[2]


def replay(graph, nodes, external):
    """`graph_builder.replay` of a segment's `nodes` for its gradient function, with each
    strided 1x1 convolution run as a 1x1 convolution of the pixels it reads (a strided
    slice of its input, one per input and strides, shared). The convolutions reading one
    input with the same strides (a ResNet block's first convolution and its projection
    shortcut) then sum their input gradients at the slice's size before one
    `StridedSliceGrad` places them, where each of their own input gradients was
    input-sized (the zeros between the pixels read included), summed at the end.
    The outputs are the strided convolutions' (a 1x1 SAME convolution pads nothing
    before: it reads pixels (i * s, j * s))."""
    slices = {}

    def add(graph, op, ins, device):
        strides = _strided_one_by_one(op, ins)
        if strides is None:
            return graph_builder.create(graph, op, ins, device)
        key = (ins[0].ref(), strides)
        part = slices.get(key)
        if part is None:
            part = slices[key] = ins[0][:, ::strides[0], ::strides[1], :]
        return graph_builder.create(graph, op.replace(strides=[1, 1, 1, 1]),
                                    [part, ins[1]], device)

    return graph_builder.replay(graph, nodes, external, add=add)


def _lean_mul_grad(op, grad):
    """`Mul`'s gradient (TensorFlow's `_MulGrad`, the same products and sums) where one
    operand is full-size and the other broadcast (a batch norm's scale): the broadcast
    operand's gradient, `sum(full * grad)`, is computed first and the full one's,
    `grad * other`, after it (a control edge). The product then reads the full operand
    at its last use, so it takes that operand's buffer (the executor forwards it) where
    in the other order both products and the full operand were alive at once."""
    x, y = op.inputs[0], op.inputs[1]
    xs, ys, gs = _static(x), _static(y), _static(grad)
    if (xs is None or ys is None or gs is None or xs == ys or grad.dtype.is_complex
            or not grad.dtype.is_floating or isinstance(grad, tf.IndexedSlices)):
        return math_grad._MulGrad(op, grad)  # pylint: disable=protected-access
    if xs == gs and len(ys) <= len(xs):
        full, small, small_shape, first = x, y, ys, False
    elif ys == gs and len(xs) <= len(ys):
        full, small, small_shape, first = y, x, xs, True
    else:
        return math_grad._MulGrad(op, grad)  # pylint: disable=protected-access
    rank = len(gs)
    padded = [1] * (rank - len(small_shape)) + list(small_shape)
    axes = [i for i in range(rank) if padded[i] == 1 and gs[i] != 1 or i < rank - len(small_shape)]
    if any(p != 1 and p != g for p, g in zip(padded, gs)):
        return math_grad._MulGrad(op, grad)  # pylint: disable=protected-access
    # (TensorFlow's order of the factors: x * grad for y's gradient, grad * y for x's)
    product = full * grad if not first else grad * full
    g_small = tf.reshape(tf.reduce_sum(product, axes), small_shape)
    g_full = grad * small if not first else small * grad
    g_full.op._add_control_input(g_small.op)  # pylint: disable=protected-access
    return [g_small, g_full] if first else [g_full, g_small]
