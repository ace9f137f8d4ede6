"""Interpreting a FunctionDef body node by node through the replayed stacks.

`Interpreter` is a mixin of `Replay` (symbolic.py): `interpret` runs the nodes of a
FuncGraph on representations; function calls are inlined, control flow goes to
control_flow.py, and every other node runs on the stack the RFC's placement gives it
(the call's stack if a scope placed the call, else the stack of its handler inputs, or a
traced scope's stack for nodes annotated while tracing).
"""
from tensorflow.python.eager import context as _context

from tf_ophandlers.core import errors
from tf_ophandlers.core import scope as _scope
from tf_ophandlers.core.functions.custom_gradients import replayable_gradient
from tf_ophandlers.core.functions.library import body as function_body
from tf_ophandlers.core.op import GRADIENT_OP_TYPE_ATTR, Op
from tf_ophandlers.core.stack import HandlerStack, stack_of

CALL_OPS = frozenset(("PartitionedCall", "StatefulPartitionedCall"))
IF_OPS = frozenset(("If", "StatelessIf"))
CASE_OPS = frozenset(("Case", "StatelessCase"))
WHILE_OPS = frozenset(("While", "StatelessWhile"))
# Ops that stay physical in a replay, as eager constants do (they never reach a handler).
PHYSICAL_OPS = frozenset(("Const", "Placeholder", "NoOp"))


def node_op(node):
    """The Op of a FunctionDef node, without TensorFlow's internal ("_") attributes; a
    gradient override (`tf.custom_gradient`) is kept as the op's `gradient_op_type`."""
    attrs = node.node_def.attr
    op = Op.create(node.type, **{k: v for k, v in attrs.items() if not k.startswith("_")})
    op.node_name, op.function_name = node.name, node.graph.name  # for op.traceback
    override = attrs.get(GRADIENT_OP_TYPE_ATTR)
    if override is not None:
        op.gradient_op_type = replayable_gradient(node, override.s.decode())
    return op


class Interpreter:
    """Runs function bodies on representations (mixed into `Replay`)."""

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
        attr = node.node_def.attr.get(_scope.TRACED_STACK_ATTR)
        if attr is None:
            return within
        traced = _scope.stack_named(attr.s.decode())
        if traced is None:
            raise errors.HandlerError(
                "tf_ophandlers: op %s of function %s was traced under handler stack %s, "
                "which no longer exists" % (node.name, self.name, attr.s.decode()))
        stack = self.segment[0] if self.scope_placed else self.bottom
        for h in traced.handlers:
            if not any(h is x for x in stack.handlers):
                if h.replays_functions is not True:  # False, or decided per call
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
        if self.fed is not None and id(node.graph) == self.fed_graph:
            fed = self.fed.get(node.name)
            if fed is not None:  # an iterator read done before the call (iterator_reads.py)
                return fed
        op_type = node.type
        within = self.traced_stack(node, within)
        if op_type in CALL_OPS:
            return self.interpret(function_body(node.get_attr("f").name), ins, within)
        if op_type in IF_OPS:
            return self.run_if(node, ins, within)
        if op_type in CASE_OPS:
            return self.run_case(node, ins, within)
        if op_type in WHILE_OPS:
            return self.run_while(node, ins, within)
        if _context.context().has_function(op_type):
            return self.interpret(function_body(op_type), ins, within)
        op = node_op(node)
        if op_type in PHYSICAL_OPS:
            stack = None
        else:
            stack = within if within is not None else self.placement(ins)
        if stack is None:
            return self.emit(op, ins)
        return stack.execute(op, ins)

