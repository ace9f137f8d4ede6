"""`DebuggerHandler`: TensorFlow Debugger V2 (tfdbg) dumps from a handler.

>>> import tempfile, tensorflow as tf, tf_ophandlers as oh
>>> from tensorflow.python.debug.lib import debug_events_reader
>>> root = tempfile.mkdtemp()
>>> f = tf.function(lambda x: tf.sqrt(x) * 2.0)
>>> with oh.DebuggerHandler(root, tensor_debug_mode="FULL_HEALTH"):
...     y = tf.math.log(tf.constant([1.0, -1.0]))        # eager: an Execution event
...     for _ in range(3):
...         f(tf.constant([4.0, 9.0]))                   # replayed: graph traces per call
>>> with debug_events_reader.DebugDataReader(root) as reader:
...     reader.update()
...     [e.op_type for e in reader.executions()][:1], reader.num_graph_execution_traces()
(['Log'], 6)

`tensorboard --logdir root` shows the dump in the Debugger V2 plugin.

It writes what `tf.debugging.experimental.enable_dump_debug_info` writes
(tensorflow/python/debug/lib/dumping_callback.py), through TensorFlow's own
`DebugEventsWriter`, so `DebugDataReader` and TensorBoard read it:

- **Eager ops**: an `Execution` event per op (type, input and output tensor ids, output
  devices, the Python stack of the call) with the debug values of its outputs computed by
  TensorFlow's `DebugNumericSummaryV2` kernel (the full value in FULL_TENSOR mode).
- **Functions** (a `tf.function`, a SavedModel function, Keras `fit`'s step) are replayed
  through the handler: the replay writes a `DebuggedGraph` per function body and a
  `GraphOpCreation` per op (node name, the line that created it when traced), and puts
  TensorFlow's `DebugIdentityV2` nodes into the replayed function, which write a
  `GraphExecutionTrace` per op output at every call; one `Execution` event per call
  (the function's name, its graph) comes from a per-call node
  (`oh.per_call.at_every_call`). So every step of `model.fit` is traced.

The ops TensorFlow's callback skips (Identity, control-flow and call ops) are skipped
the same way. Files are flushed when the scope closes (`with handler:` per step works:
each exit appends what the circular buffers hold) and closed at exit.
"""
import time
import weakref

import tensorflow as tf
from tensorflow.core.protobuf import debug_event_pb2
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import function_body, Op, OpHandler, per_call, state, with_message
from tf_ophandlers.handlers.debugger import events as de


class DebuggerHandler(OpHandler):
    """Writes a tfdbg V2 dump of every op run in its scope to `dump_root`.

    Args (those of `tf.debugging.experimental.enable_dump_debug_info`):
      dump_root: directory of the DebugEvents files (created if needed). Handlers writing
        to the same dump root in one process share its file set and run id.
      tensor_debug_mode: "NO_TENSOR" (default), "CURT_HEALTH", "CONCISE_HEALTH",
        "FULL_HEALTH", "SHAPE" or "FULL_TENSOR".
      circular_buffer_size: number of Execution and GraphExecutionTrace events kept in
        memory until the next flush (the scope's exit); <= 0 writes them at once.
      op_regex: only outputs of op types matching it (`re.match`) get debug values.
      tensor_dtypes: only outputs of these dtypes (or a predicate on the dtype) do.

    Examples:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> with oh.DebuggerHandler(root):
        ...     y = tf.constant(1.0) + 1.0
        >>> any(name.endswith(".execution") for name in os.listdir(root))
        True
    """

    transparent = True
    TYPE_NAME = "DEBUGGER"

    def __init__(self, dump_root, tensor_debug_mode="NO_TENSOR", circular_buffer_size=1000,
                 op_regex=None, tensor_dtypes=None):
        self.tensor_debug_mode = de.parse_mode(tensor_debug_mode)
        if isinstance(circular_buffer_size, bool) or not isinstance(circular_buffer_size, int):
            raise TypeError("DebuggerHandler: circular_buffer_size must be an int, not %r"
                            % (circular_buffer_size,))
        self.filter = de.TensorFilter(op_regex, tensor_dtypes)
        self.files = de.dump_files(dump_root, circular_buffer_size)
        self.dump_root = self.files.dump_root
        self._replays = weakref.WeakKeyDictionary()  # replay -> _ReplayGraphs

    # -- eager ops -----------------------------------------------------------------------

    changes_computation = False  # runs each op as it is and dumps it

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if per_call.replaying():
            self._graph_op(op, outputs)
        elif op.type not in de.SKIP_EAGER:
            self._eager_op(op, inputs, outputs)
        return outputs

    def _eager_op(self, op, inputs, outputs):
        files, mode = self.files, self.tensor_debug_mode
        # The event is a copy of one prebuilt per (stack, op type, output devices, mode), with
        # the time and tensor ids set: the per-op cost is mostly protobuf work.
        location, templates = files.stack_here()
        devices = tuple([t.device for t in outputs])
        key = (op.type, devices, mode)  # handlers of one dump root share the stacks
        template = templates.get(key)
        if template is None:
            template = debug_event_pb2.DebugEvent()
            execution = template.execution
            execution.op_type = op.type
            execution.num_outputs = len(outputs)
            execution.output_tensor_device_ids.extend([files.device_id(d) for d in devices])
            execution.tensor_debug_mode = mode
            execution.code_location.CopyFrom(location)
            templates[key] = template
        event = debug_event_pb2.DebugEvent()
        event.CopyFrom(template)
        event.wall_time = time.time()
        execution = event.execution
        # pylint: disable=protected-access
        execution.input_tensor_ids.extend([t._id for t in inputs])
        execution.output_tensor_ids.extend([t._id for t in outputs])
        # pylint: enable=protected-access
        if mode != de.NO_TENSOR:
            try:
                execution.tensor_protos.extend(de.eager_tensor_protos(
                    mode, op.type, outputs, self.filter, self.next))
            except (tf.errors.OpError, ValueError, TypeError) as e:
                raise with_message(e, "DebuggerHandler: cannot compute the %s debug "
                                   "values of op %s: %s" % (
                                       debug_event_pb2.TensorDebugMode.Name(mode), op.type,
                                       e)) from e
        files.write_execution_event(event)

    # -- ops of replayed functions ---------------------------------------------------------

    def _graph_op(self, op, outputs):
        replay = state.mode
        graphs = self._replays.get(replay)
        if graphs is None:
            graphs = self._replays[replay] = _ReplayGraphs(self.files, replay.name)
            graphs.add_per_call_execution(self.tensor_debug_mode)
        files = self.files
        graph_id, graph_name = graphs.graph_of(op.function_name)
        op_name = op.node_name or graphs.generated_name(op.type)
        tensor_ids, new = files.graph_op_tensor_ids(graph_id, op_name, len(outputs))
        if new:
            frames = op.traceback
            files.writer.WriteGraphOpCreation(debug_event_pb2.GraphOpCreation(
                op_type=op.type, op_name=op_name, graph_name=graph_name, graph_id=graph_id,
                input_names=_input_names(op), num_outputs=len(outputs),
                output_tensor_ids=tensor_ids,
                code_location=(files.code_location_of(frames) if frames
                               else files.code_location_here(True))))
        if op.type in de.SKIP_OPS:
            return
        for slot, out in enumerate(outputs):
            self._instrument(op.type, op_name, graph_id, slot, out, tensor_ids[slot])

    def _instrument(self, op_type, op_name, graph_id, slot, out, tensor_id):
        """Adds the DebugIdentityV2 node of output `slot` (as `_instrument_symbolic_tensors`
        does) to the function being replayed, on the next stack."""
        mode, dtype, nxt = self.tensor_debug_mode, out.dtype, self.next
        if not self.filter.dumps(op_type, dtype):
            return
        if mode == de.NO_TENSOR or mode == de.FULL_TENSOR:
            if not dtype.is_numpy_compatible:
                return
            traced = tf.constant([], dtype=tf.float32) if mode == de.NO_TENSOR else out
        else:
            if not de.summarized(mode, dtype):
                return
            traced = de.summarize(nxt, mode, out, tensor_id)
        files = self.files
        nxt.execute(Op.create(
            "DebugIdentityV2", T=traced.dtype, tfdbg_context_id=graph_id, op_name=op_name,
            output_slot=slot, tensor_debug_mode=int(mode), debug_urls=files.debug_urls,
            circular_buffer_size=files.circular_buffer_size, tfdbg_run_id=files.run_id),
            [traced])

    # -- scopes ------------------------------------------------------------------------------

    def scope_exited(self):
        self.flush()

    def flush(self):
        """Writes the buffered events (the circular buffers) to the dump's files."""
        self.files.flush()

    def debug_string(self):
        return "DebuggerHandler(%r, %s)" % (
            self.dump_root, debug_event_pb2.TensorDebugMode.Name(self.tensor_debug_mode))


class _ReplayGraphs:
    """The debugged graphs of one replay: the called function's, and one inside it per
    function whose nodes the replay inlined or rebuilt (callees, branches, loop bodies)."""

    def __init__(self, files, name):
        self.files = files
        self.name = name
        self.top = files.new_graph(name)
        self.graphs = {name: self.top}
        self._generated = 0

    def graph_of(self, function_name):
        """(graph id, graph name) of the nodes of `function_name` (None: ops the handlers
        above created, which belong to the called function's graph)."""
        if function_name is None:
            function_name = self.name
        graph_id = self.graphs.get(function_name)
        if graph_id is None:
            graph_id = self.graphs[function_name] = self.files.new_graph(
                function_name, self.top)
        return graph_id, function_name

    def generated_name(self, op_type):
        self._generated += 1
        return "%s/oh_%s_%d" % (self.name, op_type, self._generated)

    def add_per_call_execution(self, mode):
        """One Execution event of the called function at every call of the replay: a
        per-call node in the outermost graph being built (not in a branch or a loop body,
        which run a different number of times)."""
        files = self.files
        try:
            num_outputs = len(function_body(self.name).outputs)
        except Exception:  # pylint: disable=broad-except
            num_outputs = 0
        execution = debug_event_pb2.Execution(
            op_type=self.name, graph_id=self.top, num_outputs=num_outputs,
            tensor_debug_mode=mode, code_location=files.code_location_here(True))
        writer = files.writer

        def write(_):
            try:
                writer.WriteExecution(execution)
            except Exception:  # pylint: disable=broad-except
                pass  # a callback of a running graph must not raise

        graph = _ops.get_default_graph()
        while isinstance(getattr(graph, "outer_graph", None), _func_graph.FuncGraph):
            graph = graph.outer_graph
        with graph.as_default():
            per_call.at_every_call(self, None, write)


def _input_names(op):
    """The input tensor names of a function node ("node:slot"), from its FuncGraph."""
    if op.node_name is None:
        return []
    try:
        node = function_body(op.function_name).get_operation_by_name(op.node_name)
    except Exception:  # pylint: disable=broad-except
        return []
    return [t.name for t in node.inputs]

