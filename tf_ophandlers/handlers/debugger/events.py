"""The tfdbg V2 file set of a dump root and the debug values of tensors (for
`DebuggerHandler`, handlers/debugger/handler.py).

Everything is written through TensorFlow's own `DebugEventsWriter` and mirrors
`tensorflow/python/debug/lib/dumping_callback.py` (what
`tf.debugging.experimental.enable_dump_debug_info` writes): source files and stack frames
before the events that refer to them, `Execution` events for eager ops,
`DebuggedGraph`/`GraphOpCreation` events for the ops of replayed functions, and
`DebugIdentityV2` nodes (TensorFlow's kernel writes their `GraphExecutionTrace`s).

TensorFlow's writer is one C++ object per dump root and process: once closed it cannot be
reopened (later events are lost). So every handler writing to a dump root shares one
`DumpFiles` (one tfdbg run id, one list of source files and stack frames, as the reader
needs), handlers flush when their scope closes, and the files are closed at exit.
"""
import atexit
import os
import re
import socket
import sys
import threading
import uuid

import tensorflow as tf
from tensorflow.core.framework import graph_debug_info_pb2
from tensorflow.core.framework import tensor_pb2
from tensorflow.core.protobuf import debug_event_pb2
from tensorflow.python.client import _pywrap_debug_events_writer
from tensorflow.python.debug.lib import debug_events_writer
from tensorflow.python.debug.lib import op_callbacks_common
from tensorflow.python.debug.lib import source_utils
from tensorflow.python.framework import tensor_util

from tf_ophandlers.extend import BoundedCache, Op

MODES = debug_event_pb2.TensorDebugMode
NO_TENSOR = MODES.NO_TENSOR
CURT_HEALTH = MODES.CURT_HEALTH
CONCISE_HEALTH = MODES.CONCISE_HEALTH
FULL_HEALTH = MODES.FULL_HEALTH
SHAPE = MODES.SHAPE
FULL_TENSOR = MODES.FULL_TENSOR
SUPPORTED_MODES = ("NO_TENSOR", "CURT_HEALTH", "CONCISE_HEALTH", "FULL_HEALTH", "SHAPE",
                   "FULL_TENSOR")
HEALTH_MODES = frozenset((CURT_HEALTH, CONCISE_HEALTH, FULL_HEALTH))

# Ops TensorFlow's dumping callback neither records eagerly nor instruments in graphs
# (op_callbacks_common.OP_CALLBACK_SKIP_OPS), plus the summary op itself.
SKIP_OPS = frozenset(t.decode() for t in op_callbacks_common.OP_CALLBACK_SKIP_OPS)
SKIP_EAGER = SKIP_OPS | {"DebugNumericSummaryV2"}

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def parse_mode(tensor_debug_mode):
    """The TensorDebugMode enum of a mode name, or a ValueError naming the handler."""
    if not isinstance(tensor_debug_mode, str) or tensor_debug_mode not in SUPPORTED_MODES:
        raise ValueError(
            "DebuggerHandler: invalid tensor_debug_mode %r; valid modes are %s (as for "
            "tf.debugging.experimental.enable_dump_debug_info)"
            % (tensor_debug_mode, ", ".join(SUPPORTED_MODES)))
    return MODES.Value(tensor_debug_mode)


class TensorFilter:
    """`op_regex` and `tensor_dtypes` of `enable_dump_debug_info`: which outputs get a
    debug value (the events are written for every op either way)."""

    def __init__(self, op_regex, tensor_dtypes):
        if op_regex is not None:
            try:
                op_regex = re.compile(op_regex)
            except (re.error, TypeError) as e:
                raise ValueError("DebuggerHandler: invalid op_regex %r: %s" % (op_regex, e)) \
                    from None
        self.op_regex = op_regex
        if tensor_dtypes is not None:
            if isinstance(tensor_dtypes, (list, tuple)):
                tensor_dtypes = frozenset(tf.as_dtype(d) for d in tensor_dtypes)
            elif not callable(tensor_dtypes):
                raise ValueError(
                    "DebuggerHandler: tensor_dtypes must be a list, a tuple or a callable "
                    "taking a DType, not %r" % (tensor_dtypes,))
        self.tensor_dtypes = tensor_dtypes
        self._ops = {}

    def op_matches(self, op_type):
        hit = self._ops.get(op_type)
        if hit is None:
            hit = self._ops[op_type] = (self.op_regex is None
                                        or self.op_regex.match(op_type) is not None)
        return hit

    def dumps(self, op_type, dtype):
        if not self.op_matches(op_type):
            return False
        dtypes = self.tensor_dtypes
        if dtypes is None:
            return True
        if isinstance(dtypes, frozenset):
            return dtype in dtypes
        return bool(dtypes(dtype))


def summarized(mode, dtype):
    """Whether `mode` computes a DebugNumericSummaryV2 of a `dtype` tensor (TensorFlow's
    rule: floating-point for the health modes; also integers and booleans for SHAPE)."""
    if mode in HEALTH_MODES:
        return dtype.is_floating
    return dtype.is_floating or dtype.is_integer or dtype.is_bool


_kernel_dtypes = []  # the dtypes DebugNumericSummaryV2 has kernels for (on first use)


def _summarizable(dtype):
    if not _kernel_dtypes:
        from tensorflow.python.framework import kernels  # pylint: disable=import-outside-toplevel
        found = set()
        for kernel in kernels.get_registered_kernels_for_op("DebugNumericSummaryV2").kernel:
            for constraint in kernel.constraint:
                if constraint.name == "T":
                    found.update(constraint.allowed_values.list.type)
        _kernel_dtypes.append(frozenset(found))
    return dtype.as_datatype_enum in _kernel_dtypes[0]


def summarize(stack, mode, value, tensor_id=-1):
    """The DebugNumericSummaryV2 of `value` computed on `stack`. A dtype the kernel does
    not take (float8 variants, some unsigned integers) is summarized as float32 or int64
    (casts keep NaN, Inf and the shape; FULL_HEALTH's dtype field then names that dtype),
    where TensorFlow's callback would fail."""
    dtype = value.dtype
    if not _summarizable(dtype):
        wide = tf.float32 if dtype.is_floating else tf.int64
        (value,) = stack.execute(Op.cached("Cast", SrcT=dtype, DstT=wide, Truncate=False),
                                 [value])
        dtype = wide
    (summary,) = stack.execute(Op.cached(
        "DebugNumericSummaryV2", T=dtype, output_dtype=tf.float64,
        tensor_debug_mode=int(mode), tensor_id=int(tensor_id)), [value])
    return summary


def eager_tensor_protos(mode, op_type, outputs, tensor_filter, next_stack):
    """The `tensor_protos` of an eager op's Execution event (`_dump_eager_tensors`): one
    per dumped output, a summary computed by TensorFlow's kernel on the next stack, the
    full value, or an empty placeholder for outputs the mode does not summarize."""
    protos = []
    for t in outputs:
        dtype = t.dtype
        if not (tensor_filter.dumps(op_type, dtype) and dtype.is_numpy_compatible):
            continue
        if mode == FULL_TENSOR:
            protos.append(tensor_util.make_tensor_proto(t.numpy()))
        elif summarized(mode, dtype):
            summary = summarize(next_stack, mode, t)
            protos.append(tensor_util.make_tensor_proto(summary.numpy()))
        else:
            protos.append(tensor_pb2.TensorProto())
    return protos


class DumpFiles:
    """The DebugEvents file set of one dump root in this process."""

    def __init__(self, dump_root, circular_buffer_size):
        self.dump_root = dump_root
        self.run_id = str(uuid.uuid4())[:8]
        self.circular_buffer_size = circular_buffer_size
        self.writer = debug_events_writer.DebugEventsWriter(
            dump_root, self.run_id, circular_buffer_size=circular_buffer_size)
        self.host = socket.gethostname()
        self.debug_urls = ["file://" + dump_root]
        self._lock = threading.Lock()
        self._files = {}    # absolute path -> index in the .source_files file
        self._frames = {}   # (id of code, line) or (path, line, function) -> frame id
        self._codes = {}    # id -> code object of the frames in _frames (kept alive)
        self._devices = {}  # device name -> id
        self._tensor_ids = 0
        self._graph_ops = {}  # (graph id, op name) written -> its output tensor ids
        self._abspaths = BoundedCache("debugger.abspaths", 4096)
        # (code, line) of every frame of a Python stack -> [its CodeLocation, the eager
        # Execution events prebuilt for it] (a loop's ops repeat a few stacks); the frame
        # ids stay in _frames.
        self._locations = BoundedCache("debugger.code_locations", 2048)

    # -- source files and stack frames ---------------------------------------------------

    def _file_index(self, path):
        index = self._files.get(path)
        if index is None:
            lines = None
            if source_utils.is_extension_uncompiled_python_source(path):
                try:
                    lines, _ = source_utils.load_source(path)
                except (IOError, OSError, UnicodeDecodeError):
                    lines = None
            self.writer.WriteSourceFile(debug_event_pb2.SourceFile(
                file_path=path, host_name=self.host, lines=lines))
            index = self._files[path] = len(self._files)
        return index

    def _frame_id(self, key, filename, lineno, func):
        with self._lock:
            frame_id = self._frames.get(key)
            if frame_id is None:
                path = self._abspaths.get(filename)
                if path is None:
                    path = self._abspaths[filename] = os.path.abspath(filename)
                # Short ids (TensorFlow uses uuid4s): an eager event repeats one per frame
                # of its stack, so they are most of its bytes. Unique in the file set,
                # which only this object writes.
                frame_id = "%x" % len(self._frames)
                self.writer.WriteStackFrameWithId(debug_event_pb2.StackFrameWithId(
                    id=frame_id, file_line_col=graph_debug_info_pb2.GraphDebugInfo.FileLineCol(
                        file_index=self._file_index(path), line=lineno, func=func)))
                self._frames[key] = frame_id
            return frame_id

    def code_location_here(self, outside_package=False):
        """See `stack_here`: the CodeLocation alone."""
        return self.stack_here(outside_package, 1)[0]

    def stack_here(self, outside_package=False, depth=0):
        """The CodeLocation of the caller's Python stack (outermost frame first), without
        the innermost frames of this package (the dispatcher and the handlers' hooks);
        with `outside_package`, from the caller of the outermost frame of this package
        (the user's call that a replay or a handler's own work started from).

        Returns `[location, templates]`, cached per stack: `templates` is a dict where
        callers keep events prebuilt for that stack (a loop's ops repeat a few stacks)."""
        frame = sys._getframe(1 + depth)  # pylint: disable=protected-access
        if outside_package:
            outermost = None
            while frame is not None:
                if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                    outermost = frame
                frame = frame.f_back
            frame = (outermost.f_back if outermost is not None
                     else sys._getframe(1 + depth))  # pylint: disable=protected-access
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frame = frame.f_back
        # The key: id and line of each frame's code, flat (ints hash fast; a code
        # object's own hash is recomputed from its contents at every call). The code
        # objects are kept alive by `_codes`, so their ids are never reused.
        start = frame
        keys = []
        append = keys.append
        while frame is not None:
            append(id(frame.f_code))
            append(frame.f_lineno)
            frame = frame.f_back
        keys = tuple(keys)
        location = self._locations.get(keys)
        if location is None:
            ids = []
            frame = start
            while frame is not None:
                code, lineno = frame.f_code, frame.f_lineno
                self._codes[id(code)] = code
                ids.append(self._frame_id((id(code), lineno), code.co_filename, lineno,
                                          code.co_name))
                frame = frame.f_back
            ids.reverse()
            location = [debug_event_pb2.CodeLocation(host_name=self.host, stack_frame_ids=ids),
                        {}]
            self._locations[keys] = location
        return location

    def code_location_of(self, frames):
        """The CodeLocation of FrameSummary-like `frames` (a graph node's traceback)."""
        ids = [self._frame_id((f.filename, f.lineno, f.name), f.filename, f.lineno, f.name)
               for f in frames]
        return debug_event_pb2.CodeLocation(host_name=self.host, stack_frame_ids=ids)

    # -- ids -------------------------------------------------------------------------------

    def device_id(self, device):
        device_id = self._devices.get(device)
        if device_id is None:
            device_id = self._devices[device] = self.writer.RegisterDeviceAndGetId(device)
        return device_id

    def graph_op_tensor_ids(self, graph_id, op_name, n):
        """(the symbolic tensor ids of the `n` outputs of graph op `op_name`, whether its
        creation is still to be written). A replay sees the ops of branches and loop
        bodies twice (a probe, then the body), a callee inlined twice twice: the op is
        written once and its outputs keep their ids."""
        key = (graph_id, op_name)
        with self._lock:
            ids = self._graph_ops.get(key)
            if ids is not None:
                return ids, False
            ids = self._graph_ops[key] = list(range(self._tensor_ids + 1,
                                                    self._tensor_ids + 1 + n))
            self._tensor_ids += n
            return ids, True

    def new_graph(self, name, outer_graph_id=None):
        """Writes a DebuggedGraph; returns its id."""
        graph_id = str(uuid.uuid4())
        self.writer.WriteDebuggedGraph(debug_event_pb2.DebuggedGraph(
            graph_id=graph_id, graph_name=name, outer_context_id=outer_graph_id))
        return graph_id

    def write_execution_event(self, event):
        """Writes a DebugEvent holding an Execution (DebugEventsWriter.WriteExecution
        without building the DebugEvent around it again)."""
        _pywrap_debug_events_writer.WriteExecution(self.dump_root, event)

    def flush(self):
        self.writer.FlushNonExecutionFiles()
        self.writer.FlushExecutionFiles()


_open = {}  # absolute dump root -> DumpFiles
_open_lock = threading.Lock()


def dump_files(dump_root, circular_buffer_size):
    """The DumpFiles of `dump_root`, opened on first use."""
    if not isinstance(dump_root, (str, os.PathLike)) or not os.fspath(dump_root):
        raise ValueError("DebuggerHandler: dump_root must be a non-empty path, not %r"
                         % (dump_root,))
    root = os.path.abspath(os.fspath(dump_root))
    with _open_lock:
        files = _open.get(root)
        if files is None:
            files = _open[root] = DumpFiles(root, circular_buffer_size)
        elif files.circular_buffer_size != circular_buffer_size:
            raise ValueError(
                "DebuggerHandler: dump root %s is already written with circular_buffer_size="
                "%d in this process; TensorFlow's writer keeps one file set per dump root, "
                "so circular_buffer_size=%d cannot be honored (use another dump_root)"
                % (root, files.circular_buffer_size, circular_buffer_size))
    return files


@atexit.register
def _close_all():
    with _open_lock:
        for files in _open.values():
            try:
                files.writer.Close()
            except Exception:  # pylint: disable=broad-except
                pass
        _open.clear()
