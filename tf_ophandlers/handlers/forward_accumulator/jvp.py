"""`ForwardAccumulator` (handlers/forward_accumulator/handler.py): the JVP rules of common ops,
as `fn(execute, op, primals, tangents, outputs) -> output tangents`.

`execute(op, inputs)` runs an op on the next stack; plain TensorFlow calls in a rule run
there too. A tangent of None is zero. Ops without a rule here use TensorFlow's own
construction (forward_accumulator._tensorflow_jvp).
"""
import tensorflow as tf

FLOAT_ENUMS = frozenset(d.as_datatype_enum for d in (
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128))

# Outputs that may carry a tangent: floats, and variants (TensorLists of a TensorArray,
# whose tangent is a TensorList too, as in TensorFlow's forwardprop).
DIFFERENTIABLE_ENUMS = FLOAT_ENUMS | {tf.variant.as_datatype_enum}


def dtype_enum(t):
    """The dtype enum of an eager tensor (fast), or of a symbolic one (function replay)."""
    get = getattr(t, "_datatype_enum", None)
    return get() if get is not None else t.dtype.as_datatype_enum


def is_float(t):
    return dtype_enum(t) in FLOAT_ENUMS


# -- the rules ---------------------------------------------------------------------------

def zeros(p):
    return tf.zeros_like(p)


def _linear(positions):
    """An op linear in the inputs at `positions` ("float": every float input)."""
    def rule(execute, op, primals, tangents, outputs):
        idx = [i for i, p in enumerate(primals) if is_float(p)] if positions == "float" \
            else positions
        args = list(primals)
        for i in idx:
            if i < len(args):
                args[i] = tangents[i] if tangents[i] is not None else zeros(primals[i])
        return execute(op, args)
    return rule


def _add_sub(sign):
    def rule(execute, op, primals, tangents, outputs):
        (a, b), (ta, tb), (y,) = primals, tangents, outputs
        if tb is None and a.shape == y.shape:
            return [ta]
        if ta is None and b.shape == y.shape:
            return [tb if sign > 0 else -tb]
        return execute(op, [ta if ta is not None else zeros(a),
                            tb if tb is not None else zeros(b)])
    return rule


def multilinear(execute, op, primals, tangents, outputs):
    """Product rule with the op itself: sum over i of op(..., t_i, ...)."""
    total = None
    for i, t in enumerate(tangents):
        if t is None or not is_float(primals[i]):
            continue
        args = list(primals)
        args[i] = t
        part = execute(op, args)
        total = part if total is None else [a + b for a, b in zip(total, part)]
    return total


def _unary(fn):
    def rule(execute, op, primals, tangents, outputs):
        return [fn(primals[0], outputs[0], tangents[0])]
    return rule


def _real_div(execute, op, primals, tangents, outputs):
    (_, b), (ta, tb), (y,) = primals, tangents, outputs
    num = ta if ta is not None else zeros(y)
    if tb is not None:
        num = num - tb * y
    return [num / b]


def _softmax(execute, op, primals, tangents, outputs):
    (y,), (t,) = outputs, tangents
    return [y * (t - tf.reduce_sum(y * t, axis=-1, keepdims=True))]


def _log_softmax(execute, op, primals, tangents, outputs):
    (y,), (t,) = outputs, tangents
    return [t - tf.reduce_sum(tf.exp(y) * t, axis=-1, keepdims=True)]


def _cast(execute, op, primals, tangents, outputs):
    if not is_float(outputs[0]):
        return [None]
    return execute(op, [tangents[0]])


def _read_variable(execute, op, primals, tangents, outputs):
    return [tangents[0]]


def _resource_gather(execute, op, primals, tangents, outputs):
    return [tf.gather(tangents[0], primals[1], batch_dims=op.attrs.get("batch_dims", 0))]


def _no_tangent(execute, op, primals, tangents, outputs):
    return [None] * len(outputs)


RULES = {
    "AddV2": _add_sub(1), "Add": _add_sub(1), "Sub": _add_sub(-1),
    "RealDiv": _real_div, "Div": _real_div,
    "Mul": multilinear, "MatMul": multilinear, "BatchMatMul": multilinear,
    "BatchMatMulV2": multilinear, "BatchMatMulV3": multilinear, "Einsum": multilinear,
    "Conv2D": multilinear, "Conv3D": multilinear, "DepthwiseConv2dNative": multilinear,
    "Conv2DBackpropInput": multilinear, "Conv2DBackpropFilter": multilinear,
    "Exp": _unary(lambda x, y, t: t * y),
    "Log": _unary(lambda x, y, t: t / x),
    "Log1p": _unary(lambda x, y, t: t / (1. + x)),
    "Expm1": _unary(lambda x, y, t: t * (y + 1.)),
    "Sin": _unary(lambda x, y, t: t * tf.cos(x)),
    "Cos": _unary(lambda x, y, t: -t * tf.sin(x)),
    "Tanh": _unary(lambda x, y, t: tf.raw_ops.TanhGrad(y=y, dy=t)),
    "Sigmoid": _unary(lambda x, y, t: tf.raw_ops.SigmoidGrad(y=y, dy=t)),
    "Relu": _unary(lambda x, y, t: tf.raw_ops.ReluGrad(gradients=t, features=x)),
    "Relu6": _unary(lambda x, y, t: tf.raw_ops.Relu6Grad(gradients=t, features=x)),
    "Softplus": _unary(lambda x, y, t: tf.raw_ops.SoftplusGrad(gradients=t, features=x)),
    "Sqrt": _unary(lambda x, y, t: tf.raw_ops.SqrtGrad(y=y, dy=t)),
    "Rsqrt": _unary(lambda x, y, t: tf.raw_ops.RsqrtGrad(y=y, dy=t)),
    "Reciprocal": _unary(lambda x, y, t: tf.raw_ops.ReciprocalGrad(y=y, dy=t)),
    "Square": _unary(lambda x, y, t: 2. * x * t),
    "Abs": _unary(lambda x, y, t: t * tf.sign(x)),
    "Softmax": _softmax, "LogSoftmax": _log_softmax,
    "Cast": _cast, "ReadVariableOp": _read_variable, "ResourceGather": _resource_gather,
    "StopGradient": _no_tangent, "PreventGradient": _no_tangent,
    "ZerosLike": _no_tangent, "OnesLike": _no_tangent, "Shape": _no_tangent,
    "Size": _no_tangent, "Rank": _no_tangent,
}
for _name in ("Neg", "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze", "Unpack",
              "SplitV", "Slice", "StridedSlice", "GatherV2", "GatherNd", "Tile", "Pad",
              "MirrorPad", "Sum", "Mean", "BroadcastTo", "ReverseV2", "Cumsum", "CopyOn",
              "CopyOnGrad", "CopyOff", "CopyOffGrad", "Real", "Imag", "Conj",
              "MatrixTranspose", "SpaceToDepth", "DepthToSpace", "DiagPart", "EnsureShape",
              "CheckNumerics", "CheckNumericsV2"):
    RULES[_name] = _linear((0,))
for _name in ("AddN", "Pack", "ConcatV2", "BiasAdd", "IdentityN"):
    RULES[_name] = _linear("float")
for _name in ("Split", "Fill", "ScatterNd"):
    RULES[_name] = _linear((1,))
# TensorLists (tf.TensorArray inside functions and loops) are linear in their elements;
# TensorFlow's own JVP construction does not handle their variant tangents.
for _name, _positions in (
        ("TensorListFromTensor", (0,)), ("TensorListStack", (0,)),
        ("TensorListGetItem", (0,)), ("TensorListSetItem", (0, 2)),
        ("TensorListPushBack", (0, 1)), ("TensorListPopBack", (0,)),
        ("TensorListGather", (0,)), ("TensorListScatterIntoExistingList", (0, 1)),
        ("TensorListScatterV2", (0,)), ("TensorListScatter", (0,)),
        ("TensorListSplit", (0,)), ("TensorListConcatV2", (0,)),
        ("TensorListResize", (0,))):
    RULES[_name] = _linear(_positions)
# Rules that use TensorFlow's *Grad kernels, which conjugate complex inputs.
REAL_ONLY = frozenset(RULES[n] for n in (
    "Tanh", "Sigmoid", "Relu", "Relu6", "Softplus", "Sqrt", "Rsqrt", "Reciprocal"))
COMPLEX_ENUMS = frozenset((tf.complex64.as_datatype_enum, tf.complex128.as_datatype_enum))
