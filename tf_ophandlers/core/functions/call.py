"""Function calls under handlers: replay into a handler-free function (RFC "Replay before
function execution", DESIGN.md decision 5). Registered with the stacks as their
function-call rule.

A `tf.function` call reaches a stack as one op named after the function
(``__inference_f_123``). Unless the stack's handler takes call ops whole
(``replays_functions = False``: tapes, parallel handlers), the call is *replayed*:

1. The *segment* is the run of replaying handlers from the stack down; the *bottom* is
   the stack below it (PHYSICAL, or a tape that takes calls whole).
2. Each argument is split by its handlers' `function_input` hooks into tensors of the
   bottom plus a summary tree (representations.py); the summaries and the bottom
   tensors' specs key the cache.
3. On a miss, a `tf.function` over the bottom tensors is traced with the symbolic mode
   active (symbolic.py): the body is interpreted node by node through the segment's
   stacks (interpreter.py, control_flow.py); what reaches the bottom becomes the body.
4. The replayed ConcreteFunction is called on the bottom stack (so a tape there records
   it with TensorFlow's function gradient; for TensorFlow's forward function of a call
   a tape records, with recording on: call_records.py), and its results are rebuilt
   into the segment's representations.

A cache hit costs the splits, one dictionary lookup and one function call.
"""
import contextlib
import threading
import weakref

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import handle_data_util as _handle_data_util

import tf_ophandlers._C as _C
from tf_ophandlers.core import errors
from tf_ophandlers.core import registries as _registries
from tf_ophandlers.core import scope as _scope
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.cache import BoundedCache, LRUCache
from tf_ophandlers.core.dispatch import DISPATCHER_DEVICE
from tf_ophandlers.core.functions import call_records, library
from tf_ophandlers.core.functions import iterator_reads as _iterator_reads
from tf_ophandlers.core.functions import retrace as _retrace
from tf_ophandlers.core.functions import ungated as _ungated
from tf_ophandlers.core.functions.control_flow import as_list
from tf_ophandlers.core.functions.representations import (
    call_joins, count_leaves, eager_leaf, graph_leaf, rebuild, split)
from tf_ophandlers.core.functions.symbolic import Replay, active
from tf_ophandlers.core.op import Op, OptimizedCallOp
from tf_ophandlers.core.stack import (
    PHYSICAL, HandlerStack, register_function_call_rule, replays)
from tf_ophandlers.core.state import state

# Keyed by everything a replay depends on: the function, placement, device, argument
# summaries and specs, the handlers' cache keys and types, and the bottom stack's
# structure (`_bottom_key`).
_cache = LRUCache("functions.replays", 512)  # key -> _Entry
# Names of functions standing for ops run one by one (CompiledCall(op_by_op=True)): their
# replay gives no call semantics (an accumulator's zero tangents for the arguments).
_op_by_op = weakref.WeakValueDictionary()  # name -> CompiledCall


class CompiledCall:
    """A ConcreteFunction built by a handler (a replay, Lazy's pending ops), run on a stack.

    On physical devices it runs as one op, without ConcreteFunction's Python call path
    (tapes above recorded the original call); with `ungated`, that op calls a copy of the
    function without the output gate of automatic control dependencies (ungated.py: one
    NoOp collecting every stateful op, cross-device edges in a multi-device function). On
    a handler stack it goes through that path, so that a tape there records it with
    TensorFlow's function gradient.

    `optimized=True` (replays) gives the op the attributes TensorFlow's own call path
    gives a function call (the context's `config_proto` and `executor_type`): without
    them the runtime instantiates the function without grappler (no Conv2D+BiasAdd
    fusion, no pruning), so a replay ran slower than the function it replays. The op is
    rebuilt when the context's function options change (it is the runtime's kernel
    cache key). Handlers building many small throwaway functions keep the default
    (no grappler pass at each new function).
    """

    __slots__ = ("function", "call_op", "captured", "optimized", "ungated", "_optimized_op",
                 "__weakref__")

    def __init__(self, function, optimized=False, ungated=False, op_by_op=False):
        self.function = function  # owns the function registered in the context
        if op_by_op:  # (its ops as if run eagerly, e.g. oh.Recompute's gradient of a segment)
            for f in (function, getattr(function, "_inference_function", None)):
                if f is not None and hasattr(f, "name"):
                    _op_by_op[_as_str(f.name)] = self
        self.captured = list(function.captured_inputs)
        self.ungated = _ungated.ungated_copy(function) if ungated else None
        if self.ungated is not None:  # removed from the context with this call
            weakref.finalize(self, _ungated.remove, self.ungated)
        signature = self.function.function_def.signature
        name, count = self.ungated or signature.name, len(signature.output_arg)
        self.call_op = Op.function_call(name, count)
        self.optimized = optimized
        self._optimized_op = OptimizedCallOp(name, count) if optimized else None

    def op(self):
        """The op that calls the function on physical devices."""
        optimized = self._optimized_op
        return self.call_op if optimized is None else optimized.op()

    def run(self, stack, args):
        """The outputs of the function called on `args` (tensors) on `stack`."""
        if stack is PHYSICAL:
            return PHYSICAL.execute(self.op(), list(args) + self.captured)
        return call_on(stack, self.function, args)


def _as_bytes(value):
    return value if isinstance(value, bytes) else value.encode()


_as_str = library.as_str


class _Entry:
    __slots__ = ("compiled", "output_trees", "dense", "tangents", "substituted")

    def __init__(self, function, output_trees, dense=False, optimized=True, tangents=(),
                 substituted=""):
        self.compiled = CompiledCall(function, optimized=optimized, ungated=True)
        self.output_trees = output_trees
        # Tangents reach the arguments: tapes get dense gradients (call_records.py).
        self.dense = dense
        self.tangents = tangents  # the positions of flat outputs that are tangents
        self.substituted = substituted  # Replay.substituted


def cache_info():
    """Number of replayed functions cached (for tests and benchmarks)."""
    return len(_cache)


def clear_cache():
    _cache.clear()
    library.clear()


def _drop_replays_of(name):
    """Drops the replays of function `name`, which TensorFlow removed (library.py)."""
    for cache in (_cache, _call_ops):
        for key in [k for k in list(cache.keys()) if _as_str(k[0]) == name]:
            cache.pop(key, None)


library.on_release(_drop_replays_of)


def _segment(stack, op):
    """The stacks replaying `op` from `stack` down (top first), and the stack below."""
    segment = []
    while isinstance(stack, HandlerStack) and replays(stack.handler, op):
        segment.append(stack)
        stack = stack.next
    return segment, stack


def call(stack, op, inputs):
    """Runs function call `op` placed on `stack` by replaying it; returns its outputs."""
    segment, bottom = _segment(stack, op)
    if not call_records.is_forward_call(op.type):
        return _call(stack, op, inputs, segment, bottom)
    # TensorFlow's forward function of a call a tape records (call_records.py): tapes at
    # the bottom record the copies of the arguments and the replayed function itself,
    # TensorFlow's tapes the original call with its backward replayed on this stack.
    with call_records.recording_restarted() if bottom is not PHYSICAL else _no_context:
        outputs, dense = _call(stack, op, inputs, segment, bottom, with_dense=True)
    call_records.note_replayed_call(op.type, stack, dense)
    return outputs


_no_context = contextlib.nullcontext()


def _tf_tapes_exist():
    """Whether TensorFlow has a tape or accumulator on this thread (recording or not:
    TensorFlow runs a recorded call's forward function with recording stopped)."""
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        return not pywrap_tfe.TFE_Py_TapeSetIsEmpty()
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def _bottom_key(bottom):
    """What a replay depends on of the stack below its segment. Ops that reach the bottom
    while the replay is traced become nodes of the function, and the call runs there
    whole: a handler there that takes calls whole (a tape) counts by its type only, so a
    new tape per training step reuses the replay. A handler there that replays calls
    keeps its cache key: a handler scope opened inside the function is merged onto the
    bottom unless that very handler is in it already (interpreter.py, traced_stack)."""
    if bottom is PHYSICAL:
        return 0
    return tuple((type(h), h.function_cache_key() if h.replays_functions is True else None)
                 for h in bottom.handlers)


def _call(stack, op, inputs, segment, bottom, with_dense=False):
    scope_placed = state.scope_placed
    if scope_placed and not all(s.default_copy_on for s in segment):
        # As for any op placed by a scope, the arguments are copied onto the stack first
        # (a watched primal gets its tangent, from any handler of the segment). With the
        # default copy-on everywhere that would only wrap a tensor that the split below
        # unwraps again.
        inputs = [stack.copy_on(t) if stack.wants_copy(op, i) else t
                  for i, t in enumerate(inputs)]
    leaves = []
    trees = []
    for t in inputs:
        # (Eager: `_C.payload` is the whole of `stack.payload`. A tensor with no payload,
        # typically a variable's handle or the model's input, is a leaf without a frame.)
        trees.append(split(t, segment, eager_leaf, leaves) if _C.payload(t) is not None
                     else eager_leaf(t, leaves))
    fed = None
    if _iterator_reads.wanted(stack) is not None and not any(
            getattr(s, "_substituting", False) for s in segment):
        found = _iterator_reads.reads(_as_str(op.type))
        if found:  # fetched now, passed as arguments (iterator_reads.py)
            fed, elements = _iterator_reads.fetch(stack, _as_str(op.type), inputs, found)
            trees.extend(split(t, segment, eager_leaf, leaves) for t in elements)
    if len(segment) == 1:
        handler = segment[0].handler
        handlers = (handler.function_cache_key(), type(handler))
    else:
        handlers = (tuple(s.handler.function_cache_key() for s in segment),
                    tuple(type(s.handler) for s in segment))
    key = (op.type, scope_placed, state.device, tuple(trees), handlers, _bottom_key(bottom))
    entry = _cache.get(key)
    if entry is None:
        entry = _cache[key] = _trace(segment, bottom, scope_placed, op.type, tuple(trees),
                                     leaves, fed)
    if with_dense and entry.substituted and _tf_tapes_exist():
        # TensorFlow's tape records this call with its backward function, built from the
        # function's original ops: it would differentiate what did not run.
        raise errors.HandlerError(
            "tf_ophandlers: %s ran something else in place of op %s of function %s (the "
            "handler may change what ops compute: changes_computation), and a TensorFlow "
            "tape records "
            "the call, whose gradient TensorFlow built from the function's original ops. "
            "Run the function's body eagerly (not as a tf.function) under the tape, or take "
            "the gradient with %s outside the handler's scope."
            % (entry.substituted + (op.type, _registries.tape_name("reverse"))))
    dense = entry.dense
    if bottom is PHYSICAL:
        results = entry.compiled.run(bottom, leaves)
    else:  # a tape at the bottom records the replayed call: dense gradients if `dense`
        with call_records.replay_run(dense, segment, entry.tangents) as run:
            results = entry.compiled.run(bottom, leaves)
        dense = dense or run.nested_dense  # tangents from further down
    it = iter(results)
    outputs = [rebuild(t, segment, it) for t in entry.output_trees]
    seen = getattr(_observed, "calls", None)
    if seen is not None:
        seen.append(ObservedCall(op.type, key, entry, segment, bottom, leaves, outputs))
    return (outputs, dense) if with_dense else outputs


class ObservedCall:
    """A replayed call seen by `observe_calls`: the function's name, its replay-cache key
    and entry, the stacks it replayed on, the bottom tensors it ran on and its outputs."""

    __slots__ = ("name", "key", "entry", "segment", "bottom", "leaves", "outputs")

    def __init__(self, name, key, entry, segment, bottom, leaves, outputs):
        self.name, self.key, self.entry, self.segment = name, key, entry, segment
        self.bottom, self.leaves, self.outputs = bottom, leaves, outputs


_observed = threading.local()  # .calls: the list `observe_calls` fills, on this thread


@contextlib.contextmanager
def observe_calls():
    """Collects the replayed calls of this thread (`ObservedCall`s) while open: for a
    caller that learns once what a call replays to and then runs the cached entry
    itself (`cached_entry`), such as `oh.vectorized_map` over a `tf.function`."""
    saved = getattr(_observed, "calls", None)
    _observed.calls = calls = []
    try:
        yield calls
    finally:
        _observed.calls = saved


def cached_entry(key):
    """The replay-cache entry of `key` (an `ObservedCall.key`), None if it was dropped."""
    return _cache.get(key)


def call_on(bottom, function, args):
    """Calls `function` on the stack `bottom` through ConcreteFunction's call path, so that
    a tape there records it with TensorFlow's function gradient."""
    captured = function.captured_inputs
    # Not `scope.handler(bottom)`: re-entering a stack the current one contains is a
    # no-op, and the call must run below the segment.
    saved = state.current
    state.current = bottom
    device_scope = _scope.original_device_scope(DISPATCHER_DEVICE)
    try:
        with device_scope:
            return as_list(function._call_flat(args, captured))
    finally:
        state.current = saved


# Ops that read or update a variable in place (never change its shape, unlike an
# assignment with validate_shape=False: its variable's current shape may not be the one
# the function gives it).
_VARIABLE_OPS = ("ReadVariableOp", "ResourceGather", "ResourceScatter", "ResourceApply",
                 "ResourceSparseApply")


def _variable_dtype(node):
    """The dtype of the variable(s) a variable op `node` reads or updates (reads and
    scatters: `dtype`; optimizer kernels, whose resource inputs are the variable and its
    slots: `T`), or None for other ops."""
    if not node.type.startswith(_VARIABLE_OPS):
        return None
    for attr in ("dtype", "T"):
        try:
            return node.get_attr(attr)
        except ValueError:
            pass
    return None


# Ops passing an input on to a function's input (loops, conditionals, calls): a resource
# argument read only inside one (pfor's fallback loop around a ResourceGather, OH_FUZZ_SEED=94
# slow case 40) gets its dtype from the reads there.
_FORWARDING = ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
               "PartitionedCall", "StatefulPartitionedCall")


def _read_dtypes(tensor, depth):
    """The dtypes of the variable reads of resource `tensor` in its graph, through
    Identity ops and into the bodies of the functions it is passed to (`depth` levels)."""
    dtypes = set()
    for c in tensor.consumers():
        dtype = _variable_dtype(c)
        if dtype is not None:
            dtypes.add(dtype)
        elif c.type == "Identity":
            dtypes |= _read_dtypes(c.outputs[0], depth)
        elif c.type in _FORWARDING and depth > 0:
            positions = [k for k, t in enumerate(c.inputs) if t.name == tensor.name]
            for attr in ("body", "f", "then_branch", "else_branch", "branches"):
                try:
                    value = c.get_attr(attr)
                except ValueError:
                    continue
                shift = 1 if attr != "body" and attr != "f" else 0  # (the predicate)
                for f in value if isinstance(value, list) else [value]:
                    if not _context.context().has_function(_as_str(f.name)):
                        continue
                    inputs = library.body(_as_str(f.name)).inputs
                    for k in positions:
                        if 0 <= k - shift < len(inputs):
                            dtypes |= _read_dtypes(inputs[k - shift], depth - 1)
    return dtypes


def set_handle_data(placeholder, exterior, argument):
    """Gives a resource placeholder of a replay its variable's dtype and shape (what shape
    inference of reads needs). The FunctionDef does not record it, and the eager handles
    TensorFlow passes to a device do not carry it (it is a Python attribute of a
    variable's own handle): the dtype comes from the reads of the argument in the body,
    the shape from the variable itself."""
    data = _handle_data_util.get_handle_data(exterior)
    if data is not None and data.is_set:
        _handle_data_util.set_handle_data(placeholder, data)
        return
    if argument.dtype != tf.resource:
        return
    dtypes = _read_dtypes(argument, 4)
    if len(dtypes) != 1:
        return
    try:
        with _ops.init_scope():
            shape = tf.raw_ops.VariableShape(input=exterior).numpy()
    except (tf.errors.OpError, ValueError, TypeError):
        return
    from tensorflow.core.framework import cpp_shape_inference_pb2  # pylint: disable=import-outside-toplevel
    data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)
    data.shape_and_type.add(shape=tf.TensorShape(shape).as_proto(),
                            dtype=dtypes.pop().as_datatype_enum)
    _handle_data_util.set_handle_data(placeholder, data)


def _trace(segment, bottom, scope_placed, name, trees, leaves, fed=None):
    """`fed`: {node name: number of outputs} of the iterator reads fetched before the
    call, whose outputs are the arguments after the body's own (iterator_reads.py)."""
    body = library.body(name)
    replay = Replay(segment, bottom, scope_placed, name)
    output_trees = []
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in leaves]
    # A substituting handler over a function holding gradient ops: its Python body is
    # traced again under the handlers, so the tape inside records what they run. Other
    # replays (pass-through handlers) interpret the traced body.
    retrace = bool(replay.substituting and replay.gradient_node()
                   and not _retrace.why_not(name, scope_placed))

    def replayed(*placeholders):
        graph = _ops.get_default_graph()
        replay.graphs.add(id(graph))
        # Resource and variant handle data (a variable's dtype and shape) come from the
        # function's own argument the leaf belongs to: the eager handles TensorFlow
        # passes to a device do not carry it (it is a Python attribute of a variable's
        # handle), and handlers leave resources unchanged (transient handlers).
        position = 0
        for i, tree in enumerate(trees):
            for _ in range(count_leaves(tree)):
                p = placeholders[position]
                if (p.dtype == tf.resource or p.dtype == tf.variant) and i < len(body.inputs):
                    set_handle_data(p, leaves[position], body.inputs[i])
                position += 1
        it = iter(placeholders)
        # (an accumulator: zero tangents, as TensorFlow's JVP of a call)
        joins = None if name in _op_by_op else call_joins(trees, segment)
        args = [rebuild(t, segment, it, joins) for t in trees]
        if fed:
            elements = iter(args[len(body.inputs):])
            replay.fed = {n: [next(elements) for _ in range(k)] for n, k in fed.items()}
            replay.fed_graph = id(body)
            args = args[:len(body.inputs)]
        if retrace:  # the Python body, under the segment's handlers (retrace.py)
            outs = _retrace.run_body(replay, name, args, len(body.outputs))
        else:
            outs = replay.interpret(body, args)
        outs = [replay.lower(o) for o in outs]
        flat = []
        output_trees.extend(split(o, segment, graph_leaf, flat) for o in outs)
        return flat

    with active(replay), _scope.physical(), _record.stop_recording():
        state.current = bottom  # below the segment, ops are nodes of the function
        function = tf.function(replayed, input_signature=specs, autograph=False,
                               reduce_retracing=False).get_concrete_function()
    dense = any(_gradients_dense(t, segment) for t in trees)
    optimized = all(getattr(s.handler, "optimize_replays", True) for s in segment)
    flags = []
    for t in output_trees:
        _tangent_leaves(t, segment, False, flags)
    return _Entry(function, tuple(output_trees), dense, optimized,
                  frozenset(i for i, f in enumerate(flags) if f), replay.substituted)


def _tangent_leaves(tree, segment, inside, flags):
    """Appends to `flags`, per leaf of `tree`, whether it is a forward-mode tangent: a
    part after the first of a value whose handler makes gradients dense for it
    (`function_gradients_dense`: the accumulator's [primal, tangent])."""
    if tree[0] == "leaf":
        flags.append(inside)
        return
    level, summary, subtrees = tree
    dense = bool(segment[level].handler.function_gradients_dense(summary))
    for k, sub in enumerate(subtrees or ()):
        _tangent_leaves(sub, segment, inside or (dense and k > 0), flags)


def _gradients_dense(tree, segment):
    """Whether a handler of `segment` makes a call's gradients dense for an argument
    of summary tree `tree` (`function_gradients_dense`)."""
    if tree[0] == "leaf":
        return False
    level, summary, subtrees = tree
    handler = segment[level].handler
    return bool(handler.function_gradients_dense(summary)) or any(
        _gradients_dense(t, segment) for t in subtrees)


register_function_call_rule(call)


# -- a scope-placed call straight from TensorFlow's Python call path ----------------------

_EagerTensor = _ops.EagerTensor
_call_ops = BoundedCache("functions.scope_call_ops", 256)  # (name, attrs, n) -> Op


def _scope_execute(op_name, num_outputs, inputs, attrs, ctx, name=None):
    """TensorFlow's `execute.quick_execute` (a ConcreteFunction's call) with a function
    call placed by a handler scope on physical arguments taken straight to the replay
    rule, as the dispatcher device's callback would run it, without the op's trip through
    TensorFlow's custom-device execute and the callback (which wraps each argument in a
    new EagerTensor), a large part of a replayed call's cost. Other calls and ops take
    TensorFlow's path unchanged. (Op callbacks: TensorFlow's `execute_with_callbacks`
    calls this and runs them after.)"""
    stack = state.current
    if (stack is not PHYSICAL and type(op_name) is str  # (op wrappers pass bytes)
            and op_name.startswith("__inference_")
            and state.mode is None and not state.frames
            and ctx.device_name == DISPATCHER_DEVICE):
        op = _scope_call_op(stack, op_name, num_outputs, inputs, attrs)
        if op is not None:
            state.scope_placed = True
            return stack.execute(op, list(inputs))
    return _quick_execute(op_name, num_outputs, inputs, attrs, ctx, name)


_quick_execute = None  # what this wraps (status_to_exception's wrapper of TF's)


def _scope_call_op(stack, op_name, num_outputs, inputs, attrs):
    """The call as an Op if `stack` replays it and every argument is a physical eager
    tensor (no placement question, no copy), else None."""
    for t in inputs:
        if type(t) is not _EagerTensor or _C.stack_of(t) is not None:
            return None
    key = (op_name, attrs, num_outputs)
    op = _call_ops.get(key)
    if op is None:
        values = attrs[1::2]
        if not all(isinstance(v, (bytes, str)) for v in values):
            return None  # (a function call's attributes are strings)
        op = _call_ops[key] = _C.new_op(op_name, {
            k: _attr_value_pb2.AttrValue(s=_as_bytes(v)).SerializeToString()
            for k, v in zip(attrs[::2], values)}, num_outputs)
    return op if replays(stack.handler, op) else None


def _wrap_quick_execute(next_execute):
    # quick_execute, not only execute: TensorFlow resets `execute` to `quick_execute`
    # when op callbacks go, and `execute_with_callbacks` calls it by name (the patch
    # keeps `execute` as its alias).
    global _quick_execute  # pylint: disable=global-statement
    _quick_execute = next_execute
    return _scope_execute


tf_patches.subscribe("execute.quick_execute", "scope_function_call", _wrap_quick_execute)
