"""core/op_kinds.py: the one table of elementwise op types, checked against TensorFlow's
op registry and shape inference, and used by every handler with elementwise rules
(vectorized_map, DataFormat, Mesh), each checked against TensorFlow on random inputs."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

import tf_ophandlers as oh
from tf_ophandlers.core import op_kinds
from tf_ophandlers.handlers.vectorized_map import batching_rules
from tf_ophandlers.handlers.data_format import rules as data_format_rules
from tf_ophandlers.handlers.mesh import rules as mesh_rules
from tf_ophandlers.handlers.data_format.rules import Permuted

# Ops of the table a handler leaves to its fallback, and why (the handler files say so too).
NOT_IN = {
    "vectorized_map": {"ClipByValue"},  # bounds must be scalars or t's shape: left to pfor
    "DataFormat": set(),
    "Mesh": set(),
}
RULES = {"vectorized_map": batching_rules.RULES, "DataFormat": data_format_rules.RULES,
         "Mesh": mesh_rules.RULES}


def test_table_agrees_with_the_op_registry():
    assert op_kinds.registry_problems() == []
    assert op_kinds.ELEMENTWISE == (op_kinds.UNARY | op_kinds.BROADCASTING_BINARY
                                    | op_kinds.SAME_SHAPE_BINARY | op_kinds.NARY)
    assert op_kinds.kind_of("Tanh") == "UNARY" and op_kinds.kind_of("MatMul") is None


def test_registry_check_catches_typos_and_wrong_kinds():
    class Registry:  # the real registry, with one typo'd name and one op in a wrong kind
        @staticmethod
        def get(name):
            return None if name == "Tanh" else op_def_registry.get(
                "MatMul" if name == "Exp" else name)

    problems = op_kinds.registry_problems(Registry)
    assert "Tanh is not a registered TensorFlow op" in problems
    assert any(p.startswith("Exp (UNARY) takes inputs") for p in problems), problems


def _placeholder_shapes(op_type, shapes):
    """The output shape TensorFlow's shape inference gives `op_type` on inputs of
    `shapes` (float32, or what the op's inputs take)."""
    op_def = op_def_registry.get(op_type)
    g = tf.Graph()
    with g.as_default():
        ins = []
        for arg, shape in zip(op_def.input_arg, shapes):
            dtype = tf.bool if (arg.type == tf.bool.as_datatype_enum
                                or op_type.startswith("Logical")) else (
                tf.int32 if op_type.startswith("Bitwise") or op_type == "TruncateDiv"
                else tf.float32)
            ins.append(tf.compat.v1.placeholder(dtype, shape))
        attrs = {}
        if op_type == "Cast":
            attrs["DstT"] = tf.float64
        if op_type.startswith("CheckNumerics"):
            attrs["message"] = "m"
        kwargs = dict(zip([a.name for a in op_def.input_arg], ins))
        if op_type == "AddN":
            kwargs = {"inputs": ins}
        out = getattr(tf.raw_ops, op_type)(**kwargs, **attrs)
        return out.shape.as_list()


@pytest.mark.parametrize("op_type", sorted(op_kinds.BROADCASTING_BINARY | {"SelectV2"}))
def test_broadcasting_kind_broadcasts_in_tensorflow(op_type):
    n = 3 if op_type == "SelectV2" else 2
    shapes = [[2, 1], [1, 3], [3]][:n]
    assert _placeholder_shapes(op_type, shapes) == [2, 3]


@pytest.mark.parametrize("op_type", sorted(op_kinds.UNARY | op_kinds.SAME_SHAPE_BINARY))
def test_other_kinds_keep_the_shape(op_type):
    if op_type in ("Real", "Imag", "Conj"):
        pytest.skip("complex inputs: checked on values below")
    n = len(op_def_registry.get(op_type).input_arg)
    assert _placeholder_shapes(op_type, [[2, 3]] * n) == [2, 3]


@pytest.mark.parametrize("handler", sorted(RULES))
def test_every_elementwise_op_has_the_handlers_rule(handler):
    missing = op_kinds.ELEMENTWISE - NOT_IN[handler] - set(RULES[handler])
    assert not missing, (handler, sorted(missing))
    rule = RULES[handler]["Tanh"]
    odd = {t for t in op_kinds.ELEMENTWISE - NOT_IN[handler]
           if RULES[handler][t] is not rule and t not in op_kinds.SAME_SHAPE_BINARY | {"AddN"}}
    assert not odd, (handler, sorted(odd))


# -- each handler's elementwise rules against TensorFlow, on a sample of the table ------

SAMPLE = ["Exp", "Acosh", "Rint", "Inv", "Snapshot", "Cast", "IsNan", "Real", "LogicalNot",
          "CheckNumerics", "AddV2", "Pow", "TruncateDiv", "BitwiseXor", "LogicalOr", "Less",
          "SoftsignGrad", "InvGrad", "ReluGrad", "AddN", "SelectV2", "ClipByValue"]


def _dtype(op_type):
    if op_type.startswith("Bitwise") or op_type in ("TruncateDiv",):
        return np.int32
    if op_type.startswith("Logical"):
        return np.bool_
    if op_type in ("Real", "Imag", "Conj"):
        return np.complex64
    return np.float32


def _value(rng, op_type, shape):
    dtype = _dtype(op_type)
    if dtype is np.int32:
        return rng.integers(1, 50, size=shape).astype(dtype)
    if dtype is np.bool_:
        return rng.random(shape) < 0.5
    v = rng.uniform(0.2, 0.8, size=shape) + (1.0 if op_type == "Acosh" else 0.0)
    if dtype is np.complex64:
        v = v + 1j * rng.uniform(-1, 1, size=shape)
    return v.astype(dtype)


def _apply(op_type, args):
    """tf.raw_ops.`op_type` on `args` (the first is the tensor the handler holds)."""
    f = getattr(tf.raw_ops, op_type)
    if op_type == "AddN":
        return f(inputs=list(args))
    if op_type == "SelectV2":
        return f(condition=args[1] > 0.5, t=args[0], e=args[1])
    if op_type == "ClipByValue":
        return f(t=args[0], clip_value_min=0.3, clip_value_max=0.6)
    names = [a.name for a in op_def_registry.get(op_type).input_arg]
    attrs = {"Cast": {"DstT": tf.float64}, "CheckNumerics": {"message": "m"}}.get(op_type, {})
    return f(**dict(zip(names, args)), **attrs)


def _operands(rng, op_type, shape):
    """(second operands' shapes): broadcasting ops get a smaller one, the others the
    first input's shape (AddN and SelectV2 too; ClipByValue ignores it: scalar bounds)."""
    kind = op_kinds.kind_of(op_type)
    if kind == "UNARY":
        return []
    if kind == "BROADCASTING_BINARY":
        return [_value(rng, op_type, shape[-1:])]
    return [_value(rng, op_type, shape)]


def _close(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op_type", [t for t in SAMPLE if t not in NOT_IN["vectorized_map"]])
def test_vectorized_map_rules_match_tf_vectorized_map(op_type):
    rng = np.random.default_rng(len(op_type))
    x = tf.constant(_value(rng, op_type, (3, 2, 4)))
    others = [tf.constant(v) for v in _operands(rng, op_type, (2, 4))]

    def fn(e):
        return _apply(op_type, [e] + others)

    _close(oh.vectorized_map(fn, x), tf.vectorized_map(fn, x))


@pytest.mark.parametrize("op_type", [t for t in SAMPLE if t not in NOT_IN["DataFormat"]])
def test_data_format_rules_match_channels_last(op_type):
    rng = np.random.default_rng(len(op_type))
    nhwc = tf.constant(_value(rng, op_type, (2, 5, 6, 4)))
    others = [tf.constant(v) for v in _operands(rng, op_type, (2, 4, 5, 6))]
    ref = _apply(op_type, [tf.transpose(nhwc, [0, 3, 1, 2])] + others)
    with oh.DataFormat() as df:
        y = _apply(op_type, [tf.transpose(nhwc, [0, 3, 1, 2])] + others)
        found, rep = oh.representation_of(df, y)
        assert found and type(rep) is Permuted, rep  # stayed channels-last: the rule ran
    _close(y, ref)


@pytest.mark.parametrize("op_type", [t for t in SAMPLE if t not in NOT_IN["Mesh"]])
def test_mesh_rules_match_unsharded(op_type):
    rng = np.random.default_rng(len(op_type))
    x = _value(rng, op_type, (4, 6))
    others = _operands(rng, op_type, (4, 6))
    ref = _apply(op_type, [tf.constant(x)] + [tf.constant(v) for v in others])
    mesh = oh.Mesh({"batch": 2, "model": 2}, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with mesh:
        s = mesh.shard(tf.constant(x), ("batch", "model"))
        args = [s] + [mesh.shard(tf.constant(v), (None,) * (v.ndim - 1) + ("model",))
                      for v in others]
        y = _apply(op_type, args)
        assert mesh.layout_of(y) == ("batch", "model")  # sharded: the rule ran
    _close(y, ref)
