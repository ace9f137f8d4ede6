"""The symbolic mode: a function replay in progress (`state.mode` while it is traced).

While a replay traces its handler-free function, the stacks of the replayed *segment*
run on *shadow tensors*: placeholders in a scratch graph that carry ``(stack,
representation)``; what reaches the bottom becomes nodes of the function. Ops a handler's
hooks create with ordinary TensorFlow calls are routed through the hook's next stack, as
they are eagerly: TensorFlow's graph-op creation is patched for that, only while a replay
traces (tf_patches "FuncGraph._create_op_internal").
"""
import contextlib

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes as _dtypes
from tensorflow.python.framework import ops as _ops
from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework.tensor import Tensor as _Tensor
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import handle_data_util as _handle_data_util
from tensorflow.python.client import pywrap_tf_session as _pywrap_tf_session
from tensorflow.core.framework import cpp_shape_inference_pb2

from tf_ophandlers.core import errors
from tf_ophandlers.core import registries as _registries
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.functions import retrace as _retrace
from tf_ophandlers.core.functions.control_flow import ControlFlow
from tf_ophandlers.core.functions.interpreter import (
    CALL_OPS, CASE_OPS, IF_OPS, PHYSICAL_OPS, WHILE_OPS, Interpreter)
from tf_ophandlers.core.functions.library import (
    as_str, body as function_body, register_callees)
from tf_ophandlers.core.op import GRADIENT_OP_TYPE_ATTR, Op, decode_attr
from tf_ophandlers.core.stack import payload
from tf_ophandlers.core.state import Mode, state

_PAYLOAD_ATTR = "_oh_payload"
_tape_set_is_empty = pywrap_tfe.TFE_Py_TapeSetIsEmpty


def _chain(tensor):
    """`tensor` and its representations down the stacks (while they are tensors)."""
    chain = [tensor]
    p = payload(tensor)
    while p is not None and isinstance(p[1], _Tensor):
        chain.append(p[1])
        p = payload(p[1])
    return chain


def _gradient_node(name, seen):
    """The first gradient node (name scope "gradient_tape/") of function `name` or of a
    function it calls, or ""."""
    if name in seen:
        return ""
    if seen and name.startswith(("__backward_", "__inference___backward_")):
        # The backward function TensorFlow's tape built for a tf.function called under it
        # (its gradient ops are named "gradients/" there). A backward function replayed
        # itself (a tape outside a call) is what runs: its substitutes are allowed.
        return name
    seen.add(name)
    try:
        body = function_body(name)
    except Exception:  # pylint: disable=broad-except  (not a function of the context)
        return ""
    for node in body.get_operations():
        if node.name.startswith("gradient_tape/"):
            return node.name
        for attr in node.node_def.attr.values():
            callee = attr.func.name if attr.HasField("func") else ""
            found = _gradient_node(callee, seen) if callee else ""
            if found:
                return found
        if _context.context().has_function(node.type):
            found = _gradient_node(node.type, seen)
            if found:
                return found
    return ""


def _folded(inputs, constants):
    """Whether an op created while a body is re-traced computes on constants only (the
    shape arithmetic TensorFlow's Python code evaluates while tracing, as gradient
    functions do with `tensor_util.try_evaluate_constant`): it becomes a node, which
    TensorFlow can fold, not an op of the handlers (whose shadow tensors it cannot).
    `constants`: ids of the nodes made so (constant too)."""
    return bool(inputs) and all(
        isinstance(t, _Tensor) and payload(t) is None and (
            id(t) in constants or getattr(t.op, "type", "") == "Const")
        for t in inputs)


_SELECTS = ("Select", "SelectV2")
_NO_HANDLE_DATA = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)


def _mergeable_handles(graph, values):
    """Variants a select may pick between. A per-example If's intermediates for its
    gradient may differ in kind between branches (an Optional of a loop's accumulator list
    in one, of a float value in the other), as the If's own outputs do from run to run,
    but a select's shape function refuses to merge their handle data ("Trying to merge
    handles pointing to different dtypes"): then both go through an Identity that keeps
    no handle data."""
    data = [_handle_data_util.get_handle_data(v) for v in values]
    if any(d is None or not d.is_set for d in data) or all(
            [(s.dtype, s.type) for s in d.shape_and_type]
            == [(s.dtype, s.type) for s in data[0].shape_and_type] for d in data[1:]):
        return values
    plain = []
    for v in values:
        (out,) = _original_create_op(graph, "Identity", [v], attrs={
            "T": attr_value_pb2.AttrValue(type=v.dtype.as_datatype_enum)}).outputs
        # (not handle_data_util.set_handle_data, which skips an empty one)
        with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
            _pywrap_tf_session.SetHandleShapeAndType(
                c_graph, out._as_tf_output(),  # pylint: disable=protected-access
                _NO_HANDLE_DATA.SerializeToString())
        plain.append(out)
    return plain


class Replay(Mode, Interpreter, ControlFlow):
    """State of one replay being traced; `state.mode` while it is active."""

    def __init__(self, segment, bottom, scope_placed, name):
        self.segment = list(segment)  # grows by the stacks of traced scopes (below)
        self.members = set(id(s) for s in segment)
        self.dynamic = set()  # ids of those stacks
        self.bottom = bottom
        self.scope_placed = scope_placed
        self.name = name
        self.graphs = set()  # ids of the graphs whose ops are routed (body, branches)
        self.scratch = _ops.Graph()  # shadow tensors live here, never in a function
        self._gradient_node = None  # a gradient node of the function (None: unknown)
        self._made = {}  # id(output) -> (op type, attrs key, ids of inputs)
        # What a substituting handler changed, (handler text, op type) ("": nothing); noted
        # only when the segment has such a handler (HandlerStack._substituting).
        self.substituted = ""
        self._noting = self.substituting = any(
            getattr(s, "_substituting", False) for s in segment)
        # While the function's Python body is re-traced (retrace.py): what substituting
        # hooks ran, for the backward pass of the tape inside the body.
        self.retracing = False
        self._records = {}  # id(hook output) -> SymbolicRecord
        self._records_by_inputs = {}  # (op type, ids of hook inputs) -> SymbolicRecord
        self._kept = []  # the keys' objects, alive while the replay is traced
        self._constants = set()  # ids of nodes computed from constants only (`_folded`)
        # Branch and loop functions cond_v2/while_v2 traced in the re-traced body (name ->
        # FuncGraph), and how deep their interpretation is (`_retraced_control_flow`).
        self.traced_bodies = {}
        self._control_flow_depth = 0
        # {node name: outputs} of the body's iterator reads fetched before the call, and
        # the id of that body (iterator_reads.py); None: none.
        self.fed = None
        self.fed_graph = None

    def building(self):
        """Whether ops are being added to this replay (not eager code inside it)."""
        return (not _context.executing_eagerly()
                and id(_ops.get_default_graph()) in self.graphs)


    # -- the Mode interface (core/state.py) ----------------------------------------------

    def represents(self, stack):
        return id(stack) in self.members

    def payload(self, tensor):
        return getattr(tensor, _PAYLOAD_ATTR, None)

    def wrap(self, stack, value):
        """A symbolic tensor of `stack` whose representation is `value`."""
        handler = stack.handler
        dtype = handler.value_dtype(value)
        rank = handler.num_dims(value)
        shape = None if rank < 0 else [
            None if d < 0 else d for d in (handler.dim(value, i) for i in range(rank))]
        with self.scratch.as_default():
            t = _array_ops.placeholder(dtype, shape, name="oh_shadow")
        setattr(t, _PAYLOAD_ATTR, (stack, value))
        return t

    def to_bottom(self, tensor):
        """`tensor` copied off the segment (a tensor of the bottom)."""
        p = payload(tensor)
        if p is None:
            return tensor
        return p[0].copy_off(tensor, state.device)

    def emit(self, op, inputs):
        """Adds `op` on bottom tensors to the function being built."""
        given = inputs
        inputs = [self.to_bottom(t) for t in inputs]
        attrs = op.attr_protos()
        if op.gradient_op_type is not None:  # the node's gradient stays its own
            attrs[GRADIENT_OP_TYPE_ATTR] = attr_value_pb2.AttrValue(
                s=op.gradient_op_type.encode())
        graph = _ops.get_default_graph()
        register_callees(graph, attrs)  # (a control-flow op given whole to a handler)
        with _ops.device(state.device) if state.device else contextlib.nullcontext():
            if op.type in _SELECTS and inputs[1].dtype == _dtypes.variant:
                inputs[1:] = _mergeable_handles(graph, inputs[1:])
            node = _original_create_op(graph, op.type, inputs, attrs=attrs)
        outputs = list(node.outputs)
        self.executed(op, given, outputs)
        return outputs

    # -- substitutes in a function holding gradient ops ------------------------------------

    def gradient_node(self):
        """The name of a gradient node of the replayed function or a function it calls
        (TensorFlow's tapes build them under the name scope "gradient_tape/": a
        tf.GradientTape inside the function, Keras fit's train step), or ""."""
        if self._gradient_node is None:
            self._gradient_node = _gradient_node(self.name, set())
        return self._gradient_node

    def executed(self, op, inputs, outputs):
        if not self._noting:
            return
        made = (op.type, op.attrs_key(), tuple(id(t) for t in inputs))
        for o in outputs:
            self._made[id(o)] = made

    def check_substitute(self, stack, op, values, outputs):
        made = (op.type, op.attrs_key(), tuple(id(v) for v in values))
        if all(self._made.get(id(o)) == made for o in outputs):
            return  # the hook ran the op it got on its inputs
        self.substituted = self.substituted or (stack.handler.debug_string(), op.type)
        if self.retracing:
            self._record(stack, op, values, outputs)
            return
        if self._control_flow_depth:
            # In a branch or loop body of a re-traced body, which holds no gradient ops
            # (checked): the tape records the whole If/While, whose gradient is taken
            # from what ran (`_retraced_control_flow`).
            return
        name = getattr(op, "node_name", "") or ""
        if name.startswith("gradient_tape/") or not self.gradient_node():
            return  # (a substitute of a gradient op itself is what runs)
        raise errors.HandlerError(
            "tf_ophandlers: %s may change what op %s (node %s of function %s) computes "
            "(changes_computation) and ran something else, but the function holds gradient "
            "ops built for the original ops when it was traced (%s: a tf.GradientTape "
            "inside the function, Keras fit's train step): they would give %s's gradient, "
            "not that of what ran. Compute the gradient eagerly (tf.GradientTape or "
            "%s outside the handler's scope, Keras run_eagerly=True), or "
            "declare changes_computation = False if the handler computes every op "
            "unchanged.%s" % (stack.handler.debug_string(), op.type, name or "?", self.name,
                              self.gradient_node(), op.type, _registries.tape_name("reverse"),
                              self.why_not_retraced()))

    def why_not_retraced(self):
        """Why this function was not re-traced (appended to the refusal above)."""
        reason = _retrace.why_not(self.name, self.scope_placed)
        return " (It could not be re-traced: %s.)" % reason if reason else ""

    def _record(self, stack, op, values, outputs):
        """Keeps what a substituting hook ran for `op` while the body is re-traced, for
        the tape inside it (only while a TensorFlow tape records)."""
        if _tape_set_is_empty():
            return
        sources = [_retrace.bottom_value(v) for v in values]
        targets = [_retrace.bottom_value(o) for o in outputs]
        record = _retrace.SymbolicRecord(stack, op.type, sources, targets)
        self._kept.append((values, outputs))
        for o in outputs:
            self._records[id(o)] = record
        self._records_by_inputs[(op.type, tuple(id(v) for v in values))] = record

    def substitute_gradients(self, op_name, num_inputs, inputs, outputs, out_grads):
        """The gradient of what a substituting hook ran for a recorded op (the tape inside
        a re-traced body, through TensorFlow's gradient function), or None."""
        if not self._records:
            return None
        record = None
        for o in outputs or ():
            for t in _chain(o):
                record = self._records.get(id(t))
                if record is not None:
                    break
            if record is not None:
                break
        if record is None and inputs and all(t is not None for t in inputs):
            chains = [_chain(t) for t in inputs]
            for level in range(min(len(c) for c in chains)):
                record = self._records_by_inputs.get(
                    (op_name, tuple(id(c[level]) for c in chains)))
                if record is not None:
                    break
        if record is None or record.op_type != op_name:
            return None
        return record.gradients(self, out_grads, num_inputs)

    # -- ops created by TensorFlow calls in hooks -----------------------------------------

    def create_op(self, graph, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                  compute_device):
        target = state.current
        if self.retracing:
            # The Python body's own tensors from outside (a variable's handle, a closed-over
            # constant) are captured as TensorFlow's graph-op creation does.
            inputs = [graph.capture(t) if isinstance(t, _ops.EagerTensor)
                      and payload(t) is None else t for t in inputs]
        if self.retracing and op_type in _CONTROL_FLOW_OPS and id(target) in self.members:
            return self._retraced_control_flow(graph, op_type, name, attrs, inputs, target)
        folded = self.retracing and _folded(inputs, self._constants)
        if op_type in PHYSICAL_OPS or id(target) not in self.members or folded:
            given = inputs
            if any(payload(t) is not None for t in inputs):
                inputs = [self.to_bottom(t) for t in inputs]
            # A node of the function: placed on the hook's physical device (scope.on_device,
            # tf.device in a hook), as `emit` places nodes and as the op runs eagerly.
            with _ops.device(state.device) if state.device else contextlib.nullcontext():
                node = _original_create_op(graph, op_type, inputs, dtypes, input_types, name,
                                           attrs, op_def, compute_device)
            if folded:
                self._kept.append(node)
                self._constants.update(id(o) for o in node.outputs)
            if self._noting and op_type not in PHYSICAL_OPS:
                # A hook that computes the op it got with a TensorFlow call (tf.matmul in
                # place of execute_next) ran that op: noted for `check_substitute`.
                self.executed(Op.create(op_type, **(attrs or {})), list(given),
                              list(node.outputs))
            return node
        if op_type in CALL_OPS:
            # A tf.function a hook calls: replayed on the hook's next stack, as eagerly.
            # As for the replay's own body, the interpreter's stack is the bottom: ops
            # TensorFlow adds itself (while_v2's loop counter, automatic control
            # dependencies) must be nodes, not ops of `target` ("Expected a PyOperation
            # got None" for a pfor while loop under oh.vectorized_map).
            # TensorFlow's graph-mode call (ConcreteFunction._call_flat) overrides the
            # gradient function of the call op it creates, and asserts that no override
            # is active: a hook calling a tf.function while the body is interpreted
            # (oh.vectorized_map's pfor conversion of a JVP's op) failed. There is no
            # call op here: its override is lifted while the body runs.
            callee = as_str(attrs["f"].func.name)
            if self.retracing and _gradient_node(callee, set()) and not _retrace.why_not(
                    callee, True):
                # A tf.function the re-traced body calls (Keras fit's step inside its
                # loop function), holding gradient ops: its Python body too, inline.
                outputs = _retrace.run_body(self, callee, list(inputs), len(dtypes or ()),
                                            target)
                return _RoutedOp(op_type, name, attrs, outputs, inputs, graph)
            state.current = self.bottom
            override = getattr(graph, "_gradient_function_map", None)
            if override:
                graph._gradient_function_map = {}  # pylint: disable=protected-access
            retracing, self.retracing = self.retracing, False  # (its traced body)
            try:
                outputs = self.interpret(function_body(callee), list(inputs), target)
            finally:
                self.retracing = retracing
                state.current = target
                if override:
                    graph._gradient_function_map = override  # pylint: disable=protected-access
            return _RoutedOp(op_type, name, attrs, outputs, inputs, graph)
        op = Op.create(op_type, **(attrs or {}))
        outputs = target.execute(op, list(inputs))
        return _RoutedOp(op_type, name, attrs, outputs, inputs, graph)


    # -- control flow in a re-traced body -------------------------------------------------

    def _note_traced_bodies(self, graph):
        """Notes the branch and loop functions traced into `graph` (and their own)."""
        for fname, function in list(getattr(graph, "_functions", {}).items()):
            body = getattr(function, "graph", None)
            if body is not None and fname not in self.traced_bodies:
                self.traced_bodies[as_str(fname)] = body
                self._note_traced_bodies(body)

    def _direct_gradient_node(self, name, seen):
        """A gradient node built directly in traced body `name` or in the branches and
        loop bodies it holds (a tape's gradient taken inside a branch or loop body), or
        "". Calls to tf.functions holding gradient ops are re-traced (`run_node`)."""
        body = self.traced_bodies.get(name)
        if body is None or name in seen:
            return ""
        seen.add(name)
        for node in body.get_operations():
            if node.name.startswith("gradient_tape/"):
                return node.name
            if node.type not in _CONTROL_FLOW_OPS:
                continue
            for attr in node.node_def.attr.values():
                for f in ([attr.func] if attr.HasField("func") else []) + list(attr.list.func):
                    found = self._direct_gradient_node(as_str(f.name), seen)
                    if found:
                        return found
        return ""

    def _retraced_control_flow(self, graph, op_type, name, attrs, inputs, target):
        """An If, Case or While that cond_v2/while_v2 built in the re-traced body: its
        branches or loop body, traced as plain functions on the handlers' tensors (captured
        as TensorFlow captures outer tensors), are interpreted on the handlers as a traced
        function's control flow is. For the tape inside the body the op is recorded as a
        substitute: its gradient is that of the control flow rebuilt below the handlers
        (cond_v2/while_v2's own gradient of what ran)."""
        self._note_traced_bodies(graph)
        node = _TracedControlFlow(op_type, name, attrs, graph)
        names = [as_str(f.name) for a in attrs.values() for f in (
            [a.func] if a.HasField("func") else list(a.list.func))]
        for fname in names:
            found = self._direct_gradient_node(fname, set())
            if found:
                raise errors.HandlerError(
                    "tf_ophandlers: function %s holds gradient ops and runs under %s, which "
                    "may change what ops compute, so its Python body is traced again under "
                    "the handlers; there its control flow (%s %s) holds gradient ops built "
                    "in a branch or loop body (%s: a tape's gradient taken inside tf.cond or "
                    "tf.while_loop), which a re-trace does not rebuild for what the handlers "
                    "run. Take that gradient in a tf.function called from the branch or loop "
                    "body (it is re-traced), compute the gradient eagerly (Keras "
                    "run_eagerly=True, a tape outside the handler's scope), or declare "
                    "changes_computation = False if the handler computes every op "
                    "unchanged." % (self.name, self.segment[0].handler.debug_string(),
                                    op_type, name, found))
        saved, self.retracing = state.current, False
        state.current = self.bottom  # (as for a traced body: the interpreter places ops)
        self._control_flow_depth += 1
        try:
            if op_type in IF_OPS:
                outputs = self.run_if(node, list(inputs), target)
            elif op_type in CASE_OPS:
                outputs = self.run_case(node, list(inputs), target)
            else:
                outputs = self.run_while(node, list(inputs), target)
        finally:
            self._control_flow_depth -= 1
            self.retracing = True
            state.current = saved
        outputs = self._as_outputs_of(op_type, attrs, inputs, outputs)
        self._record_control_flow(target, op_type, inputs, outputs)
        return _RoutedOp(op_type, name, attrs, outputs, inputs, graph)

    def _as_outputs_of(self, op_type, attrs, inputs, outputs):
        """`outputs` (shadow tensors) as outputs of a scratch op of the control-flow op's
        type, on as many inputs: cond_v2/while_v2 read the op they built from its first
        output (`.op.inputs`, attributes they set), as they find it in TensorFlow."""
        with self.scratch.as_default():
            ins = [_array_ops.placeholder(t.dtype, name="oh_shadow_in") for t in inputs]
            node = self.scratch._create_op_internal(  # pylint: disable=protected-access
                op_type, ins, [o.dtype for o in outputs], name="oh_shadow_op",
                attrs={k: v for k, v in attrs.items() if k != "output_shapes"})
        fresh = []
        for shadow, o in zip(node.outputs, outputs):
            p = payload(o)
            if p is None:
                fresh.append(o)
                continue
            setattr(shadow, _PAYLOAD_ATTR, p)
            shadow.set_shape(o.shape)
            fresh.append(shadow)
        self._kept.append(node)
        return fresh

    def _record_control_flow(self, stack, op_type, inputs, outputs):
        if _tape_set_is_empty():
            return
        sources = [_retrace.bottom_value(v) for v in inputs]
        sources = [s if s is not None and (s.dtype.is_floating or s.dtype.is_complex
                                           or s.dtype == _dtypes.resource) else None
                   for s in sources]
        targets = [_retrace.bottom_value(o) for o in outputs]
        record = _retrace.SymbolicRecord(stack, op_type, sources, targets)
        self._kept.append((list(inputs), list(outputs)))
        for o in outputs:
            self._records[id(o)] = record
        self._records_by_inputs[(op_type, tuple(id(v) for v in inputs))] = record

    def run_node(self, node, ins, within=None):
        if self._control_flow_depth:
            callee = (as_str(node.get_attr("f").name) if node.type in CALL_OPS else
                      node.type if _context.context().has_function(node.type) else "")
            if callee and _gradient_node(callee, set()):
                # A tf.function holding gradient ops called in a branch or loop body of the
                # re-traced body (Keras's train step in its steps_per_execution loop): its
                # Python body too is traced again under the handlers.
                reason = _retrace.why_not(callee, True)
                if reason:
                    raise errors.HandlerError(
                        "tf_ophandlers: function %s, called in control flow of function %s "
                        "re-traced under %s, holds gradient ops and cannot be re-traced: "
                        "%s. Compute the gradient eagerly (Keras run_eagerly=True, a tape "
                        "outside the handler's scope)." % (
                            callee, self.name, self.segment[0].handler.debug_string(),
                            reason))
                stack = within if within is not None else self.segment[0]
                return _retrace.run_body(self, callee, list(ins), len(node.outputs), stack)
        return Interpreter.run_node(self, node, ins, within)


_CONTROL_FLOW_OPS = IF_OPS | CASE_OPS | WHILE_OPS


class _TracedControlFlow:
    """An If/Case/While op being created in a re-traced body, as the control-flow
    interpreter reads a node (type, name, function attributes)."""

    def __init__(self, op_type, name, attrs, graph):
        self.type = op_type
        self.name = name or op_type
        self.graph = graph
        self.node_def = node_def_pb2.NodeDef(name=self.name, op=op_type)
        for k, v in (attrs or {}).items():
            self.node_def.attr[k].CopyFrom(v)

    def get_attr(self, name):
        value = self.node_def.attr[name]
        if value.HasField("func"):
            return value.func
        if value.list.func:
            return list(value.list.func)
        return decode_attr(value)


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
        return decode_attr(self._attrs[name])

    _get_attr_type = _get_attr_bool = _get_attr_int = get_attr

    def _set_device_from_string(self, device):
        self.device = device

    def _set_attr(self, name, value):
        self._attrs[name] = value


# -- routing ops created with TensorFlow calls while replaying -----------------------------

_original_create_op = _func_graph.FuncGraph._create_op_internal  # pylint: disable=protected-access


def _create_op_internal(self, op_type, inputs, dtypes=None, input_types=None, name=None,
                        attrs=None, op_def=None, compute_device=True):
    mode = state.mode
    replay = mode if isinstance(mode, Replay) else None
    if replay is None or id(self) not in replay.graphs:
        if replay is not None and any(replay.payload(t) is not None for t in inputs):
            if replay.retracing and not state.frames and _nested_in(self, replay.graphs):
                # A branch or loop body cond_v2/while_v2 traces in the re-traced body: its
                # ops are plain nodes on captures of the handlers' tensors; the If/While
                # built on them is interpreted on the handlers (`_retraced_control_flow`).
                return _original_create_op(self, op_type, inputs, dtypes, input_types, name,
                                           attrs, op_def, compute_device)
            if replay.retracing and not state.frames:
                raise errors.HandlerError(
                    "tf_ophandlers: function %s holds gradient ops and runs under %s, which "
                    "may change what ops compute, so its Python body is traced again under "
                    "the handlers; there it builds control flow (tf.cond, tf.while_loop, "
                    "autograph's if/while on tensors) on their tensors, which a re-trace "
                    "does not support. Compute the gradient eagerly (Keras run_eagerly=True, "
                    "a tape outside the handler's scope), or declare changes_computation = "
                    "False if the handler computes every op unchanged." % (
                        replay.name, replay.segment[0].handler.debug_string()))
            raise errors.HandlerError(
                "tf_ophandlers: while replaying %s, a handler hook built a nested graph "
                "(tf.cond, tf.while_loop, tf.function tracing) on tensors of handler stack "
                "%r; hooks that run while functions are replayed must use plain ops "
                "(tf.where instead of tf.cond)" % (
                    replay.name, next(replay.payload(t)[0] for t in inputs
                                      if replay.payload(t) is not None)))
        return _original_create_op(self, op_type, inputs, dtypes, input_types, name, attrs,
                                   op_def, compute_device)
    return replay.create_op(self, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                            compute_device)


def _nested_in(graph, ids):
    """Whether FuncGraph `graph` is traced inside one of the graphs `ids`."""
    outer = getattr(graph, "outer_graph", None)
    while outer is not None:
        if id(outer) in ids:
            return True
        outer = getattr(outer, "outer_graph", None)
    return False


# (TensorFlow's `_create_op_internal` is the only one below it: `_original_create_op`.)
tf_patches.subscribe("FuncGraph._create_op_internal", "FuncGraph._create_op_internal",
                     lambda original: _create_op_internal)


@contextlib.contextmanager
def active(replay):
    """Makes `replay` this thread's mode (ops of the traced function become symbolic)."""
    saved = (state.mode, state.current, list(state.frames))
    state.mode = replay
    del state.frames[:]
    try:
        with tf_patches.installed("FuncGraph._create_op_internal"):
            yield
    finally:
        state.mode, state.current, frames = saved
        state.frames[:] = frames
