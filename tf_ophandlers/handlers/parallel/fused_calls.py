"""A function call whose components meet in a collective, run as one multi-device call
(`oh.ParallelHandler`, handler.py).

Run component by component, such a call needs a thread per component (collectives.py):
each component's call waits in its collective for the others. TensorFlow's
MirroredStrategy instead runs one function holding every replica's ops and the
collectives between them. For local components the handler does the same: a FunctionDef
that calls the function once per component, each call placed on its component's device
(the runtime inlines the calls, so the replicas' ops form one graph), called as one op.
No thread hand-off, one launch, and the runtime schedules the components' ops together.

A collective inside a loop (Keras's step with `steps_per_execution > 1` runs its train
step in a while loop) needs the components' calls kept whole. TensorFlow's collectives
meet by a key made of the instance key and the loop frame and iteration of the op
(`CollectiveKey` in collective_ops.cc), and a frame is named after its while node.
Inlined into the wrapper, component i's while node is renamed `component_i/while`, so
each component's collectives wait in a frame of their own and never meet: the call hung.
Each call run as a function of its own (as each component's own call on the threaded
path) keeps the node names of the function, so the frames, and the keys, agree.
(MirroredStrategy has one loop around all replicas, hence one frame.) Such copies are
marked `_noinline` and called through StatefulPartitionedCall, which runs its function
as a multi-device function (a component may read a tensor that lives on another
device, such as a variable created outside the scope); a failing component still
cancels the others through the call's cancellation.

The wrapper is a FunctionDef written directly rather than traced: tracing would add
TensorFlow's automatic control dependencies, which chain stateful ops without resource
inputs in program order, so component 1's call would wait for component 0's, which waits
in its collective for component 1. The wrapper has no such edges; every call is one of
its control outputs, so a call without outputs still runs.
"""
import itertools
import weakref

from tensorflow.core.framework import function_pb2 as _function_pb2
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import errors_impl as _error_codes

from tf_ophandlers.extend import BoundedCache, functions as _functions, OptimizedCallOp, PHYSICAL
from tf_ophandlers.extend import scope as _scope
from tf_ophandlers.handlers.parallel import collectives as _collectives

_library = _functions.library

_names = itertools.count()
# (function name, component devices) -> _Fused, or None when the call cannot be fused.
# Function names are unique in the eager context; an entry goes when its function does.
_fused = BoundedCache("parallel.fused_calls", 256)


def all_local(handler):
    """Whether every component of `handler` is a device of this process's task (none a
    remote worker's): a function call over them can be fused."""
    local = _context.context().host_address_space() + "/device:"
    return all(d.startswith(local) for d in handler.components)


class _Fused:
    """The registered wrapper of one function over some devices, and its call op (with
    the function options TensorFlow's own calls pass: grappler runs on the wrapper as on
    a tf.function's call)."""

    __slots__ = ("name", "num_outputs", "components", "_call", "__weakref__")

    def __init__(self, name, num_outputs, components):
        self.name = name
        self.num_outputs = num_outputs  # per component
        self.components = components
        self._call = OptimizedCallOp(name, num_outputs * components)
        weakref.finalize(self, _remove,
                         [name] + [_component_name(name, i) for i in range(components)])

    def op(self):
        return self._call.op()


def _remove(names):
    try:
        ctx = _context.context()
        for name in names:  # the wrapper first: it calls the others
            if ctx.has_function(name):
                ctx.remove_function(name)
    except Exception:  # pylint: disable=broad-except
        pass  # (a finalizer, also at interpreter exit: never raise)


def _component_name(name, i):
    """The name of component i's copy of the wrapped function (`name`: the wrapper's)."""
    return "%s_component%d" % (name, i)


def _wrapper_def(name, function, devices, separate=False):
    """The FunctionDef `name` calling FunctionDef `function` once per device of
    `devices` (component i calls its copy `_component_name(name, i)`), component i's
    arguments and results at positions i * count. `separate`: each copy is called
    through a StatefulPartitionedCall and marked `_noinline`, so that it runs as a
    multi-device function of its own (for a collective in a loop: module docstring)."""
    fdef = _function_pb2.FunctionDef()
    fdef.signature.name = name
    fdef.signature.is_stateful = function.signature.is_stateful
    inner = function.signature
    for i, device in enumerate(devices):
        node = fdef.node_def.add()
        node.name = "component_%d" % i
        if separate:
            node.op = "StatefulPartitionedCall"
            node.attr["f"].func.name = _component_name(name, i)
            node.attr["Tin"].list.type.extend(a.type for a in inner.input_arg)
            node.attr["Tout"].list.type.extend(a.type for a in inner.output_arg)
            for attr in ("config", "config_proto", "executor_type"):
                node.attr[attr].s = b""
        else:
            node.op = _component_name(name, i)
        node.device = device
        for j, arg in enumerate(inner.input_arg):
            a = fdef.signature.input_arg.add()
            a.name = "c%d_in%d" % (i, j)
            a.type = arg.type
            if j in function.arg_attr:  # a resource's dtype and shape, for the callee
                fdef.arg_attr[len(fdef.signature.input_arg) - 1].CopyFrom(
                    function.arg_attr[j])
            node.input.append(a.name)
        for j, arg in enumerate(inner.output_arg):
            out = fdef.signature.output_arg.add()
            out.name = "c%d_out%d" % (i, j)
            out.type = arg.type
            # Through an Identity on the component's device: the runtime places a
            # result that comes straight from a call on the caller's default device.
            ident = fdef.node_def.add()
            ident.name = "c%d_result%d" % (i, j)
            ident.op = "Identity"
            ident.device = device
            ident.input.append("%s:output:%d" % (node.name, j) if separate
                               else "%s:%s:0" % (node.name, arg.name))
            ident.attr["T"].type = arg.type
            fdef.ret[out.name] = "%s:output:0" % ident.name
        fdef.signature.control_output.append(node.name)
        fdef.control_ret[node.name] = node.name
    return fdef


def _simple(function):
    """Whether FunctionDef `function` has one concrete dtype per argument and result
    (a traced tf.function's have), so the wrapper can forward them one to one."""
    return not function.signature.attr and all(
        a.type and not (a.type_attr or a.number_attr or a.type_list_attr)
        for a in list(function.signature.input_arg) + list(function.signature.output_arg))


_LOOPS = ("While", "StatelessWhile")


def _collective_in_loop(name):
    """Whether function `name` (or a function it calls) runs a collective in a loop
    body (Keras's step with `steps_per_execution > 1`): the wrapper must then call each
    component's copy without inlining it (see the module docstring)."""
    for fdef in _library.function_library([name]):
        for node in fdef.node_def:
            if node.op in _LOOPS:
                for attr in ("cond", "body"):
                    f = node.attr[attr].func.name
                    if f and any(t.startswith(_collectives.COLLECTIVE_PREFIXES)
                                 for t in _library.body_op_types(f)):
                        return True
    return False


def fused_call(handler, op):
    """The wrapper running function call `op` on every component of `handler` as one
    call, or None when it cannot: components of another task, a function that is not
    in the eager context or has polymorphic arguments."""
    key = (op.type, handler.components)
    entry = _fused.get(key, False)
    if entry is not False:
        return entry
    entry = None
    ctx = _context.context()
    if all_local(handler) and ctx.has_function(op.type):
        function = ctx.get_function_def(op.type)
        if _simple(function):
            separate = _collective_in_loop(op.type)
            name = "oh_parallel_%s_x%d_%d" % (op.type, len(handler.components),
                                              next(_names))
            # A copy of the function per component: an error names the function it
            # came from, so the copy's name tells the component that failed.
            for i in range(len(handler.components)):
                copy = _function_pb2.FunctionDef()
                copy.CopyFrom(function)
                copy.signature.name = _component_name(name, i)
                if separate:
                    copy.attr["_noinline"].b = True
                ctx.add_function_def(copy)
            ctx.add_function_def(_wrapper_def(name, function, handler.components, separate))
            entry = _Fused(name, len(function.signature.output_arg),
                           len(handler.components))
    _fused[key] = entry
    return entry


def run_fused(handler, entry, op, inputs):
    """Runs `entry` (fused_call's wrapper of `op`) on the components of `inputs` (the
    ParallelValues of the call's arguments); returns each component's outputs."""
    n = len(handler.components)
    args = [v.components[i] for i in range(n) for v in inputs]
    try:
        with _scope.on_device(handler.components[0]):
            flat = PHYSICAL.execute(entry.op(), args)
    except _error_codes.OpError as e:
        # As the threaded path reports it: the handler, the op, the component (named
        # by its copy of the function in the runtime's message).
        which = [d for i, d in enumerate(handler.components)
                 if "{{function_node %s}}" % _component_name(entry.name, i) in e.message]
        raise _error_codes.exception_type_from_error_code(e.error_code)(
            e.node_def, e.op, "oh.ParallelHandler: op %s failed on %s of %s: %s" % (
                op.type, "component " + which[0] if len(which) == 1 else "a component",
                handler.debug_string(), e.message)) from e
    k = entry.num_outputs
    return [flat[i * k:(i + 1) * k] for i in range(n)]


def _released(name):
    for key in [k for k in list(_fused) if k[0] == name]:
        _fused.pop(key, None)


_library.on_release(_released)
