"""Segments of `oh.Recompute`: runs of recorded ops that a tape sees as one operation
whose gradient recomputes them (what `tf.recompute_grad` does for a function the user
chose, here for ops the handler grouped).

A `Segment` collects nodes `(op, refs)` while the forward pass runs them eagerly (the
values exist, the tapes do not record them). Its *inputs* are the tensors that entered it
(outputs of earlier segments, variable reads, the user's tensors, constants), kept; its
*outputs*, chosen when it is recorded, are the values used later (by later segments, by
ops the tape records itself) or still referenced by the program. Every other value the
segment computed is freed as soon as the program drops it.

`record(segment)` records the segment on the thread's tapes through TensorFlow's
`record_operation` (the hook `oh.GradientTape` and `tf.GradientTape` both listen to). Its
backward function is one call of a `tf.function` built from the nodes: it recomputes the
nodes from the inputs and returns `tf.gradients` of the outputs with respect to the
tracked inputs, weighted by the output gradients. The function is cached by the
segment's structure (op types, attributes, wiring, input specs), so the segments of a
deep network of repeated layers share a handful of functions.
"""
import tensorflow as tf
from tensorflow.python.eager import backprop as _backprop
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gradients_util

from tf_ophandlers.extend import (
    CompiledCall, current_stack, graph_builder, LRUCache, PHYSICAL,
    registries as _registries, tensor_key)
from tf_ophandlers.handlers.recompute import conv_grads, nested, thinning
from tf_ophandlers.handlers.recompute.thinning import nbytes  # (also evict's, handler's)

#: The op type a segment is recorded as on TensorFlow's tapes (`record_operation`). Its
#: backward function takes None for any output gradient: an input reached only from
#: outputs without a gradient then gets none, as with TensorFlow's tape op by op (a
#: gather's input keeps its IndexedSlices gradient).
SEGMENT_OP_TYPE = "RecomputeSegment"
_registries.register_gradient_accepts_none(SEGMENT_OP_TYPE)
conv_grads.register()

_gradients = LRUCache("recompute.gradient_functions", 256)  # structure -> _GradientFunction

_DENSE, _SLICES, _NONE = 1, 2, 0


class Segment:
    """Consecutive recomputable ops of a forward pass, recorded on the tapes as one op."""

    __slots__ = ("nodes", "values", "externals", "ext_index", "ext_tracked", "used",
                 "bytes", "saved", "partial", "below", "remat", "remat_ops", "sources",
                 "pieces", "xs", "out_bytes", "ordered", "__weakref__")

    def __init__(self, keep=False, partial=False):
        self.nodes = []  # (op, refs): refs are (-1, external index) or (node, output)
        self.values = []  # per node: weak references to the outputs' representations
        self.externals = []  # input tensors of the next stack (kept)
        self.ext_index = {}  # tensor_key -> index in externals
        self.ext_tracked = []  # whether a tape tracks each external
        self.used = {}  # (node, output) -> tensor used by a later op (kept)
        self.bytes = 0  # bytes of the values computed (what recomputation saves)
        # A kept segment (keep=True) holds every value it computed: its gradient function
        # takes them instead of recomputing (graph-speed backward, no recomputation).
        # A partial segment (partial=True, for `memory_budget=`'s selective part) holds
        # only the outputs of the nodes it saves (None for the others): its gradient
        # function takes them and recomputes the others (graph speed, one call).
        self.saved = [] if keep or partial else None  # per node: its output tensors
        self.partial = partial
        # Eviction (evict.py): the stack rematerializations run on, and how
        # many values / ops they recomputed.
        self.below = None
        self.remat = self.remat_ops = 0
        # Checkpoint thinning (thinning.py): input index -> (segment, node, output) for
        # inputs computed by a segment not recorded yet when this one took them; once
        # recorded, the pieces recorded, each piece's tracked inputs (the list its
        # record holds) and the bytes of the recorded outputs.
        self.sources = None
        self.pieces = ()
        self.xs = None
        self.out_bytes = 0
        # Its gradient function runs its ops one at a time, in the order they were made
        # (run_in_order, below).
        self.ordered = False

    def external(self, tensor, tracked):
        """The index of input `tensor`, added if new."""
        key = tensor_key(tensor)
        i = self.ext_index.get(key)
        if i is None:
            i = self.ext_index[key] = len(self.externals)
            self.externals.append(tensor)
            self.ext_tracked.append(bool(tracked))
        elif tracked and not self.ext_tracked[i]:
            self.ext_tracked[i] = True
        return i


_TRACKED, _CONSTANT = "x", "c"


def _kind(tensor, tracked):
    """How an input enters the gradient function: differentiated (`_TRACKED`), as an
    argument (`_CONSTANT`), or, for a small untracked value (an axis, a shape, a
    scalar factor), as its value `(bytes,)`: gradient functions and shape inference
    need such values static (a gather's gradient is sparse only for a known axis)."""
    if tracked:
        return _TRACKED
    n = tensor.shape.num_elements()
    if n is not None and n <= 16 and tensor.dtype != tf.string:
        try:
            value = tensor.numpy()
        except Exception:  # pylint: disable=broad-except  (a value of another handler)
            return _CONSTANT
        return (value.tobytes(),)
    return _CONSTANT


def record(segment, trainable):
    """Records `segment` on the current tapes; returns the recorded outputs as a list of
    `((node, output), tensor)`. `trainable(value)` says whether an output is
    differentiable. Values neither used later nor referenced are not outputs.

    An output that ops of the segment also use (a *cut*: a value the program still holds,
    or one a later segment uses) must show those uses to the tapes, or a gradient with
    respect to it would miss them. The segment is then recorded as several operations
    (`split`): one per cut, computing it from the segment's inputs and the earlier cuts,
    and one for the other outputs, computing them from the inputs and all cuts."""
    outputs = dict(segment.used)
    for n, refs in enumerate(segment.values):
        for k, ref in enumerate(refs):
            v = ref()
            if v is not None and (n, k) not in outputs:
                outputs[(n, k)] = v.tensor
    outputs = {nk: t for nk, t in outputs.items() if trainable(t)}
    if not outputs:
        return []
    for i, t in enumerate(segment.externals):
        # An input watched since it entered (tape.watch after a use): as TensorFlow's
        # tape, which records an op with all its inputs, its earlier uses count too.
        if not segment.ext_tracked[i] and trainable(t) \
                and gradients_util.PossibleTapeGradientTypes([t]) != 0:
            segment.ext_tracked[i] = True
    recorded, pieces = [], []
    for piece, back, piece_outputs in split(segment, outputs):
        made = _record_piece(piece, piece_outputs)
        if made:
            pieces.append(piece)
        recorded.extend((back[nk], t) for nk, t in made)
    segment.pieces = pieces
    segment.out_bytes = sum(nbytes(t) for _, t in recorded)
    return sorted(recorded)


def split(segment, outputs):
    """The pieces recording `segment`: a list of `(piece, back, piece_outputs)` where
    `piece` is a `Segment` of some of its nodes, `back` maps the piece's `(node, output)`
    to the segment's and `piece_outputs` maps the piece's output refs to tensors. A
    segment without cuts is one piece, itself. A node needed by two pieces is in both
    (recomputed by each gradient function); in a chain every node is in one piece."""
    consumed = set()
    for _, refs in segment.nodes:
        consumed.update(r for r in refs if r[0] >= 0)
    cuts = sorted(nk for nk in outputs if nk in consumed)
    if not cuts:
        return [(segment, {nk: nk for nk in outputs}, dict(outputs))]
    groups = []  # the cuts of one node are one piece
    for nk in cuts:
        if groups and groups[-1][0][0] == nk[0]:
            groups[-1].append(nk)
        else:
            groups.append([nk])
    leaves = sorted(nk for nk in outputs if nk not in consumed)
    pieces, done = [], set()
    for targets in groups + ([leaves] if leaves else []):
        pieces.append(_piece(segment, targets, done, outputs))
        done.update(targets)
    return pieces


def _piece(segment, targets, cuts, outputs):
    """The nodes computing `targets` from the segment's inputs and the `cuts` (values
    of earlier pieces, inputs of this one)."""
    needed, stack = set(), [n for n, _ in targets]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(p for p, i in segment.nodes[n][1] if p >= 0 and (p, i) not in cuts)
    piece = Segment(keep=segment.saved is not None, partial=segment.partial)
    piece.ordered = segment.ordered
    local = {}
    for n in sorted(needed):
        op, refs = segment.nodes[n]
        new_refs = []
        for p, i in refs:
            if p < 0:
                new_refs.append((-1, piece.external(segment.externals[i],
                                                     segment.ext_tracked[i])))
            elif (p, i) in cuts:
                new_refs.append((-1, piece.external(outputs[(p, i)], True)))
            else:
                new_refs.append((local[p], i))
        local[n] = len(piece.nodes)
        piece.nodes.append((op, tuple(new_refs)))
        if piece.saved is not None:
            piece.saved.append(segment.saved[n])
    back = {(local[n], k): (n, k) for n, k in targets}
    return piece, back, {(local[n], k): outputs[(n, k)] for n, k in targets}


def _record_piece(segment, outputs):
    """Records one piece: `outputs` maps its `(node, output)` refs to tensors."""
    outputs = sorted(outputs.items())
    kinds = [_kind(t, tr) for t, tr in zip(segment.externals, segment.ext_tracked)]
    xs = [t for t, k in zip(segment.externals, kinds) if k is _TRACKED]
    cs = [t for t, k in zip(segment.externals, kinds) if k is _CONSTANT]
    if not xs:
        return []
    segment.xs = xs  # (checkpoint thinning may put recipes in place of its tensors)
    structure = graph_builder.program_key(
        [(op, refs, None) for op, refs in segment.nodes], [nk for nk, _ in outputs],
        segment.externals, kinds=tuple(kinds))
    saved = [] if segment.saved is None else [t for ts in segment.saved if ts is not None
                                              for t in ts]
    refs = [nk for nk, _ in outputs]
    outs = [t for _, t in outputs]
    # The gradient functions need the outputs' specs only: the closure below lives as
    # long as the tapes' record, through this segment's own backward call, and must not
    # keep its outputs (checkpoints the next segment's record no longer needs).
    out_specs = [tf.TensorSpec(t.shape, t.dtype) for t in outs]
    # which nodes' values are arguments (all of a kept segment's, some of a partial one's)
    layout = None if segment.saved is None else tuple(ts is not None for ts in segment.saved)
    ordered = segment.ordered

    def function(mask, kept):
        """The gradient function of the outputs whose gradients are given (the others
        have no gradient: an input reached only from them gets none, so a gather's
        input keeps its IndexedSlices gradient as with TensorFlow's tape)."""
        key = (structure, mask, kept, layout, _GradientFunction.split_nested, ordered)
        fn = _gradients.get(key)
        if fn is None:
            fn = _gradients[key] = _GradientFunction(
                segment, kinds, [r for r, m in zip(refs, mask) if m],
                [t for t, m in zip(out_specs, mask) if m], kept, ordered)
        return fn

    def backward(*grads):
        mask = tuple(g is not None for g in grads)
        if not any(mask):
            return [None] * len(xs)
        # A kept segment's saved values were computed with the tapes paused: a tape
        # recording this backward pass (second order) would not see that they depend
        # on the inputs, so it then gets the recomputing function instead.
        kept = bool(saved) and not _record.could_possibly_record()
        # An IndexedSlices gradient (of a gathered output) enters densified, as a dense
        # op's gradient function would take it.
        return function(mask, kept).run(thinning.materialized_all(xs),
                                        cs + saved if kept else cs, [
            tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            for g in grads if g is not None])

    _record.record_operation(SEGMENT_OP_TYPE, outs, xs, backward)
    del outs
    return outputs


class _GradientFunction:
    """`tf.function(xs, cs, output gradients) -> gradients of xs`, recomputing the
    segment's nodes inside."""

    # Split at a narrow place inside (nested.py); part of the functions' cache key.
    split_nested = True

    def __init__(self, segment, kinds, output_refs, output_specs, kept=False,
                 ordered=False):
        nodes = [(op, refs) for op, refs in segment.nodes]
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in segment.externals]
        x_specs = [s for s, k in zip(specs, kinds) if k is _TRACKED]
        c_specs = [s for s, k in zip(specs, kinds) if k is _CONSTANT]
        values = [t.numpy() if type(k) is tuple else None
                  for t, k in zip(segment.externals, kinds)]
        saved = segment.saved if kept else None
        if saved is not None:  # a kept segment: its values are arguments (after cs)
            c_specs = c_specs + [tf.TensorSpec(t.shape, t.dtype) for ts in saved
                                 if ts is not None for t in ts]
        self.kinds = []
        self.split = None  # where a nested split cut the nodes (nested.py), if it did

        def build(*args):
            xs = list(args[:len(x_specs)])
            cs = list(args[len(x_specs):len(x_specs) + len(c_specs)])
            gs = list(args[len(x_specs) + len(c_specs):])
            it_x, it_c = iter(xs), iter(cs)
            ext = [next(it_x) if k is _TRACKED else next(it_c) if k is _CONSTANT
                   else tf.constant(v) for k, v in zip(kinds, values)]
            if saved is not None:
                results = [None if ts is None else [next(it_c) for _ in ts] for ts in saved]
                graph_builder.replay(  # a partial segment recomputes the others
                    _ops.get_default_graph(), [(op, refs, None) for op, refs in nodes], ext,
                    results, [n for n, ts in enumerate(saved) if ts is None])
                start = len(_ops.get_default_graph().get_operations())
                grads = backprop_kept(nodes, ext, results, output_refs, gs, xs)
            else:
                # Convolutions' gradients without the CPU kernels' scratch buffers
                # (conv_grads.py): what they allocate is most of a recomputing
                # backward pass's working memory besides the weight gradients.
                graph = _ops.get_default_graph()
                plain = [(op, refs, None) for op, refs in nodes]
                with graph.gradient_override_map(conv_grads.overrides(ordered)):
                    results = conv_grads.replay(graph, plain, ext)
                    start = len(graph.get_operations())
                    # A segment narrowing inside differentiates its two parts one after
                    # the other (nested.py): their working values are not alive together.
                    p = nested.cut(nodes, results, output_refs) if self.split_nested else None
                    if p is None:
                        grads = tf.gradients([results[n][k] for n, k in output_refs], xs,
                                             grad_ys=gs)
                    else:
                        grads = nested.gradients(graph, plain, ext, results, p, output_refs,
                                                 gs, xs, conv_grads.replay)
                    self.split = p
            if ordered:
                run_in_order(_ops.get_default_graph().get_operations())
            else:
                serialize_heavy(_ops.get_default_graph().get_operations()[start:])
            flat = []
            for g in grads:
                if g is None:
                    self.kinds.append(_NONE)
                elif isinstance(g, tf.IndexedSlices):
                    self.kinds.append(_SLICES)
                    flat.extend([g.values, g.indices, g.dense_shape])
                else:
                    self.kinds.append(_DENSE)
                    flat.append(g)
            return flat

        g_specs = list(output_specs)
        with _ops.init_scope():
            self.function = tf.function(
                build, input_signature=x_specs + c_specs + g_specs,
                autograph=False).get_concrete_function()
        # An accumulator above differentiates it as the ops TensorFlow's tape would run
        # (None, not a call's zeros, for the JVP of a gradient without a tangent).
        self.call = CompiledCall(self.function, op_by_op=True)

    def run(self, xs, cs, gs):
        """The gradients of the tracked inputs (None where unconnected)."""
        stack = current_stack()
        args = list(xs) + list(cs) + list(gs)
        if stack is PHYSICAL and _record.could_possibly_record():
            # A tape records the backward pass (higher order): ConcreteFunction's call
            # path records the call with TensorFlow's function gradient.
            flat = self.function._call_flat(args, self.function.captured_inputs)  # pylint: disable=protected-access
            flat = [flat] if not isinstance(flat, (list, tuple)) else list(flat)
        else:
            flat = self.call.run(stack, args)
        it = iter(flat)
        out = []
        for kind in self.kinds:
            if kind == _NONE:
                out.append(None)
            elif kind == _SLICES:
                out.append(tf.IndexedSlices(next(it), next(it), next(it)))
            else:
                out.append(next(it))
        return out


# Gradient kernels with a large scratch buffer of their own: TensorFlow's CPU
# convolution backprops allocate an im2col buffer of up to 30 MB per call
# (conv_grad_filter_ops.cc / conv_grad_input_ops.cc: target_working_set_size).
HEAVY_GRADIENT_OPS = frozenset((
    "Conv2DBackpropFilter", "Conv2DBackpropInput", "Conv2DBackpropFilterV2",
    "Conv2DBackpropInputV2", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput"))


# Ops that compute nothing to wait for: left out of run_in_order's chain.
UNCHAINED_OPS = frozenset(("Const", "Placeholder", "NoOp"))


def _chain(ops):
    """Each of `ops` (in creation order, a topological order) waits for the one before
    it (control edges)."""
    previous = None
    for op in ops:
        if previous is not None:
            op._add_control_input(previous)  # pylint: disable=protected-access
        previous = op


def run_in_order(ops):
    """Chains all of a gradient function's `ops` (recomputation and gradients) with
    control edges. The executor otherwise runs every op as soon as its inputs exist:
    the gradient ops that read only recomputed values run during the recomputation,
    branches side by side, and their results wait, all alive, for the ops that use
    them. In order, a value lives from its op to its last use, as in the op-by-op tape.
    It costs the parallelism between independent ops (`Recompute.in_order`)."""
    _chain(op for op in ops if op.type not in UNCHAINED_OPS)


def serialize_heavy(ops):
    """Chains the heavy gradient kernels among `ops` with control edges, so a gradient
    function runs one at a time. A segment's gradient is one graph whose executor
    would otherwise run independent backprops in parallel (the filter and input
    gradients of a convolution, of parallel branches), each with its scratch buffer: in
    a ResNet50 step that raised the peak by 20 MB over the op-by-op tape, which runs
    them one after the other."""
    _chain(op for op in ops if op.type in HEAVY_GRADIENT_OPS)


def backprop_kept(nodes, ext, results, output_refs, gs, xs):
    """Reverse mode through a kept segment's nodes (inside its gradient function) with
    the registered gradient functions, given the nodes' forward values `results` as
    arguments: what the tape does op by op, at graph speed and without recomputation.
    Returns the gradients of `xs` (tensors of `ext`)."""
    grads = {}
    for (n, k), g in zip(output_refs, gs):
        grads.setdefault((n, k), []).append(g)
    ext_grads = {}
    for n in range(len(nodes) - 1, -1, -1):
        op, refs = nodes[n]
        outs = results[n]
        parts = [grads.pop((n, k), None) for k in range(len(outs))]
        if not any(parts):
            continue
        grad_fn = _ops._gradient_registry.lookup(op.type)  # pylint: disable=protected-access
        if grad_fn is None:  # not differentiable
            continue
        out_grads = [nested.aggregate(p) if p else
                     (tf.zeros_like(o) if o.dtype.is_floating or o.dtype.is_complex else None)
                     for o, p in zip(outs, parts)]
        ins = [ext[i] if p < 0 else results[p][i] for p, i in refs]
        mock = _backprop._MockOp(op.attr_tuple(), ins, outs, op.type, None)  # pylint: disable=protected-access
        in_grads = grad_fn(mock, *out_grads)
        if not isinstance(in_grads, (list, tuple)):
            in_grads = [in_grads]
        for (p, i), g in zip(refs, in_grads):
            if g is not None:
                (ext_grads.setdefault(i, []) if p < 0
                 else grads.setdefault((p, i), [])).append(g)
    ids = {id(t): i for i, t in enumerate(ext)}
    return [nested.aggregate(ext_grads[ids[id(x)]]) if ids[id(x)] in ext_grads else None
            for x in xs]
