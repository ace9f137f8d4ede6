"""`oh.Recompute` inside a function being traced (graph mode): the recompute structure
is put into the traced function, so a graph-mode step (a `tf.function` training step, a
Keras `train_step` run by `model.fit`) saves memory too.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> ws = [tf.Variable(tf.random.normal([64, 64]) * 0.1) for _ in range(16)]
>>> @tf.function
... def step(x):
...     with tf.GradientTape() as tape:          # or oh.GradientTape (trace time)
...         with oh.Recompute():                 # segments in the traced graph
...             h = x
...             for w in ws:
...                 h = tf.tanh(h @ w)
...             loss = tf.reduce_sum(h * h)
...     return tape.gradient(loss, ws)
>>> grads = step(tf.random.normal([256, 64]))  # equal to the step without Recompute

While the scope is open, every record TensorFlow's tapes would get (an op's gradient record, `record_operation` of captures, variable reads,
function calls and custom gradients) is collected instead (`Window`). At the scope's
exit the records are made in their order, except those of recomputable ops (stateless,
registered, no resource or variant values): these are grouped into segments of about
sqrt(n) values (or ending after `save=` op types), and each segment is recorded as one
operation whose gradient *recomputes* it in the backward graph from its inputs (its
outputs' values are not used by the backward pass). Like `tf.recompute_grad`, the
recomputation depends on the incoming gradient (a zero derived from it is added to the
inputs), so TensorFlow cannot run it early or merge it with the forward ops (Grappler's
common subexpression elimination), and the executor frees a segment's interior values as
soon as the forward pass is done with them.

The outputs of a segment are its values used outside it (by later ops), values nothing
uses yet (the scope's results), values a tape watches and values the program still
references (`Window._held`); those used inside the segment
too are *cuts* and the segment is recorded in pieces (`recompute_segments.split`), so
every use is seen. The other values are recorded as outputs of one more operation
("RecomputeInterior") that is only differentiated if the program uses them after the
scope; a gradient *with respect to* such a value (found in the graph later) would miss
its uses inside the segment and raises `HandlerError`.
"""
import math
import sys
import threading
import weakref

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop as _backprop  # noqa: F401  (sets execute.record_gradient)
from tensorflow.python.eager import forwardprop_util
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import op_def_registry

from tf_ophandlers.extend import (
    GRADIENT_OP_TYPE_ATTR, HandlerError, node_attrs, state, tf_patches)
from tf_ophandlers.handlers.recompute.segments import (
    SEGMENT_OP_TYPE, Segment, serialize_heavy, split)

_local = threading.local()  # .window: the innermost open Window of this thread
_OPAQUE = (tf.resource, tf.variant)
_ZERO_OPS = frozenset(("Const", "Fill", "ZerosLike", "Zeros"))
# id(graph) -> (weak reference to it, {id(tensor)}): values recorded only as interior
_interior = {}

_previous = {}


def _capturing(name):
    def capture(*args, **kwargs):
        window = getattr(_local, "window", None)
        if window is not None and window.active and window.owns(name, args, kwargs):
            if _carries_tangents(name, args, kwargs):
                # A forward accumulator's tangents (an HVP in the step, or an accumulator
                # inside the scope): it needs the record now, and a segment's
                # recomputation would carry none; the rest of the scope is not
                # recomputed (as ops run as they are above an accumulator eagerly).
                window.demote()
                return _previous[name](*args, **kwargs)
            # Collected instead of made (made at the scope's exit, or replaced).
            scope = _ops.get_name_scope() if name == "record_gradient" else None
            window.records.append((name, args, kwargs, scope))
            return None
        return _previous[name](*args, **kwargs)
    return capture


def _carries_tangents(name, args, kwargs):
    if name == "record_gradient":
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs", ())
    else:
        inputs = args[2] if len(args) > 2 else kwargs.get("input_tensors", ())
    return bool(forwardprop_util.pack_tangents(list(inputs)).tangents)


def eager_scope(handler):
    """Called by `Recompute` when its eager scope opens (handler) and closes (None): a
    function traced meanwhile (a Keras `fit` step) gets a window around the forward pass
    of each `tf.GradientTape` scope opened while tracing it."""
    stack = _local.__dict__.setdefault("eager", [])
    if handler is not None:
        tf_patches.ensure("recompute graph records")
        stack.append(handler)
    elif stack:
        stack.pop()


def _tape_enter(self):
    collecting = _collecting_window()
    if collecting is not None:
        collecting.flush()  # the records so far are not this tape's (TensorFlow's order)
    result = _previous["enter"](self)
    stack = getattr(_local, "eager", None)
    # Only the program's step: not while a handler's hook runs (a function it traces, an
    # oh.ForwardAccumulator's JVP function, is not the step) nor in a function a handler
    # traces for its own use (oh.vectorized_map's pfor function: state.own_traces).
    if (stack and not state.frames and not state.own_traces
            and getattr(_local, "window", None) is None and not tf.executing_eagerly()):
        window = Window(stack[-1], auto=True)
        window.__enter__()
        _tape_windows[id(self)] = window
    return result


def _tape_exit(self, typ, value, traceback):
    window = _tape_windows.pop(id(self), None)
    if window is not None:
        window.__exit__(typ, value, traceback)  # records while the tape is active
    else:
        collecting = _collecting_window()
        if collecting is not None:
            collecting.flush()  # the records made while this (inner) tape recorded
    return _previous["exit"](self, typ, value, traceback)


def _collecting_window():
    """The innermost window if it is collecting (a tape scope's, or the program's own
    oh.Recompute scope's: a tape opened or closed inside it, or a gradient asked
    after a tape closed inside it, needs the records of the ops run meanwhile)."""
    window = getattr(_local, "window", None)
    return window if window is not None and window.active else None


_tape_windows = {}  # id(tf.GradientTape) -> the Window opened with it (while tracing)


def _checked_gradient(self, target, sources, *args, **kwargs):
    window = getattr(_local, "window", None)
    while window is not None and window.active:
        # A gradient inside a window (an HVP's inner tape, TensorFlow's forward
        # accumulator's JVP helper, a tape inside the scope: eager code oh.vectorized_map
        # traces): the records are made now and the window collects no more (the rest of
        # the scope is not recomputed); so do the windows around it.
        window.demote()
        window = getattr(_local, "window", None)
    if _interior and not tf.executing_eagerly():
        graph = _ops.get_default_graph()
        entry = _interior.get(id(graph))
        ids = entry[1] if entry is not None and entry[0]() is graph else None
        if ids:
            for s in tf.nest.flatten(sources):
                if id(s) in ids:
                    raise HandlerError(
                        "oh.Recompute: tape.gradient with respect to %s, a value computed "
                        "inside a recompute segment of a traced function (and used inside "
                        "it), would miss its uses inside the segment; keep a reference to it "
                        "or call tape.watch on "
                        "it inside the oh.Recompute scope (it then ends a segment)"
                        % getattr(s, "name", s))
    return _previous["gradient"](self, target, sources, *args, **kwargs)


def _wrap(name, replacement):
    def wrap(original):
        _previous[name] = original
        return replacement
    return wrap


_USE = "recompute graph records"
for _patch, _name in (("execute.record_gradient", "record_gradient"),
                      ("record.record_operation", "record_operation"),
                      ("record.record_operation_backprop_only", "record_operation_backprop_only"),
                      ("record.record_operation_forwardprop_only",
                       "record_operation_forwardprop_only")):
    tf_patches.subscribe(_patch, _USE, _wrap(_name, _capturing(_name)))
# tf.GradientTape.gradient refuses sources whose uses a segment hides; a tape scope opened
# while tracing inside an eager oh.Recompute scope (a Keras fit step) opens a window.
tf_patches.subscribe("GradientTape.gradient", _USE, _wrap("gradient", _checked_gradient))
tf_patches.subscribe("GradientTape.__enter__", _USE, _wrap("enter", _tape_enter))
tf_patches.subscribe("GradientTape.__exit__", _USE, _wrap("exit", _tape_exit))


def _nbytes(t):
    """Bytes of a symbolic value, unknown dimensions counted as 1 (relative sizes)."""
    if t.shape.rank is None:
        return t.dtype.size
    return t.dtype.size * math.prod(d if d is not None else 1 for d in t.shape.as_list())


def _recomputable(op, is_stateful, trainable):
    if op_def_registry.get(op.type) is None or is_stateful(op.type):
        return False
    if any(t.dtype in _OPAQUE for t in list(op.inputs) + list(op.outputs)):
        return False
    return any(trainable(t) for t in op.outputs)


def is_zero(g):
    """A gradient TensorFlow's tape filled in for an output without one (zeros)."""
    if g is None:
        return True
    if isinstance(g, tf.IndexedSlices) or g.op.type not in _ZERO_OPS:
        return False
    if g.op.type == "ZerosLike" or g.op.type == "Zeros":
        return True
    value = tf.get_static_value(g.op.inputs[1] if g.op.type == "Fill" else g)
    return value is not None and not value.any()


class Window:
    """The records of a `Recompute` scope opened while tracing (see the module doc)."""

    def __init__(self, handler, auto=False):
        self.handler = handler
        self.records = []
        self.active = False
        self.auto = auto  # opened by a tape scope of a step traced in an eager scope
        self.demoted = False

    def __enter__(self):
        tf_patches.ensure("recompute graph records")
        self.graph = _ops.get_default_graph()
        self.outer = getattr(_local, "window", None)
        if self.outer is not None and self.outer.active:
            # A nested scope: the outer's records so far are made first, so the tapes
            # know the values this scope's segments take from them (a segment none of
            # whose inputs a tape knows is not recorded: its gradients were None).
            self.outer.flush()
        _local.window = self
        self.active = True
        return self

    def owns(self, name, args, kwargs):
        """Whether a record is of an op of the window's graph (not of a branch or body
        being traced inside the scope, whose records go to the tapes as usual)."""
        if name == "record_gradient":
            outputs = args[3] if len(args) > 3 else kwargs.get("outputs", ())
        else:
            outputs = args[1] if len(args) > 1 else kwargs.get("output_tensors", ())
        return any(getattr(t, "graph", None) is self.graph for t in outputs)

    def __exit__(self, exc_type, exc, tb):
        if self.demoted:
            return False
        self.active = False
        _local.window = self.outer
        if exc_type is None:
            self._make_records()
        return False

    def _make_records(self):
        # A nested scope's records go to the tapes now, not to the outer scope's window
        # (its later segments take these values as inputs).
        outer = self.outer if self.outer is not None and self.outer.active else None
        if outer is not None:
            outer.active = False
        try:
            self._record_all()
        finally:
            if outer is not None:
                outer.active = True

    def flush(self):
        """Makes the records collected so far (a tape opens or closes inside the window:
        each record goes to the tapes recording when its op ran, as TensorFlow's do)."""
        if not self.records:
            return
        self.active = False  # records made meanwhile (a JVP helper's ops) pass through
        try:
            self._make_records()
        finally:
            self.records = []
            self.active = True

    def demote(self):
        """Makes the records collected so far and stops collecting (a gradient is taken
        inside the window: its tape's records must exist now)."""
        self.flush()
        self.active = False
        self.demoted = True
        if _local.window is self:
            _local.window = self.outer

    # -- planning -----------------------------------------------------------------------

    def _record_all(self):
        handler = self.handler
        _is_stateful, _trainable = handler.is_stateful_type, handler.is_trainable
        self.held = self._held()
        items, sizes = [], []
        for rec in self.records:
            op = None
            if rec[0] == "record_gradient":
                outputs = rec[1][3]
                if outputs and all(getattr(o, "op", None) is outputs[0].op for o in outputs):
                    op = outputs[0].op
                    if not _recomputable(op, _is_stateful, _trainable):
                        op = None
            items.append((rec, op))
            if op is not None:
                sizes.append(sum(_nbytes(o) for o in op.outputs))
        total, count = sum(sizes), max(len(sizes), 1)
        cap = math.sqrt(total * total / count) if total else 0
        save = handler.save if handler.policy == "save" else None
        keep = frozenset()
        if handler.policy == "memory_budget":
            keep, cap = self._budget_plan(items, cap)
        plan, open_seg, members = [], None, {}
        for rec, op in items:
            if op is None or id(op) in keep:
                if open_seg is not None and self._uses(rec, members, open_seg):
                    plan.append(("segment", open_seg))
                    open_seg = None
                plan.append(("record", rec))
                continue
            if open_seg is None:
                open_seg = Segment()
            refs = []
            for t in op.inputs:
                where = members.get(id(t.op))
                if where is not None and where[0] is open_seg:
                    refs.append((where[1], t.value_index))
                else:
                    refs.append((-1, open_seg.external(t, False)))
            members[id(op)] = (open_seg, len(open_seg.nodes))
            open_seg.nodes.append((op, tuple(refs)))
            open_seg.bytes += sum(_nbytes(o) for o in op.outputs)
            if (save is not None and op.type in save) or \
                    (save is None and open_seg.bytes >= cap):
                plan.append(("segment", open_seg))
                open_seg = None
        if open_seg is not None:
            plan.append(("segment", open_seg))
        stats = dict(computed=total, kept=0, largest=0, segments=0, recomputed={},
                     mode="graph")
        for kind, what in plan:
            if kind == "record":
                name, args, kwargs, scope = what
                if name == "record_gradient":
                    # As backprop.record_gradient does, in the op's own name scope.
                    pywrap_tfe.TFE_Py_RecordGradient(*args, scope)
                else:
                    getattr(_record, name)(*args, **kwargs)
            else:
                self._record_segment(what, stats, _trainable)
        stats["budget_plan"] = getattr(self, "budget_plan", None)
        sizing = self._sizing(items)  # the smallest budget a memory_budget= plan takes
        stats["minimum_budget"] = sizing[-1] if sizing is not None else None
        handler.graph_stats = stats

    @staticmethod
    def _sizing(items):
        """(ops, their bytes, total, mean value bytes, bytes besides activations: the
        variables' gradients and four of the largest values, minimum budget) of the
        recomputable ops, or None if a shape is not fully known."""
        ops = [op for _, op in items if op is not None]
        if not ops or not all(t.shape.is_fully_defined() for op in ops for t in op.outputs):
            return None
        sizes = [sum(_nbytes(t) for t in op.outputs) for op in ops]
        total = sum(sizes)
        mean = total / sum(len(op.outputs) for op in ops)
        extra = 4 * max(_nbytes(t) for op in ops for t in op.outputs)
        for (name, args, _, _), _op in items:
            if name == "record_gradient" and args[0] == "ReadVariableOp" and args[3] \
                    and args[3][0].shape.is_fully_defined():
                extra += _nbytes(args[3][0])
        minimum = int(math.ceil((2 * math.sqrt(total * mean) + extra) / 0.9))
        return ops, sizes, total, mean, extra, minimum

    def _budget_plan(self, items, cap):
        """Under `memory_budget=` with fully known static shapes: the recomputable ops
        recorded as usual (the last part of the computation, the tape keeping what their
        gradients read) and the segment cap for the first part, whose checkpoints and
        largest segment (about 2 sqrt(part bytes x mean value bytes)) plus the kept part,
        the variables' gradients and four of the largest values fit 90% of the budget.
        Unknown dimensions (a batch size known only when the step runs): sqrt(n)
        segments, as without a budget. A budget below the minimum raises ValueError."""
        sizing = self._sizing(items)
        if sizing is None:
            return frozenset(), cap
        ops, sizes, total, mean, extra, minimum = sizing
        budget = self.handler.memory_budget
        available = budget * 0.9 - extra
        if minimum > budget:
            raise ValueError(
                "oh.Recompute: memory_budget=%d bytes is below the minimum feasible for "
                "this traced computation, about %d bytes (%d bytes of activations, "
                "recomputed in sqrt(n) segments)" % (budget, minimum, total))
        f = 1.0
        for i in range(201):  # the smallest recomputed part that fits
            part = i / 200
            if (1 - part) * total + 2 * math.sqrt(part * total * mean) <= available:
                f = part
                break
        keep, seen = set(), 0
        for op, size in zip(ops, sizes):
            if seen >= f * total:
                keep.add(id(op))
            seen += size
        self.budget_plan = dict(recomputed_share=f, kept_ops=len(keep))
        return frozenset(keep), max(mean, math.sqrt(f * total * mean))

    def _held(self):
        """Ids of the values of recorded ops that something besides the graph and the
        records references (the program keeps them: a list of layer outputs, a variable
        used after the scope). Python reference counts, so this runs before the plan
        takes references; a miscount only adds a segment output (or leaves a value
        interior, whose use as a gradient source then raises)."""
        counts, parts = {}, set()
        for name, args, kwargs, _ in self.records:
            for part in list(args) + list(kwargs.values()):
                if isinstance(part, (list, tuple)):
                    parts.add(id(part))
                    for t in part:
                        counts[id(t)] = counts.get(id(t), 0) + 1
        held = set()
        for name, args, _, _ in self.records:
            if name != "record_gradient" or not args[3]:
                continue
            for t in args[3][0].op.outputs:
                cached = 0  # consumers' cached input tuples that are not record parts
                for c in t.consumers():
                    val = getattr(c, "_inputs_val", None)
                    if val is not None and id(val) not in parts:
                        cached += sum(1 for i in val if i is t)
                # the graph's own reference, getrefcount's argument and `t`
                if sys.getrefcount(t) > 3 + counts.get(id(t), 0) + cached:
                    held.add(id(t))
        return held

    @staticmethod
    def _uses(rec, members, segment):
        name, args, _, _ = rec
        inputs = args[1] if name == "record_gradient" else args[2]
        for t in inputs:
            where = members.get(id(getattr(t, "op", None)))
            if where is not None and where[0] is segment:
                return True
        return False

    # -- recording ----------------------------------------------------------------------

    def _record_segment(self, segment, stats, trainable):
        inside = set(id(op) for op, _ in segment.nodes)
        outputs, interior = {}, {}
        for n, (op, _) in enumerate(segment.nodes):
            for k, t in enumerate(op.outputs):
                if not trainable(t):
                    continue
                consumers = t.consumers()
                if not consumers or any(id(c) not in inside for c in consumers) \
                        or id(t) in self.held \
                        or _record.should_record_backprop([t]):  # used later, or watched
                    outputs[(n, k)] = t
                else:
                    interior[(n, k)] = t
        for i, t in enumerate(segment.externals):
            segment.ext_tracked[i] = trainable(t) and _record.should_record_backprop([t])
        if not any(segment.ext_tracked) or not outputs:
            return  # TensorFlow's tape would record none of its ops either
        stats["segments"] += 1
        stats["largest"] = max(stats["largest"], segment.bytes)
        stats["kept"] += sum(_nbytes(t) for t in outputs.values())
        recorded = 0
        for piece, _, piece_outputs in split(segment, outputs):
            recorded += _record_piece(piece, piece_outputs)
        for op, _ in segment.nodes:
            stats["recomputed"][op.type] = stats["recomputed"].get(op.type, 0) + 1
        if interior:
            _record_piece(segment, interior, "RecomputeInterior")
            graph = _ops.get_default_graph()
            entry = _interior.get(id(graph))
            if entry is None or entry[0]() is not graph:  # (a new graph at a reused id)
                entry = _interior[id(graph)] = (weakref.ref(graph), set())
            entry[1].update(id(t) for t in interior.values())
            if len(_interior) > 64:  # graphs of finished traces (bounded)
                _interior.pop(next(iter(_interior)))


SEGMENT_GRADIENT = "OhRecomputeSegment"  # a segment IdentityN's gradient (recompute_calls)


def copied_attrs(op):
    """Graph op `op`'s attributes for a copy of it (an orphan segment: Identity ops)."""
    return node_attrs(op.node_def)


def orphan_segment(op):
    """A segment's IdentityN whose plan (a Python attribute) is gone, its graph rebuilt
    from a FunctionDef. Copied as one Identity per input: its inputs are the segment's
    outputs, made by the segment's ops, which the copy's graph has too, so the gradient
    goes through them; with IdentityN's own gradient, the outputs nothing reads (inputs
    passed through) got zeros where TensorFlow has None (Recompute > Recompute,
    OH_FUZZ_SEED=133 slow case 5)."""
    override = node_attrs(op.node_def).get(GRADIENT_OP_TYPE_ATTR)
    return (op.type == "IdentityN" and override is not None and override.s == SEGMENT_GRADIENT
            .encode() and getattr(op, "oh_recompute_segment", None) is None)


def _copy(graph, op, inputs):
    """A copy of graph op `op` on `inputs`; recorded on the tapes that track an input
    (a tape recording the backward pass: second order), as a gen op wrapper would."""
    if orphan_segment(op):  # (tf.identity records itself)
        return [tf.identity(t) for t in inputs]
    new = graph.create_op(op.type, inputs, [t.dtype for t in op.outputs],
                          attrs=copied_attrs(op))
    plan = getattr(op, "oh_recompute_segment", None)
    if plan is not None:  # a nested scope's segment: the copy keeps its gradient's plan
        new.oh_recompute_segment = plan
    if _record.could_possibly_record() and _record.should_record_backprop(inputs):
        try:  # (a node's gradient override, tf.custom_gradient's, is its gradient)
            grad_fn = _ops.get_gradient_function(new)
        except LookupError:
            grad_fn = None
        if grad_fn is not None:
            def backward(*grads):
                out = grad_fn(new, *grads)
                return list(out) if isinstance(out, (list, tuple)) else [out]
            _record.record_operation(op.type, new.outputs, inputs, backward)
    return new.outputs


def _record_piece(segment, outputs, op_type=SEGMENT_OP_TYPE):
    """Records one piece on the tapes: its gradient recomputes its nodes in the backward
    graph from its inputs, after (and depending on) the incoming gradients."""
    refs = sorted(outputs)
    outs = [outputs[r] for r in refs]
    tracked = [i for i, tr in enumerate(segment.ext_tracked)
               if tr or _record.should_record_backprop([segment.externals[i]])]
    xs = [segment.externals[i] for i in tracked]
    if not xs:
        return 0
    nodes, externals = list(segment.nodes), list(segment.externals)

    def backward(*grads):
        return recompute_gradient(nodes, externals, tracked, refs, grads)

    _record.record_operation(op_type, outs, xs, backward)
    return 1


def recompute_gradient(nodes, externals, tracked, refs, grads, plain=()):
    """The gradients with respect to `externals[i]` for i in `tracked` of a segment's
    outputs `refs` ((node, output) pairs) weighted by `grads`: its `nodes` ((graph op,
    refs) pairs, refs (-1, external index) or (node, output)) recomputed in the backward
    graph from the externals, after (and depending on) the incoming gradients. Externals
    in `plain` (variable reads) enter without the dependency, whose add would make their
    gradient dense (a gather's IndexedSlices)."""
    real = [None if is_zero(g) else g for g in grads]
    if all(g is None for g in real):
        return [tf.zeros_like(externals[i]) for i in tracked]
    first = next(g for g in real if g is not None)
    first = first.values if isinstance(first, tf.IndexedSlices) else first
    # A zero that depends on the incoming gradient (as tf.recompute_grad does): the
    # recomputation runs in the backward pass and cannot be merged with the forward.
    elem = tf.reduce_max(tf.reshape(first, [-1])[:1])
    dep = tf.where(tf.equal(elem, elem), 0.0, float("nan"))
    graph = _ops.get_default_graph()
    ext = list(externals)
    new_xs = []
    for i in tracked:
        x = tf.identity(ext[i])
        if i not in plain:
            x = x + tf.cast(dep, ext[i].dtype)
        ext[i] = x
        new_xs.append(x)
    results = [None] * len(nodes)
    for j, (op, op_refs) in enumerate(nodes):
        ins = [ext[i] if p < 0 else results[p][i] for p, i in op_refs]
        results[j] = _copy(graph, op, ins)
    ys = [results[n][k] for (n, k), g in zip(refs, real) if g is not None]
    gys = [tf.convert_to_tensor(g) for g in real if g is not None]
    start = len(graph.get_operations())
    result = tf.gradients(ys, new_xs, grad_ys=gys)
    serialize_heavy(graph.get_operations()[start:])  # one conv backprop at a time
    return result
