"""Random op calls for tests/core/test_skip_trace_fuzz.py: generated op wrappers and
tf.raw_ops with tensors of many dtypes, Python scalars on either side and attributes
given valid and invalid plain values. Each case is (description, fn); fn takes no
argument and returns tensors or raises."""
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_math_ops
from tensorflow.python.ops import gen_nn_ops

R = tf.raw_ops

DTYPES = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int8, tf.uint8, tf.int16,
          tf.int32, tf.int64, tf.uint32, tf.complex64, tf.bool, tf.string]
SHAPES = [(), (3,), (2, 3), (1, 3), (2, 1)]
# Python scalars: TensorFlow converts them with the other input's dtype (or refuses).
SCALARS = [0, 1, -3, 7, 255, 256, -129, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -2**63,
           -2**63 - 1, 10**30, 0.0, 1.5, -2.25, 1e39, float("inf"), float("nan"), True, False]

UNARY = ["Abs", "Neg", "Sign", "Square", "Tanh", "Sin", "Exp", "Floor", "Sqrt", "Reciprocal",
         "LogicalNot", "Invert", "Relu", "Relu6", "Sigmoid", "Rsqrt", "IsNan", "Round",
         "OnesLike", "ZerosLike", "Identity", "Erf", "Softplus", "Real", "Imag", "Angle"]
BINARY = ["AddV2", "Add", "Sub", "Mul", "RealDiv", "Div", "FloorDiv", "FloorMod",
          "TruncateDiv", "Maximum", "Minimum", "Pow", "Equal", "NotEqual", "Less",
          "GreaterEqual", "LogicalAnd", "LogicalOr", "BitwiseAnd", "BitwiseXor", "LeftShift",
          "RightShift", "Atan2", "SquaredDifference", "DivNoNan", "MulNoNan", "Xdivy",
          "ComplexAbs", "BiasAdd", "Complex"]
# Binary ops through the wrappers Python's operators use (x + 1, 2 * x, ...).
WRAPPERS = [gen_math_ops.add_v2, gen_math_ops.sub, gen_math_ops.mul, gen_math_ops.real_div,
            gen_math_ops.floor_div, gen_math_ops.maximum, gen_math_ops.less,
            gen_math_ops._pow, gen_math_ops.floor_mod]  # pylint: disable=protected-access


def tensor(rng, dtype, shape):
    if dtype == tf.string:
        return tf.constant(np.array(["a", "bc", ""] * 4)[:int(np.prod(shape))].reshape(shape))
    if dtype == tf.bool:
        return tf.constant(rng.random(shape) < 0.5)
    if dtype == tf.complex64:
        v = rng.normal(size=shape) + 1j * rng.normal(size=shape)
        return tf.constant(v.astype(np.complex64))
    if dtype.is_integer:
        lo, hi = (0, 5) if dtype.is_unsigned else (-5, 6)
        return tf.constant(rng.integers(lo, hi, size=shape), dtype=dtype)
    return tf.constant(rng.normal(size=shape) * 3, dtype=dtype)


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _unary(rng):
    op, dtype, shape = _pick(rng, UNARY), _pick(rng, DTYPES), _pick(rng, SHAPES)
    x = tensor(rng, dtype, shape)
    return f"{op}({dtype.name}{shape})", lambda: getattr(R, op)(x=x)


def _binary(rng):
    op = _pick(rng, BINARY)
    da = _pick(rng, DTYPES)
    db = da if rng.random() < 0.7 else _pick(rng, DTYPES)
    x, y = tensor(rng, da, _pick(rng, SHAPES)), tensor(rng, db, _pick(rng, SHAPES))
    if op == "BiasAdd":
        return f"BiasAdd({da.name},{db.name})", lambda: R.BiasAdd(value=x, bias=y)
    if op == "Complex":
        return f"Complex({da.name},{db.name})", lambda: R.Complex(real=x, imag=y)
    if op == "ComplexAbs":
        return f"ComplexAbs({da.name})", lambda: R.ComplexAbs(x=x)
    return f"{op}({da.name}{tuple(x.shape)},{db.name}{tuple(y.shape)})", \
        lambda: getattr(R, op)(x=x, y=y)


def _scalar(rng):
    fn = _pick(rng, WRAPPERS)
    dtype = _pick(rng, DTYPES)
    x = tensor(rng, dtype, _pick(rng, SHAPES))
    s = _pick(rng, SCALARS)
    if rng.random() < 0.5:
        return f"{fn.__name__}({dtype.name}, {s!r})", lambda: fn(x, s)
    return f"{fn.__name__}({s!r}, {dtype.name})", lambda: fn(s, x)


def _operator(rng):
    dtype = _pick(rng, DTYPES)
    x = tensor(rng, dtype, _pick(rng, SHAPES))
    s = _pick(rng, SCALARS)
    ops = [lambda: x + s, lambda: s + x, lambda: x * s, lambda: s - x, lambda: x / s,
           lambda: x // s, lambda: x ** s, lambda: x > s, lambda: x % s, lambda: -x]
    k = int(rng.integers(len(ops)))
    return f"operator {k} ({dtype.name}, {s!r})", ops[k]


# Attribute values, valid and not: each a plain Python value of some other kind too.
BOOLS = [True, False, 0, 1, None, "yes"]
FLOATS = [0.2, 0, 3, -1.5, True, 1e39, float("nan"), 10**400, "0.1", None]
INTS = [0, 1, -1, 2, 5, 2**40, 2**63, -2**63 - 1, True, 1.0, None]
PADDINGS = ["SAME", "VALID", "same", "EXPLICIT", "NOPE", b"VALID", "", 3, None]
FORMATS = ["NHWC", "NCHW", "NWHC", "nhwc", b"NHWC", "", None]


def _strides(rng):
    # (No int64 stride past int32: plain eager's oneDNN layout pass aborts the process.)
    return _pick(rng, [[1, 1, 1, 1], [1, 2, 2, 1], (1, 1, 1, 1), [1, 1, 1], [1, -1, 1, 1],
                       [1, 0, 1, 1], [1, 2**63, 1, 1], [1.0, 1, 1, 1],
                       [], [1, True, 1, 1], 1, None])


def _attr(rng):  # pylint: disable=too-many-return-statements
    k = int(rng.integers(12))
    dtype = _pick(rng, [tf.float32, tf.float32, tf.float64, tf.float16, tf.int32, tf.bfloat16])
    img = tensor(rng, dtype, (1, 4, 4, 2))
    if k == 0:
        a, b = tensor(rng, dtype, (2, 3)), tensor(rng, dtype, (2, 3))
        ta, tb = _pick(rng, BOOLS), _pick(rng, BOOLS)
        return f"MatMul({dtype.name}, {ta!r}, {tb!r})", \
            lambda: R.MatMul(a=a, b=b, transpose_a=ta, transpose_b=tb)
    if k == 1:
        alpha = _pick(rng, FLOATS)
        return f"LeakyRelu({dtype.name}, {alpha!r})", \
            lambda: gen_nn_ops.leaky_relu(img, alpha=alpha)
    if k == 2:
        f = tensor(rng, dtype, (2, 2, 2, 3))
        s, p, d = _strides(rng), _pick(rng, PADDINGS), _pick(rng, FORMATS)
        return f"Conv2D({dtype.name}, {s!r}, {p!r}, {d!r})", \
            lambda: R.Conv2D(input=img, filter=f, strides=s, padding=p, data_format=d)
    if k in (3, 4):
        op = "MaxPool" if k == 3 else "AvgPool"
        ks, s = _strides(rng), _strides(rng)
        p, d = _pick(rng, PADDINGS), _pick(rng, FORMATS)
        return f"{op}({dtype.name}, {ks!r}, {s!r}, {p!r}, {d!r})", \
            lambda: getattr(R, op)(value=img, ksize=ks, strides=s, padding=p, data_format=d)
    if k == 5:
        ex, rev = _pick(rng, BOOLS), _pick(rng, BOOLS)
        axis = tf.constant(_pick(rng, [0, 1, -1, 2, 5]))
        x = tensor(rng, dtype, (2, 3))
        return f"Cumsum({dtype.name}, {ex!r}, {rev!r}, {int(axis)})", \
            lambda: R.Cumsum(x=x, axis=axis, exclusive=ex, reverse=rev)
    if k == 6:
        ot = _pick(rng, [tf.int32, tf.int64, tf.float32, "int32"])
        x = tensor(rng, dtype, (2, 3))
        return f"ArgMax({dtype.name}, {ot!r})", \
            lambda: R.ArgMax(input=x, dimension=tf.constant(1), output_type=ot)
    if k == 7:
        kd = _pick(rng, BOOLS)
        axes = tf.constant(_pick(rng, [[1], [0, 1], [-1], [3], []]))
        x = tensor(rng, _pick(rng, DTYPES), (2, 3))
        return f"Sum({x.dtype.name}, {kd!r}, {axes.numpy().tolist()})", \
            lambda: R.Sum(input=x, axis=axes, keep_dims=kd)
    if k == 8:
        pads = tf.constant(_pick(rng, [[[1, 0], [0, 2]], [[-1, 0], [0, 0]], [[1, 1]]]))
        x = tensor(rng, _pick(rng, DTYPES), (2, 3))
        return f"Pad({x.dtype.name}, {pads.numpy().tolist()})", \
            lambda: R.Pad(input=x, paddings=pads)
    if k == 9:
        masks = [_pick(rng, INTS) for _ in range(5)]
        x = tensor(rng, dtype, (3, 4))
        begin, end = tf.constant([0, 1]), tf.constant([2, 3])
        strides = tf.constant(_pick(rng, [[1, 1], [1, 2], [2, -1], [1, 0]]))
        return f"StridedSlice({masks!r}, {strides.numpy().tolist()})", \
            lambda: R.StridedSlice(input=x, begin=begin, end=end, strides=strides,
                                   begin_mask=masks[0], end_mask=masks[1],
                                   ellipsis_mask=masks[2], new_axis_mask=masks[3],
                                   shrink_axis_mask=masks[4])
    if k == 10:
        to = _pick(rng, [tf.int32, tf.float16, tf.uint8, tf.bool, tf.int64])
        x = tensor(rng, dtype, (2, 3))
        if rng.random() < 0.5:
            tr = _pick(rng, BOOLS)
            return f"Cast({dtype.name}->{to.name}, {tr!r})", \
                lambda: R.Cast(x=x, DstT=to, Truncate=tr)
        return f"Bitcast({dtype.name}->{to.name})", lambda: R.Bitcast(input=x, type=to)
    depth = _pick(rng, INTS)
    x = tensor(rng, dtype, (1, 2, 2, 4))
    fmt = _pick(rng, FORMATS)
    return f"DepthToSpace({depth!r}, {fmt!r})", \
        lambda: R.DepthToSpace(input=x, block_size=depth, data_format=fmt)


def _other(rng):
    # Inputs and attributes that are not plain: TensorFlow's function converts them.
    dtype = _pick(rng, [tf.float32, tf.int32, tf.float16, tf.int64])
    x = tensor(rng, dtype, (2, 3))
    k = int(rng.integers(7))
    if k == 0:
        a, b = _pick(rng, SCALARS), _pick(rng, SCALARS)  # no tensor gives the dtype
        return f"AddV2({a!r}, {b!r})", lambda: gen_math_ops.add_v2(a, b)
    if k == 1:
        v = _pick(rng, [[1, 2, 3], [[1.5, 2, 3]], np.int32(2), np.float64(0.5), np.bool_(1)])
        return f"Mul({dtype.name}, {v!r})", lambda: gen_math_ops.mul(x, v)
    if k == 2:
        alpha = _pick(rng, [np.float32(0.25), np.float64(-1.0), np.int64(2)])
        return f"LeakyRelu({dtype.name}, {alpha!r})", \
            lambda: gen_nn_ops.leaky_relu(x, alpha=alpha)
    if k == 3:
        m = _pick(rng, [np.int64(1), np.int32(2), np.uint8(3)])
        return f"StridedSlice(mask {m!r})", \
            lambda: R.StridedSlice(input=x, begin=tf.constant([0, 1]), end=tf.constant([2, 3]),
                                   strides=tf.constant([1, 1]), begin_mask=m, end_mask=0,
                                   ellipsis_mask=0, new_axis_mask=0, shrink_axis_mask=0)
    if k == 4:
        return f"Sub({dtype.name}, named)", lambda: R.Sub(x=x, y=x, name="a name")
    if k == 5:
        v = tf.Variable(x)  # a resource variable: not an EagerTensor
        return f"AddV2({dtype.name}, variable)", lambda: gen_math_ops.add_v2(v, x)
    s = np.array(["x", "yz"])
    return "StringJoin-like Add(string, str)", lambda: R.Add(x=tf.constant(s), y="!")


# Python lists and tuples as inputs (Keras's `perm`/`shape`/`axis` tuples), valid and not.
LISTS = [[0], [1, 0], (1, 0), [0, 1], [-1], [2, 3], (3, 2), [6], [0, 0], [1, 2, 3], [],
         [2 ** 31], [2 ** 40, 0], [2 ** 63], [1.5, 0], [True, 0], [[1, 0], [0, 2]],
         ([0, 1], [2, 0]), [[1], [2, 3]], [-2, 3]]


def _lists(rng):
    dtype = _pick(rng, [tf.float32, tf.int32, tf.float64, tf.int64, tf.float16, tf.bool])
    x = tensor(rng, dtype, _pick(rng, [(2, 3), (3, 2), (6,)]))
    v = _pick(rng, LISTS)
    k = int(rng.integers(7))
    if k == 0:
        return f"Transpose({dtype.name}, {v!r})", lambda: R.Transpose(x=x, perm=v)
    if k == 1:
        return f"Reshape({dtype.name}, {v!r})", lambda: R.Reshape(tensor=x, shape=v)
    if k == 2:
        kd = _pick(rng, [True, False, None])
        return f"Mean({dtype.name}, {v!r}, {kd!r})", \
            lambda: gen_math_ops.mean(x, v, keep_dims=kd)
    if k == 3:
        return f"Tile({dtype.name}, {v!r})", lambda: R.Tile(input=x, multiples=v)
    if k == 4:
        return f"Pad({dtype.name}, {v!r})", lambda: R.Pad(input=x, paddings=v)
    if k == 5:
        w = _pick(rng, LISTS + [1, 2.5])
        if rng.random() < 0.5:
            return f"AddV2({v!r}, {w!r})", lambda: gen_math_ops.add_v2(v, w)
        return f"Mul({dtype.name}, {v!r})", lambda: gen_math_ops.mul(x, v)
    return f"Squeeze({dtype.name}, None)", lambda: R.Squeeze(input=x, axis=None)


KINDS = [_unary, _binary, _scalar, _operator, _attr, _attr, _other, _lists]


def cases(seed, n):
    rng = np.random.default_rng(seed)
    return [_pick(rng, KINDS)(rng) for _ in range(n)]
