"""`oh.Recompute` and a `tf.function` *called* inside an eager scope: the call is run as
a rewritten function whose body is segmented, so its interior is recomputed in the
backward pass instead of being kept whole.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> ws = [tf.Variable(tf.random.normal([64, 64]) * 0.1) for _ in range(16)]
>>> @tf.function
... def forward(x):
...     h = x
...     for w in ws:
...         h = tf.tanh(h @ w)
...     return tf.reduce_sum(h * h)
>>> x = tf.random.normal([256, 64])
>>> with oh.GradientTape() as tape:
...     with oh.Recompute():
...         loss = forward(x)         # the body's activations are not all kept
>>> grads = tape.gradient(loss, ws)   # equal to the gradients without Recompute

When a tape watches an argument, TensorFlow calls the function's *forward function*
(``__forward_f_12``): its outputs are the function's results followed by every
intermediate value TensorFlow's backward function reads, so calling it keeps the
activations whatever the handler does. Under `oh.Recompute`, with only handler tapes
recording (no `tf.GradientTape`, which would read those values), the handler runs a
*rewrite* instead (`rewrite`, cached per forward function and policy): the forward
function's body copied node by node into a new function returning only the results, with
the recomputable ops (stateless, registered, no resource or variant values) grouped
into segments (about sqrt(n) by static bytes, or ending after `save=` op types). Each
segment ends in an ``IdentityN`` of its outputs and inputs whose gradient (registered
once, "OhRecomputeSegment") recomputes the segment from its inputs in the backward graph
(`recompute_graph.recompute_gradient`, the graph mode's) and gives its inputs' gradients,
as `tf.custom_gradient` does in graph mode: TensorFlow's function gradient of the
rewrite then keeps only the segments' inputs. The rewrite is called on the stack below
the handler, so its tape records it with TensorFlow's function gradient; TensorFlow's
record of the original call is skipped for those tapes (core/functions/call_records.py),
and its extra outputs, which nothing reads, are empty stand-ins (the function's own
inputs where they are inputs).

Not rewritten (the call is kept whole, as before): bodies with function-valued
attributes (control flow, nested calls), intermediate values of resource or variant
type, and calls under a `tf.GradientTape` (also one opened inside the scope), an
`oh.GradientTape` opened inside the scope (both record the original call, whose backward
function reads the forward function's values) or a forward accumulator (TensorFlow's or
`oh.ForwardAccumulator`, whose JVP of the call reads the forward function's values),
and calls with a replaying handler right below the scope (`oh.OpHandler`,
`CheckNumericsHandler`: its replay of the rewrite would drop the segments' gradient).
"""
import contextlib
import math
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import forwardprop_util
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import op_def_registry

from tf_ophandlers.extend import (
    call_records, CompiledCall, function_body, HandlerStack, LRUCache, replays,
    scope as _scope, set_handle_data, state)
from tf_ophandlers.handlers.recompute.graph import (
    SEGMENT_GRADIENT, copied_attrs, is_zero, orphan_segment, recompute_gradient)

GRADIENT = SEGMENT_GRADIENT
_OPAQUE = (tf.resource, tf.variant)
_READS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd"))
# (forward function name, save policy) -> _Rewrite, or False (kept whole)
_rewrites = LRUCache("recompute.call_rewrites", 128)
_registered = []
_lock = threading.Lock()


def _register_gradient():
    with _lock:
        if not _registered:
            _ops.RegisterGradient(GRADIENT)(_segment_gradient)
            _registered.append(True)


def _segment_gradient(op, *grads):
    plan = getattr(op, "oh_recompute_segment", None)
    if plan is None:
        # Its graph rebuilt from a FunctionDef (a handler's replay of the rewrite: 79 slow
        # case 3, 134/13): IdentityN's own gradient, through the segment's ops, which
        # that graph has too (recompute_graph.orphan_segment). Zeros filled in for an
        # output nothing reads (an input passed through): None, as without Recompute.
        return [None if not t.consumers() and is_zero(g) else g
                for t, g in zip(op.outputs, grads)]
    n = plan.num_outputs
    got = recompute_gradient(plan.nodes, list(op.inputs[n:]), plan.tracked, plan.refs,
                             grads[:n], plan.plain)
    result = [None] * len(op.inputs)
    for i, g in zip(plan.tracked, got):
        result[n + i] = g
    return result


class _SegmentPlan:
    """Body ops of one segment: nodes (op, refs), externals, outputs (node, index)."""

    __slots__ = ("nodes", "externals", "ext_index", "refs", "tracked", "plain",
                 "num_outputs", "bytes", "consts")

    def __init__(self):
        self.nodes, self.externals, self.ext_index, self.consts = [], [], {}, {}
        self.refs, self.tracked, self.num_outputs, self.bytes = [], [], 0, 0

    def external(self, t):
        i = self.ext_index.get(t.ref())
        if i is None:
            i = self.ext_index[t.ref()] = len(self.externals)
            self.externals.append(t)
        return i


def _static_bytes(t):
    if t.shape.rank is None:
        return t.dtype.size
    return t.dtype.size * math.prod(d if d is not None else 1 for d in t.shape.as_list())


def _trainable(t):
    return t.dtype.is_floating or t.dtype.is_complex


def _has_functions(op):
    if _context.context().has_function(op.type):
        return True
    return any(v.HasField("func") or len(v.list.func) for v in op.node_def.attr.values())


def num_results(body):
    """The function's own results among its forward function's outputs: the leading
    outputs made by the `Identity` nodes tracing adds (unconsumed in the body)."""
    k = 0
    for t in body.outputs:
        if t.op.type != "Identity" or t.consumers() or t.op.name.split("_")[0] != "Identity":
            break
        k += 1
    return k


class _Rewrite:
    """The rewritten function of one forward function (see the module docstring)."""

    def __init__(self, body, k, handler, exterior):
        self.body, self.k = body, k
        self._exterior = exterior  # the first call's arguments (handle data), while built
        ops = [o for o in body.get_operations() if o.type != "Placeholder"]
        is_stateful, save = handler.is_stateful_type, (
            handler.save if handler.policy == "save" else None)

        def recomputable(o):
            if op_def_registry.get(o.type) is None or is_stateful(o.type):
                return False
            if any(t.dtype in _OPAQUE for t in list(o.inputs) + list(o.outputs)):
                return False
            return any(_trainable(t) for t in o.outputs)
        rec = {id(o) for o in ops if recomputable(o)}
        sizes = [sum(_static_bytes(t) for t in o.outputs) for o in ops if id(o) in rec]
        total = sum(sizes)
        cap = total / math.sqrt(max(len(sizes), 1))
        segments, member, current = [], {}, None
        for o in ops:
            if id(o) not in rec:
                if current is not None and any(
                        member.get(id(t.op), (None,))[0] is current for t in o.inputs):
                    segments.append(current)
                    current = None
                continue
            if current is None:
                current = _SegmentPlan()
            refs = []
            for t in o.inputs:
                where = member.get(id(t.op))
                if where and where[0] is current:
                    refs.append((where[1], t.value_index))
                elif t.op.type == "Const":
                    # A constant (an axis, a shape) is copied into the recomputation, so
                    # gradient functions see its value (a gather's IndexedSlices).
                    n = current.consts.get(id(t.op))
                    if n is None:
                        n = current.consts[id(t.op)] = len(current.nodes)
                        current.nodes.append((t.op, ()))
                    refs.append((n, t.value_index))
                else:
                    refs.append((-1, current.external(t)))
            member[id(o)] = (current, len(current.nodes))
            current.nodes.append((o, tuple(refs)))
            current.bytes += sum(_static_bytes(t) for t in o.outputs)
            if (save is not None and o.type in save) or (save is None and current.bytes >= cap):
                segments.append(current)
                current = None
        if current is not None:
            segments.append(current)
        results = {t.ref() for t in body.outputs[:k]}  # (not the extras)
        self.outputs = {}  # id(segment) -> body tensors recorded as its outputs
        self.ends = {}  # id(last op of a segment) -> segment
        for seg in segments:
            outs = []
            for n, (o, _) in enumerate(seg.nodes):
                for t in o.outputs:
                    if not _trainable(t) or id(o) in seg.consts:
                        continue
                    if t.ref() in results or any(
                            member.get(id(c), (None,))[0] is not seg for c in t.consumers()):
                        seg.refs.append((n, t.value_index))
                        outs.append(t)
            seg.num_outputs = len(outs)
            seg.tracked = [i for i, t in enumerate(seg.externals) if _trainable(t)]
            seg.plain = frozenset(i for i, t in enumerate(seg.externals)
                                  if t.op.type in _READS)
            if outs and seg.tracked:
                self.outputs[id(seg)] = outs
                self.ends[id(seg.nodes[-1][0])] = seg
        self.segments = len(self.ends)
        self.largest = max((s.bytes for s in segments), default=0)
        self.ops = ops
        specs = [tf.TensorSpec(p.shape, p.dtype) for p in body.inputs]
        with _scope.physical(), _record.stop_recording():
            self.function = tf.function(self._build, input_signature=specs,
                                        autograph=False).get_concrete_function()
        self.call = CompiledCall(self.function)
        self._exterior = None

    def _build(self, *args):
        graph = _ops.get_default_graph()
        for a, t, p in zip(args, self._exterior, self.body.inputs):
            if a.dtype in _OPAQUE:
                # A variable's dtype and shape, as a replay's placeholders get them: a
                # second tape's gradient of a gathered variable needs them ("variable
                # without handle data", OH_FUZZ_SEED=79 slow case 3).
                set_handle_data(a, t, p)
        env = {p.ref(): a for p, a in zip(self.body.inputs, args)}
        made = {}
        for o in self.ops:
            ins = [env[t.ref()] for t in o.inputs]
            control = [made[id(c)] for c in o.control_inputs if id(c) in made]
            attrs = copied_attrs(o)  # (a tf.custom_gradient's override kept)
            with graph.control_dependencies(control) if control else contextlib.nullcontext():
                if orphan_segment(o):  # one Identity per input (see orphan_segment)
                    outputs = [tf.identity(t) for t in ins]
                    new = tf.group(*outputs)  # (for control dependencies on it)
                else:
                    new = graph.create_op(o.type, ins, [t.dtype for t in o.outputs],
                                          attrs=attrs, name=o.name)
                    outputs = new.outputs
            made[id(o)] = new
            for t, nt in zip(o.outputs, outputs):
                if t.shape.is_compatible_with(nt.shape):
                    nt.set_shape(t.shape)
                env[t.ref()] = nt
            seg = self.ends.get(id(o))
            if seg is not None:
                outs = self.outputs[id(seg)]
                flat = [env[t.ref()] for t in outs] + [env[t.ref()] for t in seg.externals]
                with graph.gradient_override_map({"IdentityN": GRADIENT}):
                    ident = tf.raw_ops.IdentityN(input=flat)
                ident[0].op.oh_recompute_segment = seg
                for t, nt in zip(outs, ident[:len(outs)]):
                    env[t.ref()] = nt
        return [env[t.ref()] for t in self.body.outputs[:self.k]]


def _build_rewrite(name, handler, tensors):
    body = function_body(name)
    k = num_results(body)
    if k == 0 or any(_has_functions(o) for o in body.get_operations()):
        return False
    if any(t.dtype in _OPAQUE for t in body.outputs[k:]):
        return False
    _register_gradient()
    rewrite = _Rewrite(body, k, handler, tensors)
    return rewrite if rewrite.segments else False


def applies(op):
    """Whether a call op under an eager scope may be rewritten now (a forward function
    TensorFlow runs for a recording tape, with no TensorFlow tape)."""
    if not call_records.is_forward_call(op.type):
        return False
    # TensorFlow stops its tapes for the call: a stopped tape set reads as empty, and
    # a tf.GradientTape opened inside the scope would get the empty stand-ins.
    with call_records.recording_restarted():
        return pywrap_tfe.TFE_Py_TapeSetIsEmpty()


def _tape_above(handler):
    """Whether an oh.GradientTape opened inside the scope (on a stack built on the
    handler's) is recording the call: it records the original call, whose backward
    function reads the forward function's extra outputs (not the rewrite)."""
    return any(getattr(f.handler, "differentiates", None) == "reverse"
               and handler in f.handlers for f in state.frames)


FORWARD_BETWEEN = (
    "oh.Recompute: an oh.ForwardAccumulator is between this scope and the tape; the "
    "tangents it computes are recorded op by op, so nothing is saved (gradients are "
    "unchanged). Open oh.Recompute() outside the accumulator (inside the tape) to save "
    "memory.")


MAP_BETWEEN = (
    "oh.Recompute: oh.vectorized_map is between this scope and any tape; a tape records "
    "the map's batched ops, so nothing is saved (gradients are unchanged). Open "
    "oh.Recompute() outside the map (inside the tape) instead.")


def map_between(stack):
    """Whether oh.vectorized_map is between `stack`'s top and the nearest handler that
    differentiates: then oh.Recompute above runs its ops as they are (the map batches
    them, the tape records the batched ops). A segment recorded on that tape from inside
    the map had per-example inputs, which cannot be copied off the map: HandlerError
    (GradientTape > vectorized_map > Recompute, OH_FUZZ_SEED=81 slow case 38). Also with
    a tape inside the map too: the segment is recorded on every tape, the outer one
    included (GradientTape > vectorized_map > GradientTape > Recompute)."""
    differentiated = mapped = False
    for h in reversed(getattr(stack, "handlers", ())):
        if getattr(h, "differentiates", None) in ("forward", "reverse"):
            if mapped:
                return True
            differentiated = True
        elif getattr(h, "TYPE_NAME", None) == "VECTORIZED_MAP":
            if not differentiated:
                return True
            mapped = True
    return False


def forward_between(stack):
    """Whether the handler nearest `stack`'s top that differentiates is a forward one
    (oh.ForwardAccumulator): then oh.Recompute above runs its ops as they are. The
    accumulator computes the tangents of a segment's ops with the tapes paused, and a
    segment's gradient recomputes the primals only: a tape's gradient of a JVP was None
    (reverse over forward: a Hessian-vector product) and second-order gradients wrong
    (CheckNumerics > GradientTape > ForwardAccumulator > Recompute(budget),
    OH_FUZZ_SEED=7 slow case 33)."""
    for h in reversed(getattr(stack, "handlers", ())):
        kind = getattr(h, "differentiates", None)
        if kind in ("forward", "reverse"):
            return kind == "forward"
    return False


def as_is(stack):
    """Why oh.Recompute above `stack` runs its ops as they are (a warning), or None."""
    if forward_between(stack):
        return FORWARD_BETWEEN
    return MAP_BETWEEN if map_between(stack) else None


def run(handler, op, tensors, stack):
    """Runs forward call `op` on `tensors` (of `stack`, the handler's next) as its
    rewrite; returns its outputs and the number of segments in the rewrite, or None when
    the call must be kept whole."""
    if any(getattr(h, "differentiates", None) == "forward"
           for h in getattr(stack, "handlers", ())) \
            or forwardprop_util.pack_tangents(tensors).tangents:
        return None, 0  # a forward accumulator's JVP of the call: kept whole
    if _tape_above(handler):
        return None, 0
    if isinstance(stack, HandlerStack) and replays(stack.handler, op):
        # A replaying handler below (oh.OpHandler, CheckNumerics) would replay the
        # rewrite node by node, without the segments' gradient (a "_" attribute and a
        # Python plan): a plain IdentityN, whose gradient passes the zeros filled in for
        # its unused outputs to every segment input (a zero gradient where TensorFlow's
        # is None: OH_FUZZ_SEED=40 slow cases 8 and 27), and recomputes nothing.
        return None, 0
    key = (op.type, handler.policy, handler.save)
    rewrite = _rewrites.get(key)
    if rewrite is None:
        rewrite = _rewrites[key] = _build_rewrite(op.type, handler, tensors)
    if rewrite is False or len(tensors) != len(rewrite.body.inputs):
        return None, 0
    with call_records.recording_restarted():  # TensorFlow stopped it for its call
        results = rewrite.call.run(stack, list(tensors))
    call_records.note_replayed_call(op.type, stack)  # its tapes recorded the rewrite
    inputs = {p.ref(): t for p, t in zip(rewrite.body.inputs, tensors)}
    extras = []
    for t in rewrite.body.outputs[rewrite.k:]:
        given = inputs.get(t.ref())
        if given is None:
            rank = t.shape.rank if t.shape.rank is not None else 1
            given = tf.zeros([0] * rank, t.dtype)  # an empty stand-in, read by no one
        extras.append(given)
    return list(results) + extras, rewrite.segments
