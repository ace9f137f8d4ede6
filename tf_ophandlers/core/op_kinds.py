"""Which TensorFlow op types are elementwise: one table for every handler.

Handlers whose rules treat elementwise ops alike (vectorized_map's batching rules,
DataFormat's layout rules, Mesh's sharding rules) take their op names from here, filtering
or extending it with a comment saying why. `registry_problems()` checks each name against
TensorFlow's op registry (registered, input/output counts, type attributes), and the tests
check the broadcasting kinds against TensorFlow's shape inference, so a typo or an op
in the wrong kind fails a test.

    >>> from tf_ophandlers.core import op_kinds
    >>> "AddV2" in op_kinds.BROADCASTING_BINARY and "Exp" in op_kinds.UNARY
    True
    >>> op_kinds.registry_problems()
    []
"""

# One input, one output of the input's shape (the dtype may differ: Cast, IsNan, Real).
UNARY = frozenset("""
Abs Acos Acosh Asin Asinh Atan Atanh Cast Ceil CheckNumerics CheckNumericsV2 Conj Cos Cosh
Digamma Elu Erf Erfc Exp Expm1 Floor Identity Imag Inv IsFinite IsInf IsNan LeakyRelu
Lgamma Log Log1p LogicalNot Neg OnesLike PreventGradient Real Reciprocal Relu Relu6 Rint
Round Rsqrt Selu Sigmoid Sign Sin Sinh Snapshot Softplus Softsign Sqrt Square
StopGradient Tan Tanh ZerosLike
""".split())

# Two inputs broadcast against each other like numpy; one output of the broadcast shape.
BROADCASTING_BINARY = frozenset("""
Add AddV2 Atan2 BitwiseAnd BitwiseOr BitwiseXor Div DivNoNan Equal FloorDiv FloorMod
Greater GreaterEqual Less LessEqual LogicalAnd LogicalOr Maximum Minimum Mul MulNoNan
NotEqual Pow RealDiv SquaredDifference Sub TruncateDiv Xdivy Xlogy
""".split())

# Two inputs of one shape (no broadcasting): the gradient kernels of unary activations.
SAME_SHAPE_BINARY = frozenset("""
EluGrad InvGrad LeakyReluGrad Relu6Grad ReluGrad ReciprocalGrad RsqrtGrad SeluGrad
SigmoidGrad SoftplusGrad SoftsignGrad SqrtGrad TanhGrad
""".split())

# More than two inputs: AddN (N inputs of one shape), SelectV2 (three, broadcasting),
# ClipByValue (bounds are scalars or of the first input's shape, not numpy broadcasting).
NARY = frozenset(("AddN", "SelectV2", "ClipByValue"))

ELEMENTWISE = UNARY | BROADCASTING_BINARY | SAME_SHAPE_BINARY | NARY

# The number of inputs each kind's ops take (None: a list, `number_attr`).
_ARITY = {"UNARY": 1, "BROADCASTING_BINARY": 2, "SAME_SHAPE_BINARY": 2}
_NARY_ARITY = {"AddN": None, "SelectV2": 3, "ClipByValue": 3}


def kind_of(op_type):
    """The kind's name ("UNARY", "BROADCASTING_BINARY", "SAME_SHAPE_BINARY", "NARY") of an
    elementwise op type, or None."""
    for name in ("UNARY", "BROADCASTING_BINARY", "SAME_SHAPE_BINARY", "NARY"):
        if op_type in globals()[name]:
            return name
    return None


def registry_problems(registry=None):
    """A list of strings, one per op name of the table that TensorFlow's op registry
    contradicts (unregistered, wrong input/output count, inputs of different types)."""
    if registry is None:
        from tensorflow.python.framework import op_def_registry as registry
    problems = []
    kinds = [UNARY, BROADCASTING_BINARY, SAME_SHAPE_BINARY, NARY]
    for i, a in enumerate(kinds):
        for b in kinds[i + 1:]:
            problems += ["%s is in two kinds" % t for t in sorted(a & b)]
    for op_type in sorted(ELEMENTWISE):
        op_def = registry.get(op_type)
        if op_def is None:
            problems.append("%s is not a registered TensorFlow op" % op_type)
            continue
        kind = kind_of(op_type)
        inputs = list(op_def.input_arg)
        arity = _NARY_ARITY[op_type] if kind == "NARY" else _ARITY[kind]
        if arity is None:
            ok = len(inputs) == 1 and bool(inputs[0].number_attr)
        else:
            ok = len(inputs) == arity and not any(a.number_attr or a.type_list_attr
                                                  for a in inputs)
        if not ok:
            problems.append("%s (%s) takes inputs %s" % (
                op_type, kind, [a.name for a in inputs]))
        if len(op_def.output_arg) != 1 or op_def.output_arg[0].number_attr:
            problems.append("%s (%s) has outputs %s" % (
                op_type, kind, [a.name for a in op_def.output_arg]))
        # The value inputs share one type attribute (SelectV2's condition is bool).
        values = inputs[1:] if op_type == "SelectV2" else inputs
        if len({(a.type_attr, a.type) for a in values}) != 1:
            problems.append("%s (%s) has inputs of different types" % (op_type, kind))
    return problems
