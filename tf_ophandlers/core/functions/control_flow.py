"""Control flow in replayed functions (RFC "Control flow": If/Case/While inputs and
outputs).

The branches and loop bodies are replayed like function bodies and rebuilt with
cond_v2/while_v2. Values crossing into and out of them are split by the handlers'
`function_input` (IfInput/IfOutput, WhileInput/WhileOutput); where the branches (or a
loop's inputs and its body's results) give a value different summaries, the handler
joins them (`function_join`) and converts values (`function_coerce`), e.g. a tangent of
zeros or a broadcast over the batch. A probe trace of each branch (a throwaway graph)
finds the summaries first.
"""
import tensorflow as tf
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import cond_v2 as _cond_v2
from tensorflow.python.ops import while_v2 as _while_v2

from tf_ophandlers.core import errors
from tf_ophandlers.core.functions.interpreter import node_op
from tf_ophandlers.core.functions.library import body as function_body
from tf_ophandlers.core.functions.representations import (
    graph_leaf, rebuild, regroup, split)
from tf_ophandlers.core.op import Op
from tf_ophandlers.core.stack import payload, stack_of


def as_list(x):
    if isinstance(x, (list, tuple)):
        return list(x)
    if x is None:
        return []
    return [x]


class ControlFlow:
    """If/Case/While of a function body (mixed into `Replay`)."""

    def body_of(self, name):
        """The FuncGraph of branch or loop function `name`: one traced by cond_v2 or
        while_v2 in a re-traced Python body (in the function being built, not yet in the
        eager context), else the eager context's."""
        traced = self.traced_bodies.get(name)
        return traced if traced is not None else function_body(name)

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
        summary = stack.call_hook(stack.handler.function_join, [t[1] for t in trees])
        same = [t for t in trees if t[1] == summary]
        if not same:
            return (first[0], summary, None)  # parts follow from the coerced values
        subs = [t[2] for t in same]
        if any(s is None or len(s) != len(subs[0]) for s in subs) or all(
                s == subs[0] for s in subs[1:]):
            return same[0]
        # Equal here, different below (a tangent appearing under a pass-through handler
        # in a loop body): the levels below are joined too.
        return (first[0], summary,
                tuple(self._join([s[k] for s in subs]) for k in range(len(subs[0]))))

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
        current, parts = stack.call_hook(stack.handler.function_input, value)
        if current != summary:
            value = stack.call_hook(stack.handler.function_coerce, value, summary)
            current, parts = stack.call_hook(stack.handler.function_input, value)
            if current != summary:
                raise errors.HandlerOutputError(
                    "%s.function_coerce gave summary %r, not %r"
                    % (stack.handler.debug_string(), current, summary))
        elif subtrees is None:
            return tensor
        if subtrees is not None:
            parts = [self._coerce(t, sub) for t, sub in zip(parts, subtrees)]
            value = stack.call_hook(stack.handler.function_output, summary, parts)
        return stack.wrap(value)

    def _probe(self, fn):
        """Runs `fn` in a throwaway graph (its ops never run); returns its result."""
        graph = _func_graph.FuncGraph("oh_probe")
        self.graphs.add(id(graph))
        with graph.as_default():
            return fn()

    def _branch_outputs(self, body, trees, comps, out_stack, within):
        args = [rebuild(t, self.segment, iter(c)) for t, c in zip(trees, comps)]
        return [self.lift(o, out_stack) for o in self.interpret(body, args, within)]

    def _split_all(self, tensors):
        flat = []
        trees = tuple(split(t, self.segment, graph_leaf, flat) for t in tensors)
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

        flat = as_list(build([branch_fn(b) for b in bodies]))
        if any(t != final[0] for t in final[1:]):
            raise errors.HandlerError(
                "tf_ophandlers: while replaying %s, the branches of %s (%s) give their "
                "outputs different handler representations (%r)"
                % (self.name, node.type, node.name, final))
        it = iter(flat)
        return [rebuild(t, self.segment, it) for t in final[0]]

    def _split_args(self, args):
        trees, comps = [], []
        for a in args:
            c = []
            trees.append(split(a, self.segment, graph_leaf, c))
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
        bodies = [self.body_of(node.get_attr(b).name) for b in ("then_branch", "else_branch")]
        outs = [[self.lift(o, stack) for o in self.interpret(body, args, within)]
                for body in bodies]
        selected = []
        for k, (a, b) in enumerate(zip(*outs)):
            if a.dtype != tf.variant:
                selected.append(stack.execute(Op.cached("SelectV2", T=a.dtype), [pred, a, b])[0])
                continue
            dtype = _list_element_dtype(bodies[0].outputs[k], bodies[1].outputs[k])
            if dtype is not None:
                selected.append(_select_lists(stack, pred, a, b, dtype))
                continue
            # Other variants (the If's intermediates for its gradient, Optionals) carry no
            # gradient of their own; TensorFlow's SelectV2 gradient cannot make the zeros
            # of a variant (TypeError "`dtype` <dtype: 'variant'> is not compatible with 0").
            (t,) = stack.execute(Op.cached("SelectV2", T=tf.variant), [pred, a, b])
            selected.append(stack.execute(Op.cached("StopGradient", T=tf.variant), [t])[0])
        return selected

    def _whole_op(self, node, ins, stack):
        """The control-flow op itself, given to the handler that keeps its predicate
        (RFC: "If the condition ... is placed on an op handler, the handler sees the If
        op itself")."""
        target = stack if stack is not None else stack_of(ins[0])
        return target.execute(node_op(node), ins)

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
        bodies = [self.body_of(name) for name in branch_names]
        return self._run_branches(node, bodies, trees, comps, stack, within,
                                  lambda fns: build(control, fns))

    def run_while(self, node, ins, within):
        stack = within if within is not None else self.placement(ins)
        args = [self.lift(t, stack) for t in ins]
        cond_body = self.body_of(node.get_attr("cond").name)
        loop_body = self.body_of(node.get_attr("body").name)
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

        def rebuild_vars(flat):
            it = iter(flat)
            return [rebuild(t, self.segment, it) for t in trees]

        def probe_cond():
            (out,) = self.interpret(cond_body, rebuild_vars([t for c in comps for t in c]), within)
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
            (out,) = self.interpret(cond_body, rebuild_vars(flat), within)
            try:
                return self.to_bottom(out)
            except errors.CopyOffError as e:
                raise errors.HandlerError(
                    "tf_ophandlers: while replaying %s, the condition of %s (%s) is kept by "
                    "a handler (%s); such loops are not supported in replayed functions"
                    % (self.name, node.type, node.name, e)) from e

        def body(*flat):
            self.graphs.add(id(_ops.get_default_graph()))
            outs = self._branch_outputs(loop_body, trees, regroup(trees, flat), stack, within)
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
        return rebuild_vars(as_list(flat))


def _list_element_dtype(*branch_outputs):
    """The element dtype of a TensorList output of an If's branches (from a branch
    output's handle data), or None (another variant: an Optional, an intermediate)."""
    from tensorflow.core.framework import full_type_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops.parallel_for import pfor as _pfor  # pylint: disable=import-outside-toplevel
    for t in branch_outputs:
        if _pfor._variant_type_id(t) == full_type_pb2.TFT_ARRAY:  # pylint: disable=protected-access
            return tf.as_dtype(_pfor._variant_handle_data(t)[0].dtype)  # pylint: disable=protected-access
    return None


def _select_lists(stack, pred, a, b, dtype):
    """The list `pred` picks of TensorLists `a` and `b`, element by element: their
    elements stacked, a SelectV2 of those, and a list of its rows. Values written into
    either branch's list keep their gradient, which a SelectV2 of the variants themselves
    cannot give (TensorFlow has no zeros of a variant for the branch not taken). Both
    lists must have one length and element shape, as the stacked select needs."""
    shape = stack.execute(Op.cached("TensorListElementShape", shape_type=tf.int32), [a])[0]
    items = [stack.execute(Op.cached("TensorListStack", element_dtype=dtype,
                                     num_elements=-1), [h, shape])[0] for h in (a, b)]
    (picked,) = stack.execute(Op.cached("SelectV2", T=dtype), [pred] + items)
    return stack.execute(Op.cached("TensorListFromTensor", element_dtype=dtype,
                                   shape_type=tf.int32), [picked, shape])[0]
