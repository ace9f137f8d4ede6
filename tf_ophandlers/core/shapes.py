"""Shapes without kernels: a tensor's `Spec`, and output specs of an op from TensorFlow's
shape functions (RFC "Shape inference"). Used by ShapeInference, Lazy and Async.

`infer(op, inputs)` builds the op once in a scratch graph whose inputs have the input
specs (placeholders, or constants where the small value is known) and caches the output
specs per op signature (type, attributes, input dtypes, dims and known values: everything
the result depends on). An op TensorFlow's shape function rejects raises as it would
while building a graph, never with an invented shape.
"""
import numpy as np
import tensorflow as tf

from tf_ophandlers.core import graph_builder
from tf_ophandlers.core.cache import BoundedCache

#: Ops that read a variable (their output shape comes from the variable itself).
VARIABLE_READS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                            "VariableShape"))
_MAX_VALUE_ELEMENTS = 64  # small integer values (shapes, axes) are carried along


class Spec:
    """A tensor's spec and, if known without computation, its (small) value."""

    __slots__ = ("spec", "value", "handle")

    def __init__(self, spec, value=None, handle=None):
        self.spec = spec
        self.value = value
        self.handle = handle  # a real resource handle (variables are read by shape)

    # OpHandler's default hooks read the representation's dtype and shape.
    dtype = property(lambda self: self.spec.dtype)
    shape = property(lambda self: self.spec.shape)

    def __repr__(self):
        return "Spec(%s%s)" % (self.spec, "" if self.value is None else ", value=%s" % self.value)


def known_value(tensor):
    """The value of a small integer tensor (shapes, axes), else None."""
    if (tensor.dtype.is_integer or tensor.dtype == tf.bool) \
            and tensor.shape.num_elements() is not None \
            and tensor.shape.num_elements() <= _MAX_VALUE_ELEMENTS:
        if not tf.executing_eagerly():  # a function being replayed: constants fold
            value = tf.get_static_value(tensor)
            return None if value is None else np.asarray(value)
        return tensor.numpy()
    return None


def assumes_success(specs):
    """Whether TensorFlow's shape function, given these input specs, could only infer
    the output shape the op would have *if it succeeds*: some input's shape is not fully
    known (a Reshape of an unknown number of elements to [4] gives (4,)), or some input
    may be a shape, an axis or a size (a small integer tensor) whose value is not known
    (a Reshape of 6 elements by an unknown 1-element shape gives (6,)). Whether the op
    succeeds only the kernel knows, so Lazy and Async wait for it then instead of
    reporting a shape an eager op may never produce (eager TensorFlow raises at the op)."""
    for s in specs:
        if not s.spec.shape.is_fully_defined():
            return True
        if s.value is None and s.spec.dtype in (tf.int32, tf.int64):
            n = s.spec.shape.num_elements()
            if n is None or n <= _MAX_VALUE_ELEMENTS:
                return True
    return False


def spec_of(tensor):
    """The `Spec` of a computed tensor: its TensorSpec and, for a small integer tensor
    (a shape, an axis), its value."""
    return Spec(tf.TensorSpec(tensor.shape, tensor.dtype), known_value(tensor))


def signature_part(dtype, dims, value):
    """One input's part of an op signature (a cache key): dtype, dims (a tuple, None for
    an unknown rank) and the known small value, if any."""
    return dtype, dims, None if value is None else (value.dtype.str, value.tobytes(),
                                                    value.shape)


def _signature(op, inputs):
    parts = []
    for s in inputs:
        shape = s.spec.shape
        parts.append(signature_part(
            s.spec.dtype, None if shape.rank is None else tuple(shape.as_list()), s.value))
    return op.type, op.attrs_key(), tuple(parts)


_inferred = BoundedCache("shapes.inferred", 16384)  # signature -> output TensorSpecs


def infer(op, inputs):
    """Output specs of `op` on `inputs`, from TensorFlow's shape functions."""
    key = _signature(op, inputs)
    specs = _inferred.get(key)
    if specs is not None:
        return specs
    graph = tf.Graph()
    with graph.as_default():
        args = []
        for s in inputs:
            if s.value is not None:
                args.append(tf.constant(s.value, dtype=s.spec.dtype))
            else:
                args.append(tf.compat.v1.placeholder(s.spec.dtype, s.spec.shape))
        specs = [tf.TensorSpec(o.shape, o.dtype) for o in graph_builder.create(graph, op, args)]
    _inferred[key] = specs
    return specs


