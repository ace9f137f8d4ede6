"""Recorded op programs: their cache keys, and building them into a graph.

A *program* is a list of recorded nodes ``(op, refs, device)`` in recording order: `op`
an `Op`, `refs` one entry per input, ``(-1, k)`` for external input k or ``(p, i)`` for
output i of node p, `device` the placement the op was recorded under (or None). Handlers
that record ops and replay them as one function (`oh.Lazy`, `oh.Recompute`'s segments,
`oh.TraceAndExecute`, vectorized_map's pfor fallback, core's shape inference) build their
graphs with `create`/`replay` and key their function caches with `program_key`, so that a
key holds everything the built function depends on, in one place.

    >>> import tensorflow as tf
    >>> from tf_ophandlers.core.op import Op
    >>> from tf_ophandlers.core import graph_builder
    >>> program = [(Op.create("Mul", T=tf.float32), [(-1, 0), (-1, 0)], None),
    ...            (Op.create("Neg", T=tf.float32), [(0, 0)], None)]
    >>> x = tf.constant([1.0, 2.0])
    >>> key = graph_builder.program_key(program, [(1, 0)], [x])
    >>> fn = tf.function(lambda t: graph_builder.replay(
    ...     tf.compat.v1.get_default_graph(), program, [t])[1][0])
    >>> fn(x).numpy().tolist()
    [-1.0, -4.0]
"""


def input_signature(tensors):
    """(dtype, shape tuple or None) of each tensor (eager or symbolic) or spec: the part
    of a key the inputs contribute (their values never: constants are inputs, not
    captured)."""
    out = []
    for t in tensors:
        fast = getattr(t, "_shape_tuple", None)  # EagerTensor's, without a TensorShape
        if fast is not None:
            out.append((t.dtype, fast()))
        else:
            shape = t.shape
            out.append((t.dtype, None if shape.rank is None else tuple(shape.as_list())))
    return tuple(out)


def program_key(nodes, returned, inputs, **flags):
    """A hashable key of the function built from program `nodes` returning the outputs
    `returned` (``(node, output)`` tuples, as refs are) of external `inputs` (tensors or specs): op
    types, attributes, wiring, per-op device, returned outputs, the inputs' dtypes and
    shapes, and `flags` (e.g. ``jit_compile=True``; any hashable values)."""
    return key_of_parts([node_part(op, refs, device) for op, refs, device in nodes],
                        returned, inputs, **flags)


def node_part(op, refs, device):
    """One node's part of a program key (for handlers that build their plan and key in
    one pass, `key_of_parts`): op type, attributes, wiring and device."""
    return (op.type, op.attrs_key(), tuple(refs), device)


def key_of_parts(parts, returned, inputs, **flags):
    """`program_key` from the nodes' `node_part`s (a list, in program order)."""
    return (tuple(parts), tuple(returned), input_signature(inputs),
            tuple(sorted(flags.items())))


def create(graph, op, inputs, device=None):
    """The outputs (a list of symbolic tensors) of recorded `op` on `inputs`, added to
    `graph` (under `device` if given)."""
    if device:
        with graph.device(device):
            return graph.create_op(op.type, inputs, attrs=op.attr_protos()).outputs
    return graph.create_op(op.type, inputs, attrs=op.attr_protos()).outputs


def replay(graph, nodes, external, results=None, indices=None, add=create):
    """Adds program `nodes` (those of `indices`, default all) to `graph` on the
    `external` inputs; returns `results` (a new per-node list if not given) with each
    added node's outputs. `add(graph, op, inputs, device)` adds one node (default
    `create`; a caller may add a node another way, e.g. a cheaper equivalent)."""
    if results is None:
        results = [None] * len(nodes)
    for j in range(len(nodes)) if indices is None else indices:
        op, refs, device = nodes[j]
        ins = [external[i] if p < 0 else results[p][i] for p, i in refs]
        results[j] = add(graph, op, ins, device)
    return results
