"""Which inputs and outputs of an op its registered gradient function reads.

TensorFlow's eager tape keeps only the tensors an op's gradient function reads; the
others reach the gradient function as None (`OpGradientUnusedInputIndices` /
`OpGradientUnusedOutputIndices`, tables generated at TensorFlow's build time from the
gradient registry by tensorflow/python/eager/gradient_input_output_exclusions.py; the
wheel ships neither the tables to Python nor the generator). oh.GradientTape does the
same, with the same rule computed from the installed TensorFlow's gradient functions: at
the first record of an op type, the source of its gradient function is parsed (once,
cached) and every `op.inputs[i]` / `op.outputs[i]` it (or a function it passes `op` to)
mentions with a literal index counts as read. Anything else (`op.inputs` used whole, a
computed index, `op` aliased or passed somewhere not resolvable, a function whose source
is not available, a gradient not from TensorFlow itself) keeps every tensor: the
analysis errs towards keeping, never towards dropping a tensor that is read.

>>> from tf_ophandlers.handlers.gradient_tape.exclusions import used_indices
>>> used_indices("Relu")
(frozenset(), frozenset({0}))
>>> used_indices("BiasAdd")
(frozenset(), frozenset())
"""
import ast
import inspect
import textwrap
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import BoundedCache, tensor_key

_key = tensor_key
_EagerTensor = _ops.EagerTensor
_WeakRef = weakref.ref
_RESOURCE = tf.resource.as_datatype_enum
_VARIANT = tf.variant.as_datatype_enum

ALL = None  # "every index is read"

# Ops TensorFlow's generator leaves out (their gradients are functions of functions).
_KEEP_WHOLE = frozenset(("If", "StatelessIf", "While", "StatelessWhile", "Case",
                         "PartitionedCall", "StatefulPartitionedCall"))

_cache = BoundedCache("gradient_tape.used_indices", 4096)


def used_indices(op_type):
    """``(inputs, outputs)``: the indices the gradient of `op_type` reads, each a
    frozenset, or ALL (None) when every one must be kept. A non-differentiable op
    (tf.no_gradient) reads none."""
    found = _cache.get(op_type, False)
    if found is False:
        found = _cache[op_type] = _analyze_op(op_type)
    return found


def _analyze_op(op_type):
    if op_type in _KEEP_WHOLE:
        return ALL, ALL
    try:
        fn = _ops._gradient_registry.lookup(op_type)  # pylint: disable=protected-access
    except LookupError:
        return ALL, ALL
    if fn is None:
        return frozenset(), frozenset()  # NotDifferentiable: its gradient reads nothing
    if not (getattr(fn, "__module__", None) or "").startswith("tensorflow."):
        return ALL, ALL  # ours or the user's: TensorFlow's tables keep those whole too
    return _reads(fn, "inputs", 0), _reads(fn, "outputs", 0)


def _reads(fn, attr, depth):
    """The literal indices of `op.<attr>` that `fn(op, ...)` reads, or ALL."""
    if depth > 4 or not inspect.isfunction(fn):
        return ALL
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ALL
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return ALL
    definition = tree.body[0]
    params = definition.args.posonlyargs + definition.args.args
    if not params:
        return ALL
    op_name = params[0].arg
    parents = {}
    for node in ast.walk(definition):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    used = set()
    for node in ast.walk(definition):
        if not (isinstance(node, ast.Name) and node.id == op_name):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            if parent.attr in ("inputs", "outputs"):
                if parent.attr != attr:
                    continue
                index = _literal_index(parents.get(parent), parent)
                if index is None:
                    return ALL
                used.add(index)
            elif parent.attr in ("_inputs", "_outputs", "__dict__"):
                return ALL
            continue  # op.type, op.get_attr(...), op.skip_input_indices, ...
        if isinstance(parent, ast.Call) and parent.args and parent.args[0] is node:
            callee = _resolve(parent.func, fn.__globals__)
            sub = _reads(callee, attr, depth + 1)
            if sub is ALL:
                return ALL
            used |= sub
            continue
        return ALL  # aliased, returned, passed elsewhere: cannot tell
    return frozenset(used)


def _literal_index(subscript, value):
    if not isinstance(subscript, ast.Subscript) or subscript.value is not value:
        return None
    index = subscript.slice
    if (isinstance(index, ast.Constant) and type(index.value) is int  # pylint: disable=unidiomatic-typecheck
            and index.value >= 0 and isinstance(subscript.ctx, ast.Load)):
        return index.value
    return None


def _resolve(expr, namespace):
    """The object a call's function expression names in `namespace`, or None."""
    if isinstance(expr, ast.Name):
        return namespace.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, namespace)
        return None if base is None else getattr(base, expr.attr, None)
    return None


# -- what a tape keeps (oh.GradientTape; contract in cc/handlers/gradient_tape/tape_record.h) -------------------

def track_ref(value):
    """What `_tracked` keeps of a recorded output: a weak reference (the tape keeps a
    value only when a record's gradient reads it; the caller's tensor holds the value
    the tape got), or the value itself for a resource handle (a transient one reaches
    the caller as it is) or an object without weak references."""
    if isinstance(value, _EagerTensor) and value._datatype_enum() == _RESOURCE:  # pylint: disable=protected-access
        return value
    try:
        return _WeakRef(value)
    except TypeError:
        return value


def tracked_entry(tracked, tensor):
    """``(canonical tensor, id)`` of `tensor` in a tape's `_tracked` map, or None: also
    None when the tensor the entry was made for is gone (its key may be a new tensor's)."""
    entry = tracked.get(_key(tensor))
    if entry is None:
        return None
    value = entry[0]
    if type(value) is _WeakRef:  # pylint: disable=unidiomatic-typecheck
        value = value()
        if value is None:
            return None
    return value, entry[1]


def drop_unread(op_type, inputs, outputs):
    """`inputs`, `outputs` and output specs with what the gradient of `op_type` does not
    read dropped (None), as TensorFlow's tape does (cc/handlers/gradient_tape/tape_record.h)."""
    used_in, used_out = used_indices(op_type)
    if used_in is not ALL:
        inputs = [x if i in used_in else None for i, x in enumerate(inputs)]
    specs = None
    if used_out is not ALL:
        kept = []
        for j, o in enumerate(outputs):
            if (j in used_out or not isinstance(o, _EagerTensor)
                    or o._datatype_enum() in (_RESOURCE, _VARIANT)):  # pylint: disable=protected-access
                kept.append(o)
                continue
            kept.append(None)
            if len(outputs) > 1:
                specs = specs or [None] * len(outputs)
                specs[j] = (o._datatype_enum(), tuple(o.shape.as_list()))  # pylint: disable=protected-access
        outputs = kept
    return inputs, outputs, None if specs is None else tuple(specs)
