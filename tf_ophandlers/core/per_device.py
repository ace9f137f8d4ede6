"""Shared machinery of handlers whose values and variables live one per device (one
buffer per component or per device of a mesh): their device names, the variable reads a
tape outside their scope cannot differentiate, and the Keras optimizer-step check for
handlers that declare `OpHandler.holds_variable`.

Several handler families need the same checks; they live here, below them, so that no
handler imports another (the messages name the handler through its arguments).
"""
import tensorflow as tf
from tensorflow.python.framework import device_spec as _device_spec

from tf_ophandlers.core import errors
from tf_ophandlers.core import registries
from tf_ophandlers.core import tf_patches as _tf_patches
from tf_ophandlers.core.stack import current_stack

_LOCAL = _device_spec.DeviceSpecV2(job="localhost", replica=0, task=0)

#: The ops that read a resource variable's buffer.
VARIABLE_READS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd"))


def _full_device_name(name, who):
    """`name` in TensorFlow's canonical form (`/job:localhost/replica:0/task:0/device:CPU:0`),
    as `tf.distribute`'s device_util.canonicalize: missing fields default to the local job,
    replica 0, task 0 and device index 0."""
    if isinstance(name, _device_spec.DeviceSpecV2):
        name = name.to_string()
    elif isinstance(name, tf.config.LogicalDevice):
        name = name.name
    if not isinstance(name, str):
        raise TypeError("%s: a component must be a device name (a string), "
                        "got %r" % (who, name))
    try:
        spec = _device_spec.DeviceSpecV2.from_string(name)
    except ValueError as e:
        raise ValueError("%s: component %r is not a device name: %s"
                         % (who, name, e)) from None
    if spec.job is None:
        spec = _LOCAL.make_merged_spec(spec)
    if spec.device_type is None:
        raise ValueError("%s: component %r names no device type" % (who, name))
    spec = spec.replace(replica=0 if spec.replica is None else spec.replica,
                        task=0 if spec.task is None else spec.task,
                        device_index=0 if spec.device_index is None else spec.device_index)
    return spec.to_string()


def _known_devices():
    """Canonical names of the devices TensorFlow knows: this process's logical devices and
    those of a cluster joined with `tf.config.experimental_connect_to_cluster`."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    ctx = context.context()
    ctx.ensure_initialized()  # the devices are fixed from here on (as for any TF use)
    return {_full_device_name(d, "tf_ophandlers") for d in ctx.devices()}


def canonical_devices(components, who):
    """Canonical names of `components` (device names, `tf.DeviceSpec`s or logical
    devices), each a device of this program, none repeated, as a tuple; raises
    TypeError/ValueError naming `who` (e.g. ``"oh.MyHandler"``) otherwise. A
    repeated or unknown device would make a collective wait forever."""
    names = [_full_device_name(c, who) for c in components]
    known = _known_devices()
    for given, name in zip(components, names):
        if name not in known:
            raise ValueError(
                "%s: component %r (%s) is not a device of this program; "
                "known devices: %s. Configure logical devices with "
                "tf.config.set_logical_device_configuration before TensorFlow initializes, "
                "or connect remote workers with tf.config.experimental_connect_to_cluster "
                "first" % (who, given, name, ", ".join(sorted(known))))
    first = {}
    for given, name in zip(components, names):
        if name in first:
            raise ValueError(
                "%s: components %r and %r are the same device %s; each "
                "component must be a distinct device (as in tf.distribute.MirroredStrategy), "
                "otherwise a collective such as all_reduce would wait forever"
                % (who, first[name], given, name))
        first[name] = given
    return tuple(names)


def refuse_tape_below(handler, op, part, who):
    """Raises if a reverse-mode tape opened outside `handler`'s scope records now, for
    `op` reading a variable made in the scope (`part`: "component", "device"; `who`:
    how messages name the handler's kind, e.g. ``"oh.MyHandler"``): the tape would
    watch the variable but record each part's read separately, and give None for it,
    silently. (Tensors packed from outside and unpacked again differentiate.)"""
    if registries.recording_handlers("reverse"):
        tape = registries.tape_name("reverse")
        raise NotImplementedError(
            "%s: op %s reads a variable made in the scope of %s (one buffer per %s) "
            "under an %s opened outside that scope, which cannot "
            "differentiate with respect to it (its gradient would be None). Open the tape "
            "inside the scope (`with handler: with %s() as tape: ...`), or "
            "pause it around the scope with `tape.stop_recording()`" % (
                who, op.type, handler.debug_string(), part, tape, tape))


def misplaced_write_message(handler, optimizer, variable, part, name, tail):
    """The `OpHandler.misplaced_write` text of a per-device handler: `part` ("component",
    "device"), `name` (the scope's variable in the examples), `tail` (the end of the
    custom-loop advice)."""
    kind = type(handler).__name__
    return (
        "oh.%s: %s.apply would write variable %r, created outside %s, once "
        "per %s; nothing was written. This optimizer's variables stay outside "
        "(building it again does nothing): make a new one inside the scope. "
        "For a Keras model, build and compile it inside the scope (`with %s: "
        "model = ...; model.compile(...)`); in a custom loop, `with %s: "
        "optimizer = keras.optimizers.%s(...)%s"
        % (kind, type(optimizer).__name__,
           getattr(variable, "path", None) or variable.name, handler.debug_string(), part,
           name, name, type(optimizer).__name__, tail))


def check_optimizer_step(optimizer, trainable_variables):
    """Raises `PlacementError` before a Keras optimizer step writes anything if a
    variable it writes (its `iterations`, its slots, the trained variables) is a host
    variable of a scope on the current stack whose handler declares `holds_variable`.
    Checked per op, the error would come at the first write to such a variable: after
    the weights were updated, so a retry would apply the step twice."""
    handlers = [h for h in current_stack().handlers
                if getattr(h, "holds_variable", None) is not None]
    if not handlers:
        return
    rate = getattr(optimizer, "_learning_rate", None)  # read by the step, not written
    writes = [optimizer.iterations] + [v for v in optimizer.variables
                                       if v is not rate and v is not optimizer.iterations]
    writes += [v for v in (trainable_variables or ()) if v is not None]
    for h in handlers:
        for v in writes:
            if getattr(v, "handle", None) is not None and not h.holds_variable(v):
                raise errors.PlacementError(h.misplaced_write(optimizer, v))


def _wrap_apply(original):
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        check_optimizer_step(self, trainable_variables if trainable_variables is not None
                             else getattr(self, "_trainable_variables", None))
        return original(self, grads, trainable_variables)
    return apply


_tf_patches.subscribe("BaseOptimizer.apply", "keras optimizer step check", _wrap_apply)


def ensure_optimizer_check():
    """Installs the Keras optimizer-step check (called when a handler that declares
    `holds_variable` is made)."""
    _tf_patches.ensure("keras optimizer step check")
