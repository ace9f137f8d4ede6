"""`vectorized_map`: eager batching, op by op, as an op handler (RFC "Transformations
which are currently graph-only").

`tf.vectorized_map` converts a traced graph (pfor), so in eager mode it re-traces on every
call. `oh.vectorized_map(fn, elems)` instead runs `fn` once, eagerly, under a
`VectorizedMap` handler: `fn` sees per-example shapes while every op runs once on the
whole batch.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> x = tf.constant([[1., 2.], [3., 4.], [5., 6.]])
>>> oh.vectorized_map(lambda row: tf.reduce_sum(row * row), x).numpy()
array([ 5., 25., 61.], dtype=float32)

The representation of a tensor is a `Batched(value, batched)`: `value` is a tensor of the
next stack whose leading axis is the batch when `batched` is true; unbatched values
(captures, constants, variables) are used as they are. Batching rules:

- direct rules for the hot ops (elementwise and broadcasting ops, matmuls, reductions,
  reshapes, transposes, concatenation, gathers, shape queries, softmax), no tracing;
- every other op is converted by TensorFlow's pfor converters on a one-op graph traced
  once per op signature (cached);
- an op pfor cannot convert runs once per example (a loop), reported once per op type by
  a warning of the `tf_ophandlers` logger (`warn=False` silences it); TensorFlow's own
  pfor error dumps for the op are suppressed.
"""
import functools
import itertools
import logging
import operator
import threading
import weakref

import tensorflow as tf
from tensorflow.core.framework import full_type_pb2 as _full_type_pb2
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager.polymorphic_function import eager_function_run as _eager_run
from tensorflow.python.eager.polymorphic_function import polymorphic_function as _polymorphic
from tensorflow.python.framework import composite_tensor as _composite_tensor
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import type_spec as _type_spec
from tensorflow.python.ops.parallel_for import control_flow_ops as _pfor_ops
from tensorflow.python.util import nest

from tf_ophandlers.extend import (
    BoundedCache, COPY_OPS, eager_leaf, errors, execute_physical as _execute_physical,
    function_call as _function_call, function_name as _as_str, graph_builder, next_stack,
    OpHandler, own_trace, PHYSICAL, registries as _registries, representation_of,
    scope as _scope, stack_of, state as _state)
from tf_ophandlers.handlers.vectorized_map.batching_rules import (
    ALWAYS_BATCHED, DTYPES, FORWARD, RULE, RULES, UNBATCHED, Batched, batched, broadcast_batch,
    ATTRIBUTE_PLANS, plan_of, static_shape, known_value)

_log = logging.getLogger("tf_ophandlers")
_tf_tape_set_is_empty = pywrap_tfe.TFE_Py_TapeSetIsEmpty
_stack_of = stack_of
# Control-flow ops reach the handler only when their predicate is per-example and they
# have side effects (core/functions selects between the branches of stateless ones):
# they run once per example, since pfor cannot convert them without their graphs.
_CONTROL_FLOW = frozenset(("If", "StatelessIf", "While", "StatelessWhile", "Case",
                           "StatelessCase"))



# -- the pfor fallback: one traced, converted graph per op signature ------------------------

# Op signature (type, attributes, input dtypes, shapes and batched flags: everything the
# converted graph depends on) -> tf.function, or None when pfor cannot convert the op.
_converted = BoundedCache("vectorized_map.pfor_converted", 4096)


def _report_fallback(handler, op_type, message, *args):
    """Reports once per op type and process (unless `warn=False`; core.errors.warn_once's
    record of causes) that `op_type` runs as a loop, as a warning of the `tf_ophandlers`
    logger."""
    if handler.warn and errors.first_time(("oh.vectorized_map fallback", op_type)):
        _log.warning(message, *args)


class _QuietPfor(logging.Filter):
    """Drops the records of TensorFlow's pfor (an ERROR dump of the graph node, ~160 lines,
    for each op it cannot convert; "uses a while_loop" warnings) while this thread converts
    one op: the handler reports the fallback itself, once per op type."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def filter(self, record):
        return not (getattr(self.local, "active", 0)
                    and "parallel_for" in record.pathname.replace("\\", "/"))


_quiet = _QuietPfor()
tf.get_logger().addFilter(_quiet)


def _signature(op, inputs):
    return (op.type, op.attrs_key(), tuple(
        (b.value.dtype, tuple(b.value.shape.as_list()) if b.value.shape.rank is not None
         else None, b.batched) for b in inputs))


def _set_resource_dtype(placeholder, op):
    """Gives a resource placeholder the dtype of the variable `op` reads (its `dtype`
    attribute, in the cache key; the shape stays unknown): without it TensorFlow's
    function gradient treats the handle as not trainable (a None gradient)."""
    dtype = op.attrs.get("dtype")
    if not isinstance(dtype, tf.DType):
        return
    from tensorflow.core.framework import cpp_shape_inference_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel
    data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)
    data.shape_and_type.add(shape=tf.TensorShape(None).as_proto(),
                            dtype=dtype.as_datatype_enum)
    handle_data_util.set_handle_data(placeholder, data)


def _set_list_handle_data(placeholder, op):
    """Marks a variant placeholder as a TensorList (TensorFlow's handle data of one, as
    list_ops gives eager lists): pfor's converters keep a batched list as one scalar
    variant only when they see this (`_is_variant_with_internal_stacking`), and stack
    an unbatched one element by element with its element dtype."""
    from tensorflow.core.framework import cpp_shape_inference_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.core.framework import full_type_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel
    dtype = op.attrs.get("element_dtype")
    data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)
    data.shape_and_type.add(
        shape=tf.TensorShape(None).as_proto(),
        dtype=dtype.as_datatype_enum if isinstance(dtype, tf.DType) else 0,
        type=full_type_pb2.FullTypeDef(type_id=full_type_pb2.TFT_ARRAY))
    handle_data_util.set_handle_data(placeholder, data)


def _has_handle_data(t):
    from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel
    data = handle_data_util.get_resource_handle_data(t)
    return bool(data is not None and data.is_set and data.shape_and_type)


def is_list_op(op_type):
    """TensorList ops (tf.TensorArray in graphs, raw list ops): their batched lists are
    pfor's, one scalar variant whose elements carry the batch dimension."""
    return op_type.startswith("TensorList") or op_type == "EmptyTensorList"


# Inputs of list ops that pfor's converters read statically (a reserved list's element
# shape must be known, or -1, when it is built): constants of the converted graph.
_STATIC_LIST_ARGS = frozenset(("element_shape", "leading_dims"))


def _static_list_args(op, inputs):
    """{input index: value} of `op`'s unbatched element-shape inputs with known values
    (part of the converted function's cache key)."""
    from tensorflow.python.framework import op_def_registry  # pylint: disable=import-outside-toplevel
    op_def = op_def_registry.get(op.type)
    if op_def is None or len(op_def.input_arg) != len(inputs):
        return {}
    out = {}
    for k, (arg, b) in enumerate(zip(op_def.input_arg, inputs)):
        if arg.name in _STATIC_LIST_ARGS and not b.batched:
            value = known_value(b.value)
            if value is not None:
                out[k] = value
    return out


def _list_pfor_function(op, inputs, size, static, while_loop=False):
    """`_pfor_function` for a TensorList op, with pfor's own representation of lists: a
    batched list input (one scalar variant, its elements batched) is handed to pfor's
    converters as the conversion of a per-example stand-in (there is no example to
    gather), as pfor's while-loop converter hands it its loop variables. Returns the
    function and, filled at its trace, which outputs pfor keeps stacked (a list's length
    or element shape is one for all examples)."""
    from tensorflow.python.ops.parallel_for import pfor as _pfor  # pylint: disable=import-outside-toplevel
    mask = [b.batched for b in inputs]
    specs = [tf.TensorSpec(b.value.shape, b.value.dtype) for b in inputs]
    stacked = []

    def run(*values):
        graph = _ops.get_default_graph()
        for v in values:
            if v.dtype == tf.variant and not _has_handle_data(v):
                _set_list_handle_data(v, op)
        existing = set(graph.get_operations())
        loop_var = tf.compat.v1.placeholder_with_default(0, shape=[])
        args, stand_ins = [], []
        for k, (v, m) in enumerate(zip(values, mask)):
            if k in static:
                args.append(tf.constant(static[k], dtype=v.dtype))
            elif not m:
                args.append(v)
            elif v.dtype == tf.variant:
                # A new empty list, not derived from `v`: `v`'s handle data (when the
                # call is traced in a graph) has the batched element shape, which the
                # op's own shape inference would reject against its per-example one.
                dtype = op.attrs.get("element_dtype")
                a = tf.raw_ops.EmptyTensorList(
                    element_shape=tf.constant(-1), max_num_elements=tf.constant(-1),
                    element_dtype=dtype if isinstance(dtype, tf.DType) else tf.float32)
                stand_ins.append((a, v))
                args.append(a)
            else:
                args.append(tf.gather(v, loop_var))
        outs = graph_builder.create(graph, op, args)
        new_ops = set(graph.get_operations()) - existing
        converter = _pfor.PFor(loop_var, size, new_ops, fallback_to_while_loop=while_loop)
        for a, v in stand_ins:
            converter._add_conversion(a, _pfor.wrap(v, True))  # pylint: disable=protected-access
        wrapped = [converter._convert_helper(o) for o in outs]  # pylint: disable=protected-access
        stacked[:] = [w.is_stacked for w in wrapped]
        return [w.t for w in wrapped]

    return _converted_now(run, specs), stacked


def _converted_now(run, specs):
    """`run` as a tf.function traced at once, with pfor's conversion logs quieted: a
    conversion failure must surface here, where it means "use the loop"."""
    fn = tf.function(run, input_signature=specs, autograph=False)
    _quiet.local.active = getattr(_quiet.local, "active", 0) + 1
    try:
        fn.get_concrete_function()
    finally:
        _quiet.local.active -= 1
    return fn


def _pfor_function(op, inputs, while_loop=False):
    """A tf.function running `op` vectorized by TensorFlow's pfor converters (with
    `while_loop`: pfor's while-loop fallback where it has no converter, as
    `tf.vectorized_map`'s).

    The specs keep the static batch dim (the cache key has it): pfor then converts the
    gather of example `i` of a batched input into the input itself, as in
    `tf.vectorized_map`, instead of a GatherV2 over range(B), whose gradient made a
    tape outside the map get tf.IndexedSlices where TensorFlow's is dense."""
    mask = [b.batched for b in inputs]
    specs = [tf.TensorSpec(b.value.shape, b.value.dtype) for b in inputs]

    def run(*values):
        for v in values:
            if v.dtype == tf.resource:
                _set_resource_dtype(v, op)
        first = next(v for v, m in zip(values, mask) if m)
        size = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]

        def loop_fn(i):
            args = [tf.gather(v, i) if m else v for v, m in zip(values, mask)]
            return graph_builder.create(_ops.get_default_graph(), op, args)

        return _pfor_ops.pfor(loop_fn, size, fallback_to_while_loop=while_loop)

    return _converted_now(run, specs)


def _converted_list_op(handler, op, inputs):
    """A TensorList op by pfor's converters (`_list_pfor_function`), with pfor's
    while-loop fallback inside the conversion where allowed. A list op never runs once
    per example: a batched list has no examples to take apart, so what pfor cannot
    convert raises, naming the op and pfor's reason (tf.vectorized_map fails there too)."""
    if (op.type == "TensorListSetItem" and op.attrs.get("resize_if_index_out_of_bounds")
            and not inputs[1].batched):
        # A write past the end of a dynamic_size TensorArray grows it; pfor's converter
        # writes without resizing ("Trying to modify element 0 in a list with 0
        # elements", tf.vectorized_map's error): the list grows first, one length for all
        # examples since the index is.
        handle, index = inputs[0].value, inputs[1].value
        length = tf.raw_ops.TensorListLength(input_handle=handle)
        grown = tf.raw_ops.TensorListResize(
            input_handle=handle, size=tf.maximum(length, tf.cast(index, tf.int32) + 1))
        inputs = [Batched(grown, inputs[0].batched)] + list(inputs[1:])
    if op.type == "TensorListResize" and not inputs[1].batched:
        # (no pfor converter) one length for all examples: the batched list's, whose
        # elements carry the batch, resized as it is (the gradient of a growing write)
        return [Batched(tf.raw_ops.TensorListResize(
            input_handle=inputs[0].value, size=inputs[1].value), inputs[0].batched)]
    static = _static_list_args(op, inputs)
    key = (_signature(op, inputs) + (handler.size, handler.fallback_to_while_loop,
                                     tf.executing_eagerly())
           + tuple((k, v.tobytes(), v.shape) for k, v in sorted(static.items())))
    hit = _converted.get(key)
    if hit is None:
        errors_seen = []
        for while_loop in ((False, True) if handler.fallback_to_while_loop else (False,)):
            try:
                hit = _list_pfor_function(op, inputs, handler.size, static, while_loop)
                break
            except Exception as e:  # pylint: disable=broad-except
                errors_seen.append("%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300]
                                               if str(e) else ""))
        if hit is None:
            raise ValueError(
                "oh.vectorized_map: TensorList op %s cannot be vectorized by pfor's "
                "converters (%s)%s" % (op.type, errors_seen[-1], "" if handler.fallback_to_while_loop
                                       else "; fallback_to_while_loop=False"))
        _converted[key] = hit
    fn, stacked = hit
    outs = fn(*[b.value for b in inputs])
    return [Batched(o, s) for o, s in zip(nest.flatten(outs), stacked)]


def _converted_by_pfor(handler, execute, op, inputs):
    # Keyed by eagerness too: the tf.function keeps the gradient functions TensorFlow
    # builds at its first differentiation, and those built while a graph is traced (a
    # replayed or traced step) have extra outputs of unknown shape that an eager
    # gradient then cannot fill with zeros (ValueError: "Cannot convert a partially
    # known TensorShape"; found by test_fuzz_compositions, OH_FUZZ_SEED=11).
    key = _signature(op, inputs) + (handler.fallback_to_while_loop, tf.executing_eagerly())
    fn = _converted.get(key, False)
    if fn is False:
        try:
            fn = _pfor_function(op, inputs)
        except Exception as e:  # pylint: disable=broad-except
            fn = None
            reason = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200] if str(e)
                                 else "")
            if handler.fallback_to_while_loop:
                # As tf.vectorized_map: pfor's while loop over the examples, in one graph
                # (a tape outside gets TensorFlow's gradient types: dense for a looped
                # op's unbatched inputs, e.g. a gathered variable).
                try:
                    fn = _pfor_function(op, inputs, while_loop=True)
                except Exception:  # pylint: disable=broad-except
                    fn = None
            _report_fallback(handler, op.type, "oh.vectorized_map: no batching rule for op "
                             "%s (%s); it runs once per example%s", op.type, reason,
                             " (a while loop)" if fn is not None else "")
        _converted[key] = fn
    if fn is None:
        return None
    try:
        outs = fn(*[b.value for b in inputs])
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        # Some converted graphs fail only when run; use the loop from now on.
        _converted[key] = None
        _report_fallback(handler, op.type, "oh.vectorized_map: the pfor conversion of op %s "
                         "failed (%s); it runs once per example", op.type,
                         str(e).splitlines()[0][:200])
        return None
    return batched(nest.flatten(outs))


def _list_dtype(t):
    """The element dtype of TensorList `t` from its handle data (a graph's lists have it:
    a replayed function's), or None (not a list, or an eager list made by a raw op)."""
    from tensorflow.python.ops.parallel_for import pfor as _pfor  # pylint: disable=import-outside-toplevel
    if isinstance(t, _ops.EagerTensor) or t.dtype != tf.variant:
        return None
    if not _pfor._is_variant_with_internal_stacking(t) or _is_optional(t):  # pylint: disable=protected-access
        return None
    return tf.as_dtype(_pfor._variant_handle_data(t)[0].dtype)  # pylint: disable=protected-access


def _is_optional(t):
    from tensorflow.python.ops.parallel_for import pfor as _pfor  # pylint: disable=import-outside-toplevel
    return _pfor._variant_type_id(t) == _full_type_pb2.TFT_OPTIONAL  # pylint: disable=protected-access


def _optional_parts(t):
    """The component dtypes and shapes of pfor's batched Optional `t` (one scalar variant
    holding every example's components, stacked) from its handle data, or None where it
    has none, or a component is itself a variant (not taken apart per example)."""
    if isinstance(t, _ops.EagerTensor) or t.dtype != tf.variant or not _is_optional(t):
        return None
    from tensorflow.python.ops.parallel_for import pfor as _pfor  # pylint: disable=import-outside-toplevel
    parts = _pfor._variant_handle_data(t)  # pylint: disable=protected-access
    if not parts:
        return None
    dtypes = [tf.as_dtype(p.dtype) for p in parts]
    shapes = [tf.TensorShape(p.shape) for p in parts]
    if any(d == tf.variant for d in dtypes) or any(s.rank == 0 for s in shapes):
        return None
    return dtypes, shapes


def _optional_example(t, i, parts):
    """Example `i` of pfor's batched Optional `t` (`_optional_parts`): an Optional of
    row i of each component. (pfor makes one only from a value, OptionalFromValue: it
    holds a value.)"""
    dtypes, shapes = parts
    components = tf.raw_ops.OptionalGetValue(optional=t, output_types=dtypes,
                                             output_shapes=shapes)
    return tf.raw_ops.OptionalFromValue(components=[c[i] for c in components])


def _list_example(handle, i, dtype):
    """Example `i` of a batched list (its elements' row i), as a list of its own (an
    empty one for an empty list: its element shape may be unknown, which stacking it
    refuses; a fresh reserved list for a reserved one: its elements are not written yet,
    and stacking them fails unless their shape is fully known)."""
    if not isinstance(handle, _ops.EagerTensor) and handle.op.type == "TensorListReserve":
        stacked_shape, length = handle.op.inputs
        shape = known_value(stacked_shape)
        return tf.raw_ops.TensorListReserve(
            element_shape=(tf.constant(-1) if shape is None or shape.ndim == 0
                           else tf.constant(shape[1:], stacked_shape.dtype)),
            num_elements=length, element_dtype=dtype)
    def example():
        items = tf.raw_ops.TensorListStack(  # [length, batch, ...]
            input_handle=handle, element_dtype=dtype,
            element_shape=tf.raw_ops.TensorListElementShape(input_handle=handle,
                                                            shape_type=tf.int32))
        return tf.raw_ops.TensorListFromTensor(tensor=items[:, i],
                                               element_shape=tf.shape(items)[2:])

    def empty():
        return tf.raw_ops.EmptyTensorList(
            element_shape=tf.constant(-1), max_num_elements=tf.constant(-1),
            element_dtype=dtype)

    if isinstance(handle, _ops.EagerTensor):
        return example() if int(tf.raw_ops.TensorListLength(input_handle=handle)) else empty()
    return tf.cond(tf.raw_ops.TensorListLength(input_handle=handle) > 0, example, empty)


def _batched_lists(rows, dtype):
    """Per-example lists as one batched list (their elements stacked; they must have one
    length and element shape)."""
    items = [tf.raw_ops.TensorListStack(
        input_handle=r, element_dtype=dtype,
        element_shape=tf.raw_ops.TensorListElementShape(input_handle=r, shape_type=tf.int32))
        for r in rows]
    stacked = tf.stack(items, axis=1)  # [length, batch, ...]
    return tf.raw_ops.TensorListFromTensor(tensor=stacked, element_shape=tf.shape(stacked)[1:])


def _per_example_loop(handler, execute, op, inputs, report=True):
    """`op` run once per example. `report=False`: on rows (`is_rows`), values only a loop
    that was reported made (a Case's Optionals, TensorFlow's zeros for them)."""
    lists, optionals = {}, {}
    for k, b in enumerate(inputs):
        if b.batched and b.value.shape.rank == 0:
            dtype = _list_dtype(b.value)
            parts = _optional_parts(b.value) if dtype is None else None
            if parts is not None:
                optionals[k] = parts
                continue
            if dtype is None:
                # Eager TensorLists, and pfor's batched Optionals whose components are
                # unknown or variants, are one scalar variant holding the batched
                # components: no example can be taken apart.
                raise ValueError(
                    "oh.vectorized_map: op %s has no batching rule for a per-example "
                    "Optional or TensorList (one variant holding every example's values), "
                    "and it cannot run once per example on it; tf.vectorized_map cannot "
                    "convert it either" % op.type)
            lists[k] = dtype
    if report:
        _report_fallback(handler, op.type, "oh.vectorized_map: op %s runs once per example "
                         "(a loop)", op.type)
    rows = []
    for i in range(handler.size):
        rows.append(execute(op, [
            _list_example(b.value, i, lists[k]) if k in lists
            else _optional_example(b.value, i, optionals[k]) if k in optionals
            else _example(b.value, i) if b.batched else b.value
            for k, b in enumerate(inputs)]))
        if op.type in _CONTROL_FLOW and rows[-1] and not isinstance(rows[-1][0], _ops.EagerTensor):
            _own_bodies(rows[-1][0].op)
    # A loop's outputs are its loop variables: an output list has its input's dtype.
    hints = lists if op.type in _CONTROL_FLOW and "While" in op.type else {}
    outputs = _stack_rows(op.type, rows, hints)
    if op.type in ("While", "StatelessWhile"):
        # A resource loop variable (a variable the body reads) leaves the loop unchanged:
        # the shared handle, not a [batch] stack of its copies, which has no handle data
        # for the gradient of the variable.
        outputs = [inputs[k] if (k < len(inputs) and not inputs[k].batched
                                 and _is_resource(inputs[k].value)) else b
                   for k, b in enumerate(outputs)]
    return outputs


_DIFFERENT_SHAPES = (
    "oh.vectorized_map: op %s gives outputs of different shapes for different examples "
    "(%s); a mapped value has one shape in every example, as in tf.vectorized_map (the "
    "rows of a tf.RaggedTensor or tf.SparseTensor can differ so). Use tf.map_fn with "
    "fn_output_signature=... for such results")


_body_copies = itertools.count()


def _own_bodies(node):
    """Gives control-flow op `node` (one example's copy, in a graph) branch and loop
    FuncGraphs of its own names, cached where cond_v2's and while_v2's gradients look
    first: the gradient of each copy rewrites them (with its accumulators, named after
    them + "_rewritten"), and copies sharing the function names would register different
    functions under one name."""
    from tensorflow.python.ops import control_flow_util_v2 as _cf_util  # pylint: disable=import-outside-toplevel
    if node.type in ("While", "StatelessWhile"):
        shapes = [tf.TensorShape(s) for s in node.get_attr("output_shapes")]
        bodies = [(node.get_attr("cond").name, "_cond_graph"),
                  (node.get_attr("body").name, "_body_graph")]
    else:
        shapes = [t.shape for t in node.inputs[1:]]
        if node.type in ("If", "StatelessIf"):
            bodies = [(node.get_attr("then_branch").name, "_true_graph"),
                      (node.get_attr("else_branch").name, "_false_graph")]
        else:
            bodies = [(f.name, "_branch_graph_%d" % k)
                      for k, f in enumerate(node.get_attr("branches"))]
    from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel
    inputs = list(node.inputs) if node.type in ("While", "StatelessWhile") else list(
        node.inputs[1:])
    for name, cached in bodies:
        graph = _cf_util.get_func_graph(node, shapes, name)
        graph.name = "%s_oh_example_%d" % (_as_str(name), next(_body_copies))
        # A graph made from its FunctionDef has resource placeholders without handle
        # data (the traced one had it): a variable read in the body, or in control flow
        # nested in it, would have no gradient ("variable without handle data").
        for external, internal in zip(inputs, graph.inputs):
            if external.dtype == tf.resource:
                handle_data_util.copy_handle_data(external, internal)
        setattr(node, cached, graph)
        # So too the control flow nested in it that a variable reaches (a cond in a loop
        # in this branch): TensorFlow would make its bodies from their FunctionDefs.
        for inner in graph.get_operations():
            if inner.type in _CONTROL_FLOW and any(
                    t.dtype == tf.resource for t in inner.inputs):
                _own_bodies(inner)


def _stack_rows(op_type, rows, list_dtypes=None):
    """Per-example outputs stacked into batched values, or a clear error where the
    examples' shapes differ (a ragged element's rows: tf.Stack's error named no op).

    Per-example variants that are not one list of one length in every example (an
    Optional, present in some examples only; a loop's list whose length is the example's
    trip count, such as a While gradient's accumulators) stay one variant per example:
    *rows*, a [batch] variant (`is_rows`) that ops run once per example take apart."""
    out = []
    for k, col in enumerate(zip(*rows)):
        shapes = {tuple(t.shape) if t.shape.rank is not None else None for t in col}
        ranks = {len(shape) for shape in shapes if shape is not None}
        if len(shapes) > 1 and (len(ranks) > 1 or all(
                shape is not None and None not in shape for shape in shapes)):
            raise ValueError(_DIFFERENT_SHAPES % (
                op_type, ", ".join(str(t.shape) for t in col[:4])))
        dtype = None
        if col[0].shape.rank == 0 and col[0].dtype == tf.variant:
            dtype = _list_dtype(col[0]) or (list_dtypes or {}).get(k)
        if dtype is not None and _one_length(col):
            # lists of one length (a TensorArray of a fixed size): a batched list, pfor's
            out.append(Batched(_batched_lists(col, dtype), True))
        elif col[0].dtype == tf.variant:
            out.append(Batched(_rows_of(col), True))
        elif len(shapes) == 1 and all(
                shape is not None and None not in shape for shape in shapes):
            out.append(Batched(tf.stack(list(col)), True))
        else:  # shapes known only when it runs: checked then, naming the op
            out.append(Batched(_checked_stack(op_type, col), True))
    return out


def _one_length(lists):
    """Whether per-example lists are known to have one length (eager lists, now)."""
    if not all(isinstance(t, _ops.EagerTensor) for t in lists):
        return False  # (a replay: per-example trip counts are known only when it runs)
    lengths = {int(tf.raw_ops.TensorListLength(input_handle=t)) for t in lists}
    return len(lengths) == 1


def _checked_stack(op_type, col):
    """tf.stack of per-example tensors whose shapes are known only when the graph runs,
    with a clear error (naming the op) where they differ."""
    shapes = [tf.shape(t, out_type=tf.int64) for t in col]
    ranks = tf.stack([tf.size(s) for s in shapes])
    same = tf.reduce_all(tf.equal(ranks, ranks[0]))
    same = tf.cond(same, lambda: tf.reduce_all(tf.equal(tf.stack(shapes), shapes[0])),
                   lambda: tf.constant(False))
    message = _DIFFERENT_SHAPES % (op_type, "known when the function runs")
    with tf.control_dependencies([tf.debugging.Assert(same, [message] + shapes[:4])]):
        return tf.stack([tf.identity(t) for t in col])


_VARIANT_ENUM = tf.variant.as_datatype_enum


def _rows_of(col):
    """Per-example variants stacked as rows. In a graph, the rows remember the tensors
    they stack (`_example`): ops on one example use that tensor, not a slice of the rows,
    so that gradients (a list's, of a loop's accumulators) reach it without adding
    [batch] variants, which TensorFlow cannot (AddN of non-scalar variants)."""
    rows = tf.stack(list(col))
    if not isinstance(rows, _ops.EagerTensor):
        rows._oh_examples = tuple(col)  # pylint: disable=protected-access
    return rows


def _example(value, i):
    """Example `i` of a batched value (rows: the tensor it stacks, `_rows_of`)."""
    parts = getattr(value, "_oh_examples", None)
    return value[i] if parts is None else parts[i]


def is_rows(b):
    """Whether a batched value is per-example variants, one row each (`_stack_rows`):
    a variant of rank >= 1 (pfor's batched lists and Optionals are scalars)."""
    if not b.batched:
        return False
    v = b.value
    if type(v) is _EagerTensor:  # (cheaply: this runs for every function argument)
        return v._datatype_enum() == _VARIANT_ENUM and len(v._shape_tuple()) >= 1  # pylint: disable=protected-access
    return v.dtype == tf.variant and v.shape.rank is not None and v.shape.rank >= 1


def _as_rows(b, size):
    """A value as rows: an unbatched variant repeated, a batched list (pfor's) taken apart
    per example."""
    if is_rows(b):
        return b.value
    if not b.batched:
        return tf.stack([b.value] * size)
    dtype = _list_dtype(b.value)
    parts = _optional_parts(b.value) if dtype is None else None
    if parts is not None:
        return tf.stack([_optional_example(b.value, i, parts) for i in range(size)])
    if dtype is None:
        raise ValueError(
            "oh.vectorized_map: a per-example Optional (one variant holding every example's "
            "values) meets per-example variants of its own in control flow; they cannot be "
            "joined")
    return tf.stack([_list_example(b.value, i, dtype) for i in range(size)])


_STATE_WRITERS = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                  "ResourceStridedSliceAssign", "LookupTableInsert", "LookupTableRemove",
                  "LookupTableImport", "TensorArrayWrite", "TensorArrayScatter")


def _resource_key(handle):
    """What identifies the variable (table) behind a resource handle: each use of a
    captured variable brings its handle on as a new tensor, so eagerly its serialized
    ResourceHandle (device, container, name); in a function being replayed the handle."""
    if isinstance(handle, _ops.EagerTensor):
        return tf.io.serialize_tensor(handle).numpy()
    return handle.ref()  # a symbolic tensor


_RESOURCE_ENUM = tf.resource.as_datatype_enum


def _is_resource(t):
    """Whether `t` is a resource handle, cheaply for eager tensors (their `dtype` is a
    Python property, and DType's `==` too: this runs per input and output of every op)."""
    if type(t) is _ops.EagerTensor:
        return t._datatype_enum() == _RESOURCE_ENUM  # pylint: disable=protected-access
    return t.dtype == tf.resource


def _writes_state(op_type):
    """Whether an op of this type updates a variable or table given as an input."""
    return op_type.startswith(_STATE_WRITERS)


# -- per-signature plans -------------------------------------------------------

_FALLBACK = "fallback"  # VectorizedMap._execute_generic: checks everything per op
# (op type, attributes if the plan reads them, per input: batched, dtype enum, rank) ->
# FORWARD, UNBATCHED, RULE
# or _FALLBACK: what the handler does with ops of that signature (batching_rules.plan_of),
# decided once instead of per op. Bounded: a program has a few hundred signatures.
_plans = BoundedCache("vectorized_map.plans", 8192)
_EagerTensor = _ops.EagerTensor
_value_of = operator.attrgetter("value")  # Batched.value, in C


def _plan(op, inputs):
    """The plan of `op`'s signature: ops that may update state always take the generic
    path (its per-variable order checks)."""
    if _writes_state(op.type) or any(is_rows(b) for b in inputs):
        return _FALLBACK
    return plan_of(op, inputs) or _FALLBACK


class VectorizedMap(OpHandler):
    """Runs every op of its scope once on a batch of `size` examples.

    Use it through `oh.vectorized_map(fn, elems)`, which brings `elems` on as batched
    tensors.

    Examples:
        >>> vm = oh.vectorized_map(lambda x: x * 2.0, tf.constant([1.0, 2.0, 3.0]))
        >>> vm.numpy().tolist()
        [2.0, 4.0, 6.0]
    """

    transparent = False
    TYPE_NAME = "VECTORIZED_MAP"
    # Read by oh.GradientTape: a target's default output gradient (ones) may be a cached
    # constant copied onto this stack (unbatched), as `ones_like` here gives.
    constant_seeds = True
    # Read by oh.GradientTape: Add/Sub gradients take their reduction axes from the
    # static (per-example) shapes, as graph gradients do (gradient_tape/static_gradients.py).
    static_shape_gradients = True
    # Read by oh.GradientTape's C record path: a physical input the tape does not track
    # comes to `execute` as it is (copied on here, unbatched) instead of through the
    # tape's copy_on, and the tape's record keeps it physical (core/recording.py).
    tape_copies_through = True
    # tf.vectorized_map traces the mapped function: ops reaching a handler below through
    # this scope are differentiated there as ops of a function.
    counterpart_traces = True
    # copy_on of a physical tensor over PHYSICAL, called by the C++ path without a frame.
    physical_copy_on = staticmethod(functools.partial(Batched, batched=False))  # (C: no frame)

    def __init__(self, size, fallback_to_while_loop=True, warn=True):
        self.size = int(size)
        self.fallback_to_while_loop = fallback_to_while_loop
        self.warn = warn
        # Variables (tables) used in this map: [(op type, resource handles)], and those
        # updated once per example: resource key -> op type.
        self._used = []
        self._written = {}
        self._created = set()  # keys of the variables created in the map

    def _check_state_order(self, op, resources):
        """Refuses what makes the map differ from tf.map_fn, which runs the whole function
        per example: an update of a variable the map also used earlier (every example's
        use saw the value before all updates, not the updates of earlier examples), or a
        use after the update (it would see all examples' updates)."""
        keys = [_resource_key(r) for r in resources]
        for key in keys:
            if key in self._written:
                raise ValueError(
                    "oh.vectorized_map: op %s uses a variable (or table) that op %s updated "
                    "once per example earlier in the mapped function. Every op runs for the "
                    "whole batch, so it would see all examples' updates, not only those of "
                    "the examples before it as in tf.map_fn; use tf.map_fn, or use the "
                    "variable outside the map" % (op.type, self._written[key]))
        if not _writes_state(op.type):
            return
        for used_type, used in self._used:
            if any(_resource_key(r) in keys for r in used):
                raise ValueError(
                    "oh.vectorized_map: op %s updates once per example a variable (or table) "
                    "that op %s used earlier in the mapped function. Every op runs for the "
                    "whole batch, so that use saw none of the updates, not those of the "
                    "examples before it as in tf.map_fn; use tf.map_fn, or update the "
                    "variable outside the map" % (op.type, used_type))
        for key in keys:
            self._written[key] = op.type

    def debug_string(self):
        return "VectorizedMap(size=%d)" % self.size

    # Per-example view of a batched value.
    def value_dtype(self, value):
        v = value.value  # (dtype_of, inlined: called for every output the map wraps)
        return DTYPES[v._datatype_enum()] if type(v) is _EagerTensor else v.dtype  # pylint: disable=protected-access

    def num_dims(self, value):
        shape = static_shape(value.value)
        if shape is None:
            return -1
        return len(shape) - 1 if value.batched else len(shape)

    def dim(self, value, index):
        d = static_shape(value.value)[index + 1 if value.batched else index]
        return -1 if d is None else d

    def value_shape(self, value):
        """The per-example shape (a tuple, None for unknown dims or rank), as
        `tensor._shape_tuple()` gives it through num_dims/dim; read by oh.GradientTape's
        static-shape gradients (gradient_tape/static_gradients.py) without those per-axis trips."""
        v = value.value  # (static_shape, inlined for eager tensors: once per shape query)
        shape = v._shape_tuple() if type(v) is _EagerTensor else static_shape(v)  # pylint: disable=protected-access
        return shape[1:] if shape is not None and value.batched else shape

    def static_value(self, value):
        return None if value.batched else tf.get_static_value(value.value)

    def tensor_debug_string(self, value):
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        text = ops.value_text(value.value)
        return "VectorizedMap(%s): %s" % ("batched" if value.batched else "unbatched", text)

    def copy_on(self, tensor):
        source = _stack_of(tensor)
        below = next_stack()
        if source is None and below is PHYSICAL:
            return Batched(tensor, False)  # (PHYSICAL's copy_on of a physical tensor)
        if source is not None and source.handler is self:
            b = source.unwrap(tensor)
            return Batched(below.copy_on(b.value), b.batched)
        return Batched(below.copy_on(tensor), False)

    def copy_off(self, value, device):
        if value.batched:
            raise errors.CopyOffError(
                "oh.vectorized_map: a per-example tensor cannot be copied off inside the "
                "mapped function (it has one value per example); return it from the "
                "function instead of calling .numpy() or using it in Python control flow")
        return value.value

    def represented_value(self, value):
        # What carries a per-example value below the map (which does not copy it off):
        # its batched tensor, one row per example.
        return value.value

    # Copy ops inside the map act per example: a gradient computed inside the mapped
    # function (CopyOnGrad of a captured tensor) stays one value per example. (True,
    # not a method: the C++ per-op path runs them through `execute` without frames.)
    handles_copy = True

    changes_computation = False  # runs each op as it is, batched

    def execute(self, op, inputs):
        frames = _state.frames  # (next_stack(), inlined: this runs for every op)
        below = frames[-1].next if frames else next_stack()
        execute = below.execute
        plan = _FALLBACK
        # The plan's key (see _plans; attributes only for ATTRIBUTE_PLANS, reading them
        # costs a serialization), built inline: this runs for every op. An input that is
        # not an eager tensor (a function being replayed) takes _FALLBACK.
        sig = []
        for b in inputs:
            v = b.value
            if type(v) is not _EagerTensor:
                break
            sig.append((b.batched, v._datatype_enum(), len(v._shape_tuple())))  # pylint: disable=protected-access
        else:
            op_type = op.type
            key = (op_type, op.attrs_key() if op_type in ATTRIBUTE_PLANS else None, tuple(sig))
            plan = _plans.get(key)
            if plan is None:
                plan = _plans[key] = _plan(op, inputs)
        if plan is FORWARD or plan is UNBATCHED:
            values = list(map(_value_of, inputs))  # (no comprehension frame)
            if below is PHYSICAL and _state.mode is None and op.type not in COPY_OPS:
                # PHYSICAL.execute's eager case, without its frame (eager inputs: a plan)
                outputs = _execute_physical(op, values, _state.device)
            else:
                outputs = execute(op, values)
            if plan is FORWARD:  # every output batched, the values as they are
                if len(outputs) == 1:  # (the common case, without a comprehension frame)
                    return [Batched(outputs[0], True)]
                return [Batched(o, True) for o in outputs]
            return self._unbatched(outputs)  # no batched or resource input: as it is
        if plan is RULE:
            return self._batched(execute, op, inputs)
        return self._execute_generic(execute, op, inputs)

    def _execute_generic(self, execute, op, inputs):
        """Every case (variables and tables, random ops, replayed functions' symbolic
        tensors); `execute` takes the others through cached plans (`_plan`)."""
        resources = [b.value for b in inputs if not b.batched and _is_resource(b.value)]
        if _writes_state(op.type) and not (
                self._created and all(_resource_key(r) in self._created for r in resources)):
            # The mapped function runs once per example (tf.map_fn's result): so does an
            # update of a variable or table. (pfor would apply a per-example update once,
            # with example 0's value, silently; tf.vectorized_map does.)
            self._check_state_order(op, resources)
            rows = [execute(op, [b.value[i] if b.batched else b.value for b in inputs])
                    for i in range(self.size)]
            return _stack_rows(op.type, rows)
        if resources:
            if self._written:
                self._check_state_order(op, resources)
            self._used.append((op.type, resources))
        if any(b.batched for b in inputs) or op.type in ALWAYS_BATCHED:
            if op.type not in _CONTROL_FLOW and any(is_rows(b) for b in inputs):
                # Per-example variants (rows): no rule or pfor converter takes them.
                return _per_example_loop(self, execute, op, inputs, report=False)
            return self._batched(execute, op, inputs)
        return self._unbatched(execute(op, [b.value for b in inputs]))

    def _unbatched(self, outputs):
        """The outputs of an op without batched inputs. Resource handles stay on the next
        stack (variables created inside; their initialization is not a per-example
        update)."""
        results = []
        for o in outputs:
            if _is_resource(o):
                self._created.add(_resource_key(o))
                results.append(o)
            else:
                results.append(Batched(o, False))
        return results

    def _batched(self, execute, op, inputs):
        """`op` on a batched input (or a random op): its rule, else pfor's converter,
        else a loop over the examples."""
        result = None
        rule = RULES.get(op.type)
        if rule is not None:
            result = rule(self, execute, op, inputs)
        if result is None and is_list_op(op.type):
            return _converted_list_op(self, op, inputs)
        if (result is None and op.output_dtype_enums is not None
                and op.type not in _CONTROL_FLOW):
            result = _converted_by_pfor(self, execute, op, inputs)
        if result is None:
            if not self.fallback_to_while_loop:
                raise ValueError(
                    "oh.vectorized_map: op %s has no batching rule and pfor cannot "
                    "convert it; pass fallback_to_while_loop=True to run it once per "
                    "example" % op.type)
            result = _per_example_loop(self, execute, op, inputs)
        return result

    # -- functions (core/functions): a tf.function called in the map is replayed with
    # its arguments batched or not; cond branches and loops that disagree broadcast.

    # A tf.function using TensorLists (tf.TensorArray, tf.map_fn, tf.scan) is replayed
    # too: its list ops take pfor's converters one by one (_converted_list_op).
    replays_functions = True

    # Rows (per-example variants, `is_rows`) cross function and control-flow boundaries
    # as one list of them, summary ("rows", per-example shape): a [batch] variant
    # function output has no zeros TensorFlow's function gradient could give it, a list
    # of variants does.

    def function_input(self, value):
        if value.batched and is_rows(value):
            v = value.value
            shape = tuple(v.shape[1:].as_list()) if v.shape[1:].is_fully_defined() else None
            return ("rows", shape), [tf.raw_ops.TensorListFromTensor(
                tensor=v, element_shape=tf.constant(-1 if shape is None else shape, tf.int32))]
        return value.batched, [value.value]

    def function_output(self, summary, tensors):
        if type(summary) is tuple:
            shape = summary[1]
            rows = tf.raw_ops.TensorListStack(
                input_handle=tensors[0], element_dtype=tf.variant,
                element_shape=tf.constant(-1 if shape is None else shape, tf.int32),
                num_elements=self.size)
            return Batched(rows, True)
        return Batched(tensors[0], summary)

    def function_join(self, summaries):
        rows = [s for s in summaries if type(s) is tuple]
        if rows:
            return rows[0] if all(s == rows[0] for s in rows) else ("rows", None)
        return any(summaries)

    def function_coerce(self, value, summary):
        if type(summary) is tuple:
            return Batched(_as_rows(value, self.size), True)
        return Batched(broadcast_batch(value, self.size), True) if summary else value

    def function_cache_key(self):
        return ("VectorizedMap", self.size, self.fallback_to_while_loop)


def _batchable_spec(value, where):
    """The `BatchableTypeSpec` of a composite tensor (pfor maps a composite through its
    spec's tensor lists), None for anything else; a clear error for a composite that
    has none, as tf.vectorized_map gives."""
    if (not isinstance(value, _composite_tensor.CompositeTensor)
            or isinstance(value, (tf.Variable, tf.IndexedSlices))):
        return None  # (IndexedSlices: converted to dense, as before; pfor refuses them)
    spec = value._type_spec  # pylint: disable=protected-access
    if not isinstance(spec, _type_spec.BatchableTypeSpec):
        raise ValueError(
            "oh.vectorized_map: CompositeTensor instance %r %s must provide a "
            "`BatchableTypeSpec` (saw: %s)" % (value, where, spec))
    return spec


def _dense_elem(e):
    """`e` (a part of vectorized_map's `elems`) as a dense tensor, or a clear error."""
    try:
        return tf.convert_to_tensor(e)
    except (TypeError, ValueError) as error:
        raise TypeError("oh.vectorized_map: elems must be tensors (or nested structures of "
                        "them); cannot convert %r to a tensor: %s" % (e, error)) from None


def _leaves(elems):
    """`elems` flattened: dense tensors, and each composite tensor as its per-example
    spec and its batched component tensors (as pfor takes them apart)."""
    leaves, parts = [], []
    for e in nest.flatten(elems):
        spec = _batchable_spec(e, "in elems")
        if spec is None:
            leaves.append(None)
            parts.append([_dense_elem(e)])
        else:
            leaves.append(spec._unbatch())  # pylint: disable=protected-access
            tensors = spec._to_batched_tensor_list(e)  # pylint: disable=protected-access
            parts.append([tf.convert_to_tensor(t) for t in tensors])
    return leaves, parts


def vectorized_map(fn, elems, fallback_to_while_loop=True, warn=True):
    """`tf.vectorized_map`, eagerly: `fn` runs once, each op on the whole batch.

    The arguments are `tf.vectorized_map`'s. `fallback_to_while_loop`: an op without a
    batching rule that pfor cannot convert runs once per example (a loop); if False it
    raises ValueError naming the op. `warn`: report each such fallback, once per op type,
    as a warning of the `tf_ophandlers` logger (TensorFlow's own pfor error dumps are
    never printed).

    `elems` is a tensor or nested structure of tensors with a common leading (batch)
    dimension; `fn` receives one example (the structure of `elems`, per-example shapes)
    and may capture other tensors. Returns the structure of `fn`'s outputs with the
    batch dimension first.

    Inside a function being traced it is `tf.vectorized_map` (pfor on the graph). When
    `fn` is a `tf.function`, its call is replayed once through the vectorizing handler into
    a cached, handler-free function (core/functions): later calls with the same specs run
    at graph speed, with `fn` traced once, not at every call.

    Examples:
        >>> w = tf.Variable([1.0, 2.0])
        >>> def grad(x):
        ...     with oh.GradientTape() as tape:
        ...         loss = tf.reduce_sum(w * x)
        ...     return tape.gradient(loss, w)
        >>> oh.vectorized_map(grad, tf.constant([[1.0, 0.0], [0.0, 3.0]])).numpy().tolist()
        [[1.0, 0.0], [0.0, 3.0]]
    """
    if tf.executing_eagerly() and _tf_tape_set_is_empty():
        # First and in a helper, so that this frame (and _run's) stay at a small bytecode
        # offset while fn's ops run: TensorFlow captures the line numbers of up to 30
        # Python frames for every eager op (TFE_Py_FastPathExecute's stack trace), each
        # by a scan of the frame's line table up to its current instruction.
        if isinstance(fn, _Function):
            return _run_function(fn, elems, fallback_to_while_loop, warn)
        return _run(fn, elems, fallback_to_while_loop, warn)
    # Traced: pfor on the graph. Under a tf.GradientTape (or TensorFlow's forward
    # accumulator): TensorFlow's tapes record by Python object and would see none of
    # the handler's ops (a None gradient, silently), so TensorFlow's own map runs.
    with own_trace():  # pfor's function (eagerly) is not the program's step
        return tf.vectorized_map(fn, elems, warn=warn,
                                 fallback_to_while_loop=fallback_to_while_loop)


def _batch_of(elems, fallback_to_while_loop, warn):
    """`elems` flattened (see `_leaves`), the dense tensors among them in one list, and
    the handler for their common batch size (or a clear error)."""
    leaves, parts = _leaves(elems)
    flat = [t for ts in parts for t in ts]
    if not flat:
        raise ValueError("oh.vectorized_map: elems must contain at least one tensor")
    if any(e.shape.rank == 0 for e in flat):
        raise ValueError("oh.vectorized_map: elems must have a leading (batch) dimension, "
                         "got a scalar")
    sizes = {int(e.shape[0]) for e in flat if e.shape.rank and e.shape[0] is not None}
    if len(sizes) == 2 and 1 in sizes:
        # tf.vectorized_map maps over the largest leading dimension and gathers example i
        # of a unit one as example 0 (pfor's gather): unit leading dimensions broadcast.
        size = max(sizes)
        flat = [tf.broadcast_to(e, tf.concat([[size], tf.shape(e)[1:]], 0))
                if e.shape[0] == 1 else e for e in flat]
        sizes = {size}
    if len(sizes) != 1:
        raise ValueError("oh.vectorized_map: elems need one static leading dimension (or "
                         "a leading dimension of 1, which broadcasts), got shapes %s"
                         % [e.shape for e in flat])
    return leaves, parts, flat, VectorizedMap(sizes.pop(), fallback_to_while_loop, warn)


def _output_parts(t):
    """An output of `fn`, read inside the map: a variable is read there (as tf.map_fn
    reads it per example; read after the scope it would give the final value for every
    example), a composite tensor is taken apart into its spec's tensor list (pfor's
    way), anything else is kept."""
    if isinstance(t, tf.Variable):
        return tf.convert_to_tensor(t)
    spec = _batchable_spec(t, "returned from the function mapped by oh.vectorized_map")
    if spec is None:
        return t
    return _CompositeOutput(spec, spec._to_tensor_list(t))  # pylint: disable=protected-access


class _CompositeOutput:
    """A composite output of `fn`: its per-example spec and component tensors."""
    __slots__ = ("spec", "tensors")

    def __init__(self, spec, tensors):
        self.spec, self.tensors = spec, tensors


def _run(fn, elems, fallback_to_while_loop, warn, raw=None):
    """`raw`: a list `fn`'s result (as `fn` returned it, in the map) is appended to."""
    leaves, parts, flat, handler = _batch_of(elems, fallback_to_while_loop, warn)
    with _scope.handler(handler) as stack:
        wrapped = [stack.wrap(Batched(stack.next.copy_on(e), True)) for e in flat]
        if any(spec is not None for spec in leaves):  # composites: rebuilt per example
            per_example, at = [], 0
            for spec, ts in zip(leaves, parts):
                group, at = wrapped[at:at + len(ts)], at + len(ts)
                # pylint: disable-next=protected-access
                per_example.append(group[0] if spec is None else
                                   spec._from_compatible_tensor_list(group))
            wrapped = per_example
        result = fn(nest.pack_sequence_as(elems, wrapped))
        if raw is not None:
            raw.append(result)
        outputs = nest.map_structure(_output_parts, result)

    def unbatch(t):
        if t is None:
            return None
        if isinstance(t, _CompositeOutput):
            batched_spec = t.spec._batch(handler.size)  # pylint: disable=protected-access
            return batched_spec._from_compatible_tensor_list(  # pylint: disable=protected-access
                [unbatch(c) for c in t.tensors])
        t = tf.convert_to_tensor(t)
        found, value = representation_of(handler, t)
        return broadcast_batch(value if found else Batched(t, False), handler.size)

    return nest.map_structure(unbatch, outputs)


# -- fn a tf.function: its replayed call, run without the scope ----------------------------
#
# `_run` over a tf.function is one call op, replayed once into a cached function
# (core/functions): a later call with the same arguments runs that entry, but first pays
# the handler scope, TensorFlow's dispatch of the call on handler tensors (binding them
# and building their trace types), the custom device's round trip, the splits and
# rebuilds of the representations and the unbatching, about as much again as a small
# model's replayed function itself. A *call plan* records, from a first call through
# `_run`, which replay-cache entry the call came to and how its outputs form `fn`'s
# result; later calls with the same function, argument specs and context run that
# entry directly. Every call checks what would make `_run` do something else
# (`_call_plan_key`, `_run_function`, `_run_plan`); `_run` takes over where it would.

_Function = _polymorphic.Function
_EagerTensor = _ops.EagerTensor
# (id(fn), type(elems), per tensor (dtype enum, shape), fallback_to_while_loop, device)
# -> _CallPlan (its entry None where `_run` cannot be skipped; reconsidered when fn
# traces again)
_call_plans = BoundedCache("vectorized_map.function_calls", 256)


class _CallPlan:
    """What `oh.vectorized_map(fn, elems)` came to for one key of `_call_plans`: `fn`
    and its tracing count then (weakly: the plan must not keep a dropped function's
    captures alive), and unless `key` is None (`_run` cannot be skipped: checked again
    when `fn` traces again), the concrete function called (weakly), its captures'
    cache-key parts, the replay-cache key it ran and its entry's output trees (not the
    entry: a replay the replay cache drops, with its function in TensorFlow's context,
    must not stay alive here), the batch size, whether each output is batched, and
    `fn`'s result as the positions of those outputs (-1: None) in its structure."""

    __slots__ = ("fn", "tracing_count", "function", "captures", "key", "output_trees",
                 "size", "batched", "order", "structure")

    def __init__(self, fn):
        self.fn = weakref.ref(fn)
        self.tracing_count = fn.experimental_get_tracing_count()
        self.key = None


def _call_plan_key(fn, elems, fallback_to_while_loop):
    """The `_call_plans` key of a call and its flat tensors, or (None, None) where the
    call must take `_run` (functions run eagerly, an open handler scope or replay, op
    callbacks that see every op, `elems` other than eager tensors in a flat tuple or
    list)."""
    if (_eager_run.RUN_FUNCTIONS_EAGERLY or _state.current is not PHYSICAL
            or _state.mode is not None or _state.frames
            or _context.context().op_callbacks):
        return None, None
    kind = type(elems)
    if kind is _EagerTensor:
        flat = (elems,)
    elif (kind is tuple or kind is list) and elems and all(
            type(e) is _EagerTensor for e in elems):
        flat = elems
    else:
        return None, None
    sig = tuple((e._datatype_enum(), e._shape_tuple()) for e in flat)  # pylint: disable=protected-access
    return (id(fn), kind, sig, fallback_to_while_loop, _state.device), flat


def _run_function(fn, elems, fallback_to_while_loop, warn):
    key, flat = _call_plan_key(fn, elems, fallback_to_while_loop)
    if key is None:
        return _run(fn, elems, fallback_to_while_loop, warn)
    plan = _call_plans.get(key)
    if (plan is not None and plan.fn() is fn
            and plan.tracing_count == fn.experimental_get_tracing_count()):
        if plan.key is None:
            return _run(fn, elems, fallback_to_while_loop, warn)
        outputs = _run_plan(plan, flat)
        if outputs is not None:
            return outputs
    raw = []
    with _function_call.observe_calls() as calls:
        result = _run(fn, elems, fallback_to_while_loop, warn, raw)
    _call_plans[key] = _make_plan(fn, elems, flat, calls, raw)
    return result


def _run_plan(plan, flat):
    """`fn`'s result from the plan's replayed function, or None where the plan no longer
    applies (the concrete function was dropped, its captures changed, its replay left the
    replay cache)."""
    function = plan.function()
    if function is None:
        return None
    captured = function.captured_inputs
    if tuple(map(eager_leaf, captured)) != plan.captures:
        return None
    entry = _function_call.cached_entry(plan.key)
    if entry is None or entry.output_trees != plan.output_trees:
        return None
    results = entry.compiled.run(PHYSICAL, list(flat) + captured)
    size = plan.size
    batched = plan.batched
    values = [None if k < 0 else results[k] if batched[k]
              else broadcast_batch(Batched(results[k], False), size) for k in plan.order]
    return nest.pack_sequence_as(plan.structure, values)


def _make_plan(fn, elems, flat, calls, raw):
    """The call plan `_run`'s call of `fn` on `elems` shows (`calls`: the replayed calls
    observed, `raw`: `fn`'s result as `fn` returned it, in the map); one with no entry
    when the call was anything but `fn`'s one replayed call on the map's stack alone, on
    `elems` and the function's captures, whose outputs are `fn`'s result."""
    plan = _CallPlan(fn)
    if len(calls) != 1 or len(raw) != 1:
        return plan
    call = calls[0]
    if (call.bottom is not PHYSICAL or len(call.segment) != 1
            or not isinstance(call.segment[0].handler, VectorizedMap)):
        return plan
    handler = call.segment[0].handler
    try:
        # (TensorFlow's dispatch of the call: the same specs, the same function)
        specs = [tf.TensorSpec(e.shape[1:], e.dtype) for e in flat]
        function = fn.get_concrete_function(
            specs[0] if type(elems) is _EagerTensor else type(elems)(specs))
    except Exception:  # pylint: disable=broad-except
        return plan  # (what _run did stands; only the shortcut is given up)
    if (_as_str(function.function_def.signature.name) != _as_str(call.name)
            or fn.experimental_get_tracing_count() != plan.tracing_count):
        return plan
    captured = function.captured_inputs
    leaves = call.leaves
    if (len(leaves) != len(flat) + len(captured)
            or any(a is not b for a, b in zip(leaves, flat))
            or any(eager_leaf(a) != eager_leaf(b)
                   for a, b in zip(leaves[len(flat):], captured))):
        return plan
    batched = []
    for tree in call.entry.output_trees:
        if tree[0] == "leaf":  # a tensor below the map: unbatched
            batched.append(False)
        elif (tree[0] == 0 and len(tree[2]) == 1 and tree[2][0][0] == "leaf"
              and type(tree[1]) is bool):  # (not rows: their part is a list of them)
            batched.append(tree[1])
        else:
            return plan
    # fn's result: its tensors are the call's outputs (the same representations), in
    # order; None stays None
    outputs = [representation_of(handler, t) for t in call.outputs]
    order = []
    for leaf in nest.flatten(raw[0]):
        if leaf is None:
            order.append(-1)
            continue
        k = len(order) - order.count(-1)
        if k >= len(outputs) or not isinstance(leaf, tf.Tensor):
            return plan
        found, value = representation_of(handler, leaf)
        if not (found and outputs[k][0] and value is outputs[k][1]):
            return plan
        order.append(k)
    if len(order) - order.count(-1) != len(outputs):
        return plan
    plan.function = weakref.ref(function)
    plan.captures = tuple(map(eager_leaf, captured))
    plan.size, plan.batched, plan.order = handler.size, batched, order
    plan.structure = nest.map_structure(lambda _: 0, raw[0])
    plan.output_trees = call.entry.output_trees
    plan.key = call.key
    return plan


_registries.register_vectorizer(vectorized_map)
