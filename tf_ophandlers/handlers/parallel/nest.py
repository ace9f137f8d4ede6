"""`oh.ParallelHandler.pack` / `unpack` of nested structures (dicts, tuples, namedtuples,
lists), as tf.nest walks them: `pack([{"x": x0}, {"x": x1}])` is `{"x": pack([x0, x1])}`,
and `unpack` of a structure gives one structure per component.

A list or tuple of plain numbers (nested) is one tensor's data, as for
`tf.convert_to_tensor`: `pack([[1., 2.], [3., 4.]])` packs two 2-element tensors.
"""
import collections.abc
import numbers

import numpy as np
import tensorflow as tf


def _is_data(v):
    """Whether `v` is one tensor's worth (a tensor, array, scalar, or nested lists or
    tuples of plain numbers) rather than a structure of tensors."""
    if tf.is_tensor(v) or isinstance(v, (tf.Variable, np.ndarray, np.generic, numbers.Number,
                                         str, bytes)):
        return True
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return all(_is_data(e) and not tf.is_tensor(e) and not isinstance(e, tf.Variable)
                   for e in v)
    return False


def _flatten(v):
    if _is_data(v) or v is None:
        return [v]
    if isinstance(v, collections.abc.Mapping):
        return [x for k in sorted(v) for x in _flatten(v[k])]
    if isinstance(v, (list, tuple)):
        return [x for e in v for x in _flatten(e)]
    raise TypeError("oh.ParallelHandler.pack: cannot pack a %s (tensors, or dicts, tuples "
                    "and lists of them)" % type(v).__name__)


def _rebuild(like, leaves):
    """`like`'s structure with its leaves taken in order from the iterator `leaves`."""
    if _is_data(like) or like is None:
        return next(leaves)
    if isinstance(like, collections.abc.Mapping):
        built = {k: _rebuild(like[k], leaves) for k in sorted(like)}
        return type(like)((k, built[k]) for k in like) if not isinstance(like, dict) \
            else {k: built[k] for k in like}
    items = [_rebuild(e, leaves) for e in like]
    if hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*items)
    return type(like)(items)


def _same_structure(a, b):
    if (_is_data(a) or a is None) and (_is_data(b) or b is None):
        return (a is None) == (b is None)
    if isinstance(a, collections.abc.Mapping) and isinstance(b, collections.abc.Mapping):
        return sorted(a) == sorted(b) and all(_same_structure(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(_same_structure(x, y) for x, y in zip(a, b))
    return False


def is_structure(values):
    """Whether pack's `values` (one per component) are structures rather than tensors."""
    return any(not _is_data(v) for v in values)


def pack(values, pack_one):
    """`values`' common structure with each leaf position packed by `pack_one` (leaves
    None in every component stay None)."""
    first = values[0]
    for i, v in enumerate(values[1:], 1):
        if not _same_structure(first, v):
            raise ValueError(
                "oh.ParallelHandler.pack: component %d has another structure than "
                "component 0 (%s vs %s); every component must have the same nesting of "
                "dicts, tuples and lists" % (i, _describe(v), _describe(first)))
    flats = [_flatten(v) for v in values]
    packed = [None if leaves[0] is None else pack_one(list(leaves))
              for leaves in zip(*flats)]
    return _rebuild(first, iter(packed))


def unpack(structure, n, unpack_one):
    """One structure per component: each tensor of `structure` unpacked by `unpack_one`."""
    flat = _flatten(structure)
    parts = [None if t is None else unpack_one(t) for t in flat]
    return [_rebuild(structure, iter([None if p is None else p[i] for p in parts]))
            for i in range(n)]


def _describe(v):
    if isinstance(v, collections.abc.Mapping):
        return "dict with keys %s" % sorted(v)
    if isinstance(v, (list, tuple)) and not _is_data(v):
        return "%s of %d" % (type(v).__name__, len(v))
    return "a tensor" if v is not None else "None"
