"""The handler author's API: everything a handler module may use of this package.

Every handler shipped with tf-ophandlers imports the package only through this module
(and its own subpackage); `tests/core/test_structure.py` enforces it. A handler written
outside the package needs nothing else either. What one handler family needs of another
is a declaration on `OpHandler` (a documented flag or hook the other sets) or a table
below (`registries`) that the providing module fills, as JAX's rule tables::

    import tensorflow as tf
    from tf_ophandlers import extend as ox

    class Doubler(ox.OpHandler):
        changes_computation = True
        def execute(self, op, inputs):
            outputs = ox.next_stack().execute(op, inputs)
            return [o * 2. if o.dtype.is_floating else o for o in outputs]

Each name, by topic (functions and classes carry their own docstrings):

**Handlers and ops**

- `OpHandler`: the base class; its class attributes are the declarations (flags and
  optional hooks) a handler makes, each documented there.
- `Op`: an op as hooks receive it (type, attrs, node name); `Op.cached` / `Op.create`
  build ops to run.
- `SOURCE_GRADIENT_NODE`: the node name of the ``IdentityN(gradient, source)`` marking a
  traced tape's dense gradient of a source, for handlers with `source_gradient`.
- `GRADIENT_OP_TYPE_ATTR`, `node_attrs`: the attr TensorFlow stores a gradient op's
  forward type in, and a graph node's attrs as `Op` attrs.

**Stacks** (where ops run; RFC "Handler stacks")

- `HandlerStack`: a handler merged onto the stack below it (`stack.execute`,
  `stack.copy_on`, `stack.handler`, `stack.next`, `stack.handlers`).
- `PHYSICAL`: the bottom stack (TensorFlow's own devices).
- `current_stack()`, `next_stack()`, `stack_of(tensor)`: the stack ops are placed on now,
  the stack below the running hook, the stack a tensor belongs to.
- `tensor_key(tensor)`: an identity key for a tensor (its handle), for dicts that must
  not keep tensors alive.
- `representation_of(handler, tensor)`: a handler's representation of a tensor.
- `payload(tensor)`: ``(stack, representation)`` of a handler tensor, or None.
- `OffStack(tensor)`: an output that leaves the stack as it is (`returns_off_stack`).
- `COPY_OPS`: the copy op types (CopyOn, CopyOff and their gradients).
- `never_copy(tensor)`: marks a physical tensor that copy-on passes as it is.
- `own_handle(tensor)`: whether a tensor's handle is this package's own.
- `replays(handler, op)`: whether a function call op is replayed op by op through it.
- `run_deferred_above(handler)`: runs the pending work of deferring handlers above.
- `execute_physical(op, inputs)`: runs an op on physical tensors, below every handler.
- `register_substitute_rule(rule)`: the rule run for handlers that `changes_computation`
  while a TensorFlow tape records.

**Scopes and copies**

- `handler(target)`, `handler_of(tensor)`: open a scope (`oh.handler`); a tensor's stack.
- `scope`: the scope module (`scope.physical()`, `scope.on_device(name)`,
  `scope.is_open(handler)`, `scope.handler(target)`); `physical()`: a scope whose ops
  run on physical devices, below every handler.
- `copy_on(x)`, `copy_off(x, device)`: the RFC's copy ops; `copies`: the module with
  them and `parallel_pack` / `parallel_unpack`.

**Errors**

- `HandlerError`, `HandlerOutputError`, `CopyOffError`, `PlacementError`: the package's
  exception types (`errors` is their module).
- `with_message(error, message)`: the same TensorFlow error type with a new message.
- `warn_once(cause, message)`, `first_time(cause)`: warnings given once per cause.

**Caches** (bounded; keyed by everything the result depends on)

- `BoundedCache(name, size)`, `LRUCache(name, size)`: listed by `caches()`.
- `register_external_cache(name, sizes)`: lists a cache kept elsewhere (a C++ one).

**Functions and control flow**

- `functions`: the function-replay package (`functions.function_library`).
- `function_body(name)`: the FuncGraph of a function of the eager context;
  `body_op_types(name)`: the op types in its body and callees; `function_name(name)`:
  a function name as str.
- `CompiledCall`: a ConcreteFunction a handler built, run on a stack.
- `OptimizedCallOp(function_name, num_outputs)`: a function's call op with the
  context's function options, as TensorFlow's own calls pass them (grappler runs);
  `.op()` rebuilds it only when the options change.
- `per_call`: per-call handler state for tf.function replays (`per_call.at_every_call`).
- `call_records`: how tapes outside a replaying handler record a replayed call
  (`densified`, `replayed_call`, `recording_restarted` are its names a tape uses).
- `function_call`: the call path (`observe_calls`, `cached_entry`); `set_handle_data`
  copies a resource's handle data onto a replayed output; `eager_leaf` tells eager
  leaves of a nested argument.
- `retrace`: callbacks when a function is traced again (`retrace.on_retrace`).
- `graph_builder`: build a function from recorded ops and replay it (`create`,
  `replay`, `program_key`).

**Shapes and op kinds**

- `shapes`: TensorFlow's shape functions run without kernels (`infer`, `known_value`,
  `assumes_success`); `Spec`, `spec_of`: a tensor's dtype and static shape.
- `op_kinds`: op-type tables shared by rule-based handlers (`ELEMENTWISE`, `UNARY`, ...).
- `move_axis`: moving a representation's axis through function replays.
- `dispatch`: Python constants the dispatcher folds (`collect_python_constants`,
  `is_python_constant`).

**Recording** (for handlers in a tape's role)

- `recording(trainable_dtype_enums, used_indices)`: the C++ per-op recorder.
- `copy_through(copy_on)`, `record_on_tf_tapes(op, inputs, outputs)`,
  `subscribe_records(fn)`: the recorder's links to TensorFlow's tapes.

**The C++ fast path** (a handler's own C++ per-op work)

- `async_hook_in_c`, `lazy_record_setup`, `lazy_plan`, `lazy_upstream`,
  `lazy_computed`: the hook slots of handlers whose common ops C++ runs.

**Threads and state**

- `LAUNCHES`: the lock held while a handler launches one op on several devices.
- `state`: the per-thread dispatch state a handler may read: `state.current`,
  `state.device`, `state.frames`, `state.scopes`, `state.mode` (None eagerly, the
  replay's mode while a function is replayed), `state.own_traces`.
- `executing_eagerly()`: `tf.executing_eagerly()` in one frame; `own_trace()`: marks a
  function a handler traces for its own use.

**Declarations between handlers** (`registries`, filled by the module that provides)

- `register_gradient_accepts_none(op_type, indices)`, `gradient_accepts_none(op_type)`,
  `ALL_OUTPUTS`: gradient functions that accept None output gradients.
- `register_tape(kind, cls)`, `tape_class(kind)`, `tape_name(kind)`: the package's
  differentiating handler of each kind ("reverse", "forward").
- `recording_handlers(kind)`: the differentiating handlers recording now.
- `register_vectorizer(fn)`, `vectorizer()`: batching a function op by op.
- `per_device`: checks shared by handlers whose values live one per device
  (`canonical_devices`, `refuse_tape_below`, `VARIABLE_READS`, the optimizer-step check
  for handlers declaring `holds_variable`).

**TensorFlow patches**

- `tf_patches`: the registry of changes to TensorFlow's internals: `register(name,
  target, reason, when, install, uninstall)`, `ensure(name)`, `installed(name)`,
  `acquire(name)` / `release(name)`; `patches()` lists them.
"""
# pylint: disable=unused-import
from tf_ophandlers.core import copies, dispatch, errors, graph_builder, move_axis
from tf_ophandlers.core import op_kinds, per_device, registries, scope, shapes, tf_patches
from tf_ophandlers.core import functions
from tf_ophandlers.core.cache import BoundedCache, LRUCache, caches, register_external_cache
from tf_ophandlers.core.copies import copy_off, copy_on
from tf_ophandlers.core.errors import (
    CopyOffError, HandlerError, HandlerOutputError, PlacementError, first_time, warn_once,
    with_message)
from tf_ophandlers.core.fast_decision import (
    async_hook_in_c, lazy_computed, lazy_plan, lazy_record_setup, lazy_upstream)
from tf_ophandlers.core.functions import (
    CompiledCall, body_op_types, call_records, per_call, retrace)
from tf_ophandlers.core.functions.call_records import (
    densified, recording_restarted, replayed_call)
from tf_ophandlers.core.functions.library import as_str as function_name
from tf_ophandlers.core.functions.library import body as function_body
from tf_ophandlers.core.functions import call as function_call
from tf_ophandlers.core.functions.call import set_handle_data
from tf_ophandlers.core.functions.representations import eager_leaf
from tf_ophandlers.core.handler import SOURCE_GRADIENT_NODE, OpHandler
from tf_ophandlers.core.launch_lock import LAUNCHES
from tf_ophandlers.core.op import GRADIENT_OP_TYPE_ATTR, Op, OptimizedCallOp, node_attrs
from tf_ophandlers.core.recording import (
    copy_through, record_on_tf_tapes, recording, subscribe_records)
from tf_ophandlers.core.registries import (
    ALL_OUTPUTS, gradient_accepts_none, recording_handlers, register_gradient_accepts_none,
    register_tape, register_vectorizer, tape_class, tape_name, vectorizer)
from tf_ophandlers.core.scope import handler, handler_of, physical
from tf_ophandlers.core.shapes import Spec, spec_of
from tf_ophandlers.core.stack import (
    COPY_OPS, PHYSICAL, HandlerStack, OffStack, current_stack, execute_physical,
    never_copy, next_stack, own_handle, payload, register_substitute_rule, replays,
    representation_of, run_deferred_above, stack_of, tensor_key)
from tf_ophandlers.core.state import executing_eagerly, own_trace, state
from tf_ophandlers.core.tf_patches import patches

__all__ = [
    # handlers and ops
    "OpHandler", "Op", "SOURCE_GRADIENT_NODE", "GRADIENT_OP_TYPE_ATTR", "node_attrs",
    # stacks
    "HandlerStack", "PHYSICAL", "current_stack", "next_stack", "stack_of", "tensor_key",
    "representation_of", "payload", "OffStack", "COPY_OPS", "never_copy", "own_handle",
    "replays", "run_deferred_above", "execute_physical", "register_substitute_rule",
    # scopes and copies
    "handler", "handler_of", "scope", "physical", "copy_on", "copy_off", "copies",
    # errors
    "errors", "HandlerError", "HandlerOutputError", "CopyOffError", "PlacementError",
    "with_message", "warn_once", "first_time",
    # caches
    "BoundedCache", "LRUCache", "caches", "register_external_cache",
    # functions and control flow
    "functions", "function_body", "body_op_types", "function_name", "CompiledCall",
    "OptimizedCallOp", "per_call", "call_records", "densified", "replayed_call",
    "recording_restarted", "function_call",
    "set_handle_data", "eager_leaf", "retrace", "graph_builder",
    # shapes and op kinds
    "shapes", "Spec", "spec_of", "op_kinds", "move_axis", "dispatch",
    # recording
    "recording", "copy_through", "record_on_tf_tapes", "subscribe_records",
    # the C++ fast path
    "async_hook_in_c", "lazy_record_setup", "lazy_plan", "lazy_upstream", "lazy_computed",
    # threads and state
    "LAUNCHES", "state", "executing_eagerly", "own_trace",
    # declarations between handlers
    "registries", "register_gradient_accepts_none", "gradient_accepts_none", "ALL_OUTPUTS",
    "register_tape", "tape_class", "tape_name", "recording_handlers", "register_vectorizer",
    "vectorizer", "per_device",
    # TensorFlow patches
    "tf_patches", "patches",
]
