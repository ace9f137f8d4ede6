"""`oh.Recompute()` on `keras.applications.ResNet50(weights=None)` over batch sizes: peak
memory of one training step (loss and gradients of every weight), eager, at 64x64
inputs, batch 8, 16 and 32 (inference-mode batch norm, so every configuration computes
the same function).

At batch 8 on 64x64 inputs the weights (23.6 M parameters: 94 MB of weight gradients,
alive at the end of every step) are as large as the activations; gradient checkpointing
is for the regime where activations dominate, which the larger batches show. Per batch,
in one process: tf.GradientTape, oh.GradientTape (the baseline oh.Recompute composes
with) and oh.GradientTape + oh.Recompute() (default policy, the handler reused per step).
Gradients must equal tf.GradientTape's (rtol 1e-5, atol 1e-6) or the script fails.

oh.Recompute() is measured twice: as it is (it drops the values a Keras functional model
holds in its `tensor_dict` once their segment closed and rematerializes them when used,
recompute/evict.py) and with that eviction off (`rc.evict_min_bytes = None`).

Columns: *forward peak* and *kept* (bytes still allocated when the forward pass ends:
what the tape holds for the backward pass), *step peak*, the eager inference peak (no
tape; a Keras 3 functional model holds every layer's output until its call returns, a
floor under an eager forward pass that does not drop them) and TensorFlow's tape's saved
activations (its *kept*), which say whether activations dominate. Peaks are TensorFlow's
BFC CPU allocator's (`TF_CPU_ALLOCATOR_USE_BFC=true`, `reset_memory_stats`,
`get_memory_info`) minus the bytes in use before the step (after `gc.collect()`); they
do not depend on the machine's load, but vary by some MB from step to step (the order in
which the executor's threads run ops): each figure is the median of `--steps` (5) steps
after a warm-up step, with the step peaks' range. Each configuration (and each swept
setting) runs in a process of its own, as a training run does: after other
configurations' steps the allocator's chunks, whose slack it counts as in use, raised
a step's peak by up to 15 MB (oh.Recompute() in order at batch 16: 125.9 MB alone,
140.8 MB after four other configurations). Each process checks its gradients against
tf.GradientTape's, computed after its measured steps. The table's step times are
of the same steps on a shared machine: wall-clock and the process's CPU time
(`time.process_time`, all threads); two processes' times differ by up to 30% whatever
they run, so the step-time ratios the targets name come from one more process per
batch (`measure_timing`: rounds of one step per configuration, shuffled).
Also a lower bound on any checkpointing's step peak with the convolution gradients
oh.Recompute computes (`checkpointing_bound`; recompute/conv_grads.py, without the CPU
kernels' scratch buffers): the weight gradients that exist when the convolution whose
backward pass needs most runs, plus that backward's peak (run alone), its input
and output gradient and the residual add's gradient of its input; the ratio
oh.GradientTape's peak / bound is the best any segmentation can reach. At the batches
with a target, the sqrt policy's two settings (`join_fraction`, `join_cap`: where
segments end) are swept around the default (SWEEP). Writes the `recompute-resnet`
section of docs/benchmarks.md and docs/recompute-resnet.png.

    python benchmarks/recompute_resnet.py               # batches 8, 16, 32
    python benchmarks/recompute_resnet.py --batches 8   # one row
"""
import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow starts: peak bytes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _common  # noqa: E402  (also puts the repository on sys.path)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from _resnet import resnet50 as _resnet50  # noqa: E402  (as recompute.py's)

SIZE = 64
# The step peak oh.Recompute() should reach, as a ratio below eager oh.GradientTape's
# (per batch), at most TIME_TARGET times its step time.
TARGETS = {16: 2.5, 32: 3.0}
TIME_TARGET = 1.3
# The sqrt policy's two settings (join_fraction, join_cap), swept at the batches with a
# target: finer and coarser segments than the default's, which comes first.
SWEEP = ((0.5, 2.0), (0.25, 2.0), (1.0, 2.0), (2.0, 4.0), (0.5, 1.0), (0.5, 0.5))
KINDS = ("tf", "tape", "recompute", "recompute_noevict", "recompute_in_order", "called",
         "called_recompute")
NAMES = {"tf": "tf.GradientTape", "tape": "oh.GradientTape",
         "recompute": "oh.GradientTape + oh.Recompute()",
         "recompute_noevict": "oh.GradientTape + oh.Recompute(), eviction off",
         "recompute_in_order": "oh.GradientTape + oh.Recompute(), in_order",
         "called": "model in a called tf.function, oh.GradientTape",
         "called_recompute": "model in a called tf.function, + oh.Recompute()"}
BASELINE = {"tf": "tf", "tape": "tape", "recompute": "tape", "recompute_noevict": "tape",
            "recompute_in_order": "tape",
            "called": "called",
            "called_recompute": "called"}


def _handler(kind, setting=None):
    """The handler a configuration runs its model under (None: none), used for all its
    steps; `setting`: (join_fraction, join_cap) of the sqrt policy."""
    if kind not in ("recompute", "recompute_noevict", "recompute_in_order",
                    "called_recompute"):
        return None
    rc = oh.Recompute()
    if kind == "recompute_noevict":
        rc.evict_min_bytes = None
    elif kind == "recompute_in_order":
        rc.in_order = True
    if setting is not None:
        rc.join_fraction, rc.join_cap = setting
    return rc


def measure_configuration(batch, kind, steps=5, setting=None, size=SIZE):
    """{forward, kept, peak, ms, cpu, peak_range} of one configuration (a key of NAMES;
    with `setting`, "recompute" with those sqrt-policy settings) in this process, plus
    the Recompute handler's `stats`. Raises AssertionError when the gradients of a step
    differ from tf.GradientTape's, computed in this process after the measured steps
    (the configuration's steps are the only ones the allocator saw before them)."""
    model, x, y, loss_fn = _resnet50(batch, size)
    info = tf.config.experimental.get_memory_info
    handler = _handler(kind, setting)
    called = tf.function(lambda v: loss_fn(y, model(v, training=False)))

    def step(kind, handler):
        # Garbage first: garbage freed by the collector during a step (Keras layers form
        # reference cycles) would lower the bytes in use below the base and the peak
        # minus the base under the truth.
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = info("CPU:0")["current"]
        start, cpu = time.perf_counter(), time.process_time()
        tape = tf.GradientTape() if kind == "tf" else oh.GradientTape()
        with tape, handler or contextlib.nullcontext():
            loss = (called(x) if kind.startswith("called")
                    else loss_fn(y, model(x, training=False)))
        forward, kept = info("CPU:0")["peak"] - base, info("CPU:0")["current"] - base
        grads = tape.gradient(loss, model.trainable_variables)
        return dict(forward=forward, kept=kept, peak=info("CPU:0")["peak"] - base,
                    ms=(time.perf_counter() - start) * 1e3,
                    cpu=time.process_time() - cpu), grads

    def host(grads):  # (copies: a CPU tensor's .numpy() may share its buffer)
        return [np.array(tf.convert_to_tensor(g), copy=True) for g in grads]

    step(kind, handler)  # warm-up (a Recompute handler learns the computation's size)
    runs, first = [], None
    for _ in range(steps):
        result, grads = step(kind, handler)
        if first is None:
            first = host(grads)
        else:
            _assert_same(batch, kind, host(grads), first)
        del grads
        runs.append(result)
    _, want = step("tf", None)
    _assert_same(batch, kind + " against tf.GradientTape", first, host(want))
    # Peaks vary by some MB from step to step (the order in which the executor's
    # threads run a gradient function's ops): medians, and the peaks' range.
    m = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    m["peak_range"] = (min(r["peak"] for r in runs), max(r["peak"] for r in runs))
    if handler is not None:
        m["stats"] = dict(handler.stats)
    return m


def _assert_same(batch, kind, got, want):
    for g, r in zip(got, want):
        np.testing.assert_allclose(
            g, r, rtol=1e-5, atol=1e-6,
            err_msg="ResNet50 batch %d, %s: gradients differ" % (batch, kind))


def measure_extras(batch, size=SIZE):
    """The eager inference peak, the weight gradients' bytes and `checkpointing_bound`
    for one batch size, in this process."""
    model, x, _, _ = _resnet50(batch, size)
    info = tf.config.experimental.get_memory_info
    model(x, training=False)
    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = info("CPU:0")["current"]
    model(x, training=False)
    return dict(inference=info("CPU:0")["peak"] - base,
                gradient_bytes=sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                                   for v in model.trainable_variables),
                bound=checkpointing_bound(model, batch))


# The configurations whose step time is compared with oh.GradientTape's in one process.
TIMED = ("recompute", "recompute_in_order")


def measure_timing(batch, rounds=8, size=SIZE):
    """{kind: {wall, wall_iqr, cpu}} for the kinds of TIMED: the step time as a multiple
    of oh.GradientTape's, measured in one process (no peaks: those need a process per
    configuration) where each round runs one step of every configuration in a shuffled
    order; the medians (and IQR) of the rounds' ratios. Two processes' times differ by
    up to 30% on this machine whatever they run, so a ratio of medians taken in two
    processes says little."""
    import random  # pylint: disable=import-outside-toplevel
    model, x, y, loss_fn = _resnet50(batch, size)
    handlers = {kind: _handler(kind) for kind in ("tape",) + TIMED}
    rng = random.Random(batch)

    def step(handler):
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        with oh.GradientTape() as tape:
            with handler or contextlib.nullcontext():
                loss = loss_fn(y, model(x, training=False))
        grads = tape.gradient(loss, model.trainable_variables)
        del grads
        return time.perf_counter() - start, time.process_time() - cpu

    for _ in range(2):  # warm-up: traces, and the handlers learn the computation's size
        for handler in handlers.values():
            step(handler)
    ratios = {kind: [] for kind in TIMED}
    for _ in range(rounds):
        order = list(handlers)
        rng.shuffle(order)
        times = {kind: step(handlers[kind]) for kind in order}
        for kind in TIMED:
            ratios[kind].append((times[kind][0] / times["tape"][0],
                                 times[kind][1] / times["tape"][1]))
    out = {}
    for kind, rs in ratios.items():
        wall = [w for w, _ in rs]
        out[kind] = dict(wall=float(np.median(wall)),
                         wall_iqr=(float(np.percentile(wall, 25)),
                                   float(np.percentile(wall, 75))),
                         cpu=float(np.median([c for _, c in rs])))
    return out


def measure_batch(batch, steps=5, sweep=()):
    """{kind: {forward, kept, peak, ms, ...}, gradient_bytes, inference, stats,
    called_segments, bound, sweep} for one batch size. Each configuration is measured
    by `measure_named(batch, steps, name)` in a process of its own, as a training run
    has one: the BFC allocator's chunks after other configurations' steps changed a
    step's peak by up to 15 MB (the slack it counts as in use). `name`: a kind, "extras",
    "timing" (`measure_timing`) or "sweep:<join_fraction>,<join_cap>"."""
    out = {kind: _measure_in_child(batch, steps, kind) for kind in KINDS}
    out.update(_measure_in_child(batch, steps, "extras"))
    out["timing"] = _measure_in_child(batch, steps, "timing")
    out["stats"] = out["recompute"]["stats"]
    out["called_segments"] = out["called_recompute"]["stats"]["call_segments"]
    out["sweep"] = []
    for fraction, cap in sweep:
        m = _measure_in_child(batch, steps, "sweep:%r,%r" % (fraction, cap))
        m.update(join_fraction=fraction, join_cap=cap, segments=m["stats"]["segments"])
        out["sweep"].append(m)
    return out


def measure_named(batch, steps, name):
    """One `measure_batch` measurement in this process (see there for `name`)."""
    if name == "extras":
        return measure_extras(batch)
    if name == "timing":
        return measure_timing(batch)
    if name.startswith("sweep:"):
        fraction, cap = (float(v) for v in name[len("sweep:"):].split(","))
        return measure_configuration(batch, "recompute", steps, (fraction, cap))
    return measure_configuration(batch, name, steps)


def _lean_conv_gradients(strides, padding, of_input):
    """A function of (input, kernel, output gradient) computing a Conv2D's kernel (and
    input) gradient the way oh.Recompute's segment gradient functions do."""
    from tf_ophandlers.handlers.recompute import conv_grads  # pylint: disable=import-outside-toplevel

    @tf.function(autograph=False)
    def lean(h, k, g):
        overrides = conv_grads.overrides(ordered=False)  # (the default's)
        with tf.compat.v1.get_default_graph().gradient_override_map(overrides):
            o = tf.nn.conv2d(h, k, strides, padding)
        return tf.gradients(o, [h, k] if of_input else [k], grad_ys=g)
    return lean


def checkpointing_bound(model, batch):
    """A lower bound on the step peak of any checkpointing (bytes), with its parts: the
    convolution whose backward pass (filter and input gradients computed as oh.Recompute's
    gradient functions compute them, recompute/conv_grads.py, run alone, BFC peak) plus
    its input and output gradient is largest, and the weight
    gradients that exist when it runs (those of every weight after it: the backward pass
    runs last to first), plus, where the convolution's input has a consumer later in the
    forward pass (a residual add), that consumer's gradient of the input: it exists
    before this backward runs and is summed with its input gradient after it. Returns
    dict(bound, layer, kernel, values, residual, gradients)."""
    import keras  # pylint: disable=import-outside-toplevel
    info = tf.config.experimental.get_memory_info
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    consumers = {}  # id(Keras tensor) -> indices (forward order) of the layers taking it
    for i, layer in enumerate(model.layers):
        ins = layer.input if isinstance(layer.input, (list, tuple)) else [layer.input]
        for t in ins:
            consumers.setdefault(id(t), []).append(i)
    position = {id(layer): i for i, layer in enumerate(model.layers)}
    order = {id(v.value if hasattr(v, "value") else v): i
             for i, v in enumerate(model.trainable_variables)}
    best, seen = None, {}
    for layer in convs:
        shape = (batch,) + tuple(layer.input.shape[1:])
        key = (shape, tuple(layer.kernel.shape), layer.strides, layer.padding)
        if key not in seen:
            h, k = tf.random.normal(shape), tf.identity(layer.kernel)
            padding = layer.padding.upper()
            g = tf.ones(tf.nn.conv2d(h, k, layer.strides, padding).shape)
            # The gradients as oh.Recompute's gradient functions compute them
            # (recompute/conv_grads.py), in one graph; none of the image.
            lean = _lean_conv_gradients(layer.strides, padding, shape[-1] != 3)
            lean(h, k, g)
            gc.collect()
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = info("CPU:0")["current"]
            grads = lean(h, k, g)
            del grads
            seen[key] = (info("CPU:0")["peak"] - base,
                         (h.shape.num_elements() + g.shape.num_elements()) * 4)
        kernel, values = seen[key]
        first = min(order.get(id(w.value if hasattr(w, "value") else w), 0)
                    for w in layer.trainable_weights)
        later = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                    for v in model.trainable_variables[first:])
        residual = 0
        if any(i > position[id(layer)] for i in consumers.get(id(layer.input), ())):
            residual = int(np.prod((batch,) + tuple(layer.input.shape[1:]))) * 4
        total = later + kernel + values + residual
        if best is None or total > best["bound"]:
            best = dict(bound=total, layer=layer.name, kernel=kernel, values=values,
                        residual=residual, gradients=later)
    return best


def _time_md(t):
    """A step-time ratio of `measure_timing` as the page states it."""
    return "%.2fx (IQR %.2f–%.2f, CPU %.2fx)" % (t["wall"], t["wall_iqr"][0],
                                                 t["wall_iqr"][1], t["cpu"])


def render_md(results, info, elapsed, steps=5, image=""):
    mb = 1e6
    rows = []
    dominate = []
    for batch, r in results.items():
        grads = r["gradient_bytes"]
        acts = r["tf"]["kept"]
        if acts > 2 * grads:
            dominate.append(batch)
        for kind in KINDS:
            m = r[kind]
            rows.append(("%d" % batch, NAMES[kind], "%.1f" % (m["forward"] / mb),
                         "%.1f" % (m["kept"] / mb), "**%.1f**" % (m["peak"] / mb)
                         if kind.endswith("recompute") else "%.1f" % (m["peak"] / mb),
                         "%.2fx" % (r[BASELINE[kind]]["peak"] / max(m["peak"], 1)),
                         "%.2fx" % (r["tape"]["peak"] / max(m["peak"], 1)),
                         "%.2fx" % (r["tf"]["peak"] / max(m["peak"], 1)),
                         "%.0f–%.0f" % (m["peak_range"][0] / mb, m["peak_range"][1] / mb),
                         "%.0f" % m["ms"], "%.1f" % m["cpu"]))
    summary = [(
        "%d" % b, "%.1f" % (r["tf"]["kept"] / mb), "%.1f" % (r["gradient_bytes"] / mb),
        "%.1f" % (r["inference"] / mb), "%.0f" % (r["stats"]["computed"] / mb),
        "%.1f" % (r["stats"]["kept"] / mb), "%d" % r["stats"]["segments"],
        "%.1f" % (r["stats"]["evicted"] / mb), "%d" % r["stats"]["rematerialized"],
        "%.2fx" % (r["tape"]["peak"] / max(r["recompute"]["peak"], 1)))
        for b, r in results.items()]
    first = min(results)  # (the smallest batch: weights weigh most there)
    L = ["## recompute-resnet: oh.Recompute() on ResNet50 over batch sizes", "",
         "`python benchmarks/recompute_resnet.py` — `keras.applications.ResNet50("
         "weights=None)`, %dx%d inputs, inference-mode batch norm, eager; one step = loss "
         "and gradients of every weight. Peaks: BFC CPU allocator peak minus the bytes in "
         "use before the step (a `gc.collect()` first), the median of %d steps after a "
         "warm-up step, and their range; each configuration in a process of its own, "
         "as a training run has one (the allocator's chunks left by other "
         "configurations' steps raise a step's peak by up to 15 MB; a step's peak also "
         "varies by some MB with the order in which the executor's threads run ops). "
         "Gradients of every step equal tf.GradientTape's in the same process (rtol "
         "1e-5, atol 1e-6; checked). The table's step times are medians of the same "
         "steps (wall-clock indicative only: two processes' times differ by up to 30%% "
         "on this machine whatever they run; CPU time is the process's, all threads); "
         "the step-time ratios the targets name are measured in one more process per "
         "batch, where each of 8 rounds runs one step of oh.GradientTape, "
         "oh.Recompute() and oh.Recompute() in order in a shuffled order (after two "
         "warm-up rounds): the median of the rounds' ratios, their IQR and the same "
         "for CPU time." % (SIZE, SIZE, steps), "",
         _common.machine_md(info, len(KINDS) * len(results), elapsed), "",
         image, "",
         _common.md_table(("batch", "configuration", "forward peak MB", "kept MB",
                           "step peak MB", "vs same call without Recompute",
                           "vs eager oh.GradientTape", "vs tf.GradientTape",
                           "step peak range MB", "one step ms", "one step CPU s"),
                          rows), "",
         "Per batch: activations TensorFlow's tape saves (its kept bytes), weight "
         "gradients (alive at the end of every step), eager inference peak (no tape), "
         "and what oh.Recompute() computed in segments, kept, how many segments, the bytes "
         "it dropped while Keras held them and the ops it ran again to rematerialize "
         "values:", "",
         _common.md_table(("batch", "tf tape activations MB", "weight gradients MB",
                           "eager inference peak MB", "segments computed MB",
                           "Recompute kept MB", "segments", "dropped MB",
                           "rematerialized ops", "peak ratio vs oh tape"),
                          summary), "",
         "- Activations dominate (TensorFlow's tape saves more than twice the weight "
         "gradients' bytes) at batch %s; at batch %d they are %.1f MB against %.1f MB of "
         "weight gradients (alive at the end of every step)." % (
             ", ".join(str(b) for b in dominate) if dominate else "(none measured)",
             first, results[first]["tf"]["kept"] / mb,
             results[first]["gradient_bytes"] / mb),
         "- Targets: peak >= %s lower than eager oh.GradientTape's at <= %.1fx its step "
         "time, eager model call, default policy (`oh.Recompute()`, sqrt; nothing tuned "
         "per batch). Measured: %s; against tf.GradientTape: %s." % (
             " and ".join("%.1fx at batch %d" % (t, b) for b, t in sorted(TARGETS.items())),
             TIME_TARGET, "; ".join(
                 "batch %d %.2fx (%s), step time %s" % (
                     b, r["tape"]["peak"] / r["recompute"]["peak"],
                     "target %.1fx %s" % (TARGETS[b], "met" if r["tape"]["peak"]
                                          >= TARGETS[b] * r["recompute"]["peak"]
                                          else "**not met**")
                     if b in TARGETS else "no target", _time_md(r["timing"]["recompute"]))
                 for b, r in results.items()),
             ", ".join("batch %d %.2fx" % (b, r["tf"]["peak"] / r["recompute"]["peak"])
                       for b, r in results.items())),
         "- A lower bound on any checkpointing's step peak with the convolution "
         "gradients oh.Recompute's gradient functions compute by default (matrix "
         "products without the CPU kernels' scratch buffers, and oneDNN's filter kernel "
         "for kernels of several taps where its custom ops are on, "
         "`recompute/conv_grads.py`): the convolution "
         "whose backward pass needs most (its gradients' own peak, run alone, plus its input and output gradient, plus the gradient of its "
         "input from a later consumer, the residual add, which exists before this "
         "backward and is summed with its result after it) runs while the gradients "
         "of every weight after it exist: %s." % "; ".join(
             "batch %d: %s, %.1f MB weight gradients + %.1f MB gradients' peak + %.1f MB "
             "values + %.1f MB residual gradient = %.1f MB, so at best %.2fx below "
             "oh.GradientTape's %.1f MB%s" % (
                 b, r["bound"]["layer"], r["bound"]["gradients"] / mb,
                 r["bound"]["kernel"] / mb, r["bound"]["values"] / mb,
                 r["bound"].get("residual", 0) / mb,
                 r["bound"]["bound"] / mb, r["tape"]["peak"] / r["bound"]["bound"],
                 r["tape"]["peak"] / mb,
                 " (the %.1fx target is out of reach)" % TARGETS[b]
                 if b in TARGETS and r["tape"]["peak"] < TARGETS[b] * r["bound"]["bound"]
                 else "") for b, r in results.items()),
         ] + _sweep_md(results) + [
         "- Eviction (dropping the values Keras's functional `_run_through_graph` holds "
         "in its `tensor_dict` until the call returns, rematerialized when read): "
         "forward peak without it / with it %s (eager inference peak %s); step peak "
         "%s. Without eviction an eager forward pass cannot go below the inference "
         "peak; with it the step's peak is the backward pass's: the weight gradients "
         "accumulate (the last stages hold most weights) while the checkpoints of the "
         "first stages (most activation bytes) are still kept, plus one segment's "
         "recomputation." % (
             ", ".join("%.1f / %.1f MB" % (r["recompute_noevict"]["forward"] / mb,
                                           r["recompute"]["forward"] / mb)
                       for r in results.values()),
             ", ".join("%.1f MB" % (r["inference"] / mb) for r in results.values()),
             ", ".join("%.1f / %.1f MB" % (r["recompute_noevict"]["peak"] / mb,
                                           r["recompute"]["peak"] / mb)
                       for r in results.values())),
         "- `rc.in_order = True` (each gradient function runs its ops one at a time, in "
         "the order they were made: a value lives from its op to its last use, as in the "
         "op-by-op tape, at the cost of the parallelism between independent ops): step "
         "peak %s, step time %s against oh.GradientTape's." % (
             ", ".join("batch %d %.1f MB (%.2fx below oh.GradientTape)" % (
                 b, r["recompute_in_order"]["peak"] / mb,
                 r["tape"]["peak"] / max(r["recompute_in_order"]["peak"], 1))
                 for b, r in results.items()),
             ", ".join(_time_md(r["timing"]["recompute_in_order"])
                       for r in results.values())),
         "- Model in a `tf.function` called inside the scope (no Keras dictionary: the "
         "call runs as a segmented rewrite, %s segments), against the same call without "
         "Recompute: %s; against the eager oh.GradientTape step: %s." % (
             "/".join(str(r["called_segments"]) for r in results.values()),
             ", ".join("batch %d %.2fx" % (b, r["called"]["peak"]
                                          / r["called_recompute"]["peak"])
                       for b, r in results.items()),
             ", ".join("batch %d %.2fx" % (b, r["tape"]["peak"]
                                          / r["called_recompute"]["peak"])
                       for b, r in results.items())),
         "- In the called function the forward pass keeps little (the kept column), but "
         "TensorFlow runs the rewrite's whole backward pass as one function call, whose "
         "working memory (recomputed segments, activation gradients) is the rest of its "
         "peak over the kept bytes and the weight gradients.",
         "- The backward pass ends holding every weight gradient. A segment's gradient "
         "function computes its convolutions' gradients as matrix products (one per "
         "filter tap, chained) instead of TensorFlow's CPU kernels, whose Eigen versions "
         "allocate a scratch buffer of up to 34 MB each; oneDNN's, used where its custom "
         "ops are on, do not, and there the gradient functions the executor orders take "
         "their filter gradients for kernels of several taps (`recompute/conv_grads.py`, "
         "`overrides`); oh.GradientTape "
         "frees each record once its gradient ran, as TensorFlow's tape does, and keeps "
         "none of a segment's outputs (its gradient function reads none)."]
    return "\n".join(L)


def _sweep_md(results):
    """The sweep of the sqrt policy's settings (SWEEP) as a paragraph and a table."""
    mb = 1e6
    swept = {b: r["sweep"] for b, r in results.items() if r.get("sweep")}
    if not swept:
        return []
    default = oh.Recompute()
    default = (default.join_fraction, default.join_cap)

    def setting(m):
        return m["join_fraction"], m["join_cap"]

    rows, best = [], []
    for b, runs in swept.items():
        tape = results[b]["tape"]
        for m in runs:
            rows.append(("%d" % b, "%g" % m["join_fraction"], "%g" % m["join_cap"],
                         "yes" if setting(m) == default else "", "%d" % m["segments"],
                         "%.1f" % (m["peak"] / mb),
                         "%.0f–%.0f" % (m["peak_range"][0] / mb, m["peak_range"][1] / mb),
                         "%.2fx" % (tape["peak"] / m["peak"]),
                         "%.2fx" % (m["ms"] / tape["ms"]),
                         "%.2fx" % (m["cpu"] / tape["cpu"])))
        low = min(runs, key=lambda m: m["peak"])
        best.append("batch %d: join_fraction=%g, join_cap=%g, %.2fx below "
                     "oh.GradientTape%s" % (
                         b, low["join_fraction"], low["join_cap"],
                         tape["peak"] / low["peak"],
                         " (the default)" if setting(low) == default else ""))
    return [
        "", "The sqrt policy's two settings, swept (a handler per setting, measured as "
        "the `oh.Recompute()` row; segments end at the first join, a residual add, after "
        "`join_fraction` x sqrt(total x mean value bytes) were computed, or at "
        "`join_cap` times that without one): smaller segments keep more checkpoints "
        "alive while the weight gradients accumulate, larger ones recompute more at "
        "once. Lowest median step peak: %s." % "; ".join(best), "",
        _common.md_table(("batch", "join_fraction", "join_cap", "default", "segments",
                          "step peak MB", "step peak range MB", "vs eager oh.GradientTape",
                          "step time vs oh.GradientTape (two processes)",
                          "CPU time vs oh.GradientTape (two processes)"), rows), ""]


def draw(plt, results):
    """Left: each batch's step peak for oh.GradientTape, oh.Recompute() and
    tf.GradientTape, with the checkpointing bound; right: the peak ratio against its
    target and the step-time ratio against TIME_TARGET."""
    mb = 1e6
    batches = sorted(results)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    width = 0.26
    for j, (kind, color) in enumerate((("tf", "#999999"), ("tape", "#555555"),
                                       ("recompute", "#3b7dd8"))):
        xs = [i + (j - 1) * width for i in range(len(batches))]
        tops = [results[b][kind]["peak"] / mb for b in batches]
        ax.bar(xs, tops, width * 0.9, color=color, label=NAMES[kind])
        _common.label_bars(ax, xs, tops, ["%.0f" % t for t in tops], fontsize=7)
    ax.plot(range(len(batches)), [results[b]["bound"]["bound"] / mb for b in batches],
            "k_", markersize=40, mew=2, label="checkpointing bound")
    ax.set_xticks(range(len(batches)))
    ax.set_xticklabels(["batch %d" % b for b in batches], fontsize=8)
    ax.set_ylabel("step peak, MB (median of steps)")
    ax.set_title("ResNet50 (64x64), one eager training step: peak memory", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    peak = [results[b]["tape"]["peak"] / max(results[b]["recompute"]["peak"], 1)
            for b in batches]
    peak_q = [(results[b]["tape"]["peak"] / max(results[b]["recompute"]["peak_range"][1], 1),
               results[b]["tape"]["peak"] / max(results[b]["recompute"]["peak_range"][0], 1))
              for b in batches]
    time_ratio = [results[b]["timing"]["recompute"]["wall"] for b in batches]
    time_q = [tuple(results[b]["timing"]["recompute"]["wall_iqr"]) for b in batches]
    bound = [results[b]["tape"]["peak"] / results[b]["bound"]["bound"] for b in batches]
    targets = [(i, i, TARGETS[b], "peak target" if i == min(
        k for k, c in enumerate(batches) if c in TARGETS) else None)
        for i, b in enumerate(batches) if b in TARGETS]
    targets.append((0, len(batches) - 1, TIME_TARGET, "step-time limit %.1fx" % TIME_TARGET))
    _common.ratio_panel(
        ax2, ["batch %d" % b for b in batches],
        [("peak: oh.GradientTape / oh.Recompute() (range over steps)", "#3b7dd8", peak,
          peak_q),
         ("peak bound: oh.GradientTape / checkpointing bound", "#bbbbbb", bound,
          [(v, v) for v in bound]),
         ("step time: oh.Recompute() / oh.GradientTape (IQR over rounds)", "#d8743b",
          time_ratio, time_q)],
        "ratio (log)", "peak reduction and step-time cost vs targets",
        targets=targets)
    return fig


def _measure_in_child(batch, steps, name):
    """measure_named(batch, steps, name) in a new process (this script with
    --measure-only)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "measured.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--batches",
                        str(batch), "--steps", str(steps), "--measure-only", path,
                        "--configuration", name], check=True)
        with open(path) as f:
            return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per "
                        "configuration (after one warm-up step)")
    parser.add_argument("--out", default=_common.DEFAULT_MD)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--measure-only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--configuration", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(s) for s in args.batches.split(",")]
    if args.measure_only:  # (a child of _measure_in_child: one measurement, no page)
        b, = batches
        with open(args.measure_only, "w") as f:
            json.dump(measure_named(b, args.steps, args.configuration), f)
        return None
    start = time.perf_counter()
    info = _common.machine_info()
    results = {}

    def measure():
        for b in batches:
            results[b] = measure_batch(b, args.steps, SWEEP if b in TARGETS else ())
            r = results[b]
            print("batch %d: %s" % (b, ", ".join(
                "%s peak %.1f MB" % (k, r[k]["peak"] / 1e6) for k in KINDS)), flush=True)
    _common.measure_under_load(info, measure)
    if args.json:  # the raw numbers, to render again without measuring
        with open(args.json, "w") as f:
            json.dump({"results": {str(b): r for b, r in results.items()}, "info": info}, f)
    elapsed = time.perf_counter() - start

    def render(png_name, plotted):
        body = render_md(results, info, elapsed, args.steps,
                         _common.image_md("ResNet50 step peaks and ratios", png_name, plotted))
        print(body)
        return body, None
    _, png = _common.publish(args.out, "recompute-resnet", lambda plt: draw(plt, results),
                             render)
    _common.print_wrote(args.out, png, elapsed)
    return results


if __name__ == "__main__":
    main()
