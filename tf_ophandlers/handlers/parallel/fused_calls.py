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
import re
import threading
import weakref

from tensorflow.core.framework import function_pb2 as _function_pb2
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import dtypes as _dtypes
from tensorflow.python.framework import errors_impl as _error_codes
from tensorflow.python.framework import op_def_registry as _op_def_registry
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import tensor_util as _tensor_util
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import collective_ops as _collective_ops

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

    __slots__ = ("name", "num_outputs", "components", "groups", "_call", "__weakref__")

    def __init__(self, name, num_outputs, components, groups=()):
        self.name = name
        self.num_outputs = num_outputs  # per component
        self.components = components
        self.groups = groups  # collective groups to complete before the first call
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
                           len(handler.components),
                           _collective_groups(op.type, len(handler.components)))
    _fused[key] = entry
    return entry


def run_fused(handler, entry, op, inputs):
    """Runs `entry` (fused_call's wrapper of `op`) on the components of `inputs` (the
    ParallelValues of the call's arguments); returns each component's outputs."""
    n = len(handler.components)
    if entry.groups:
        for group in entry.groups:
            _complete_group(handler, group)
        entry.groups = ()
    args = [v.components[i] for i in range(n) for v in inputs]
    try:
        with _scope.on_device(handler.components[0]):
            flat = PHYSICAL.execute(entry.op(), args)
    except _error_codes.OpError as e:
        # As the threaded path reports it: the handler, the op, the component (named
        # by its copy of the function in the runtime's message) and the cause's type.
        which, code = _failed_component(handler, entry, e)
        raise _error_codes.exception_type_from_error_code(code)(
            e.node_def, e.op, "oh.ParallelHandler: op %s failed on %s of %s: %s" % (
                op.type, "component " + which if which else "a component",
                handler.debug_string(), e.message)) from e
    k = entry.num_outputs
    return [flat[i * k:(i + 1) * k] for i in range(n)]


# One root error of a runtime message: "(0) INVALID_ARGUMENT: ..." up to the next one.
_ROOT_ERROR = re.compile(r"\((\d+)\) ([A-Z_]+): ")


def _failed_component(handler, entry, error):
    """(the device of the component that failed, or None if not one; the error code of
    its failure). The runtime may report the other components' cancellation, which the
    failure caused, as root errors beside it, in either order: the component and the code
    are those of the root errors that are not a cancellation, when there are such."""
    message = error.message
    names = [(d, "{{function_node %s}}" % _component_name(entry.name, i))
             for i, d in enumerate(handler.components)]
    cuts = list(_ROOT_ERROR.finditer(message))
    parts = [(m.group(2), message[m.end():cuts[k + 1].start() if k + 1 < len(cuts) else None])
             for k, m in enumerate(cuts)] or [(None, message)]
    causes = [(c, text) for c, text in parts if c != "CANCELLED"] or parts
    which = {d for _, text in causes for d, name in names if name in text}
    code = getattr(_error_codes, causes[0][0], None) if causes[0][0] else None
    if not isinstance(code, int):
        code = error.error_code
    return (next(iter(which)) if len(which) == 1 else None), code


# -- collective groups completed before a fused call first runs ---------------------------
#
# TensorFlow forms a collective group when its first collective runs: each member joins
# and waits for the others. A fused call that fails on one component (a NaN check) before
# that component joined cancels the others while they wait for the group, and TensorFlow
# then marks the group cancelled for good: every later collective of the process failed
# ("Collective ops is aborted by: group is cancelled"), at random (it depends on whether
# the waiting member had joined when the failure cancelled it). A group that is complete
# is not cancelled by a failure. So the groups a fused function uses are formed first, by
# one small collective over the components, as MirroredStrategy's first step forms its
# group with every replica present.

_GROUP_OPS = {}  # collective op type -> (index of group_size, index of group_key), or None
_complete = set()  # (group key, group size, components) formed in this process
_complete_lock = threading.Lock()
# The instance key of the collective that forms a group: one per group and process, far
# above the keys allocators hand out (TensorFlow's and the handler's count up from 100).
_FORMING_INSTANCE_KEY = 2 ** 30


def _group_inputs(op_type):
    # Only collective op types are remembered: a node's op may be a function's name,
    # new with every traced function.
    if not op_type.startswith(_collectives.COLLECTIVE_PREFIXES):
        return None
    if op_type not in _GROUP_OPS:
        found = None
        op_def = _op_def_registry.get(op_type)
        names = [a.name for a in op_def.input_arg] if op_def is not None else []
        if "group_size" in names and "group_key" in names:
            found = names.index("group_size"), names.index("group_key")
        _GROUP_OPS[op_type] = found
    return _GROUP_OPS[op_type]


def _collective_groups(name, n):
    """The (group key, group size) of the collectives of function `name` and its callees
    that a call on `n` components forms: keys and sizes that are constants of the
    function, size `n`, on no device of their own (so on the component's)."""
    groups = set()
    for fdef in _library.function_library([name]):
        consts = {node.name: node for node in fdef.node_def if node.op == "Const"}
        for node in fdef.node_def:
            where = _group_inputs(node.op)
            if where is None or node.device:
                continue
            values = []
            for i in where:
                source = consts.get(node.input[i].split(":")[0]) if i < len(node.input) \
                    else None
                value = None if source is None else _tensor_util.MakeNdarray(
                    source.attr["value"].tensor)
                values.append(None if value is None or value.shape else int(value))
            size, key = values
            if size == n and key is not None:
                groups.add((key, size))
    return tuple(sorted(groups))


def _complete_group(handler, group):
    """Forms collective group `group` (key, size) over the components of `handler`, once
    per process (see above). A failure is left to the call itself to report."""
    key, size = group
    done = (key, size, handler.components)
    with _complete_lock:
        if done in _complete:
            return
        _complete.add(done)
    # One eager member per component, each on a thread of its own (in one traced
    # function, TensorFlow's automatic control dependencies would chain the members, the
    # second waiting for the first, which waits for it).
    with _scope.physical():
        zeros = []
        for device in handler.components:
            with _ops.device(device):
                zeros.append(_array_ops.zeros([], _dtypes.float32))

    def member(i):
        try:
            with _ops.device(handler.components[i]):
                _collective_ops.all_reduce_v2(zeros[i], size, key, _FORMING_INSTANCE_KEY,
                                              merge_op="Add", final_op="Id")
        except _error_codes.OpError:
            pass  # (a group formed over other devices: the call raises TensorFlow's error)

    threads = [threading.Thread(target=member, args=(i,), daemon=True,
                                name="oh.ParallelHandler group")
               for i in range(1, len(zeros))]
    for t in threads:
        t.start()
    with _scope.physical():
        member(0)
    for t in threads:
        t.join()


def _released(name):
    for key in [k for k in list(_fused) if k[0] == name]:
        _fused.pop(key, None)


_library.on_release(_released)
