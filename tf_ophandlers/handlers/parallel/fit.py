"""`model.fit` in an `oh.ParallelHandler` scope trains data-parallel, as Keras does under
`tf.distribute.MirroredStrategy` on the same devices.

Keras builds `fit`'s dataset and iterator in the scope, so every component reads the
whole global batch. The training step (`train_step`, compiled or eager) gets each
component's slice of it, split as MirroredStrategy's distributed dataset splits a batch
(`split_batch`). While the step runs, Keras sees the component count where it asks
`tf.distribute` for the number of replicas (the loss of each component is its mean
over its slice divided by that count), and the optimizer's gradient all-reduce (which
Keras does in the replica context of a strategy) sums the components' gradients with
TensorFlow's collectives (the compiled step of every component runs as one
multi-device call, as MirroredStrategy runs its replicas: fused_calls.py). Metric state (the variables Keras declares
`aggregation="sum"`) is summed over the components after the step, as a mirrored
variable sums its replicas' updates, so every component reports the global metrics.

An eager step (`run_eagerly=True`) records Keras's `train_step` on an `oh.GradientTape`
where Keras opens a `tf.GradientTape`: a batch that splits unevenly gives components of
different lengths, which TensorFlow's C++ tape cannot record (it keeps one shape per
tensor); the handler's tape keeps each component's shape.
"""
import threading
import types

import tensorflow as tf
from tensorflow.python.ops import collective_ops as _collective_ops

from tf_ophandlers.extend import (
    current_stack, registries as _registries, tf_patches as _tf_patches)
from tf_ophandlers.handlers.parallel import collectives as _collectives
from tf_ophandlers.handlers.parallel import fused_calls as _fused_calls

# .replicas: the ParallelHandler whose fit step is traced/run; .eager: that step runs eagerly
_thread = threading.local()


def replica_handler():
    """The ParallelHandler whose data-parallel `fit` step this thread runs (or traces)."""
    return getattr(_thread, "replicas", None)


def data_parallel_handler(model):
    """The innermost multi-component ParallelHandler on the current stack that holds
    `model`'s weights (or will: an unbuilt model is built in the scope), else None (a
    model built outside keeps the optimizer check's PlacementError)."""
    for h in reversed(current_stack().handlers):
        # By type name: handler.py imports this module (an import back would be a cycle).
        if getattr(h, "TYPE_NAME", None) == "PARALLEL" and len(h.components) > 1:
            weights = [v for v in model.trainable_variables
                       if getattr(v, "handle", None) is not None]
            return h if all(h.holds_variable(v) for v in weights) else None
    return None


def split_batch(t, replica_id, n):
    """Component `replica_id`'s part of batch `t` (axis 0) over `n` components, as
    MirroredStrategy's distributed dataset splits a batch of b examples: consecutive
    slices of ceil(b / n), the last ones shorter or empty (b = 3 on 2: 2 + 1; b = 1:
    1 + 0)."""
    if isinstance(t, tf.Tensor) and t.shape.rank == 0:
        return t
    if not isinstance(t, tf.Tensor):
        raise NotImplementedError(
            "oh.ParallelHandler: model.fit splits each batch over the components along "
            "axis 0; it cannot split a %s (dense tensors only)" % type(t).__name__)
    b = tf.shape(t, out_type=tf.int32)[0]
    size = (b + (n - 1)) // n
    start = tf.minimum(replica_id * size, b)
    stop = tf.minimum(start + size, b)
    return t[start:stop]


def all_reduce_sum(handler, tensors):
    """The sums over the components of `tensors` (dense, of this handler), one collective
    per dtype (the tensors flattened and concatenated)."""
    out = list(tensors)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        parts = [tf.reshape(tensors[i], [-1]) for i in indices]
        flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
        if tf.executing_eagerly():
            total = handler.all_reduce(flat)
        else:
            total = _collective(handler, flat)
        sizes = [tf.size(p) for p in parts]
        pieces = [total] if len(parts) == 1 else tf.split(total, tf.stack(sizes), 0)
        for i, piece in zip(indices, pieces):
            out[i] = tf.reshape(piece, tf.shape(tensors[i]))
        del dtype
    return out


def all_gather_slices(handler, slices):
    """The sum over the components of `slices` (a tf.IndexedSlices of this handler) as
    MirroredStrategy's all-reduce gives it: the components' indices and values
    concatenated in component order (duplicate indices kept, as a sparse optimizer
    update such as Adam's sees them), on every component."""
    if tf.executing_eagerly():
        # In the scope, a concat of ordinary tensors runs on every component.
        values = tf.concat(handler.unpack(slices.values), 0)
        indices = tf.concat(handler.unpack(slices.indices), 0)
    else:
        values = _gather_rows(handler, slices.values)
        indices = _gather_rows(handler, slices.indices)
    return tf.IndexedSlices(values, indices, slices.dense_shape)


# Padded lengths of a gather (powers of two; int32 caps the last).
_PADDED_LENGTHS = tuple(2 ** i for i in range(31)) + (2 ** 31 - 1,)


def _gather_rows(handler, t):
    """The components' `t` concatenated along axis 0, in a function that runs once per
    component. Their lengths may differ (and change from step to step): each is padded to
    the power of two at or above the longest, and each padded length has its own
    collective instance (TensorFlow keeps the shape of an instance's first run and
    refuses another)."""
    length = tf.shape(t, out_type=tf.int32)[:1]
    lengths = _collective(handler, length, gather=True)
    longest = tf.reduce_max(lengths)
    bucket = tf.searchsorted(_PADDED_LENGTHS, tf.reshape(longest, [1]))[0]
    padded = tf.gather(_PADDED_LENGTHS, bucket)
    pad = tf.concat([[[0, padded - length[0]]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], 0)
    keys = tf.constant([_collectives.instance_key(handler) for _ in _PADDED_LENGTHS], tf.int32)
    rows = _collective(handler, tf.pad(t, pad), gather=True,
                       instance=tf.gather(keys, bucket))
    keep = tf.reshape(tf.sequence_mask(lengths, padded), [-1])
    return tf.boolean_mask(rows, keep)


def _collective(handler, t, gather=False, instance=None):
    """A TensorFlow all-reduce (sum), or all-gather along axis 0, in a function that runs
    once per component: each component's call holds one member of the collective (the
    handler runs such calls at the same time). Keys from the process's allocator, as
    `all_reduce` uses (`instance`: a key tensor chosen in the graph)."""
    devices = list(handler.components)
    group = _collectives.collective_keys().get_group_key(devices)
    if instance is None:
        instance = _collectives.instance_key(handler)
    # The timeout is for a remote worker that died. Local components' calls start
    # together (one fused call, or one thread each) and a failing one cancels or aborts
    # the others, so they need none; and TensorFlow starts a thread per collective run
    # that sleeps out the timeout, a cost in every step.
    timeout = 0 if _fused_calls.all_local(handler) else handler.timeout_seconds or 0
    if gather:
        return _collective_ops.all_gather_v2(
            t, group_size=len(devices), group_key=group, instance_key=instance,
            timeout=timeout)
    return _collective_ops.all_reduce_v2(
        t, group_size=len(devices), group_key=group, instance_key=instance,
        merge_op="Add", final_op="Id", timeout=timeout)


def _data_parallel_step(model, handler, step_function):
    """`step_function` (Keras's train_step) on each component's slice of the batch, with
    the metric state summed over the components afterwards."""
    n = len(handler.components)
    replica_ids = handler.device_ids  # component i: i (a capture of a compiled step)

    def step(data):
        data = tf.nest.map_structure(
            lambda t: t if t is None else split_batch(t, replica_ids, n), data)
        # Metrics built in the step would escape the sums below (Keras builds them
        # before a strategy's step too).
        model._symbolic_build(data_batch=data)  # pylint: disable=protected-access
        metric_vars = [v for v in model.metrics_variables if v.aggregation == "sum"]
        # Each component accumulates its own contributions from zero; the sum over the
        # components is added to the state from before the step (as a mirrored
        # variable adds its replicas' summed updates).
        before = [tf.identity(v.value) for v in metric_vars]
        for v in metric_vars:
            v.assign(tf.zeros_like(v.value))
        outer = replica_handler(), getattr(_thread, "eager", False)
        _thread.replicas, _thread.eager = handler, tf.executing_eagerly()
        try:
            logs = step_function(data)
        finally:
            _thread.replicas, _thread.eager = outer
        if metric_vars:
            sums = all_reduce_sum(handler, [v.value for v in metric_vars])
            for v, b, s in zip(metric_vars, before, sums):
                v.assign(b + s)
        return _synced_logs(model, handler, logs)

    return step


def _synced_logs(model, handler, logs):
    """The step's outputs as MirroredStrategy's `fit` reports them: a metric's result
    read again from the summed state; any other float output averaged over the
    components (Keras's reduce_per_replica "mean")."""
    metrics = model.get_metrics_result() if isinstance(logs, dict) else {}
    if isinstance(logs, dict):
        logs = {k: metrics[k] if k in metrics else v for k, v in logs.items()}
    flat = tf.nest.flatten(logs)
    synced = {id(t) for t in metrics.values()}
    floats = [i for i, t in enumerate(flat) if isinstance(t, tf.Tensor)
              and t.dtype.is_floating and id(t) not in synced]
    if floats:
        n = len(handler.components)
        sums = all_reduce_sum(handler, [flat[i] for i in floats])
        for i, s in zip(floats, sums):
            flat[i] = s / tf.cast(n, s.dtype)
    return tf.nest.pack_sequence_as(logs, flat)


class _TrainerTensorFlow(types.ModuleType):
    """TensorFlow as Keras's trainer module sees it: `GradientTape` is `oh.GradientTape`
    while an eager data-parallel step runs on this thread, TensorFlow's otherwise; every
    other name is TensorFlow's."""

    def __init__(self, tf_module):
        super().__init__(tf_module.__name__)
        self._tf = tf_module

    @property
    def GradientTape(self):  # pylint: disable=invalid-name
        if getattr(_thread, "eager", False) and replica_handler() is not None:
            return _registries.tape_class("reverse")
        return self._tf.GradientTape

    def __getattr__(self, name):
        return getattr(self._tf, name)


def _wrap_trainer_tf(original):
    return _TrainerTensorFlow(original) if original is tf else original


def _wrap_make_train_function(make_train_function):
    def make(self, force=False):
        handler = data_parallel_handler(self)
        if self.__dict__.get("_oh_train_parallel") is not handler:
            force = True  # built for another scope (or none)
            object.__setattr__(self, "_oh_train_parallel", handler)
        if handler is None:
            return make_train_function(self, force)
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = self._make_function(  # pylint: disable=protected-access
            _data_parallel_step(self, handler, self.train_step))
        return self.train_function
    return make


def _wrap_scale_loss(scale):
    def scale_loss_for_distribution(value):
        handler = replica_handler()
        if handler is None:
            return scale(value)
        return value * tf.cast(1.0 / len(handler.components), value.dtype)
    return scale_loss_for_distribution


def _wrap_unscale_loss(unscale):
    def unscale_loss_for_distribution(value):
        handler = replica_handler()
        if handler is None:
            return unscale(value)
        return value * tf.cast(len(handler.components), value.dtype)
    return unscale_loss_for_distribution


def _wrap_all_reduce(reduce_gradients):
    def all_reduce_gradients(self, grads_and_vars):
        handler = replica_handler()
        if handler is None:
            return reduce_gradients(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        for i, (g, v) in enumerate(grads_and_vars):
            if isinstance(g, tf.IndexedSlices):
                grads_and_vars[i] = (all_gather_slices(handler, g), v)
        present = [i for i, (g, _) in enumerate(grads_and_vars)
                   if g is not None and not isinstance(g, tf.IndexedSlices)]
        sums = all_reduce_sum(handler, [tf.convert_to_tensor(grads_and_vars[i][0])
                                        for i in present])
        for i, s in zip(present, sums):
            grads_and_vars[i] = (s, grads_and_vars[i][1])
        return grads_and_vars
    return all_reduce_gradients


_USE = "keras data-parallel fit"
_tf_patches.subscribe("trainer.tf", _USE, _wrap_trainer_tf)
_tf_patches.subscribe("TensorFlowTrainer.make_train_function", _USE, _wrap_make_train_function)
_tf_patches.subscribe("loss.scale_loss_for_distribution", _USE, _wrap_scale_loss)
_tf_patches.subscribe("loss.unscale_loss_for_distribution", _USE, _wrap_unscale_loss)
_tf_patches.subscribe("TFOptimizer._all_reduce_sum_gradients", _USE, _wrap_all_reduce)


def ensure_data_parallel_fit():
    """Installs the data-parallel `fit` (a ParallelHandler exists; Keras 3 imported)."""
    try:
        import keras.src.backend.tensorflow.trainer  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return
    _tf_patches.ensure("keras data-parallel fit")
