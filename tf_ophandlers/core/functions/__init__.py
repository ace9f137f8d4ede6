"""Functions and control flow under handlers (RFC "Op handlers inside functions and
control flow"; DESIGN.md decision 5).

  library.py          FunctionDefs of the eager context as FuncGraphs; callee walks
  representations.py  FunctionInput/FunctionOutput: split and rebuild representations
  symbolic.py         the symbolic mode (shadow tensors) a replay runs the stacks in
  interpreter.py      a function body run node by node through the stacks
  control_flow.py     If/Case/While rebuilt around replayed branches and bodies
  call.py             the call path, the replay cache, `CompiledCall` (registers itself
                      with core/stack.py as the function-call rule)
  ungated.py          a replayed function's copy without the output gate of automatic
                      control dependencies (what `CompiledCall` runs on devices)
  call_records.py     how tapes outside a replaying handler record a replayed call
  saving.py           refusing to save functions that depend on live handlers
  eager_control_flow.py  eager tf.cond/switch_case/while_loop on tensors without one
                      value, run as a tf.function of the call

Importing this package registers the function-call rule with the stacks.
"""
from tf_ophandlers.core.functions import eager_control_flow  # noqa: F401  (its patch)
from tf_ophandlers.core.functions import saving  # noqa: F401  (registers its patch)
from tf_ophandlers.core.functions.call import CompiledCall, cache_info, clear_cache
from tf_ophandlers.core.functions.library import body_op_types, function_library

__all__ = ["CompiledCall", "cache_info", "clear_cache", "body_op_types", "function_library"]
