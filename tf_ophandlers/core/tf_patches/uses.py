"""Who needs TensorFlow patched, and from when: one use per owner need.

"runtime": from the first handler scope on. "first-use": from the owner's `ensure` on.
"scoped": while the owner holds it (`acquire`/`release`, `installed`).
"""
from tf_ophandlers.core.tf_patches.registry import declare_use

# core/
declare_use("EagerTensor.device", "runtime",
            "tensor.device of a handler tensor is what its handler says "
            "(OpHandler.device_string: a transparent tape shows the physical device)")
declare_use("constant_value", "runtime",
            "gradient functions short-circuit on static values; a handler tensor answers "
            "through its handler's static_value hook instead of a copy-off the handler "
            "may refuse")
declare_use("size", "runtime",
            "eagerly, tf.size multiplies the tensor's static dims in Python; a handler "
            "tensor with an unknown dim (components of different batch sizes on "
            "several devices) runs the Size op instead. Plain tensors pay one shape check.")
declare_use("EagerTensor.set_shape", "runtime",
            "TensorFlow's eager set_shape requires equal dims (an eager shape is always "
            "known); a handler tensor with unknown dims (a handler that infers shapes only) gets graph "
            "semantics: compatible shapes merge (OpHandler.refine_shape)")
declare_use("TFE_ClearScalarCache", "runtime",
            "the Python scalars converted under a scope are known by handle address, "
            "which is theirs only while TensorFlow's scalar cache holds the handle; when "
            "the cache is cleared the handles die and a user tensor of equal value at a "
            "reused address would pass for a constant (core/dispatch.py)")
declare_use("status_to_exception", "runtime",
            "a handler's exception crosses TensorFlow's C API only as a status; these "
            "conversions give the user the original exception object back (type, "
            "message, traceback) (core/errors.py)")
declare_use("scope_function_call", "runtime",
            "a ConcreteFunction's call reaches the dispatcher only through TensorFlow's "
            "custom-device execute; a call placed by a handler scope on physical "
            "arguments is replayed from here, without that trip (core/functions/call.py)")
declare_use("save._fill_meta_graph_def", "runtime",
            "tf.saved_model.save must refuse a function that captured a live handler "
            "tensor, which would not load without the handler (core/functions/saving.py)")
declare_use("Context.device", "runtime",
            "tf.device inside a handler scope keeps the handlers active and sets the "
            "physical placement at the bottom of the stack (RFC 'Final handlers'); "
            "tf.device(stack name) re-enters that stack (core/scope.py)")
declare_use("function call records", "runtime",
            "TensorFlow records a tf.function call with the original function's backward "
            "function; for a call replayed by handlers it must run on the stack the call "
            "ran on, and tapes under the handlers must not get that record; handlers "
            "subscribed in core/recording.py see each record after TensorFlow's tapes "
            "(core/functions/call_records.py)")
declare_use("released functions", "runtime",
            "the replays and bodies cached for a function TensorFlow removes from the "
            "eager context must go with it (core/functions/library.py)")
declare_use("traced python functions", "runtime",
            "re-tracing a function body under a substituting handler needs the Python "
            "function, which neither the ConcreteFunction nor the call op keeps: it is "
            "noted (weakly) when TensorFlow traces it (core/functions/retrace.py)")
declare_use("eager control flow", "runtime",
            "eager tf.cond/tf.switch_case/tf.while_loop decide in Python from the "
            "predicate's value, which a per-example or per-device handler tensor does not "
            "have; such calls run as a tf.function of the call, whose If/Case/While op "
            "the handler's replay runs (core/functions/eager_control_flow.py)")
declare_use("FuncGraph._create_op_internal", "scoped",
            "while a function is replayed, ops that handler hooks create with ordinary "
            "TensorFlow calls run on the hook's next stack (as they do eagerly) instead "
            "of becoming nodes of the function (core/functions/symbolic.py). Held while "
            "a replay traces.")
declare_use("fast path without stack capture", "scoped",
            "an op placed on the dispatcher never runs as that op, so the Python stack "
            "TensorFlow's fast path captures for it is dropped unread; those ops skip "
            "the capture (core/skip_trace.py). Held while a handler scope places ops on "
            "the dispatcher.")
declare_use("tf.handler", "first-use",
            "oh.install() exposes the scope as tf.handler, the RFC's spelling")

# handlers/
declare_use("source gradients", "runtime",
            "tf.GradientTape's gradients of sources on a handler's stack are represented "
            "as that handler chooses (OpHandler.source_gradient), as the handler tapes' "
            "are (handlers/gradient_tape/handler.py)")
declare_use("tape hooks", "first-use",
            "gradients recorded from Python (tf.custom_gradient, tf.recompute_grad, "
            "tf.function calls) go to the handler tapes of the current scope too "
            "(handlers/gradient_tape/hooks.py). Started by the first handler tape.")
declare_use("forwardprop state", "first-use",
            "a forward accumulator transposing a custom gradient function resumes "
            "recording inside push_forwardprop_state, as TensorFlow's accumulators do "
            "(handlers/forward_accumulator/custom_gradients.py)")
declare_use("substitute gradients", "first-use",
            "a tf.GradientTape outside a handler that substituted an op gets the gradient "
            "of what the handler ran; a tf.autodiff.ForwardAccumulator's JVP of such an "
            "op raises (handlers/substitutes.py). Started when a substituting handler "
            "first runs under a TensorFlow tape.")
declare_use("recompute graph records", "first-use",
            "A recompute scope inside a traced function pauses TensorFlow's tapes and makes "
            "their records itself at the scope's exit, recomputable ops grouped into "
            "segments (handlers/recompute/graph.py). Started by the first such scope.")
declare_use("trace variable reads", "scoped",
            "A tracing handler captures every variable its scope reads as the variable, "
            "trainable or not (handlers/trace.py). Held while a trace scope is open.")
declare_use("keras data-parallel fit", "first-use",
            "in a data-parallel handler's scope Keras's fit splits batches, scales the loss "
            "and all-reduces gradients as under a strategy (handlers/parallel/fit.py)")
declare_use("keras optimizer step check", "first-use",
            "an optimizer step in a Parallel or Mesh scope that would fail on a host "
            "variable is refused before its first write (core/per_device.py)")
