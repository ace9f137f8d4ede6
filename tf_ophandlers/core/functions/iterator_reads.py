"""Dataset elements a replayed function reads, fetched eagerly just before the call.

A function that gets the next element of a dataset iterator it takes as an argument
(Keras's compiled train step: ``one_step_on_data(iterator.get_next())``) was traced with
the dataset's element spec, whose batch dimension is unknown when the last batch may be
partial (``[None, 8]``); a handler whose rules need shapes (oh.Mesh's SPMD rules decide
layouts and collectives from them) cannot run the rest of the body on such values. A
handler that asks for it (`OpHandler.iterator_element`) gets those reads done outside the
replay instead: each read at the top level of the body (which runs exactly once per call)
is executed eagerly on the call's stack, in the body's order, just before the replayed
function is called; its outputs become extra arguments of the replay, so their shapes key
the replay cache as any eager argument's do (a partial last batch gets its own replay),
and the handler gives each output its representation (oh.Mesh: sharded along its batch
dimension). The iterator advances once per read, as the function would advance it; the
end of the dataset raises OutOfRangeError from the call, as the function does.

Reads elsewhere (inside a loop or a branch: Keras's ``steps_per_execution > 1``;
``get_next_as_optional``) and elements holding resources or variants (nested datasets,
ragged components) stay in the body and reach the handler inside the replay.
"""
import tensorflow as tf

from tf_ophandlers.core.cache import BoundedCache
from tf_ophandlers.core.functions import library
from tf_ophandlers.core.functions.interpreter import node_op

_READ_OPS = ("IteratorGetNext", "IteratorGetNextSync")
_NOT_FED = (tf.resource, tf.variant)
# name -> ((node name, argument index), ...); function names are unique in the context.
_reads = BoundedCache("functions.iterator_reads", 1024)


def wanted(stack):
    """The handler hook giving fetched elements their representation, or None."""
    return getattr(stack.handler, "iterator_element", None)


def reads(name):
    """The top-level iterator reads of function `name` on one of its arguments, in the
    body's order: ((node name, argument index), ...)."""
    found = _reads.get(name)
    if found is None:
        body = library.body(name)
        args = {id(t.op): i for i, t in enumerate(body.inputs)}
        found = []
        for node in body.get_operations():
            if node.type not in _READ_OPS or any(t.dtype in _NOT_FED for t in node.outputs):
                continue
            source = node.inputs[0].op
            while source.type == "Identity" and id(source) not in args:
                source = source.inputs[0].op
            if id(source) in args:
                found.append((node.name, args[id(source)]))
        found = _reads[name] = tuple(found)
    return found


def fetch(stack, name, inputs, found):
    """Runs the reads `found` of function `name` eagerly on `stack` with the call's
    `inputs`; returns ({node name: number of outputs}, the outputs as the handler's
    `iterator_element` represents them, flat, tensors of `stack`)."""
    body = library.body(name)
    hook = stack.handler.iterator_element
    counts, elements = {}, []
    for node_name, index in found:
        outs = stack.execute(node_op(body.get_operation_by_name(node_name)), [inputs[index]])
        counts[node_name] = len(outs)
        elements.extend(stack.wrap(stack.call_hook(hook, stack.unwrap(t))) for t in outs)
    return counts, elements
