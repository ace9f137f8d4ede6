"""The tracing handlers on one Keras model: record, defer, run asynchronously.

- `oh.TraceAndExecute()` runs the model eagerly and records it; `trace.function(y)` is a
  ConcreteFunction of the tensors that entered the scope, saved as a SavedModel and
  loaded back.
- `oh.Lazy()` defers the ops of a loop with a Python decision in it; the value requests
  run compiled functions, cached by structure in one process-wide cache, so a second
  pass in a new `with oh.Lazy():` scope compiles nothing; `oh.Lazy(jit_compile=True)`
  compiles them with XLA; `oh.Lazy(chunk_ops=4)` launches every 4 pending ops as a
  compiled call on an asynchronous executor while Python keeps recording.
- `oh.Async()` returns control to Python before the model's kernels (and those of a
  `CheckNumericsHandler` inside it) have run: shapes come from TensorFlow's shape
  functions, so Keras does not wait; the result is read at the synchronization point.

Every result is compared with plain eager TensorFlow.

    python examples/tracing_handlers.py
"""
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_ophandlers as oh  # noqa: E402

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                          keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
x = tf.random.stateless_normal([512, 64], seed=[1, 2])
expected = model(x).numpy()

# -- TraceAndExecute: an eager run recorded into a saveable function -----------------------
with oh.TraceAndExecute() as trace:
    y = model(x)
fn = trace.function(y)
print("TraceAndExecute: %d input(s), %d ops recorded; same values as eager: %s"
      % (len(trace.inputs), len(fn.graph.get_operations()),
         np.allclose(y.numpy(), expected, atol=1e-5)))
module = tf.Module()
module.variables_of_model = model.variables  # tracked, so the SavedModel holds them
module.f = fn
path = os.path.join(tempfile.mkdtemp(), "traced")
tf.saved_model.save(module, path)
reloaded = tf.saved_model.load(path)
print("  reloaded SavedModel gives the same values:",
      np.allclose(reloaded.f(x).numpy(), expected, atol=1e-5))


# -- Lazy: ops deferred until a value is needed --------------------------------------------
def normalize_until_small(h):
    steps = 0
    while float(tf.reduce_max(tf.abs(h))) > 1.0:  # a Python decision: a value request
        h = tf.tanh(h * 0.5) * 1.5
        steps += 1
    return h, steps


compiled = []
for _ in range(2):
    lazy = oh.Lazy()  # a new scope per pass, as one writes `with tf.GradientTape():`
    with lazy:
        h, steps = normalize_until_small(model(x) * 20.0)
        value = h.numpy()
    compiled.append(lazy.compiled)
ref, ref_steps = normalize_until_small(model(x) * 20.0)
print("Lazy: %d loop steps (eager %d); functions compiled: %d in the first pass, %d in the "
      "second (a new handler: the process-wide cache); same values as eager: %s"
      % (steps, ref_steps, compiled[0], compiled[1],
         np.allclose(value, ref.numpy(), atol=1e-5)))
with oh.Lazy(jit_compile=True):  # the pending ops compiled with XLA
    h, _ = normalize_until_small(model(x) * 20.0)
    print("Lazy(jit_compile=True): same values as eager: %s"
          % np.allclose(h.numpy(), ref.numpy(), atol=1e-4))
for _ in range(2):  # the second pass: every chunk from the cache, launched asynchronously
    chunked = oh.Lazy(chunk_ops=4)
    with chunked:
        h, _ = normalize_until_small(model(x) * 20.0)
        value = h.numpy()
print("Lazy(chunk_ops=4): %d chunks launched while recording; same values as eager: %s"
      % (chunked.chunks, np.allclose(value, ref.numpy(), atol=1e-5)))

# -- Async: control returns before the kernels ----------------------------------------------
big = tf.random.stateless_normal([4096, 64], seed=[3, 4])
reference = float(tf.reduce_sum(model(big)))
for attempt in ("first", "second"):  # the first call also fills the shape caches
    runner = oh.Async(sync_on_exit=False)
    start = time.perf_counter()
    with runner:
        with oh.CheckNumericsHandler():  # its checks run on the async executor too
            out = model(big)
            issued = time.perf_counter() - start
            total = float(tf.reduce_sum(out))  # a synchronization point
    done = time.perf_counter() - start
    print("Async (%s call): control back after %.1f ms, result after %.1f ms; same value "
          "as eager: %s" % (attempt, issued * 1e3, done * 1e3,
                            np.isclose(total, reference, rtol=1e-4)))
