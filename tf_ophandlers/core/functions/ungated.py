"""Replayed functions without the output gate of automatic control dependencies.

`tf.function` tracing (TensorFlow's automatic control dependencies) makes every returned
tensor wait for a NoOp that depends on every stateful op of the body: the reads and
updates of all variables. In a function whose ops run on several devices (a mesh's
replayed step) that NoOp sits on one device and each of its control inputs from another
device becomes a Send/Recv pair of the partitioned function (16 edges in a 2x2 mesh's
replayed training step, 12 of them across devices). The gate orders nothing a caller can
observe when the function runs as one call op: the call returns only when every node of
every partition has run, the stateful ops stay the function's control outputs (so they
are never pruned), and reads and writes of one resource keep their own control edges.

A `CompiledCall` run on TensorFlow's devices therefore calls a copy of the FunctionDef
without the gate (`ungated_copy`), registered in the eager context next to the original
(which a tape recording the call still uses) and removed with it.

>>> import tensorflow as tf
>>> v = tf.Variable(1.0)
>>> f = tf.function(lambda: (v.assign_add(1.0), v.read_value())[1]).get_concrete_function()
>>> name = ungated_copy(f)         # registered next to f's own function
>>> from tensorflow.python.eager import context, execute
>>> float(execute.execute(name, 1, f.captured_inputs, (), context.context())[0])
2.0
>>> remove(name)
"""
import copy
import itertools

from tensorflow.python.eager import context as _context

_names = itertools.count()


def _gates(fdef):
    """The names of `fdef`'s output gates: NoOps whose inputs are all control inputs from
    the function's control outputs and whose only consumers are control inputs of the
    Identity nodes it returns; empty if any NoOp of that kind is used otherwise."""
    control_ret = set(fdef.control_ret.values())
    gates = {n.name for n in fdef.node_def
             if n.op == "NoOp" and n.input and n.name not in control_ret
             and all(i.startswith("^") and i[1:] in control_ret for i in n.input)}
    if not gates:
        return gates
    returned = {v.split(":")[0] for v in fdef.ret.values()}
    for n in fdef.node_def:
        for i in n.input:
            if i.lstrip("^").split(":")[0] in gates and not (
                    i.startswith("^") and n.op == "Identity" and n.name in returned):
                return set()
    return gates


def ungated_function_def(fdef, name):
    """A copy of FunctionDef `fdef` named `name` without its output gates, or None when
    it has none."""
    gates = _gates(fdef)
    if not gates:
        return None
    out = copy.deepcopy(fdef)
    out.signature.name = name
    kept = []
    for n in out.node_def:
        if n.name in gates:
            continue
        inputs = [i for i in n.input if not (i.startswith("^") and i[1:] in gates)]
        if len(inputs) != len(n.input):
            del n.input[:]
            n.input.extend(inputs)
        kept.append(n)
    del out.node_def[:]
    out.node_def.extend(kept)
    return out


def ungated_copy(function):
    """Registers an ungated copy of ConcreteFunction `function`'s FunctionDef in the eager
    context and returns its name; None when the function has no output gate."""
    fdef = function.function_def
    name = "%s_ungated%d" % (fdef.signature.name, next(_names))
    out = ungated_function_def(fdef, name)
    if out is None:
        return None
    _context.context().add_function_def(out)
    return name


def remove(name):
    """Removes function `name` (an `ungated_copy`) from the eager context, if it is still
    there (never raises: called when a cache entry dies, also at interpreter exit)."""
    try:
        ctx = _context.context()
        if ctx.has_function(name):
            ctx.remove_function(name)
    except Exception:  # pylint: disable=broad-except
        pass
