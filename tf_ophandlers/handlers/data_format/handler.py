"""`DataFormat`: channels-first (NCHW/NCDHW) models on the CPU, layout as an op handler.

TensorFlow's CPU kernels refuse channels-first convolutions and pools ("The Conv2D op
currently only supports the NHWC tensor format on the CPU"). Under `oh.DataFormat()`,
every op with a `data_format` attribute of NCHW, NCDHW or CHANNELS_FIRST (found in
TensorFlow's op registry: Conv2D/3D and their backprops, DepthwiseConv2dNative and its
backprops, MaxPool/AvgPool 2D/3D and their gradients, BiasAdd(Grad), FusedBatchNorm*
and their gradients, SpaceToDepth/DepthToSpace) runs as its channels-last twin on data
kept channels-last:

>>> import tensorflow as tf, tf_ophandlers as oh
>>> x = tf.random.normal([2, 3, 8, 8])                     # NCHW
>>> w = tf.random.normal([3, 3, 3, 4])
>>> with oh.DataFormat():
...     y = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW"))
>>> y.shape                                                 # what the model promises
TensorShape([2, 4, 8, 8])

A tensor's representation carries its physical layout (rules.py:
`Permuted(value, perm)`, or the plain next-stack tensor when physical == logical), so
the output of a converted op stays channels-last: elementwise ops, reductions,
concatenation, splits, pads, slices and transposes run on it directly (axes remapped,
broadcast operands reshaped), and only ops without a rule (a Flatten's Reshape, a
MatMul) and copies off the handler (`.numpy()`, printing, leaving through `copy_off`)
transpose back to the logical layout. What users see is exactly what the channels-first
model gives, in shape and value.
"""
import collections

import tensorflow as tf
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import (
    BoundedCache, next_stack, Op, OpHandler, PHYSICAL, tensor_key, with_message)
from tf_ophandlers.handlers.data_format.rules import (
    RULES, Permuted, bias_add_permuted, channels_first_perm, fallback, inverse, logical, perm_of,
    permuted, physical, rank_of, relayout, relayout_transposes, static, vector_to_physical)

# data_format attribute value -> (its channels-last twin, rank or None: the input's).
_FORMATS = {b"NCHW": (b"NHWC", 4), b"NCDHW": (b"NDHWC", 5),
            b"CHANNELS_FIRST": (b"CHANNELS_LAST", None)}
# Inputs (OpDef argument names) that are per-axis vectors in the op's layout, and those
# that have no layout (filters); every other input of the op's rank is data.
_VECTOR_ARGS = frozenset(("input_sizes", "orig_input_shape", "ksize", "strides"))
_NO_LAYOUT_ARGS = frozenset(("filter", "filter_sizes"))
# Ops whose "NCHW" means "channels at axis 1" at any rank (BiasAdd of a 5-D tensor).
_ANY_RANK = frozenset(("BiasAdd", "BiasAddGrad"))
_gpu_present = []  # [bool] once known (the context's devices never change after start)


def _has_gpu():
    """Whether the process has a logical GPU (asked once: a handler is often made per
    step, and listing devices costs a context round trip)."""
    if not _gpu_present:
        _gpu_present.append(bool(tf.config.list_logical_devices("GPU")))
    return _gpu_present[0]


_TARGETS = {"auto": "auto", "channels_last": "channels_last", "nhwc": "channels_last",
            "ndhwc": "channels_last"}

_roles = BoundedCache("data_format.input_roles", 1024)  # op type -> roles or None
# (op type, attributes) -> _Layout, or None for an op this handler runs as it is.
_layouts = BoundedCache("data_format.layouts", 1024)


def _input_roles(op_type):
    """Per input, 'vector', 'free' or 'data' (from the OpDef's argument names); None
    for ops without a `data_format` attribute (or with list inputs)."""
    roles = _roles.get(op_type, False)
    if roles is False:
        op_def = op_def_registry.get(op_type)
        roles = None
        if op_def is not None and any(a.name == "data_format" for a in op_def.attr) and not any(
                a.number_attr or a.type_list_attr for a in op_def.input_arg):
            roles = tuple("vector" if a.name in _VECTOR_ARGS else
                          "free" if a.name in _NO_LAYOUT_ARGS else "data"
                          for a in op_def.input_arg)
        _roles[op_type] = roles
    return roles


# Rules that change a tensor with no permuted input: a transpose to channels-first is
# kept lazily, a broadcast as large as converted data is made channels-last.
_PLAIN_RULES = frozenset(("Transpose", "BroadcastTo"))


_hooked = BoundedCache("data_format.hooked_types", 1024)  # op type -> bool


def _runs_on_plain_inputs(op_type):
    """`DataFormat.handles_ops`: whether `execute` is called for ops of this type when
    their inputs are all plain tensors: the layout-sensitive ops and _PLAIN_RULES,
    which change plain tensors, and ops without an OpDef. Other ops with plain inputs
    (a variable read, a Keras reshape of a bias) run as they are, so they are
    forwarded, in C++ without a Python call (the default copy_on passes inputs that are
    not on the stack down as they are); one with a `Permuted` input (not a tensor)
    still reaches `execute` (OpHandler.handles_ops)."""
    hooked = _hooked.get(op_type)
    if hooked is None:
        hooked = _hooked[op_type] = (
            op_type in _PLAIN_RULES or _input_roles(op_type) is not None
            or op_def_registry.get(op_type) is None)
    return hooked


class _Layout:
    """How ops of one type and attribute set (a channels-first `data_format`) run
    channels-last: decided once per (type, attributes), so an op pays one cache lookup
    instead of decoding its attributes. `rank` is None when the channel axis is 1 at
    any rank (BiasAdd, CHANNELS_FIRST): the input's rank decides per op."""

    __slots__ = ("type", "attrs", "fmt", "target", "rank", "roles", "filter_out", "_ops")

    def __init__(self, op, target, rank, roles):
        self.type = op.type
        self.attrs = op.attrs  # decoded (shared, read-only): they build the converted ops
        self.fmt = self.attrs["data_format"]
        self.target = target
        self.rank = rank
        self.roles = roles
        self.filter_out = "BackpropFilter" in op.type  # a filter has no data layout
        self._ops = {}  # rank -> converted Op (a handful of ranks at most)

    def converted(self, rank):
        """The op with its channels-last data format and its per-axis attributes
        (strides, ksize, dilations, explicit_paddings) in channels-last axis order."""
        new = self._ops.get(rank)
        if new is None:
            inv = inverse(channels_first_perm(rank))  # result[k] = attr[inv[k]]
            attrs = dict(self.attrs)
            attrs["data_format"] = self.target
            for name, value in self.attrs.items():
                if not isinstance(value, list) or not value or not all(
                        isinstance(v, int) for v in value):
                    continue
                if len(value) == rank:
                    attrs[name] = [value[i] for i in inv]
                elif len(value) == 2 * rank and name == "explicit_paddings":
                    attrs[name] = [value[2 * i + j] for i in inv for j in (0, 1)]
            new = self._ops[rank] = Op.create(
                self.type, **{k: v for k, v in attrs.items() if v is not None})
        return new


def _layout_of(op, roles):
    """The op's `_Layout`, or None if its data format is not channels-first (or it has
    inputs this conversion does not know)."""
    raw = op._attrs_proto()  # pylint: disable=protected-access
    if b"NC" not in raw and b"CHANNELS_FIRST" not in raw:
        # The serialized attributes hold the data_format string as it is: without
        # NCHW/NCDHW/CHANNELS_FIRST the op runs as it is (Keras's channels-first pooling
        # and depthwise convolution run NHWC ops on data it transposed).
        return None
    # `_attrs_proto` gives one byte string per attribute content (cc/boundary/op.cc sorts the
    # fields), so the bytes are the key (op.attrs_key() would serialize them again).
    key = (op.type, raw)
    layout = _layouts.get(key, False)
    if layout is False:
        attrs = op.attrs
        spec = _FORMATS.get(attrs.get("data_format"))
        layout = None
        if spec is not None:
            target, rank = spec
            if rank is None or op.type in _ANY_RANK:  # the channel axis is 1 at any rank
                rank = None
            if rank is not None or attrs.get("batch_dims", 1) == 1:
                layout = _Layout(op, target, rank, roles)
        _layouts[key] = layout
    return layout


class DataFormat(OpHandler):
    """Runs channels-first ops channels-last, keeping data channels-last in between.

    Args:
      target: "auto" (default): convert ops that run on the CPU (all of them when
        TensorFlow sees no GPU; with a GPU, only ops placed on a CPU explicitly, since
        GPU kernels take NCHW); "channels_last" (or "NHWC"): convert every channels-first
        op wherever it runs.

    `fallbacks` counts, per op type, the ops that had to see a permuted input in its
    logical layout (a transpose back): what to look at when a model runs slower than
    its channels-last twin. In a replayed function it counts once per replay.

    >>> import tensorflow as tf, tf_ophandlers as oh
    >>> with oh.DataFormat() as df:
    ...     y = tf.nn.max_pool2d(tf.ones([1, 2, 4, 4]), 2, 2, "VALID", data_format="NCHW")
    >>> y.shape, dict(df.fallbacks)
    (TensorShape([1, 2, 2, 2]), {})
    """

    transparent = True
    TYPE_NAME = "DATAFORMAT"
    handles_ops = staticmethod(_runs_on_plain_inputs)

    def __init__(self, target="auto"):
        key = _TARGETS.get(str(target).lower()) if isinstance(target, str) else None
        if key is None:
            raise ValueError(
                "oh.DataFormat: target must be 'auto', 'channels_last' or 'NHWC', got %r "
                "(channels-first targets are not implemented: GPU kernels take NCHW "
                "directly)" % (target,))
        self.target = key
        # Whether the program has a GPU: asked at first use, since listing devices
        # initializes TensorFlow, and users configure devices after making handlers.
        self._gpu_known = None if key == "auto" else False
        self._fallbacks = None  # made on first use (a handler is often made per call)
        self.converted_ranks = set()  # ranks of the channels-first ops converted so far
        # Eagerly, the channels-last copies of the last few data inputs made for
        # converted ops: a backward pass (Conv2DBackpropInput and ...Filter) or a second
        # consumer uses the same input again. Keyed by the input tensor (kept alive by
        # the entry, so its key is not reused) and the layout. Made on first use (a
        # handler is often created per step).
        self._moved = None

    def debug_string(self):
        return "DataFormat(target=%r)" % self.target

    @property
    def fallbacks(self):
        if self._fallbacks is None:
            self._fallbacks = collections.Counter()
        return self._fallbacks

    def note_transpose_back(self, op_type):
        self.fallbacks[op_type] += 1

    # -- the representation's view ------------------------------------------------------

    def value_dtype(self, value):
        return value.dtype

    # (Asked by TensorFlow per axis at every `.shape` of a handler tensor: the shape
    # tuple, not a TensorShape per axis.)

    def num_dims(self, value):
        dims = physical(value)._shape_tuple()  # pylint: disable=protected-access
        return -1 if dims is None else len(dims)

    def dim(self, value, index):
        if type(value) is Permuted:
            d = value.value._shape_tuple()[value.perm[index]]  # pylint: disable=protected-access
        else:
            d = value._shape_tuple()[index]  # pylint: disable=protected-access
        return -1 if d is None else d

    def static_value(self, value):
        known = static(physical(value))  # (the tensor's own buffer: a copy is given away)
        if known is None:
            return None
        return (known.transpose(value.perm) if type(value) is Permuted else known).copy()

    def tensor_debug_string(self, value):
        if type(value) is Permuted:  # the logical value, as TensorFlow prints it
            return str(value.value.numpy().transpose(value.perm))
        return _ops.value_text(value) if hasattr(value, "_id") else repr(value)

    # -- copies -------------------------------------------------------------------------
    # copy_on is OpHandler's (a move): a tensor that is not the handler's moves onto the
    # next stack as it is (the C++ per-op path passes it down without a Python call), and
    # one of an earlier merge of this handler keeps its layout (core.stack.move_onto moves
    # a `Permuted` through function_input/function_output).

    def copy_off(self, value, device):
        return logical(next_stack(), value)

    # -- ops ----------------------------------------------------------------------------

    changes_computation = False  # the same values in another layout; gradient ops take its representations too

    def execute(self, op, inputs):
        nxt = next_stack()
        op_type = op.type  # (a new str per read)
        rule = RULES.get(op_type)
        if rule is not None:
            return rule(self, nxt, op, inputs)
        roles = _input_roles(op_type)
        if roles is not None:
            if op_type == "BiasAdd" and type(inputs[0]) is Permuted and self._converts(op):
                return bias_add_permuted(self, nxt, op, inputs)
            layout = _layout_of(op, roles)
            if layout is not None:
                outputs = self._channels_last(nxt, op, inputs, layout)
                if outputs is not None:
                    return outputs
        for x in inputs:
            if type(x) is Permuted:
                return fallback(self, nxt, op, inputs)
        return nxt.execute(op, inputs)

    @property
    def _gpu(self):
        gpu = self._gpu_known
        if gpu is None:
            gpu = self._gpu_known = _has_gpu()
        return gpu

    def _converts(self, op):
        if self.target != "auto":
            return True
        device = op.requested_device
        if not device:
            return not self._gpu  # with a GPU, only ops placed on a CPU convert
        device = device.upper()
        return "GPU" not in device and (not self._gpu or "CPU" in device)

    def _channels_last(self, nxt, op, inputs, layout):
        """A layout-sensitive op given a channels-first format, run channels-last on
        physical data (its data outputs stay channels-last); None to run it as it is."""
        roles = layout.roles
        if len(roles) != len(inputs) or not self._converts(op):
            return None
        rank = layout.rank
        if rank is None:  # the channel axis is 1 at any rank
            rank = rank_of(inputs[0])
            if rank is None or rank < 3:
                return None
        for x, role in zip(inputs, roles):
            if role == "data":
                if rank_of(x) not in (rank, None):
                    return None  # not the layout this conversion knows: TensorFlow decides
                break
        perm = channels_first_perm(rank)
        self.converted_ranks.add(rank)
        args = []
        for x, role in zip(inputs, roles):
            if role == "data":
                if rank_of(x) == rank:
                    args.append(x.value if type(x) is Permuted and x.perm == perm
                                else self._relayout(nxt, x, perm))
                    continue
            elif role == "vector" and rank_of(x) == 1:
                length = physical(x).shape[0]
                if length == rank:
                    args.append(vector_to_physical(nxt, physical(x), perm))
                    continue
                if length is None:
                    return None  # a vector of unknown length (2 or 4 input sizes): as it is
            args.append(logical(nxt, x))
        new_op = layout.converted(rank)
        try:
            outputs = nxt.execute(new_op, args)
        except tf.errors.OpError as e:
            raise with_message(e, (
                "oh.DataFormat: op %s (data_format=%s, run as data_format=%s on the "
                "channels-last data): %s" % (op.type, layout.fmt.decode(),
                                             layout.target.decode(), e.message))) from None
        if layout.filter_out:
            return outputs  # a filter has no data layout
        return [Permuted(o, perm) if rank_of(o) == rank else o for o in outputs]

    def _relayout(self, nxt, x, perm):
        if nxt is not PHYSICAL or not relayout_transposes(x, perm) or not tf.executing_eagerly():
            # (On a handler below, a kept copy could bypass what it records; a replayed
            # function's duplicate transposes are merged by TensorFlow's optimizer.)
            return relayout(nxt, x, perm)
        key = (tensor_key(physical(x)), perm_of(x), perm)
        if self._moved is None:
            self._moved = BoundedCache("data_format.moved_inputs.%x" % id(self), 4)
        hit = self._moved.get(key)
        if hit is None:
            hit = self._moved[key] = (x, relayout(nxt, x, perm))
        return hit[1]

    # -- functions (core/functions) -----------------------------------------------------

    def function_input(self, value):
        return perm_of(value), [physical(value)]

    def function_output(self, summary, tensors):
        return permuted(tensors[0], summary)

    def function_join(self, summaries):
        first = summaries[0]
        return first if all(s == first for s in summaries[1:]) else None

    def function_coerce(self, value, summary):
        return permuted(relayout(next_stack(), value, summary), summary)

    def function_cache_key(self):
        # The replay depends on the layouts (the summaries) and the target only.
        return ("DataFormat", self.target, self._gpu)

