"""A TensorFlow Debugger V2 dump of a Keras model with `oh.DebuggerHandler`.

A small CNN whose custom layer takes the log of negative numbers is run eagerly, then
trained with `model.fit`, inside one `oh.DebuggerHandler` scope in FULL_HEALTH mode. The
dump has what `tf.debugging.experimental.enable_dump_debug_info` writes: one Execution
event per eager op (with NaN/Inf counts of its outputs), and, for `fit`'s train step (a
`tf.function`, replayed through the handler), the step's graph ops and a trace of every
op output at every step. TensorFlow's `DebugDataReader` reads it back; to browse it, run

    tensorboard --logdir <the dump directory printed below>

and open the "Debugger V2" dashboard (execution timeline, graph executions, source lines,
NaN alerts).

    python examples/debugger.py [dump_dir]
"""
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.debug.lib import debug_events_reader  # noqa: E402

import tf_ophandlers as oh  # noqa: E402


class ShiftedLog(keras.layers.Layer):
    """log(x - 1): NaN wherever x < 1 (the bug this dump finds)."""

    def call(self, x):
        return tf.math.log(x - 1.0)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                          ShiftedLog(), keras.layers.Flatten(), keras.layers.Dense(1)])
model.compile("sgd", "mse")
x = np.random.default_rng(0).random((10, 8, 8, 1)).astype(np.float32)
y = np.ones((10, 1), np.float32)

dump_root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="oh-tfdbg-")
with oh.DebuggerHandler(dump_root, tensor_debug_mode="FULL_HEALTH"):
    model(x[:2])                                        # eager: one event per op
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 3 steps, each traced

with debug_events_reader.DebugDataReader(dump_root) as reader:
    reader.update()
    executions = reader.executions()
    eager = [e for e in executions if not e.graph_id]
    steps = [e for e in executions if e.graph_id]
    print("eager ops: %d, the model's: %s" % (len(eager), [e.op_type for e in eager[:15]]))
    # FULL_HEALTH: [tensor id, device, dtype, rank, size, -inf, +inf, nan, ...]
    first_nan = next(e for e in eager if any(v is not None and v[7] > 0
                                             for v in e.debug_tensor_values))
    _, frames = reader.read_execution_stack_trace(first_nan)
    line = next(f for f in reversed(frames) if f[0] == os.path.abspath(__file__))
    print("first NaN: op %s, from %s line %d (%s)" % (first_nan.op_type,
                                                      os.path.basename(line[0]), line[1],
                                                      line[2]))
    print("fit steps traced: %d calls of %s" % (len(steps), steps[0].op_type))
    traces = reader.graph_execution_traces()
    nan_traces = [t for t in traces if t.debug_tensor_value and t.debug_tensor_value[7] > 0]
    print("graph execution traces: %d, with NaN: %d (first: %s %s)" % (
        len(traces), len(nan_traces), nan_traces[0].op_type, nan_traces[0].op_name))
print("dump written to", dump_root, "- view it with: tensorboard --logdir", dump_root)
