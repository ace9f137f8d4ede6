"""The functions `oh.Lazy` compiles, in one process-wide cache (handlers/lazy/handler.py).

A *plan* is the pending subgraph of one value request, in recording order: for each node
``(op, refs, live, device)`` where `refs` names each input as ``(-1, k)`` (external
input k) or ``(p, i)`` (output i of plan entry p), `live` the outputs the function
returns and `device` the physical placement (`tf.device`) the op was recorded under. The
key of a plan (`Lazy._run`: one bytes object from cc/handlers/lazy/fast_lazy_plan.cc's `lazy_plan`, with
the input specs) holds everything the compiled function depends on: op types, attributes, wiring, live outputs,
devices, the dtypes and shapes of the external inputs (constants are inputs too, never
captured, so their values are not part of it), whether XLA is asked for. Functions are
only compiled for plans that run on the physical devices (over another handler Lazy runs
the ops one by one), so the stack below needs no key. The cache is shared by every
`oh.Lazy()`: a scope opened afresh per step (``with oh.Lazy():`` as one writes ``with
tf.GradientTape():``) compiles on its first step only.

With ``jit_compile=True`` the function is `tf.function(jit_compile=True)`: XLA fuses the
chain into a few kernels. An op XLA has no kernel for (string ops, some others on CPU)
is found from XLA's error on the first run and remembered (`lazy.no_xla_ops`); the plan
is then compiled as a plain function in which the runs of XLA-compilable ops between
such ops are each one XLA-compiled call, and the others run as TensorFlow kernels.
Results equal `tf.function(jit_compile=True)`'s (XLA's numerics, not eager's bit for
bit). Any other failure of the XLA-compiled function falls back to the plain function,
whose error (eager's) is the one raised.
"""
import re

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import (
    BoundedCache, functions as _functions, graph_builder, LRUCache, Op, PHYSICAL,
    state as _state)

# Stateful ops (OpDef) that change nothing the program can observe: reading state. Every
# other stateful op (a variable update, a print, a function call, a stateful random op)
# first runs the pending ops recorded before it, so that an error among them stops the
# program before the side effect, as eagerly (has_effects).
_READS_STATE = frozenset({
    "ReadVariableOp", "VarHandleOp", "_VarHandlesOp", "VarIsInitializedOp", "VariableShape",
    "ResourceGather", "ResourceGatherNd", "ReadVariableXlaSplitND", "IsVariableInitialized",
    "HashTableV2", "LookupTableFindV2", "LookupTableSizeV2", "MutableHashTableV2",
    "MutableHashTableOfTensorsV2", "MutableDenseHashTableV2", "AnonymousHashTable",
    "AnonymousMutableHashTable",
})
_effects = BoundedCache("lazy.effect_ops", 4096)  # op type -> whether it has side effects


def has_effects(op_type):
    """Whether ops of `op_type` run at once for a side effect (Lazy.execute: then the
    pending ops run first)."""
    e = _effects.get(op_type)
    if e is None:
        op_def = op_def_registry.get(op_type)  # (None: a function call)
        e = op_type not in _READS_STATE and (op_def is None or op_def.is_stateful)
        _effects[op_type] = e
    return e


CACHE_SIZE = 256
functions = LRUCache("lazy.functions", CACHE_SIZE)  # plan key -> CompiledCall
no_xla_ops = BoundedCache("lazy.no_xla_ops", 1024)  # op type -> True: no XLA kernel
_UNSUPPORTED = re.compile(r"No registered '([A-Za-z0-9_>]+)' OpKernel for XLA")


# A node's signature (op type, canonical attribute bytes) costs a serialization of the
# op's attributes (as much as the rest of recording). For an op type whose
# attributes are all type attributes that its outputs' dtypes give (Tanh, Mul, AddV2:
# `T`), the attributes follow from (op type, output dtypes): the signature is
# serialized once per such pair and looked up after that.
_by_outputs = BoundedCache("lazy.attrs_by_outputs", 4096)  # op type -> whether they follow
sigs = BoundedCache("lazy.sigs", 4096)  # (op type, output dtype enums) -> signature


def attrs_follow_outputs(op_type):
    """Whether an op of `op_type` has only type attributes, each one the dtype of an
    output (so that its output dtypes give all its attributes)."""
    follow = _by_outputs.get(op_type)
    if follow is None:
        op_def = op_def_registry.get(op_type)
        follow = op_def is not None
        if follow:
            out_types = {a.type_attr for a in op_def.output_arg
                         if a.type_attr and not a.number_attr}
            follow = all(a.type == "type" and a.name in out_types for a in op_def.attr)
        _by_outputs[op_type] = follow
    return follow


def signature(op, enums):
    """(op type, canonical attribute bytes) of `op`, whose output dtypes are `enums`."""
    key = (op.type, enums)
    sig = sigs.get(key)
    if sig is None:
        sig = (key[0], op.attrs_key())
        if attrs_follow_outputs(key[0]):
            sigs[key] = sig
    return sig


# (op type, attributes key) -> an Op of them: a node keeps no Op (keeping the one being
# executed would make the dispatcher copy it); built only when a function is compiled.
_templates = BoundedCache("lazy.op_templates", 4096)


def op_of(node):
    """The Op of a recorded node (kept for a node over another handler, else rebuilt
    from its type and attributes key, which hold everything about it)."""
    op = node.op
    if op is None:
        op = _templates.get(node.sig)
        if op is None:
            attrs = attr_value_pb2.NameAttrList.FromString(node.sig[1]).attr
            op = _templates[node.sig] = Op.create(node.sig[0], **{k: attrs[k] for k in attrs})
        node.op = op
    return op


def run_op_by_op(plan, external):
    """The `live` outputs of `plan` (entries ``(node, refs, live, device)``, as the
    compiled function returns them), each op run on the stack its node was recorded on
    (over another handler: it sees the ops one by one, as eagerly)."""
    results = []
    saved = _state.device
    try:
        for node, refs, _, device in plan:
            ins = [external[i] if p < 0 else results[p][i] for p, i in refs]
            _state.device = device  # as when it was recorded
            results.append(node.next.execute(op_of(node), ins))
    finally:
        _state.device = saved
    return [outs[k] for outs, (_, _, live, _) in zip(results, plan) for k in live]


def run(key, plan, external, jit):
    """The outputs of `plan` on `external` (tensors), from the cached function of `key`
    or a new one; also the number of functions built (0 on a cache hit) and the
    CompiledCall that ran."""
    entry = functions.get(key)
    if entry is not None:
        return entry.run(PHYSICAL, external), 0, entry
    if not jit:
        entry = functions[key] = compile_plan(plan, external, False)
        return entry.run(PHYSICAL, external), 1, entry
    types = {op.type for op, _, _, _ in plan}
    no_xla = {t for t in types if t in no_xla_ops}
    built = 0
    while True:
        entry = compile_plan(plan, external, True, no_xla)
        built += 1
        try:
            outputs = entry.run(PHYSICAL, external)
        except tf.errors.OpError as e:
            found = set(_UNSUPPORTED.findall(str(e))) & types - no_xla
            if found and no_xla | found != types:
                for t in found:
                    no_xla_ops[t] = True
                no_xla |= found
                continue  # again, with those ops outside the XLA calls
            for t in found:
                no_xla_ops[t] = True
            break  # no XLA kernel for any op, or another failure: the plain function
        functions[key] = entry
        return outputs, built, entry
    entry = compile_plan(plan, external, False)
    outputs = entry.run(PHYSICAL, external)  # eager's error if the ops fail
    functions[key] = entry
    return outputs, built + 1, entry


# XLA has no string, variant or resource values: ops taking or giving them stay outside.
_NO_XLA_DTYPES = frozenset(d.as_datatype_enum for d in (tf.string, tf.variant, tf.resource))


def _segments(plan, external, no_xla):
    """Maximal runs of consecutive plan entries, ``[(xla, [index, ...])]``."""
    out = []
    for j, (op, refs, _, _) in enumerate(plan):
        enums = op.output_dtype_enums
        xla = op.type not in no_xla and not any(e in _NO_XLA_DTYPES for e in enums) and not any(
            (external[i].dtype.as_datatype_enum if p < 0
             else plan[p][0].output_dtype_enums[i]) in _NO_XLA_DTYPES for p, i in refs)
        if out and out[-1][0] == xla:
            out[-1][1].append(j)
        else:
            out.append((xla, [j]))
    return out


def _xla_call(graph, plan, indices, results, args):
    """Entries `indices` of `plan` as one XLA-compiled call inside the function being
    built; fills `results` with the outputs that later entries or the function need."""
    inside = set(indices)
    last = indices[-1]
    wanted = set()  # (entry, output) needed after this run
    for j, (_, refs, live, _) in enumerate(plan):
        if j > last:
            wanted.update((p, i) for p, i in refs if p in inside)
    for j in indices:
        wanted.update((j, k) for k in plan[j][2])
    wanted = sorted(wanted)
    sources = []  # the run's inputs from outside it, as refs
    for j in indices:
        for r in plan[j][1]:
            if r[0] not in inside and r not in sources:
                sources.append(r)
    position = {r: n for n, r in enumerate(sources)}

    def body(*xs):
        local = {}
        g = tf.compat.v1.get_default_graph()
        for j in indices:
            op, refs, _, device = plan[j]
            ins = [local[r] if r[0] in inside else xs[position[r]] for r in refs]
            for k, t in enumerate(graph_builder.create(g, op, ins, device)):
                local[(j, k)] = t
        return [local[w] for w in wanted]

    values = [args[i] if p < 0 else results[p][i] for p, i in sources]
    outs = tf.function(body, jit_compile=True, autograph=False)(*values)
    for w, t in zip(wanted, outs):
        results[w[0]][w[1]] = t


def compile_plan(plan, external, jit, no_xla=()):
    """A CompiledCall of the external inputs returning the `live` outputs of `plan`:
    XLA-compiled if `jit` (the runs of ops not in `no_xla` if that is not empty)."""
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in external]
    segments = _segments(plan, external, no_xla) if jit else [(False, range(len(plan)))]
    whole = len(segments) == 1 and segments[0][0]  # all of it is one XLA call
    nodes = [(op, refs, device) for op, refs, _, device in plan]

    def build(*args):
        graph = tf.compat.v1.get_default_graph()
        results = [[None] * len(op.output_dtype_enums) for op, _, _, _ in plan]
        for xla, indices in segments:
            if xla and not whole:
                _xla_call(graph, plan, indices, results, args)
            else:
                graph_builder.replay(graph, nodes, args, results, indices)
        return [results[j][k] for j, (_, _, live, _) in enumerate(plan) for k in live]

    with _ops.init_scope():
        try:
            fn = tf.function(build, input_signature=specs, autograph=False,
                             jit_compile=True if whole else None).get_concrete_function()
        except ValueError as e:
            # A shape function rejected an op while building the function: eagerly
            # the kernel would have, with InvalidArgumentError (same error class).
            raise tf.errors.InvalidArgumentError(None, None, str(e)) from e
    return _functions.CompiledCall(fn)
