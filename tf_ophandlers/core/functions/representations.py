"""Splitting representations into tensors of the bottom and rebuilding them (the RFC's
FunctionInput / FunctionOutput hooks), for function arguments, results and the values
crossing control flow.

A *tree* describes one value: ``("leaf", ...)`` for a tensor of the bottom, or
``(level, summary, subtrees)`` for a representation of the stack ``segment[level]``,
whose `function_input` gave `summary` and the parts described by `subtrees`.
"""
from tensorflow.python.framework import dtypes as _dtypes
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework.tensor import Tensor as _Tensor

from tf_ophandlers.core import errors
from tf_ophandlers.core.stack import payload

_RESOURCE = _dtypes.resource.as_datatype_enum
_VARIANT = _dtypes.variant.as_datatype_enum
_EagerTensor = _ops.EagerTensor


def split(tensor, segment, leaf_key, comps):
    """Appends the bottom tensors carrying `tensor` to `comps`; returns its summary tree."""
    p = payload(tensor)
    if p is not None:
        stack = p[0]
        for level, s in enumerate(segment):
            if s is stack:
                handler = stack.handler
                if stack.default_function_input:
                    summary, parts = None, (p[1],)  # no frame needed
                else:
                    summary, parts = stack.call_hook(handler.function_input, p[1])  # pylint: disable=protected-access
                try:
                    hash(summary)
                except TypeError:
                    raise errors.HandlerOutputError(
                        "%s.function_input returned an unhashable summary %r; summaries key "
                        "the replay cache" % (stack.handler.debug_string(), summary)) from None
                return (level, summary, tuple(split(t, segment, leaf_key, comps) for t in parts))
    comps.append(tensor)
    return leaf_key(tensor)


def rebuild(tree, segment, comps, joins=None):
    """The tensor (on its stack of `segment`) for `tree` from the bottom tensors `comps`;
    `joins` (level -> summary, from `call_joins`): values of those levels are coerced to
    that summary."""
    if tree[0] == "leaf":
        return next(comps)
    level, summary, subtrees = tree
    stack = segment[level]
    parts = [rebuild(t, segment, comps, joins) for t in subtrees]
    handler = stack.handler
    if stack.default_function_output:
        return stack.wrap(parts[0])
    value = stack.call_hook(handler.function_output, summary, parts)  # pylint: disable=protected-access
    if joins is not None and level in joins and joins[level] != summary:
        value = stack.call_hook(handler.function_coerce, value, joins[level])  # pylint: disable=protected-access
    return stack.wrap(value)


def call_joins(trees, segment):
    """level -> the summary every argument of a call at that level is coerced to, for the
    handlers of `segment` whose `function_call_join` gives one (None if none does)."""
    found = {}

    def walk(tree):
        if tree[0] != "leaf":
            found.setdefault(tree[0], []).append(tree[1])
            for t in tree[2]:
                walk(t)
    for t in trees:
        walk(t)
    joins = {}
    for level, summaries in found.items():
        handler = segment[level].handler
        joined = segment[level].call_hook(handler.function_call_join, summaries)  # pylint: disable=protected-access
        if joined is not None:
            joins[level] = joined
    return joins or None


def eager_leaf(tensor, comps=None):
    """Cache-key part of a bottom tensor: what the replay's placeholder depends on (its
    dtype, as TensorFlow's enum, and its shape). Appends `tensor` to `comps` if given."""
    if type(tensor) is not _EagerTensor and not isinstance(tensor, _Tensor):
        raise errors.HandlerOutputError(
            "tf_ophandlers: function_input returned %r, which is not a tensor" % (tensor,))
    if comps is not None:
        comps.append(tensor)
    dtype = (tensor._datatype_enum() if type(tensor) is _EagerTensor  # pylint: disable=protected-access
             else tensor.dtype.as_datatype_enum)
    if dtype == _RESOURCE or dtype == _VARIANT:
        # The replay's placeholder takes its handle data (a variable's dtype and shape)
        # from the function's own argument, which TensorFlow traced for it.
        return ("leaf", dtype)
    return ("leaf", dtype, tensor._shape_tuple())  # pylint: disable=protected-access


def graph_leaf(tensor):
    return ("leaf", tensor.dtype)


def count_leaves(tree):
    if tree[0] == "leaf":
        return 1
    return sum(count_leaves(t) for t in tree[2])


def regroup(trees, flat):
    """`flat` bottom tensors grouped per tree."""
    out, k = [], 0
    for t in trees:
        n = count_leaves(t)
        out.append(list(flat[k:k + n]))
        k += n
    return out
