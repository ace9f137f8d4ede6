"""Function calls under handlers: replay into a handler-free function (RFC "Replay before
function execution", DESIGN.md decision 5).

A `tf.function` call reaches a stack as one op named after the function
(``__inference_f_123``). Unless the stack's handler takes call ops whole
(``replays_functions = False``: tapes, parallel handlers), the call is *replayed*:

1. The *segment* is the run of replaying handlers from the stack down; the *bottom* is
   the stack below it (PHYSICAL, or a tape that takes calls whole).
2. Each argument is split by its handlers' `function_input` hooks into tensors of the
   bottom plus a summary tree; the summaries and the bottom tensors' specs key the cache.
3. On a miss, a `tf.function` over the bottom tensors is traced: placeholders are rebuilt
   into representations (`function_output`), the FunctionDef's body is interpreted node by
   node through the segment's stacks (symbolic: a stack's tensors are *shadow* tensors
   that carry ``(stack, representation)``), nested calls are inlined, and If/Case/While
   are rebuilt with TensorFlow's cond_v2/while_v2 around replayed branches. Ops a
   handler's hooks create with ordinary TensorFlow calls are routed through the next
   stack, as they are eagerly. What reaches the bottom becomes the function's body.
4. The replayed ConcreteFunction is called on the bottom stack (so a tape there records
   it with TensorFlow's function gradient), and its results are rebuilt into the
   segment's representations.

A cache hit costs the splits, one dictionary lookup and one function call.
"""
import collections
import contextlib
import threading

import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import function_def_to_graph as _fdef_to_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework.tensor import Tensor as _Tensor
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import cond_v2 as _cond_v2
from tensorflow.python.ops import handle_data_util as _handle_data_util
from tensorflow.python.ops import while_v2 as _while_v2

from tf_ophandlers import _C
from tf_ophandlers.core import errors
from tf_ophandlers.core.handler import OpHandler as _OpHandler
from tf_ophandlers.core.op import Op, _decode
from tf_ophandlers.core.stack import PHYSICAL, HandlerStack, _replays, payload, stack_of, state

_CALL_OPS = frozenset(("PartitionedCall", "StatefulPartitionedCall"))
_IF_OPS = frozenset(("If", "StatelessIf"))
_CASE_OPS = frozenset(("Case", "StatelessCase"))
_WHILE_OPS = frozenset(("While", "StatelessWhile"))
# Ops that stay physical in a replay, as eager constants do (they never reach a handler).
_PHYSICAL_OPS = frozenset(("Const", "Placeholder", "NoOp"))

_RESOURCE = tf.resource
_VARIANT = tf.variant
_default_function_input = _OpHandler.function_input
_default_function_output = _OpHandler.function_output

_CACHE_SIZE = 512
_cache = collections.OrderedDict()  # key -> _Entry
_cache_lock = threading.Lock()
_bodies = {}  # function name -> FuncGraph of its FunctionDef


class CompiledCall:
    """A ConcreteFunction built by a handler (a replay, Lazy's pending ops), run on a stack.

    On physical devices it runs as one op, without ConcreteFunction's Python call path
    (tapes above recorded the original call). On a handler stack it goes through that
    path, so that a tape there records it with TensorFlow's function gradient.
    """

    __slots__ = ("function", "call_op", "captured")

    def __init__(self, function):
        self.function = function  # owns the function registered in the context
        signature = function.function_def.signature
        self.call_op = _C.new_op(signature.name, {}, len(signature.output_arg))
        self.captured = list(function.captured_inputs)

    def run(self, stack, args):
        """The outputs of the function called on `args` (tensors) on `stack`."""
        if stack is PHYSICAL:
            return PHYSICAL.execute(self.call_op, list(args) + self.captured)
        return _call_on(stack, self.function, args)


class _Entry:
    __slots__ = ("compiled", "output_trees")

    def __init__(self, function, output_trees):
        self.compiled = CompiledCall(function)
        self.output_trees = output_trees


def cache_info():
    """Number of replayed functions cached (for tests and benchmarks)."""
    return len(_cache)


def clear_cache():
    with _cache_lock:
        _cache.clear()
    _bodies.clear()


# -- the segment of a call -------------------------------------------------------------------

def _segment(stack, op):
    """The stacks replaying `op` from `stack` down (top first), and the stack below."""
    segment = []
    while isinstance(stack, HandlerStack) and _replays(stack.handler, op):
        segment.append(stack)
        stack = stack.next
    return segment, stack


def _body(name):
    """The FuncGraph of the FunctionDef `name` registered in the eager context."""
    graph = _bodies.get(name)
    if graph is None:
        ctx = _context.context()
        if not ctx.has_function(name):
            raise errors.HandlerError(
                "tf_ophandlers: cannot replay function %s: it is not registered in the "
                "eager context" % name)
        fdef = ctx.get_function_def(name)
        with _ops.init_scope():  # nested functions are looked up in the eager context
            graph = _fdef_to_graph.function_def_to_graph(fdef)
        if len(_bodies) > 1024:
            _bodies.clear()
        _bodies[name] = graph
    return graph


def function_library(names):
    """The FunctionDefs of the functions `names` and of every function they call (as op
    types or through function attributes: branches, loop bodies), callees first."""
    ctx = _context.context()
    seen, order = set(), []

    def visit(name):
        if name in seen or not ctx.has_function(name):
            return
        seen.add(name)
        fdef = ctx.get_function_def(name)
        for node in fdef.node_def:
            visit(node.op)
            for value in node.attr.values():
                if value.HasField("func"):
                    visit(value.func.name)
                for f in value.list.func:
                    visit(f.name)
        order.append(fdef)

    for name in names:
        visit(name)
    return order


_op_types = {}  # function name -> op types of its body and the functions it calls


def body_op_types(name):
    """The op types in function `name`'s body and in the functions it calls (for a
    handler's `replays_functions(op)` decision)."""
    types = _op_types.get(name)
    if types is None:
        types = _op_types[name] = frozenset(
            node.op for fdef in function_library([name]) for node in fdef.node_def)
    return types


# -- splitting and rebuilding representations (FunctionInput / FunctionOutput) -------------

def _split(tensor, segment, leaf_key, comps):
    """Appends the bottom tensors carrying `tensor` to `comps`; returns its summary tree."""
    p = payload(tensor)
    if p is not None:
        stack = p[0]
        for level, s in enumerate(segment):
            if s is stack:
                handler = stack.handler
                if type(handler).function_input is _default_function_input:
                    summary, parts = None, (p[1],)  # no frame needed
                else:
                    summary, parts = stack._call(handler.function_input, p[1])  # pylint: disable=protected-access
                try:
                    hash(summary)
                except TypeError:
                    raise errors.HandlerOutputError(
                        "%s.function_input returned an unhashable summary %r; summaries key "
                        "the replay cache" % (stack.handler.debug_string(), summary)) from None
                return (level, summary, tuple(_split(t, segment, leaf_key, comps) for t in parts))
    comps.append(tensor)
    return leaf_key(tensor)


def _rebuild(tree, segment, comps):
    """The tensor (on its stack of `segment`) for `tree` from the bottom tensors `comps`."""
    if tree[0] == "leaf":
        return next(comps)
    level, summary, subtrees = tree
    stack = segment[level]
    parts = [_rebuild(t, segment, comps) for t in subtrees]
    handler = stack.handler
    if type(handler).function_output is _default_function_output:
        return stack.wrap(parts[0])
    value = stack._call(handler.function_output, summary, parts)  # pylint: disable=protected-access
    return stack.wrap(value)


def _eager_leaf(tensor):
    """Cache-key part of a bottom tensor: what the replay's placeholder depends on."""
    if not isinstance(tensor, _Tensor):
        raise errors.HandlerOutputError(
            "tf_ophandlers: function_input returned %r, which is not a tensor" % (tensor,))
    dtype = tensor.dtype
    if dtype == _RESOURCE or dtype == _VARIANT:
        # The replay's placeholder takes its handle data (a variable's dtype and shape)
        # from the function's own argument, which TensorFlow traced for it.
        return ("leaf", dtype)
    return ("leaf", dtype, tensor._shape_tuple())  # pylint: disable=protected-access


def _graph_leaf(tensor):
    return ("leaf", tensor.dtype)


# -- a replay in progress ---------------------------------------------------------------------

class _Replay:
    """State of one replay being traced; `state.replay` while it is active."""

    def __init__(self, segment, bottom, scope_placed, name):
        self.segment = list(segment)  # grows by the stacks of traced scopes (below)
        self.members = set(id(s) for s in segment)
        self.dynamic = set()  # ids of those stacks
        self.bottom = bottom
        self.scope_placed = scope_placed
        self.name = name
        self.graphs = set()  # ids of the graphs whose ops are routed (body, branches)
        self.scratch = _ops.Graph()  # shadow tensors live here, never in a function

    def building(self):
        """Whether ops are being added to this replay (not eager code inside it)."""
        return (not _context.executing_eagerly()
                and id(_ops.get_default_graph()) in self.graphs)

    # -- symbolic stacks ------------------------------------------------------------------

    def shadow(self, stack, value):
        """A symbolic tensor of `stack` whose representation is `value`."""
        handler = stack.handler
        dtype = handler.value_dtype(value)
        rank = handler.num_dims(value)
        shape = None if rank < 0 else [
            None if d < 0 else d for d in (handler.dim(value, i) for i in range(rank))]
        with self.scratch.as_default():
            t = _array_ops.placeholder(dtype, shape, name="oh_shadow")
        t._oh_payload = (stack, value)  # pylint: disable=protected-access
        return t

    def to_bottom(self, tensor):
        """`tensor` copied off the segment (a tensor of the bottom)."""
        p = payload(tensor)
        if p is None:
            return tensor
        return p[0].copy_off(tensor, state.device)

    def execute(self, stack, op, inputs):
        """A stack's execute while replaying: symbolic for the segment, nodes below."""
        if id(stack) in self.members:
            return _execute_symbolic(stack, op, inputs)
        return self.emit(op, inputs)

    def emit(self, op, inputs):
        """Adds `op` on bottom tensors to the function being built."""
        inputs = [self.to_bottom(t) for t in inputs]
        attrs = op.attr_protos()
        graph = _ops.get_default_graph()
        with _ops.device(state.device) if state.device else contextlib.nullcontext():
            node = _original_create_op(graph, op.type, inputs, attrs=attrs)
        return list(node.outputs)

    # -- ops created by TensorFlow calls in hooks -----------------------------------------

    def create_op(self, graph, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                  compute_device):
        target = state.current
        if op_type in _PHYSICAL_OPS or id(target) not in self.members:
            if any(payload(t) is not None for t in inputs):
                inputs = [self.to_bottom(t) for t in inputs]
            return _original_create_op(graph, op_type, inputs, dtypes, input_types, name,
                                       attrs, op_def, compute_device)
        if op_type in _CALL_OPS:
            # A tf.function a hook calls: replayed on the hook's next stack, as eagerly.
            outputs = self.interpret(_body(attrs["f"].func.name), list(inputs), target)
            return _RoutedOp(op_type, name, attrs, outputs, inputs, graph)
        op = Op.create(op_type, **(attrs or {}))
        outputs = target.execute(op, list(inputs))
        return _RoutedOp(op_type, name, attrs, outputs, inputs, graph)

    # -- interpreting a FunctionDef body ----------------------------------------------------

    def placement(self, inputs):
        """The stack a body op runs on: the call's stack if it was placed by a scope,
        else the stack of its handler inputs (type-based dispatch), else the bottom."""
        if self.scope_placed:
            return self.segment[0]
        best = None
        for t in inputs:
            s = stack_of(t)
            if s is not None and id(s) in self.members:
                if best is None or len(s.handlers) > len(best.handlers):
                    best = s
        return best

    def lift(self, tensor, stack):
        """`tensor` moved onto `stack` (None: the bottom)."""
        if stack is None:
            return self.to_bottom(tensor)
        return stack.copy_on(tensor)

    def traced_stack(self, node, within):
        """The stack a node annotated by a handler scope opened while tracing runs on:
        that scope's handlers merged onto the stack of the call (or `within`, the stack
        of an annotated call or control-flow op containing the node)."""
        attr = node.node_def.attr.get(_scope_module().TRACED_STACK_ATTR)
        if attr is None:
            return within
        traced = _scope_module().stack_named(attr.s.decode())
        if traced is None:
            raise errors.HandlerError(
                "tf_ophandlers: op %s of function %s was traced under handler stack %s, "
                "which no longer exists" % (node.name, self.name, attr.s.decode()))
        stack = self.segment[0] if self.scope_placed else self.bottom
        for h in traced.handlers:
            if not any(h is x for x in stack.handlers):
                if not h.replays_functions:
                    raise errors.HandlerError(
                        "tf_ophandlers: %s cannot run the ops of a traced scope: it takes "
                        "function calls whole" % h.debug_string())
                stack = HandlerStack.merged(h, stack)
                if id(stack) not in self.members:
                    self.members.add(id(stack))
                    self.dynamic.add(id(stack))
                    self.segment.append(stack)
        return stack

    def lower(self, tensor):
        """A result of the replay moved off the stacks of traced scopes (they exist only
        while the replay is built)."""
        s = stack_of(tensor)
        if s is None or id(s) not in self.dynamic:
            return tensor
        if self.scope_placed:
            return self.segment[0].copy_on(tensor)
        return self.to_bottom(tensor)

    def interpret(self, body, args, within=None):
        """Runs the ops of FuncGraph `body` on `args`; returns its outputs."""
        env = {}
        for placeholder, arg in zip(body.inputs, args):
            env[id(placeholder)] = arg
        inputs = set(id(p.op) for p in body.inputs)
        for node in body.get_operations():
            if id(node) in inputs:
                continue
            ins = [env[id(t)] for t in node.inputs]
            outs = self.run_node(node, ins, within)
            for t, o in zip(node.outputs, outs):
                env[id(t)] = o
        return [env[id(t)] for t in body.outputs]

    def run_node(self, node, ins, within=None):
        op_type = node.type
        within = self.traced_stack(node, within)
        if op_type in _CALL_OPS:
            return self.interpret(_body(node.get_attr("f").name), ins, within)
        if op_type in _IF_OPS:
            return self.run_if(node, ins, within)
        if op_type in _CASE_OPS:
            return self.run_case(node, ins, within)
        if op_type in _WHILE_OPS:
            return self.run_while(node, ins, within)
        if _context.context().has_function(op_type):
            return self.interpret(_body(op_type), ins, within)
        op = _node_op(node)
        if op_type in _PHYSICAL_OPS:
            stack = None
        else:
            stack = within if within is not None else self.placement(ins)
        if stack is None:
            return self.emit(op, ins)
        return stack.execute(op, ins)

    # -- control flow (RFC "Control flow": If/Case/While inputs and outputs) -------------
    #
    # The branches and loop bodies are replayed like function bodies and rebuilt with
    # cond_v2/while_v2. Values crossing into and out of them are split by the handlers'
    # `function_input` (IfInput/IfOutput, WhileInput/WhileOutput); where the branches
    # (or a loop's inputs and its body's results) give a value different summaries, the
    # handler joins them (`function_join`) and converts values (`function_coerce`), e.g.
    # a tangent of zeros or a broadcast over the batch. A probe trace of each branch (a
    # throwaway graph) finds the summaries first.

    def _join(self, trees):
        """The tree values of `trees` (one per branch) are coerced to."""
        first = trees[0]
        if all(t == first for t in trees[1:]):
            return first
        if any(t[0] == "leaf" for t in trees) or any(t[0] != first[0] for t in trees):
            raise errors.HandlerError(
                "tf_ophandlers: while replaying %s, control flow merges values of "
                "different handler stacks (%r)" % (self.name, list(trees)))
        stack = self.segment[first[0]]
        summary = stack._call(stack.handler.function_join, [t[1] for t in trees])  # pylint: disable=protected-access
        for t in trees:
            if t[1] == summary:
                return t
        return (first[0], summary, None)  # parts follow from the coerced values

    def _coerce(self, tensor, tree):
        """`tensor` (on the stack of `tree`'s level) converted to `tree`'s summaries."""
        if tree[0] == "leaf":
            return tensor
        level, summary, subtrees = tree
        stack = self.segment[level]
        p = payload(tensor)
        if p is None or p[0] is not stack:
            # A part a handler built that is not on its stack yet (a zero tangent that
            # stayed a physical constant): move it on.
            tensor = stack.copy_on(tensor)
            p = payload(tensor)
        value = p[1]
        current, parts = stack._call(stack.handler.function_input, value)  # pylint: disable=protected-access
        if current != summary:
            value = stack._call(stack.handler.function_coerce, value, summary)  # pylint: disable=protected-access
            current, parts = stack._call(stack.handler.function_input, value)  # pylint: disable=protected-access
            if current != summary:
                raise errors.HandlerOutputError(
                    "%s.function_coerce gave summary %r, not %r"
                    % (stack.handler.debug_string(), current, summary))
        elif subtrees is None:
            return tensor
        if subtrees is not None:
            parts = [self._coerce(t, sub) for t, sub in zip(parts, subtrees)]
            value = stack._call(stack.handler.function_output, summary, parts)  # pylint: disable=protected-access
        return stack.wrap(value)

    def _probe(self, fn):
        """Runs `fn` in a throwaway graph (its ops never run); returns its result."""
        graph = _func_graph.FuncGraph("oh_probe")
        self.graphs.add(id(graph))
        with graph.as_default():
            return fn()

    def _branch_outputs(self, body, trees, comps, out_stack, within):
        args = [_rebuild(t, self.segment, iter(c)) for t, c in zip(trees, comps)]
        return [self.lift(o, out_stack) for o in self.interpret(body, args, within)]

    def _split_all(self, tensors):
        flat = []
        trees = tuple(_split(t, self.segment, _graph_leaf, flat) for t in tensors)
        return trees, flat

    def _run_branches(self, node, bodies, trees, comps, stack, within, build):
        probes = [self._probe(lambda b=b: self._split_all(
            self._branch_outputs(b, trees, comps, stack, within))[0]) for b in bodies]
        joined = tuple(self._join([p[k] for p in probes]) for k in range(len(probes[0])))
        final = []

        def branch_fn(body):
            def branch():
                self.graphs.add(id(_ops.get_default_graph()))
                outs = self._branch_outputs(body, trees, comps, stack, within)
                outs = [self._coerce(o, t) for o, t in zip(outs, joined)]
                out_trees, flat = self._split_all(outs)
                final.append(out_trees)
                return flat
            return branch

        flat = _as_list(build([branch_fn(b) for b in bodies]))
        if any(t != final[0] for t in final[1:]):
            raise errors.HandlerError(
                "tf_ophandlers: while replaying %s, the branches of %s (%s) give their "
                "outputs different handler representations (%r)"
                % (self.name, node.type, node.name, final))
        it = iter(flat)
        return [_rebuild(t, self.segment, it) for t in final[0]]

    def _split_args(self, args):
        trees, comps = [], []
        for a in args:
            c = []
            trees.append(_split(a, self.segment, _graph_leaf, c))
            comps.append(c)
        return trees, comps

    def _control_input(self, tensor):
        """The branch index / predicate as a bottom tensor, or None if a handler keeps it
        (a per-example predicate under vectorized_map): then that handler gets the op."""
        try:
            return self.to_bottom(tensor)
        except errors.CopyOffError:
            return None

    def _select(self, node, ins, within):
        """A stateless If whose predicate a handler keeps (one value per example under
        vectorized_map): both branches run, and a SelectV2 on the handler picks, as pfor
        converts it."""
        pred = ins[0]
        stack = stack_of(pred)
        args = [self.lift(t, stack) for t in ins[1:]]
        outs = [[self.lift(o, stack) for o in self.interpret(
            _body(node.get_attr(b).name), args, within)] for b in ("then_branch", "else_branch")]
        return [stack.execute(Op.cached("SelectV2", T=a.dtype), [pred, a, b])[0]
                for a, b in zip(*outs)]

    def _whole_op(self, node, ins, stack):
        """The control-flow op itself, given to the handler that keeps its predicate
        (RFC: "If the condition ... is placed on an op handler, the handler sees the If
        op itself")."""
        target = stack if stack is not None else stack_of(ins[0])
        return target.execute(_node_op(node), ins)

    def run_if(self, node, ins, within):
        return self._run_conditional(
            node, ins, within, [node.get_attr(b).name for b in ("then_branch", "else_branch")],
            lambda pred, fns: _cond_v2.cond_v2(pred, fns[0], fns[1], name=node.name))

    def run_case(self, node, ins, within):
        return self._run_conditional(
            node, ins, within, [f.name for f in node.get_attr("branches")],
            lambda index, fns: _cond_v2.indexed_case(index, fns, name=node.name))

    def _run_conditional(self, node, ins, within, branch_names, build):
        """If/Case: the predicate (or branch index) `ins[0]` selects a branch function."""
        stack = within if within is not None else self.placement(ins)
        control = self._control_input(ins[0])
        if control is None:
            if node.type == "StatelessIf":
                return self._select(node, ins, within)
            return self._whole_op(node, ins, stack)
        args = [self.lift(t, stack) for t in ins[1:]]
        trees, comps = self._split_args(args)
        bodies = [_body(name) for name in branch_names]
        return self._run_branches(node, bodies, trees, comps, stack, within,
                                  lambda fns: build(control, fns))

    def run_while(self, node, ins, within):
        stack = within if within is not None else self.placement(ins)
        args = [self.lift(t, stack) for t in ins]
        cond_body = _body(node.get_attr("cond").name)
        loop_body = _body(node.get_attr("body").name)
        # Loop variables whose representation the body changes (a tangent appearing, a
        # value becoming per-example) are joined with the body's results until stable.
        for _ in range(4):
            trees, comps = self._split_args(args)
            probe = self._probe(lambda: self._split_all(
                self._branch_outputs(loop_body, trees, comps, stack, within))[0])
            joined = tuple(self._join([a, b]) for a, b in zip(trees, probe))
            if joined == tuple(trees):
                break
            args = [self._coerce(a, t) for a, t in zip(args, joined)]
        else:
            raise errors.HandlerError(
                "tf_ophandlers: while replaying %s, the handler representations of the loop "
                "variables of %s (%s) do not settle" % (self.name, node.type, node.name))
        trees = tuple(trees)

        def rebuild(flat):
            it = iter(flat)
            return [_rebuild(t, self.segment, it) for t in trees]

        def probe_cond():
            (out,) = self.interpret(cond_body, rebuild([t for c in comps for t in c]), within)
            try:
                self.to_bottom(out)
                return True
            except errors.CopyOffError:
                return False

        if not self._probe(probe_cond):
            # The condition is kept by a handler (per example, or unknown): the handler
            # gets the While op itself.
            return self._whole_op(node, args, stack)

        def cond(*flat):
            self.graphs.add(id(_ops.get_default_graph()))
            (out,) = self.interpret(cond_body, rebuild(flat), within)
            try:
                return self.to_bottom(out)
            except errors.CopyOffError as e:
                raise errors.HandlerError(
                    "tf_ophandlers: while replaying %s, the condition of %s (%s) is kept by "
                    "a handler (%s); such loops are not supported in replayed functions"
                    % (self.name, node.type, node.name, e)) from e

        def body(*flat):
            self.graphs.add(id(_ops.get_default_graph()))
            outs = self._branch_outputs(loop_body, trees, _regroup(trees, flat), stack, within)
            outs = [self._coerce(o, t) for o, t in zip(outs, trees)]
            out_trees, new_flat = self._split_all(outs)
            if out_trees != trees:
                raise errors.HandlerError(
                    "tf_ophandlers: while replaying %s, the body of %s (%s) changes the "
                    "handler representation of its loop variables (%r -> %r)" % (
                        self.name, node.type, node.name, trees, out_trees))
            return new_flat

        flat_in = [t for c in comps for t in c]
        try:
            flat = _while_v2.while_loop(cond, body, flat_in, name=node.name,
                                        return_same_structure=True)
        except ValueError as e:
            if "shape" not in str(e):
                raise
            # A loop variable changes shape: relax, as the original While did.
            flat = _while_v2.while_loop(
                cond, body, flat_in, name=node.name, return_same_structure=True,
                shape_invariants=[tf.TensorShape(None) for _ in flat_in])
        return rebuild(_as_list(flat))


def _node_op(node):
    """The Op of a FunctionDef node, without TensorFlow's internal ("_") attributes."""
    op = Op.create(node.type, **{k: v for k, v in node.node_def.attr.items()
                                 if not k.startswith("_")})
    op.node_name, op.function_name = node.name, node.graph.name  # for op.traceback
    return op


def _regroup(trees, flat):
    """`flat` bottom tensors grouped per tree."""
    out, k = [], 0
    for t in trees:
        n = _count_leaves(t)
        out.append(list(flat[k:k + n]))
        k += n
    return out


def _scope_module():
    from tf_ophandlers.core import scope  # pylint: disable=import-outside-toplevel
    return scope


def _as_list(x):
    if isinstance(x, (list, tuple)):
        return list(x)
    if x is None:
        return []
    return [x]


class _RoutedOp:
    """What a TensorFlow call gets back for an op a handler ran while replaying: the
    outputs are shadow tensors of the stack it ran on (the op is not a graph node)."""

    def __init__(self, op_type, name, attrs, outputs, inputs, graph):
        self.type = op_type
        self.name = name or op_type
        self._attrs = attrs or {}
        self.outputs = list(outputs)
        self.inputs = list(inputs)
        self.graph = graph
        self.device = ""
        self.control_inputs = []

    def get_attr(self, name):
        return _decode(self._attrs[name])

    _get_attr_type = _get_attr_bool = _get_attr_int = get_attr

    def _set_device_from_string(self, device):
        self.device = device

    def _set_attr(self, name, value):
        self._attrs[name] = value


def _execute_symbolic(stack, op, inputs):
    """`HandlerStack.execute` on shadow tensors (the eager path lives in core/stack.py)."""
    from tf_ophandlers.core.stack import _COPY_OPS, OffStack  # pylint: disable=import-outside-toplevel
    handler = stack.handler
    if op.type in _COPY_OPS and not (handler.handles_copy and handler.handles_copy(op)):
        return stack._execute_copy(op, inputs)  # pylint: disable=protected-access
    values = list(inputs)
    for i, t in enumerate(inputs):
        p = payload(t)
        if p is not None and p[0] is stack:
            values[i] = p[1]
        elif stack._wants_copy(op, i):  # pylint: disable=protected-access
            values[i] = stack._copy_on_value(t)  # pylint: disable=protected-access
    outputs = stack._call(handler.execute, op, values)  # pylint: disable=protected-access
    if outputs is None:
        raise errors.HandlerOutputError(
            "%s.execute returned None for op %s; it must return a list of outputs"
            % (handler.debug_string(), op.type))
    replay = state.replay
    result = []
    for o in outputs:
        if type(o) is OffStack:
            result.append(o.tensor)
        elif handler.transient and getattr(o, "dtype", None) == tf.resource:
            result.append(o)  # resource handles stay on the next stack
        elif (isinstance(o, _Tensor) and id(stack.next) in replay.members
              and stack_of(o) is not stack.next):
            result.append(o)  # left the stacks below
        else:
            result.append(stack.wrap(o))
    return result


# -- the call ---------------------------------------------------------------------------------

def call(stack, op, inputs):
    """Runs function call `op` placed on `stack` by replaying it; returns its outputs."""
    segment, bottom = _segment(stack, op)
    scope_placed = state.scope_placed
    if scope_placed and not all(s._default_copy_on for s in segment):  # pylint: disable=protected-access
        # As for any op placed by a scope, the arguments are copied onto the stack first
        # (a watched primal gets its tangent, from any handler of the segment). With the
        # default copy-on everywhere that would only wrap a tensor that the split below
        # unwraps again.
        inputs = [stack.copy_on(t) if stack._wants_copy(op, i) else t  # pylint: disable=protected-access
                  for i, t in enumerate(inputs)]
    leaves = []
    trees = tuple(_split(t, segment, _eager_leaf, leaves) for t in inputs)
    key = (op.type, scope_placed, state.device, trees,
           tuple(s.handler.function_cache_key() for s in segment),
           tuple(type(s.handler) for s in segment), id(bottom) if bottom is not PHYSICAL else 0)
    entry = _cache.get(key)
    if entry is None:
        entry = _trace(segment, bottom, scope_placed, op.type, trees, leaves)
        with _cache_lock:
            _cache[key] = entry
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)  # the oldest replay
    it = iter(entry.compiled.run(bottom, leaves))
    return [_rebuild(t, segment, it) for t in entry.output_trees]


def _call_on(bottom, function, args):
    """Calls `function` on the stack `bottom` through ConcreteFunction's call path, so that
    a tape there records it with TensorFlow's function gradient."""
    from tf_ophandlers.core import scope  # pylint: disable=import-outside-toplevel
    captured = function.captured_inputs
    # Not `scope.handler(bottom)`: re-entering a stack the current one contains is a
    # no-op, and the call must run below the segment.
    saved = state.current
    state.current = bottom
    device_scope = scope._original_context_device(_context.context(), scope.DISPATCHER_DEVICE)  # pylint: disable=protected-access
    try:
        with device_scope:
            return _as_list(function._call_flat(args, captured))  # pylint: disable=protected-access
    finally:
        state.current = saved


_VARIABLE_READS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd"))


def _set_handle_data(placeholder, exterior, argument):
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
    dtypes = {c.get_attr("dtype") for c in argument.consumers() if c.type in _VARIABLE_READS}
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


def _count_leaves(tree):
    if tree[0] == "leaf":
        return 1
    return sum(_count_leaves(t) for t in tree[2])


def _trace(segment, bottom, scope_placed, name, trees, leaves):
    from tf_ophandlers.core import scope  # pylint: disable=import-outside-toplevel
    body = _body(name)
    replay = _Replay(segment, bottom, scope_placed, name)
    output_trees = []
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in leaves]

    def replayed(*placeholders):
        graph = _ops.get_default_graph()
        replay.graphs.add(id(graph))
        # Resource and variant handle data (a variable's dtype and shape) come from the
        # function's own argument the leaf belongs to: the eager handles TensorFlow
        # passes to a device do not carry it (it is a Python attribute of a variable's
        # handle), and handlers leave resources unchanged (transient handlers).
        position = 0
        for i, tree in enumerate(trees):
            for _ in range(_count_leaves(tree)):
                p = placeholders[position]
                if p.dtype == tf.resource or p.dtype == tf.variant:
                    _set_handle_data(p, leaves[position], body.inputs[i])
                position += 1
        it = iter(placeholders)
        args = [_rebuild(t, segment, it) for t in trees]
        outs = [replay.lower(o) for o in replay.interpret(body, args)]
        flat = []
        output_trees.extend(_split(o, segment, _graph_leaf, flat) for o in outs)
        return flat

    saved = (state.replay, state.current, list(state.frames))
    state.replay = replay
    del state.frames[:]
    try:
        with scope.physical(), _record.stop_recording():
            state.current = bottom  # below the segment, ops are nodes of the function
            function = tf.function(replayed, input_signature=specs, autograph=False,
                                   reduce_retracing=False).get_concrete_function()
    finally:
        state.replay, state.current, frames = saved
        state.frames[:] = frames
    return _Entry(function, tuple(output_trees))


# -- routing ops created with TensorFlow calls while replaying -----------------------------

_original_create_op = _func_graph.FuncGraph._create_op_internal  # pylint: disable=protected-access


def _create_op_internal(self, op_type, inputs, dtypes=None, input_types=None, name=None,
                        attrs=None, op_def=None, compute_device=True):
    replay = state.replay
    if replay is None or id(self) not in replay.graphs:
        if replay is not None and any(getattr(t, "_oh_payload", None) is not None
                                      for t in inputs):
            raise errors.HandlerError(
                "tf_ophandlers: while replaying %s, a handler hook built a nested graph "
                "(tf.cond, tf.while_loop, tf.function tracing) on tensors of handler stack "
                "%r; hooks that run while functions are replayed must use plain ops "
                "(tf.where instead of tf.cond)" % (
                    replay.name, next(t._oh_payload[0] for t in inputs  # pylint: disable=protected-access
                                      if getattr(t, "_oh_payload", None) is not None)))
        return _original_create_op(self, op_type, inputs, dtypes, input_types, name, attrs,
                                   op_def, compute_device)
    return replay.create_op(self, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                            compute_device)


def _name(function):
    name = function.name
    return name.decode() if isinstance(name, bytes) else name


def _check_saveable(saveable_view):
    """Refuses to save a function whose body depends on a live handler (RFC
    "Relationship to SavedModels": a handler scope opened while tracing, or a captured
    handler tensor). Functions called under handlers save as they are."""
    for function in getattr(saveable_view, "concrete_functions", ()):
        for t in getattr(function, "captured_inputs", ()):
            s = stack_of(t)
            if s is not None:
                raise errors.HandlerError(
                    "tf_ophandlers: cannot save function %s: its body depends on the live "
                    "handler stack %r (a handler scope opened while tracing it, or a "
                    "captured handler tensor). Save the function without handlers and "
                    "apply them around the call after loading." % (_name(function), s))


def install():
    _func_graph.FuncGraph._create_op_internal = _create_op_internal  # pylint: disable=protected-access
    from tensorflow.python.saved_model import save as _save  # pylint: disable=import-outside-toplevel
    original = _save._fill_meta_graph_def  # pylint: disable=protected-access

    def _fill_meta_graph_def(meta_graph_def, saveable_view, *args, **kwargs):
        _check_saveable(saveable_view)
        return original(meta_graph_def, saveable_view, *args, **kwargs)

    _save._fill_meta_graph_def = _fill_meta_graph_def  # pylint: disable=protected-access
