"""`OpLogHandler`: records every op it sees (the op-callback / tfdbg use case).

>>> import tensorflow as tf, tf_ophandlers as oh
>>> log = oh.OpLogHandler()
>>> with log:
...     y = tf.sin(tf.constant([1.0, 2.0])) * 2.0
>>> [r.op_type for r in log.records]
['Sin', 'Mul']
>>> log.records[0].input_shapes, log.records[0].input_dtypes
([TensorShape([2])], [tf.float32])

It is transparent: tensors keep showing their physical device, and values are those of
plain TensorFlow. Like `tf.debugging.experimental.enable_dump_debug_info`'s op records,
each record holds metadata only (no tensor values), so logging long loops stays cheap.
"""
import dataclasses
from typing import List, Optional

import tensorflow as tf

from tf_ophandlers.extend import OpHandler, per_call


@dataclasses.dataclass
class OpRecord:
    """One op seen by an OpLogHandler.

    Examples:
        >>> log = oh.OpLogHandler()
        >>> with log:
        ...     y = tf.matmul(tf.ones([2, 3]), tf.ones([3, 4]))
        >>> r = log.records[-1]
        >>> r.op_type, r.output_shapes
        ('MatMul', [TensorShape([2, 4])])
    """
    op_type: str
    input_shapes: List[tf.TensorShape]
    input_dtypes: List[tf.DType]
    output_shapes: List[tf.TensorShape]
    output_dtypes: List[tf.DType]
    stack: str               # name of the handler stack the op ran on
    device: str              # physical placement requested for it ('' if none)
    attrs: Optional[dict] = None


class OpLogHandler(OpHandler):
    """Logs each op (type, input/output shapes and dtypes, stack) into `records`.

    Args:
      record_attrs: also keep each op's decoded attributes (slower).
      op_types: if given, only ops of these types are recorded.
      every_call: how the ops of a replayed function (a `tf.function`, Keras `fit`'s
        train step) are recorded. False (default): once per replay, when the handler
        sees them, as op callbacks see a traced function once. True: at every call of
        the replayed function (per step of `fit`, per iteration of a loop body, only
        taken cond branches), through one `per_call.at_every_call` node per replayed
        graph; shapes are those known when the function was replayed (a dimension may
        be None), and the same record objects are appended at each call.

    Examples:
        >>> log = oh.OpLogHandler()
        >>> with log:
        ...     y = tf.sin(tf.constant([1.0, 2.0])) * 2.0
        >>> log.op_types_seen()
        ['Sin', 'Mul']
    """

    transparent = True
    TYPE_NAME = "OPLOG"

    def __init__(self, record_attrs=False, op_types=None, every_call=False):
        self.records = []
        self.record_attrs = record_attrs
        self.op_types = frozenset(op_types) if op_types is not None else None
        self.every_call = bool(every_call)

    changes_computation = False  # runs each op as it is and logs it

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if self.op_types is None or op.type in self.op_types:
            from tf_ophandlers.extend import state  # pylint: disable=import-outside-toplevel
            record = OpRecord(
                op_type=op.type,
                input_shapes=[t.shape for t in inputs],
                input_dtypes=[t.dtype for t in inputs],
                output_shapes=[t.shape for t in outputs],
                output_dtypes=[t.dtype for t in outputs],
                stack=state.frames[-1].name,
                device=state.device,
                attrs=dict(op.attrs) if self.record_attrs else None)
            if self.every_call:
                per_call.at_every_call(self, record, self._extend)
            else:
                self.records.append(record)
        return outputs

    def _extend(self, records):
        self.records.extend(records)

    def clear(self):
        self.records = []

    def op_types_seen(self):
        return [r.op_type for r in self.records]

    def debug_string(self):
        return "OpLogHandler(%d records)" % len(self.records)
