"""`ShapeInference`: run a program on shapes and dtypes only (RFC "Shape inference").

The representation of a tensor is a `Spec`: a `tf.TensorSpec` and, when it is known
without running a kernel (a constant, a shape), its value. An op placed on the handler
never runs: its output specs come from TensorFlow's own shape functions, by building the
op once in a scratch graph whose inputs have the input specs (placeholders, or constants
where the value is known). Results are cached per op signature, so a repeated op costs a
dictionary lookup.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> oh.eval_shape(lambda x: tf.matmul(x, tf.ones([3, 5])), tf.TensorSpec([None, 3]))
TensorSpec(shape=(None, 5), dtype=tf.float32, name=None)
"""
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import composite_tensor as _composite_tensor
from tensorflow.python.framework import ops as _ops
from tensorflow.python.util import nest

from tf_ophandlers.extend import (
    errors, next_stack, OpHandler, PHYSICAL, representation_of, scope as _scope, shapes,
    Spec, spec_of)

_RESOURCE = tf.resource
_VARIABLE_READS = shapes.VARIABLE_READS
_STATEFUL = frozenset(("RandomUniformInt", "Multinomial", "RandomShuffle"))


class ShapeInference(OpHandler):
    """Computes the shapes and dtypes of a program's tensors without running kernels.

    Use it through `oh.eval_shape(fn, *specs)`.

    Examples:
        >>> spec = oh.eval_shape(lambda x: tf.concat([x, x], axis=0),
        ...                      tf.TensorSpec([None, 3], tf.float32))
        >>> spec.shape.as_list()
        [None, 3]
    """

    TYPE_NAME = "SHAPE_INFERENCE"

    def debug_string(self):
        return "ShapeInference()"

    def static_value(self, value):
        return value.value

    def refine_shape(self, value, shape):
        # `t.set_shape(...)` in the program (tf.tensordot, Keras): as in a traced
        # function, the spec becomes the merged shape, which later ops' shape functions
        # see (Spec is this tensor's own: other tensors are not affected).
        value.spec = tf.TensorSpec(shape, value.spec.dtype)

    def tensor_debug_string(self, value):
        return "ShapeInference: %s" % (value,)

    def copy_on(self, tensor):
        found, value = representation_of(self, tensor)
        if found:
            return value
        tensor = next_stack().copy_on(tensor)  # a real tensor: its spec
        if tensor.dtype == _RESOURCE:
            return Spec(tf.TensorSpec(tensor.shape, tensor.dtype), handle=tensor)
        return spec_of(tensor)

    def copy_off(self, value, device):
        if value.value is not None:
            return tf.constant(value.value, dtype=value.spec.dtype)
        raise errors.CopyOffError(
            "oh.ShapeInference: a tensor of spec %s has no value (only its shape and dtype "
            "are computed); avoid .numpy() and Python decisions on values inside eval_shape"
            % (value.spec,))

    # -- functions (core/functions): a tf.function called under eval_shape is replayed
    # through this handler; a spec crosses the boundary whole in its summary (no tensor),
    # a variable as its real handle.

    def function_input(self, value):
        spec = value.spec
        shape = None if spec.shape.rank is None else tuple(spec.shape.as_list())
        if value.handle is not None:
            return ("handle", spec.dtype, shape), [value.handle]
        known = None if value.value is None else (
            value.value.dtype.str, value.value.tobytes(), value.value.shape)
        return (spec.dtype, shape, known), []

    def function_output(self, summary, tensors):
        if summary[0] == "handle":
            return Spec(tf.TensorSpec(summary[2], summary[1]), handle=tensors[0])
        dtype, shape, known = summary
        value = None if known is None else np.frombuffer(
            known[1], dtype=np.dtype(known[0])).reshape(known[2])
        return Spec(tf.TensorSpec(shape, dtype), value)

    def function_join(self, summaries):
        # Branches and loop iterations: the most specific spec all of them satisfy; a
        # value only if they all know the same one (a loop counter does not).
        first = summaries[0]
        if first[0] == "handle" or any(s[0] != first[0] for s in summaries):
            return super().function_join(summaries)
        shape = tf.TensorShape(first[1])
        for other in summaries[1:]:
            shape = shape.most_specific_compatible_shape(tf.TensorShape(other[1]))
        known = first[2] if all(s[2] == first[2] for s in summaries) else None
        return (first[0], None if shape.rank is None else tuple(shape.as_list()), known)

    def function_coerce(self, value, summary):
        return self.function_output(summary, [])

    def function_cache_key(self):
        return "ShapeInference"

    changes_computation = False  # infers shapes of the ops as they are

    def execute(self, op, inputs):
        below = next_stack()
        if any(s.handle is not None for s in inputs):
            # Reading a variable (its handle is real): the read aliases the buffer, and
            # its result gives the shape. No computation runs.
            if op.type not in _VARIABLE_READS:
                raise NotImplementedError(
                    "oh.ShapeInference: op %s on a variable; only reads are supported "
                    "inside eval_shape" % op.type)
            args = [s.handle if s.handle is not None else self.copy_off(s, "") for s in inputs]
            return [Spec(tf.TensorSpec(o.shape, o.dtype)) for o in below.execute(op, args)]
        if (inputs and all(s.value is not None for s in inputs) and op.type not in _STATEFUL
                and all(d.is_integer or d == tf.bool for d in op.output_dtypes)):
            # Shape arithmetic on known small integers (tf.shape(x)[1:], concat of dims):
            # folded, as graph construction's constant folding does, so shapes stay known
            # (eagerly, also while a function is replayed).
            if tf.executing_eagerly():
                outs = below.execute(op, [tf.constant(s.value, dtype=s.spec.dtype)
                                               for s in inputs])
            else:
                with _ops.init_scope():
                    outs = PHYSICAL.execute(op, [tf.constant(s.value, dtype=s.spec.dtype)
                                                 for s in inputs])
            return [spec_of(o) for o in outs]
        if op.type == "Shape" and inputs[0].spec.shape.is_fully_defined():
            dims = inputs[0].spec.shape.as_list()
            dtype = op.attrs["out_type"]
            return [Spec(tf.TensorSpec([len(dims)], dtype), np.array(dims, dtype.as_numpy_dtype))]
        try:
            specs = shapes.infer(op, inputs)
        except (ValueError, TypeError, tf.errors.OpError) as e:
            raise ValueError("oh.ShapeInference: op %s rejects inputs %s: %s"
                             % (op.type, [s.spec for s in inputs], e)) from e
        out = []
        for s in specs:
            if s.dtype == _RESOURCE:
                raise NotImplementedError(
                    "oh.ShapeInference: op %s creates a resource (a variable); create "
                    "variables outside eval_shape" % op.type)
            out.append(Spec(s))
        return out


def _composite_of(stack, spec):
    """A value of the composite `spec` (tf.RaggedTensorSpec, tf.SparseTensorSpec, ...)
    whose components are tensors of the handler, as get_concrete_function builds one from
    placeholders."""
    try:
        component_specs = spec._component_specs  # pylint: disable=protected-access
    except (AttributeError, NotImplementedError, ValueError) as e:
        raise TypeError("oh.eval_shape: cannot take an argument of spec %s (%s: %s); pass "
                        "tf.TensorSpec, tf.RaggedTensorSpec or tf.SparseTensorSpec"
                        % (spec, type(e).__name__, e)) from None
    known = {}
    if isinstance(spec, tf.SparseTensorSpec):
        if not spec.shape.is_fully_defined():
            # eval_shape runs the program eagerly, and an eager SparseTensor's dense shape
            # is a value (tf.SparseTensor refuses an unknown one; TensorFlow's sparse ops
            # read it).
            raise ValueError(
                "oh.eval_shape: a tf.SparseTensorSpec needs a fully defined shape (eval_shape "
                "runs the program eagerly, where a SparseTensor's dense shape is known), got "
                "%s; give every dimension, or trace with tf.function(fn)."
                "get_concrete_function(spec)" % (spec.shape,))
        # The dense shape is given by the spec: its value is known (a static shape).
        known[2] = np.array(spec.shape.as_list(), np.int64)
    flat = nest.flatten(component_specs)
    if not all(isinstance(c, tf.TensorSpec) for c in flat):
        raise TypeError("oh.eval_shape: cannot take an argument of spec %s (its components "
                        "are %s); pass tf.TensorSpec, tf.RaggedTensorSpec or "
                        "tf.SparseTensorSpec" % (spec, flat))
    tensors = [stack.wrap(Spec(tf.TensorSpec(c.shape, c.dtype), known.get(i)))
               for i, c in enumerate(flat)]
    return spec._from_components(nest.pack_sequence_as(component_specs, tensors))  # pylint: disable=protected-access


def eval_shape(fn, *specs, **kwargs):
    """The `tf.TensorSpec`s of `fn`'s outputs for inputs of the given specs.

    `specs` (and keyword arguments) are `tf.TensorSpec`s, `tf.RaggedTensorSpec`s,
    `tf.SparseTensorSpec`s or nested structures of them (a ragged or sparse output is
    returned as its spec); other arguments are passed as they are. No kernel runs: each op's output spec comes
    from TensorFlow's shape function. Works for Keras models whose variables exist
    (call the model once, or build it, before).

    Examples:
        >>> oh.eval_shape(lambda x: tf.reduce_sum(x, axis=1), tf.TensorSpec([4, 5], tf.int32))
        TensorSpec(shape=(4,), dtype=tf.int32, name=None)
    """
    handler = ShapeInference()
    with _scope.handler(handler) as stack:
        def enter(x):
            if isinstance(x, tf.TensorSpec):
                return stack.wrap(Spec(tf.TensorSpec(x.shape, x.dtype)))
            if isinstance(x, tf.TypeSpec):
                return _composite_of(stack, x)
            return x
        args = nest.map_structure(enter, specs)
        kw = nest.map_structure(enter, kwargs)
        outputs = fn(*args, **kw)

    def leave(t):
        if isinstance(t, _composite_tensor.CompositeTensor) and not isinstance(
                t, tf.Variable):
            # A RaggedTensor or SparseTensor of the handler's tensors: its spec comes
            # from its components' specs (and a sparse tensor's known dense shape).
            return t._type_spec  # pylint: disable=protected-access
        if isinstance(t, (tf.Tensor, tf.Variable)) or hasattr(t, "__tf_tensor__"):
            t = tf.convert_to_tensor(t) if not isinstance(t, tf.Tensor) else t
            found, value = representation_of(handler, t)
            if found:
                return value.spec
            return tf.TensorSpec(t.shape, t.dtype)
        return t

    return nest.map_structure(leave, outputs)

