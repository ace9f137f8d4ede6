"""What a tensor stands for on the stacks: its payload, its stack, and a handler's
representation of it (looking through the handlers above).

Split from core/stack.py, which re-exports these; they need only the C++ payloads and
`state.mode` (a replayed function's symbolic tensors), not the stacks' classes.
"""
from tensorflow.python.framework.tensor import Tensor as _Tensor

import tf_ophandlers._C as _C
from tf_ophandlers.core import errors
from tf_ophandlers.core.state import state


def payload(tensor):
    """``(stack, representation)`` of a handler tensor, or None for an ordinary tensor.
    Eager handler tensors carry their payload in C++; while a function is being replayed
    (state.mode) a stack's tensors are symbolic tensors whose payload the mode knows."""
    p = _C.payload(tensor)
    if p is None and state.mode is not None:
        p = state.mode.payload(tensor)
    return p


def stack_of(tensor):
    """The stack `tensor` lives on, or None (eager or replayed tensors).

    Examples:
        >>> h = oh.OpHandler()
        >>> with h:
        ...     y = tf.constant(1.0) * 2.0
        >>> oh.stack_of(y) is oh.handler_of(y), oh.stack_of(tf.constant(1.0))
        (True, None)
    """
    s = _C.stack_of(tensor)
    if s is None and state.mode is not None:
        p = state.mode.payload(tensor)
        if p is not None:
            return p[0]
    return s


def move_onto(handler, next_stack, tensor):
    """The default copy-on of `handler` merged onto `next_stack` (OpHandler.copy_on).

    Moves `tensor` onto `next_stack`; a tensor of the same handler from an earlier merge
    is taken directly (its representation is moved, no copy off the handler). A
    representation that is not a tensor (a handler's own object, e.g. DataFormat's
    `Permuted`) moves as it crosses a function boundary: its `function_input` parts are
    moved and `function_output` rebuilds it."""
    source = stack_of(tensor)
    if source is not None and source.handler is handler:
        value = source.unwrap(tensor)
        if isinstance(value, _Tensor):
            return next_stack.copy_on(value)
        summary, parts = handler.function_input(value)
        return handler.function_output(summary, [next_stack.copy_on(p) for p in parts])
    return next_stack.copy_on(tensor)


def representation_of(handler, tensor, carrier=False):
    """`handler`'s representation of `tensor`: ``(True, value)`` if `tensor` lives on a
    stack containing `handler` (looking through the tensor representations of handlers
    above it), else ``(False, tensor)``.

    `carrier=True` asks which of `handler`'s values carries `tensor`, for a handler
    attaching state to it (a forward accumulator's zero tangent), not for its value: the
    handlers above are looked through with their `represented_value` hook (an
    oh.vectorized_map's batched tensor for a per-example one, which it does not copy
    off), and a refusal means no representation.

    Examples:
        >>> acc = oh.ForwardAccumulator(tf.constant(2.0), tf.constant(1.0))
        >>> with acc:
        ...     y = tf.constant(2.0) * 3.0
        >>> found, value = oh.representation_of(acc, y)
        >>> found, type(value).__name__
        (True, 'Dual')
    """
    while True:
        stack = _C.stack_of(tensor)  # (stack_of, inlined for eager tensors)
        if stack is None:
            stack = stack_of(tensor) if state.mode is not None else None
        if stack is None:
            return False, tensor
        for h in stack.handlers:  # (a loop, not any() of a generator: per tensor)
            if h is handler:
                break
        else:
            return False, tensor
        value = stack.unwrap(tensor)
        if stack.handler is handler:
            return True, value
        if not isinstance(value, _Tensor):
            # A handler above with its own representation (a forward accumulator's
            # primal and tangent): step down through its copy_off, which gives the tensor
            # of the next stack. A refusal (a parallel handler's CopyOffError) reaches the
            # caller: a tensor of a handler below must not silently look unrelated.
            if not carrier:
                value = stack.call_hook(stack.handler.copy_off, value, "")
            else:
                try:
                    value = stack.call_hook(stack.handler.represented_value, value)
                except errors.HandlerError:
                    return False, tensor
            if not isinstance(value, _Tensor):
                return False, tensor
        tensor = value
