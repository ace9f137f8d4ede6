"""`Op`: what a handler's `execute` hook is asked to run.

An Op carries the op type, its attributes (decoded on first access), the number and
dtypes of outputs TensorFlow's OpDef requires, and the device that was requested. It is
backed by the C++ boundary (`cc/boundary/dispatcher.h`): during a dispatcher callback it borrows
TensorFlow's op, and it keeps its own copy of the attributes only if a handler holds on
to it, so forwarding an op costs nothing for its attributes.
"""
import types

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import dtypes as _dtypes
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import tensor_shape
from tensorflow.python.framework import tensor_util

import tf_ophandlers._C as _C
from tf_ophandlers.core.cache import BoundedCache
from tf_ophandlers.core.state import start_runtime


def decode_attr(value):
    kind = value.WhichOneof("value")
    if kind == "list":
        lst = value.list
        for field in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
            items = getattr(lst, field)
            if items:
                return [_decode_scalar(field, x) for x in items]
        return []
    if kind is None:
        return None
    return _decode_scalar(kind, getattr(value, kind))


def _decode_scalar(kind, x):
    if kind == "type":
        return _dtypes.as_dtype(x)
    if kind == "shape":
        return tensor_shape.TensorShape(x)
    if kind == "tensor":
        return tensor_util.MakeNdarray(x)
    if kind == "func":
        return x.name
    return x


def _encode(attr_type, value):
    """Encodes a Python value as an AttrValue for an OpDef attr of `attr_type`."""
    out = attr_value_pb2.AttrValue()
    if isinstance(value, attr_value_pb2.AttrValue):
        return value
    if attr_type.startswith("list("):
        inner = attr_type[5:-1]
        out.list.SetInParent()  # an empty list is still a list
        for v in value:
            _encode_into(out.list, inner, v, repeated=True)
    else:
        _encode_into(out, attr_type, value, repeated=False)
    return out


def _encode_into(msg, attr_type, v, repeated):
    def put(field, x):
        if repeated:
            getattr(msg, field).append(x)
        else:
            setattr(msg, field, x)

    if attr_type == "type":
        put("type", _dtypes.as_dtype(v).as_datatype_enum)
    elif attr_type == "int":
        put("i", int(v))
    elif attr_type == "float":
        put("f", float(v))
    elif attr_type == "bool":
        put("b", bool(v))
    elif attr_type == "string":
        put("s", v.encode() if isinstance(v, str) else bytes(v))
    elif attr_type == "shape":
        proto = tensor_shape.as_shape(v).as_proto()
        if repeated:
            msg.shape.add().CopyFrom(proto)
        else:
            msg.shape.CopyFrom(proto)
    elif attr_type == "tensor":
        proto = tensor_util.make_tensor_proto(v)
        if repeated:
            msg.tensor.add().CopyFrom(proto)
        else:
            msg.tensor.CopyFrom(proto)
    elif attr_type == "func":
        if repeated:
            msg.func.add().name = v
        else:
            msg.func.name = v
    else:
        raise TypeError("tf_ophandlers.Op: cannot encode attr of type %r" % attr_type)


# function name -> {node name: frames} (TensorFlow's GraphDebugInfo); a function name
# identifies one traced function for the life of the context.
_traces = BoundedCache("op.function_traces", 64)


def _function_traces(function_name):
    """The stack traces TensorFlow recorded for the nodes of a function when it was traced
    (the ones its runtime errors show), by node name."""
    traces = _traces.get(function_name)
    if traces is None:
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        from tensorflow.python.util import tf_stack  # pylint: disable=import-outside-toplevel
        try:
            info = context.context().get_graph_debug_info(function_name)
            traces = dict(tf_stack.LoadTracesFromDebugInfo(info))
        except Exception:  # pylint: disable=broad-except
            traces = {}  # not registered in the eager context, no traces
        _traces[function_name] = traces
    return traces


def _canonical(raw):
    """`raw` (a serialized NameAttrList: the op name and one map entry per attribute) with
    its fields in sorted byte order: equal for equal attributes.

    TensorFlow serializes an op's attribute map in the order of its hash table, which
    differs between ops with the same attributes (the same Conv2D call gives dozens of
    byte strings), so caches keyed by the raw bytes alone miss often. Sorting the
    length-delimited top-level fields is cheaper than parsing and re-serializing
    deterministically; an unexpected encoding takes that slower way. `_attrs_proto()`
    already returns the sorted bytes (cc/boundary/op.cc `SortTopLevelFields`, the same order), so
    this is the identity on its result and only the fallback for other encodings costs.
    """
    fields = []
    i, n = 0, len(raw)
    try:
        while i < n:
            start = i
            if raw[i] & 7 != 2 or raw[i] >= 0x80:  # one-byte tag, length-delimited
                raise ValueError
            i += 1
            length = shift = 0
            while True:
                b = raw[i]
                i += 1
                length |= (b & 0x7F) << shift
                if b < 0x80:
                    break
                shift += 7
            i += length
            if i > n:
                raise ValueError
            fields.append(raw[start:i])
    except (ValueError, IndexError):
        return attr_value_pb2.NameAttrList.FromString(raw).SerializeToString(deterministic=True)
    fields.sort()
    return b"".join(fields)


# Keyed by TensorFlow's serialized attributes (everything the value depends on).
_decoded = BoundedCache("op.decoded_attrs", 4096)  # serialized (raw or canonical) -> decoded
_attr_keys = BoundedCache("op.attrs_keys", 4096)  # serialized attrs -> canonical bytes
# id of a shared decoded attrs mapping -> (that mapping, attr tuple); the identity check
# on a hit makes a reused id harmless.
_attr_tuples = BoundedCache("op.attr_tuples", 4096)
_cached_ops = BoundedCache("op.cached_ops", 4096)  # (type, attrs) -> Op


def _raw_attr(value):
    """An attr value in the form TensorFlow's eager tape stores it (backprop.make_attr)."""
    if isinstance(value, _dtypes.DType):
        return value.as_datatype_enum
    if isinstance(value, tensor_shape.TensorShape):
        return None if value.rank is None else value.as_list()
    if isinstance(value, list):
        return [_raw_attr(v) for v in value]
    return value


#: The attribute of a graph node naming the gradient function that replaces its type's
#: (TensorFlow's ``ops.get_gradient_function`` reads it).
GRADIENT_OP_TYPE_ATTR = "_gradient_op_type"


def node_attrs(node_def):
    """A graph node's attributes as a copy of the node keeps them: its OpDef's, without
    TensorFlow's internal ("_") ones, except the gradient override, which decides the
    node's gradient (dropping it silently gives the type's gradient instead of a
    `tf.custom_gradient`'s)."""
    return {k: v for k, v in node_def.attr.items()
            if not k.startswith("_") or k == GRADIENT_OP_TYPE_ATTR}


class Op(_C.OpBase):
    """One operation to execute: `type`, `attrs`, `num_outputs`, `output_dtypes`.

    Handlers receive Ops in `execute(op, inputs)` and forward them unchanged
    (`self.next.execute(op, inputs)`), or build new ones:

    >>> op = oh.Op.create("AddV2", T=tf.float32)
    >>> oh.PHYSICAL.execute(op, [tf.constant(1.), tf.constant(2.)])
    [<tf.Tensor: shape=(), dtype=float32, numpy=3.0>]
    """

    # Where an op of a replayed function comes from (set by core/functions for the nodes
    # of a function body; None for eager ops): the graph node's name and its function's.
    node_name = None
    function_name = None
    #: The gradient a graph node asked for in place of its type's (the node's
    #: ``_gradient_op_type``, set by `tf.custom_gradient` and `gradient_override_map`),
    #: or None. Set for the nodes of a replayed function (core/functions), kept when the
    #: op is emitted into the replayed graph, and looked up by the tapes (`gradient_type`).
    gradient_op_type = None

    @property
    def gradient_type(self):
        """The name this op's gradient function is registered under: its
        `gradient_op_type` if the node overrode it, else its type."""
        return self.gradient_op_type or self.type

    @property
    def traceback(self):
        """The Python frames (`FrameSummary`s, outermost first) that created the node when
        its function was traced, or None (eager ops; functions without stack traces)."""
        if self.node_name is None or self.function_name is None:
            return None
        return _function_traces(self.function_name).get(self.node_name)

    @classmethod
    def create(cls, op_type, **attrs):
        """Builds an Op from its type and attributes given as Python values."""
        start_runtime()  # Ops are objects of the C++ boundary
        op_def = op_def_registry.get(op_type)
        types = {a.name: a.type for a in op_def.attr} if op_def is not None else {}
        protos = {}
        for name, value in attrs.items():
            if name not in types and not isinstance(value, attr_value_pb2.AttrValue):
                raise TypeError("tf_ophandlers.Op.create: op %s has no attr %r" % (op_type, name))
            protos[name] = _encode(types.get(name, ""), value).SerializeToString()
        return _C.new_op(op_type, protos)

    @classmethod
    def function_call(cls, function_name, num_outputs, **attrs):
        """An op calling the function `function_name` registered in the context, with
        `num_outputs` outputs (a function has no OpDef to count them) and attributes
        given as `AttrValue` protos (a call's executor options)."""
        start_runtime()
        return _C.new_op(function_name, {name: value.SerializeToString()
                                         for name, value in attrs.items()}, num_outputs)

    @classmethod
    def cached(cls, op_type, **attrs):
        """`Op.create` memoized per type and attributes (hashable values).

        Ops are read-only templates, so handlers reuse the few they build on a hot path
        (an Identity per dtype, the CopyOn a tape records) instead of encoding them again.
        """
        key = (op_type, tuple(sorted(attrs.items())))
        op = _cached_ops.get(key)
        if op is None:
            op = _cached_ops[key] = cls.create(op_type, **attrs)
        return op

    @property
    def attrs(self):
        """The op's attributes, read-only, as Python values (dtypes as tf.DType)."""
        cached = self.__dict__.get("_attrs")
        if cached is None:
            # Decoded attributes are shared between ops with the same attributes (a
            # training loop runs the same few ops over and over): parsing is the cost.
            raw = self._attrs_proto()
            cached = _decoded.get(raw)
            if cached is None:
                # The same attributes come in many byte orders (see _canonical): decode
                # once per content.
                key = _canonical(raw)
                cached = _decoded.get(key)
                if cached is None:
                    proto = attr_value_pb2.NameAttrList.FromString(raw)
                    cached = types.MappingProxyType(
                        {k: decode_attr(v) for k, v in proto.attr.items()})
                    _decoded[key] = cached
                _decoded[raw] = cached
            self.__dict__["_attrs"] = cached
        return cached

    def attr_protos(self):
        """The attributes as TensorFlow `AttrValue` protos (to build graph nodes)."""
        return dict(attr_value_pb2.NameAttrList.FromString(self._attrs_proto()).attr)

    def attrs_key(self):
        """Bytes identifying the attributes, for caches keyed by op signature.

        Serialized deterministically: TensorFlow's own serialization of the attribute
        map does not keep one order.
        """
        raw = self._attrs_proto()
        key = _attr_keys.get(raw)
        if key is None:
            # Memoized by TensorFlow's bytes: a loop repeats the same few attribute sets
            # (each in several byte orders, see _canonical).
            key = _attr_keys[raw] = _canonical(raw)
        return key

    def attr_tuple(self):
        """The attributes as TensorFlow's eager tape stores them, ``(name, value, ...)``
        (what `TFE_Py_RecordGradient` and gradient functions' `op.get_attr` expect)."""
        attrs = self.attrs
        hit = _attr_tuples.get(id(attrs))
        if hit is not None and hit[0] is attrs:
            return hit[1]
        flat = []
        for name, value in attrs.items():
            flat.append(name)
            flat.append(_raw_attr(value))
        flat = tuple(flat)
        _attr_tuples[id(attrs)] = (attrs, flat)
        return flat

    @property
    def output_dtypes(self):
        """Output dtypes as `tf.DType`s per the OpDef, or None (function calls)."""
        enums = self.output_dtype_enums
        return None if enums is None else [_dtypes.as_dtype(e) for e in enums]

    def replace(self, **attrs):
        """A new Op of the same type with some attributes replaced."""
        merged = dict(self.attrs)
        merged.update(attrs)
        merged = {k: v for k, v in merged.items() if v is not None}
        return Op.create(self.type, **merged)

    def __repr__(self):
        try:
            attrs = ", ".join("%s=%s" % (k, getattr(v, "name", v))
                              for k, v in sorted(self.attrs.items()))
        except Exception:  # pylint: disable=broad-except
            attrs = "?"
        return "Op(%s%s)" % (self.type, ", " + attrs if attrs else "")


class OptimizedCallOp:
    """The op calling the function `function_name` registered in the context (with
    `num_outputs` outputs) as TensorFlow's own call path calls a function: with the
    context's function options (`executor_type`, `config_proto`) as attributes. Without
    them the runtime instantiates the function without grappler (no Conv2D+BiasAdd
    fusion, no pruning). `op()` rebuilds the op only when the options change: the op is
    the runtime's kernel cache key, so a new op per call would instantiate again."""

    __slots__ = ("function_name", "num_outputs", "_built")

    def __init__(self, function_name, num_outputs):
        self.function_name = function_name
        self.num_outputs = num_outputs
        self._built = None  # ((executor_type, config_proto), op), replaced as one

    def op(self):
        """The call op for the context's current function options."""
        options = _context.context().function_call_options.as_attrs()
        key = (options["executor_type"], options["config_proto"])
        built = self._built
        if built is None or built[0] != key:
            built = self._built = (key, Op.function_call(
                self.function_name, self.num_outputs,
                **{name: attr_value_pb2.AttrValue(
                    s=value if isinstance(value, bytes) else value.encode())
                   for name, value in options.items()}))
        return built[1]
