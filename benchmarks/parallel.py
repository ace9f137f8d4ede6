"""`oh.ParallelHandler` (every op on several devices, as an op handler) against
TensorFlow's experimental ParallelDevice and `tf.distribute.MirroredStrategy`.

Times, in one process, on two logical CPUs (configured before TensorFlow initializes):

  per-op    the per-op eager cost of running one op on both devices: N back-to-back
            `tf.add(a, b)` on 2x2 float32 tensors that are already parallel (packed on
            both devices), inside `with parallel:` (oh) and inside `with pd:`
            (TensorFlow's `parallel_device.ParallelDevice`), scope entered once per
            round; plain single-device eager `tf.add` as a reference
  mlp-step  a data-parallel training step of a small Keras MLP (32 -> 64 relu -> 10,
            MSE, SGD, batch 64 split in two halves): `oh.ParallelHandler` +
            `oh.GradientTape` (gradients of the broadcast weights summed over the
            components), eager `MirroredStrategy.run`, and (information)
            `tf.function`-wrapped `MirroredStrategy.run` and a single-device eager
            `tf.GradientTape` step on the whole batch
  fit-step  one step of `model.fit` (Keras's compiled train function on the next batch
            of a repeated dataset, batch 64) of the same MLP compiled with MSE and SGD:
            built and run in an `oh.ParallelHandler` scope (the batch split over the
            components, as MirroredStrategy splits it) against the same under
            `MirroredStrategy.scope()` with its distributed dataset; one device for
            reference

Before timing, the script checks (untimed) that every method computes what it should:
per component sums for the adds, data-parallel gradients equal to single-device
`tf.GradientTape` gradients on the full batch (allclose, 1e-5) and, after one training
step, weights equal to the reference SGD step; it exits non-zero otherwise.
Configurations are interleaved (shuffled order every round) and repeated; the reported
time is the median over rounds of the mean time per op / call of N back-to-back ops /
calls. Writes the `parallel` section of docs/benchmarks.md and docs/parallel.png.

    python benchmarks/parallel.py            # full run (~1 min on 2 cores)
    python benchmarks/parallel.py --quick    # smoke run (< 40 s, noisy numbers)
    python benchmarks/parallel.py --case fit-step   # one case only: prints its table
                                                    # and target, writes no page
"""
import contextlib
import logging
import os
import sys
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tensorflow.python.distribute.parallel_device import parallel_device  # noqa: E402

# Two logical CPUs, configured after the imports as users do (importing tf_ophandlers
# does not initialize TensorFlow's devices; the first op or handler scope does).
_LOGICAL_CPU_ERROR = None
try:
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError as _e:  # TensorFlow already initialized (e.g. by an importer)
    _LOGICAL_CPU_ERROR = str(_e)

COMPONENTS = ("/job:localhost/replica:0/task:0/device:CPU:0",
              "/job:localhost/replica:0/task:0/device:CPU:1")
MIRRORED_DEVICES = ("/cpu:0", "/cpu:1")
D, H, C, B = 32, 64, 10, 64  # inputs, hidden units, outputs, global batch (2 x 32)
HALF = B // 2
LR = 0.01

METHODS = {
    "per-op": (
        # key, name
        ("oh", "oh.ParallelHandler"),
        ("pd", "TF ParallelDevice"),
        ("plain", "plain eager, one device (reference)"),
    ),
    "mlp-step": (
        ("oh", "oh.ParallelHandler + oh.GradientTape"),
        ("ms", "MirroredStrategy.run, eager"),
        ("tff", "tf.function(MirroredStrategy.run) (information)"),
        ("single", "single device, eager tf.GradientTape, full batch (reference)"),
    ),
    "fit-step": (
        ("oh", "model.fit step in oh.ParallelHandler (batch split)"),
        ("ms", "model.fit step under MirroredStrategy"),
        ("single", "model.fit step, one device, full batch (reference)"),
    ),
}
BASELINE = {"per-op": "pd", "mlp-step": "ms", "fit-step": "ms"}  # oh's TF counterpart
BASE_NAME = {"per-op": "ParallelDevice", "mlp-step": "eager MirroredStrategy",
             "fit-step": "MirroredStrategy's fit step"}
CASES = (
    # key, title, per-op?, description
    ("per-op", "Per-op cost: tf.add of two parallel 2x2 float32 tensors", True,
     "`a`, `b` have one 2x2 float32 component per logical CPU (different values per "
     "component), packed once during setup: `parallel.pack([a0, a1])` (oh) and "
     "`pd.pack([a0, a1])` (TensorFlow's `ParallelDevice(components)`), likewise `b`. "
     "Once per round: `with parallel:` / `with pd:`, then, inside that already-entered "
     "scope, %d untimed and N timed back-to-back `tf.add(a, b)` (each result dropped at "
     "once): every add runs the kernel once per component device. *plain eager* is "
     "`tf.add(a0, b0)` on one device without any scope, for reference (one kernel "
     "instead of two). Times are per `tf.add`."),
    ("mlp-step", "Data-parallel training step of a Keras MLP 32-64-10, batch 64 on 2 "
     "devices", False,
     "`keras.Sequential([keras.Input((32,)), Dense(64, relu), Dense(10)])`, "
     "`keras.optimizers.SGD(0.01)`, fixed inputs x [64, 32] and targets y [64, 10], "
     "`loss = reduce_sum((model(x) - y) ** 2) / 64` (the sum over the global batch, so "
     "summing the two halves' gradients gives the full-batch gradient); every method "
     "trains its own model and optimizer, built identically "
     "(`keras.utils.set_random_seed(0)` before each). *oh*: an ordinary model; one call "
     "is `with parallel: with oh.GradientTape() as tape: xb = parallel.pack([x0, x1]); "
     "yb = parallel.pack([y0, y1]); loss = ...(model(xb) - yb)...`, `grads = "
     "tape.gradient(loss, model.trainable_variables)` (the weights are broadcast onto "
     "both devices, so their gradients come back as ordinary tensors summed over the "
     "components), then `opt.apply_gradients` outside the scope; the halves x0, x1, y0, "
     "y1 are ordinary tensors, packed in every step. *MirroredStrategy*: "
     "`tf.distribute.MirroredStrategy([\"/cpu:0\", \"/cpu:1\"])`, model and optimizer "
     "created under `strategy.scope()` (mirrored variables), the batch distributed once "
     "during setup (`experimental_distribute_values_from_function`, each half placed on "
     "its replica's device), one call is `strategy.run(step_fn, args=(dist_batch,))` "
     "with `step_fn` = `tf.GradientTape` forward + gradient + `opt.apply_gradients` "
     "(which all-reduces the gradients across replicas), run eagerly; "
     "*tf.function(MirroredStrategy.run)* is the same call wrapped in a `tf.function`, "
     "traced once before timing (information, no target). *single device* is the same "
     "step with `tf.GradientTape` on the whole batch on one device, for reference."),
    ("fit-step", "One step of model.fit: the same MLP, batch 64 on 2 devices", False,
     "The MLP above compiled with `loss=\"mse\"` and `keras.optimizers.SGD(0.01)`, the "
     "same x, y as a `tf.data` dataset batched by 64 and repeated. One call is one "
     "step of `model.fit`: Keras's compiled train function (`model.train_function(iterator)`, "
     "what fit calls per step, traced once before timing) on the next batch. *oh*: model, "
     "dataset and iterator made in `with parallel:` and every call in it; the step "
     "splits the batch over the two components (32 + 32), scales the loss by 1/2 and "
     "all-reduces the gradients and the metric state with TensorFlow's collectives (the "
     "components' step functions run as one multi-device call, as MirroredStrategy "
     "runs its replicas). *MirroredStrategy*: model "
     "compiled under `strategy.scope()`, iterator over "
     "`strategy.experimental_distribute_dataset(dataset)` (as fit makes it). *one "
     "device*: the same step without either, on the whole batch, for reference."),
)
FIT_TARGET_RATIO = 1.0  # fit-step: oh at most MirroredStrategy's time
TARGET_RATIO = 1.2   # per-op: oh.ParallelHandler at most 1.2x TensorFlow's ParallelDevice
WARMUP_OPS = 20      # per-op: per (round, configuration), inside the scope, untimed
WARMUP_CALLS = 3     # mlp-step: per (round, configuration), untimed
TOLERANCE = 1e-5


class SanityError(Exception):
    pass


class _DropMirroredEagerWarning(logging.Filter):
    """Eager `MirroredStrategy.run` logs that running eagerly is slow (it is what is
    measured here); only that message is dropped from the output."""

    def filter(self, record):
        return "Using MirroredStrategy eagerly" not in record.getMessage()


# -- the workload -----------------------------------------------------------------------

def make_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(H, activation="relu"),
        keras.layers.Dense(C),
    ])
    return model, keras.optimizers.SGD(LR)


def mlp_loss(pred, y):
    return tf.reduce_sum((pred - y) ** 2) / B


class Workload:
    """Devices, data and the handler / ParallelDevice / strategy shared by the configs."""

    def __init__(self):
        self.parallel = oh.ParallelHandler(COMPONENTS)
        self.pd = parallel_device.ParallelDevice(list(COMPONENTS))
        # per-op: 2x2 components, different per device
        self.a = [tf.random.stateless_uniform([2, 2], seed=[1, i]) for i in range(2)]
        self.b = [tf.random.stateless_uniform([2, 2], seed=[2, i]) for i in range(2)]
        with self.parallel:
            self.a_oh = self.parallel.pack(self.a)
            self.b_oh = self.parallel.pack(self.b)
        with self.pd:
            self.a_pd = self.pd.pack(self.a)
            self.b_pd = self.pd.pack(self.b)
        # mlp-step: one global batch and its halves
        self.x = tf.random.stateless_normal([B, D], seed=[3, 1])
        self.y = tf.random.stateless_normal([B, C], seed=[3, 2])
        self.xs = [self.x[:HALF], self.x[HALF:]]
        self.ys = [self.y[:HALF], self.y[HALF:]]
        self.strategy = tf.distribute.MirroredStrategy(list(MIRRORED_DEVICES))
        self.dist_batch = self.strategy.experimental_distribute_values_from_function(
            self._replica_batch)

    def _replica_batch(self, ctx):
        i = ctx.replica_id_in_sync_group
        with tf.device(self.strategy.extended.worker_devices[i]):
            return tf.identity(self.xs[i]), tf.identity(self.ys[i])


class AddPerOp:
    """per-op for one method: oh, pd or plain."""

    case = "per-op"

    def __init__(self, w, key):
        self.w, self.key = w, key
        self.times = []
        if key == "oh":
            self.args, self.scope = (w.a_oh, w.b_oh), (lambda: w.parallel)
        elif key == "pd":
            self.args, self.scope = (w.a_pd, w.b_pd), (lambda: w.pd)
        else:
            self.args, self.scope = (w.a[0], w.b[0]), contextlib.nullcontext

    def run(self, n):
        """Enters the scope once, then WARMUP_OPS untimed and `n` timed adds in it."""
        (a, b), add = self.args, tf.add
        with self.scope():
            def one():
                return add(a, b)  # the caller drops it: only the last result is alive

            return _common.warm_time(one, WARMUP_OPS, n)


class MlpStep:
    """mlp-step for one method: its own model and optimizer."""

    case = "mlp-step"

    def __init__(self, w, key):
        self.w, self.key = w, key
        self.times = []
        if key in ("ms", "tff"):
            with w.strategy.scope():
                self.model, self.opt = make_mlp()
        else:
            self.model, self.opt = make_mlp()
        if key == "tff":
            self._tff = tf.function(self._ms_run)
        self.call = {"oh": self.step_oh, "ms": self.step_ms, "tff": self.step_tff,
                     "single": self.step_single}[key]

    def step_oh(self):
        w, model, opt, parallel = self.w, self.model, self.opt, self.w.parallel
        with parallel:
            with oh.GradientTape() as tape:
                xb = parallel.pack(w.xs)
                yb = parallel.pack(w.ys)
                loss = mlp_loss(model(xb), yb)
            grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def _replica_step(self, batch):
        model, opt = self.model, self.opt
        xb, yb = batch
        with tf.GradientTape() as tape:
            loss = mlp_loss(model(xb), yb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def _ms_run(self, dist_batch):
        self.w.strategy.run(self._replica_step, args=(dist_batch,))

    def step_ms(self):
        self._ms_run(self.w.dist_batch)

    def step_tff(self):
        self._tff(self.w.dist_batch)

    def step_single(self):
        model, opt = self.model, self.opt
        with tf.GradientTape() as tape:
            loss = mlp_loss(model(self.w.x), self.w.y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def run(self, n):
        return _common.warm_time(self.call, WARMUP_CALLS, n)

    # sanity
    def gradients(self):
        """Data-parallel gradients of the current weights (no update), as numpy."""
        w, model = self.w, self.model
        if self.key == "oh":
            parallel = w.parallel
            with parallel:
                with oh.GradientTape() as tape:
                    if not any(h is tape for h in oh.current_stack().handlers):
                        raise SanityError("oh.GradientTape not on the stack in its scope")
                    xb = parallel.pack(w.xs)
                    yb = parallel.pack(w.ys)
                    loss = mlp_loss(model(xb), yb)
                if oh.handler_of(loss) is None or not any(
                        h is parallel for h in oh.handler_of(loss).handlers):
                    raise SanityError("mlp-step: the loss is not on the parallel handler")
                grads = tape.gradient(loss, model.trainable_variables)
            for g in grads:
                if g is None or oh.handler_of(g) is not None:
                    raise SanityError("mlp-step: oh gradient is not an ordinary tensor: %r"
                                      % (g,))
            return [np.asarray(g) for g in grads]
        if self.key == "ms":
            strategy = w.strategy

            def replica_grads(batch):
                xb, yb = batch
                with tf.GradientTape() as tape:
                    loss = mlp_loss(model(xb), yb)
                grads = tape.gradient(loss, model.trainable_variables)
                return tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, grads)

            per_replica = strategy.run(replica_grads, args=(w.dist_batch,))
            out = []
            for g in per_replica:
                local = [np.asarray(t) for t in strategy.experimental_local_results(g)]
                if len(local) != 2 or not np.array_equal(local[0], local[1]):
                    raise SanityError("mlp-step: MirroredStrategy replicas disagree after "
                                      "all-reduce")
                out.append(local[0])
            return out
        raise ValueError(self.key)

    def weights(self):
        """Trainable weights as numpy (mirrored: checks both replicas agree)."""
        out = []
        for v in self.model.trainable_variables:
            inner = getattr(v, "value", v)
            values = getattr(inner, "values", None)
            if self.key in ("ms", "tff"):
                if values is None or len(values) != 2:
                    raise SanityError("mlp-step: %s variable %s is not mirrored on 2 "
                                      "devices" % (self.key, v.path))
                parts = [np.asarray(t) for t in values]
                if not np.array_equal(parts[0], parts[1]):
                    raise SanityError("mlp-step: %s replicas of %s differ"
                                      % (self.key, v.path))
            out.append(np.asarray(v))
        return out


class FitStep:
    """fit-step for one method: its own compiled model and iterator."""

    case = "fit-step"

    def __init__(self, w, key):
        self.w, self.key = w, key
        self.times = []
        self.scope = (lambda: w.parallel) if key == "oh" else contextlib.nullcontext
        outer = w.strategy.scope() if key == "ms" else self.scope()
        with outer:
            self.model, _ = make_mlp()
            self.model.compile(keras.optimizers.SGD(LR), "mse")
            data = tf.data.Dataset.from_tensor_slices((w.x, w.y)).batch(B).repeat()
            if key == "ms":
                data = w.strategy.experimental_distribute_dataset(data)
            self.iterator = iter(data)
            self.model.make_train_function()

    def call(self):
        with self.scope():
            return self.model.train_function(self.iterator)

    def run(self, n):
        return _common.warm_time(self.call, WARMUP_CALLS, n)

    weights = MlpStep.weights


_CONFIG_CLASS = {"per-op": AddPerOp, "mlp-step": MlpStep, "fit-step": FitStep}


def make_configs(w, cases=None):
    return [_CONFIG_CLASS[case](w, key) for case, _, _, _ in CASES
            if cases is None or case in cases for key, _ in METHODS[case]]


def _compare(what, got, want):
    if len(got) != len(want):
        raise SanityError("%s: %d tensors, expected %d" % (what, len(got), len(want)))
    worst = 0.0
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise SanityError("%s: shape %s, expected %s" % (what, a.shape, b.shape))
        if not np.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE):
            raise SanityError("%s: differs from the reference by up to %.3g"
                              % (what, float(np.max(np.abs(a - b)))))
        worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
    return worst


def check_results(w, configs, cases=None):
    """Sanity (untimed): two logical CPUs; each parallel add gives a_i + b_i on component
    device i; the oh and MirroredStrategy gradients equal single-device tf.GradientTape
    gradients on the full batch; one training step of every method gives the weights of
    the reference SGD step. Returns the max abs differences. `cases`: only those."""
    report = {}
    logical = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(logical) != 2:
        raise SanityError("expected 2 logical CPUs, found %s%s" % (
            logical, "" if _LOGICAL_CPU_ERROR is None
            else " (set_logical_device_configuration: %s)" % _LOGICAL_CPU_ERROR))
    if cases is None or "per-op" in cases:
        _check_per_op(w, report)
    if cases is None or "mlp-step" in cases:
        _check_mlp_step(w, configs, report)
    if cases is None or "fit-step" in cases:
        _check_fit_step(w, configs, report)
    return report


def _check_per_op(w, report):
    want = [a + b for a, b in zip(w.a, w.b)]
    with w.parallel:
        y = tf.add(w.a_oh, w.b_oh)
        stack = oh.handler_of(y)
        if stack is None or not any(h is w.parallel for h in stack.handlers):
            raise SanityError("per-op: oh result is not on the parallel handler's stack")
    parts = w.parallel.unpack(y)
    if [t.device for t in parts] != list(COMPONENTS):
        raise SanityError("per-op: oh components on %s" % [t.device for t in parts])
    report["per-op oh"] = _compare("per-op oh", parts, want)
    with w.pd:
        y = tf.add(w.a_pd, w.b_pd)
    if "CUSTOM" not in y.device:
        raise SanityError("per-op: ParallelDevice result on %s" % y.device)
    parts = w.pd.unpack(y)
    if [t.device for t in parts] != list(COMPONENTS):
        raise SanityError("per-op: ParallelDevice components on %s"
                          % [t.device for t in parts])
    report["per-op pd"] = _compare("per-op ParallelDevice", parts, want)


def _check_mlp_step(w, configs, report):
    by_key = {c.key: c for c in configs if c.case == "mlp-step"}
    ref_model = by_key["single"].model
    with tf.GradientTape() as tape:
        loss = mlp_loss(ref_model(w.x), w.y)
    g_ref = [np.asarray(g) for g in tape.gradient(loss, ref_model.trainable_variables)]
    w0 = [np.asarray(v) for v in ref_model.trainable_variables]
    for key in ("oh", "ms", "tff"):
        _compare("mlp-step %s initial weights" % key, by_key[key].weights(), w0)
    report["grads oh"] = _compare("mlp-step oh gradients", by_key["oh"].gradients(), g_ref)
    report["grads ms"] = _compare("mlp-step MirroredStrategy gradients",
                                  by_key["ms"].gradients(), g_ref)
    w1 = [v - LR * g for v, g in zip(w0, g_ref)]
    worst = 0.0
    for key, _ in METHODS["mlp-step"]:  # each method's first step (tff: traces it)
        cfg = by_key[key]
        cfg.call()
        worst = max(worst, _compare("mlp-step %s weights after one step" % key,
                                    cfg.weights(), w1))
    report["step"] = worst


def _check_fit_step(w, configs, report):
    fits = {c.key: c for c in configs if c.case == "fit-step"}
    for key in ("oh", "ms", "single"):  # each traces its step here
        fits[key].call()
    want = [np.asarray(v) for v in fits["single"].model.trainable_variables]
    worst = 0.0
    oh_weights = []
    for v in fits["oh"].model.trainable_variables:  # one buffer per component
        parts = w.parallel.unpack(tf.convert_to_tensor(v))
        if len(parts) != 2 or not np.array_equal(parts[0], parts[1]):
            raise SanityError("fit-step: oh components of %s differ" % v.path)
        oh_weights.append(np.asarray(parts[0]))
    for key, got in (("oh", oh_weights), ("ms", fits["ms"].weights())):
        worst = max(worst, _compare("fit-step %s weights after one step" % key, got, want))
    report["fit"] = worst


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, n_add, n_step, seed=0):
    n_of = {"per-op": n_add, "mlp-step": n_step, "fit-step": n_step}
    _common.run_rounds(configs, rounds, lambda cfg: n_of[cfg.case], seed=seed)
    # µs per op (per-op) or ms per call (mlp-step), one entry per round
    return {(cfg.case, cfg.key): [t * (1e6 if cfg.case == "per-op" else 1e3)
                                  for t in cfg.times] for cfg in configs}


def summarize(times):
    """case -> {key: stats}; every method also gets its ratio to the case's TensorFlow
    baseline (this / baseline of the medians, same-round IQR, best rounds) and to oh."""
    out = {}
    for (case, key), ts in times.items():
        out.setdefault(case, {})[key] = _common.stats(ts)
    for case, row in out.items():
        base, o = row[BASELINE[case]], row["oh"]
        for s in row.values():
            s["ratio"] = s["t"] / base["t"]
            s["best_ratio"] = s["min"] / base["min"]
            s["ratio_q"] = _common.round_ratio_quartiles(s["rounds"], base["rounds"])
            s["oh_ratio"] = o["t"] / s["t"]  # oh / this
            s["oh_ratio_q"] = _common.round_ratio_quartiles(o["rounds"], s["rounds"])
    return out


def _fmt(x, per_op):
    return ("%.2f" if per_op else "%.3f") % x


def render_md(summary, info, args, png_name, plotted, elapsed, checks):
    method = (
        "One process, with the CPU split into two logical devices "
        "(`tf.config.set_logical_device_configuration` before TensorFlow initializes; "
        "components `%s` and `%s`), times `oh.ParallelHandler` (each op runs once per "
        "component device, as an op handler) against TensorFlow's experimental "
        "`parallel_device.ParallelDevice` (a C++ custom device) and "
        "`tf.distribute.MirroredStrategy` on each case below; all three are used in the "
        "same process, next to the custom device tf-ophandlers registers, and each keeps "
        "its own inputs (and, for the training step, its own model and optimizer) for "
        "the whole run. After an untimed sanity check (which also runs every training "
        "step once and traces the `tf.function`) and a warm-up pass over all "
        "configurations with N/5 calls, each of %d rounds runs every configuration once, "
        "in a freshly shuffled order: for `per-op` the scope is entered once and %d "
        "untimed + N timed `tf.add`s run in it (N = %d), for `mlp-step` and `fit-step` %d "
        "untimed + N timed back-to-back steps (N = %d); all timed with `time.perf_counter` with the "
        "garbage collector off (after a `gc.collect()`; the objects alive after setup are "
        "frozen with `gc.freeze()` so that collection stays short). The tables give the "
        "median over rounds of the mean time per op / call, the interquartile range (IQR) "
        "of the per-round means and the best (lowest) round, which is the least disturbed "
        "by other processes; the target uses the median. *Ratio* is this method's median "
        "over TensorFlow's counterpart's (ParallelDevice for `per-op`, eager "
        "`MirroredStrategy` for `mlp-step`, MirroredStrategy's fit step for `fit-step`; "
        "< 1: faster than TensorFlow), its IQR that of "
        "the same-round ratios. The sanity check requires (`np.allclose`, rtol = atol = "
        "%g, else the script exits non-zero) each parallel add to give a_i + b_i on "
        "component device i (max abs difference oh %.1e, ParallelDevice %.1e), the oh "
        "gradients and the all-reduced `MirroredStrategy` gradients of the first step to "
        "equal single-device `tf.GradientTape` gradients on the full batch (%.1e and "
        "%.1e), and one training step of every method to give the weights of the "
        "reference SGD step, identical on both replicas for `MirroredStrategy` (%.1e), "
        "and the first `fit-step` of oh and of `MirroredStrategy` to give the weights of "
        "the one-device fit step (%.1e; oh's two components identical). "
        "TensorFlow's warning that eager `MirroredStrategy` is slow is filtered from the "
        "log output (the eager cost is what that row measures)."
        % (COMPONENTS[0], COMPONENTS[1], args.rounds, WARMUP_OPS, args.n_add,
           WARMUP_CALLS, args.n_step, TOLERANCE, checks["per-op oh"], checks["per-op pd"],
           checks["grads oh"], checks["grads ms"], checks["step"], checks["fit"]))
    L = _common.intro_md(
        "`oh.ParallelHandler` vs. TensorFlow's ParallelDevice and `MirroredStrategy` "
        "(`benchmarks/parallel.py`)", args.quick, method,
        _common.machine_md(info, info["nconfigs"], elapsed,
                           "CPU, 2 logical devices on the same cores"),
        _common.image_md("time per op / call and ratios to TensorFlow", png_name, plotted))
    for case, title, per_op, desc in CASES:
        unit = "µs/op" if per_op else "ms/call"
        rows = []
        for key, name in METHODS[case]:
            s = summary[case][key]
            rows.append([
                name, _fmt(s["t"], per_op),
                "1.00x" if key == BASELINE[case] else "%.2fx (IQR %.2f – %.2f)"
                % (s["ratio"], s["ratio_q"][0], s["ratio_q"][1]),
                "%s – %s" % (_fmt(s["q1"], per_op), _fmt(s["q3"], per_op)),
                _fmt(s["min"], per_op),
            ])
        after = []
        if case == "per-op":
            pd_, oh_ = summary[case]["pd"], summary[case]["oh"]
            after.append(
                "How the two differ: `oh.ParallelHandler` runs the components one after "
                "the other on the calling thread (two kernel launches plus the handler's "
                "dispatch), whereas ParallelDevice hands each component to its own device "
                "thread and waits for both, so its time per op includes two cross-thread "
                "hand-offs and depends on how fast the scheduler wakes those threads. "
                "That makes it the noisier of the two (IQR %.0f – %.0f µs, best round "
                "%.0f µs, against %.0f – %.0f µs for oh); outside this script, on this "
                "2-vCPU VM, it was markedly faster when another process kept the CPUs "
                "busy than when they were idle. Even against ParallelDevice's best round, "
                "oh's median is %.2fx its time."
                % (pd_["q1"], pd_["q3"], pd_["min"], oh_["q1"], oh_["q3"],
                   oh_["t"] / pd_["min"]))
        L += _common.case_md(
            "%s (`%s`)" % (title, case), desc % WARMUP_OPS if per_op else desc,
            ["method", unit, "ratio to %s (this / TF)" % BASE_NAME[case],
             "IQR %s (rounds)" % unit, "best round %s" % unit], rows, after)

    add = summary["per-op"]
    ok = add["oh"]["ratio"] <= TARGET_RATIO
    st = summary["mlp-step"]
    T = []
    T.append("- Per-op time (`per-op`) at most %.1fx that of TensorFlow's ParallelDevice: "
             "%.3fx (%.2f vs %.2f µs per op) — %s  (best rounds: %.2fx; plain eager "
             "`tf.add` on one device: %.2f µs, so running each op on both devices costs "
             "%.2fx one plain op with `oh.ParallelHandler` and %.2fx with ParallelDevice)"
             % (TARGET_RATIO, add["oh"]["ratio"], add["oh"]["t"], add["pd"]["t"],
                _common.verdict(ok), add["oh"]["best_ratio"], add["plain"]["t"],
                add["oh"]["t"] / add["plain"]["t"], add["pd"]["t"] / add["plain"]["t"]))
    T.append("- `mlp-step` has no target (information): the oh step takes %.2fx the time "
             "of eager `MirroredStrategy` (IQR %.2f – %.2f; best rounds %.2fx), %.2fx that "
             "of `tf.function(MirroredStrategy.run)` and %.2fx that of the single-device "
             "eager step on the whole batch."
             % (st["oh"]["ratio"], st["oh"]["ratio_q"][0], st["oh"]["ratio_q"][1],
                st["oh"]["best_ratio"], st["tff"]["oh_ratio"], st["single"]["oh_ratio"]))
    fit = summary["fit-step"]
    fit_ok = fit["oh"]["ratio"] <= FIT_TARGET_RATIO
    T.append("- `model.fit` step (`fit-step`) at most %.1fx that of `MirroredStrategy`: "
             "%.3fx (%.3f vs %.3f ms per step; IQR of same-round ratios %.2f – %.2f; best "
             "rounds %.2fx) — %s (the one-device step on the whole batch: %.3f ms)"
             % (FIT_TARGET_RATIO, fit["oh"]["ratio"], fit["oh"]["t"], fit["ms"]["t"],
                fit["oh"]["ratio_q"][0], fit["oh"]["ratio_q"][1], fit["oh"]["best_ratio"],
                _common.verdict(fit_ok), fit["single"]["t"]))
    L += _common.targets_md(T, "parallel", args.quick, png_name)
    return "\n".join(L), ok and fit_ok


COLORS = {"oh": "tab:orange", "pd": "tab:blue", "ms": "tab:blue", "tff": "tab:cyan",
          "plain": "tab:gray", "single": "tab:gray"}
LABELS = {
    "per-op": {"oh": "oh.Parallel-\nHandler", "pd": "TF Parallel-\nDevice",
               "plain": "plain eager\n1 device (ref.)"},
    "mlp-step": {"oh": "oh.Parallel-\nHandler", "ms": "Mirrored-\nStrategy\n(eager)",
                 "tff": "tf.function(\nMirrored-\nStrategy)", "single": "1 device\n(ref.)"},
    "fit-step": {"oh": "oh.Parallel-\nHandler\nfit step", "ms": "Mirrored-\nStrategy\nfit step",
                 "single": "1 device\n(ref.)"},
}


def plot(summary, plt):
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6),
                             gridspec_kw={"width_ratios": [1, 1.3, 1, 1.2]})
    for ax, (case, _, per_op, _) in zip(axes, CASES):
        keys = [k for k, _ in METHODS[case]]
        ss = [summary[case][k] for k in keys]
        xs = np.arange(len(keys))
        ax.bar(xs, [s["t"] for s in ss], 0.6, yerr=_common.iqr_err(ss), capsize=3,
               color=[COLORS[k] for k in keys])
        _common.label_bars(ax, xs, [max(s["t"], s["q3"]) for s in ss],
                           [_fmt(s["t"], per_op) for s in ss])
        ax.set_xticks(xs)
        ax.set_xticklabels([LABELS[case][k] for k in keys], fontsize=7)
        if per_op:
            ax.set_ylabel("µs per tf.add")
            ax.set_ylim(0, max(s["q3"] for s in ss) * 1.18)
        else:
            ax.set_yscale("log")
            ax.set_ylabel("ms per training step (log scale)")
            ax.set_ylim(min(s["q1"] for s in ss) / 2, max(s["q3"] for s in ss) * 3)
        ax.set_title("%s\n(median, IQR of rounds)" % case, fontsize=9)
        ax.grid(axis="y", alpha=0.3, which="both")

    # right: oh's time over each TensorFlow method's (same-round IQR), target line
    ax_r = axes[-1]
    bars = [("per-op", "pd", "per-op\nvs ParallelDevice"),
            ("mlp-step", "ms", "mlp-step\nvs eager Mirrored"),
            ("mlp-step", "tff", "mlp-step\nvs tf.function\nMirrored"),
            ("mlp-step", "single", "mlp-step\nvs 1 device"),
            ("fit-step", "ms", "fit-step\nvs Mirrored")]
    xs = np.arange(len(bars))
    vals = [summary[c][k]["oh_ratio"] for c, k, _ in bars]
    lo, hi = _common.spread(vals, [summary[c][k]["oh_ratio_q"] for c, k, _ in bars])
    ax_r.bar(xs, vals, 0.6, yerr=[lo, hi], capsize=3,
             color=["tab:orange", "tab:orange", "tab:gray", "tab:gray", "tab:orange"])
    ax_r.hlines(TARGET_RATIO, -0.4, 0.4, colors="tab:red", linestyles=":", lw=1.5,
                label="target (per-op): <= %.1fx" % TARGET_RATIO)
    ax_r.hlines(FIT_TARGET_RATIO, 3.6, 4.4, colors="tab:red", linestyles="--", lw=1.5,
                label="target (fit-step): <= %.1fx" % FIT_TARGET_RATIO)
    ax_r.axhline(1.0, color="black", lw=0.8, label="parity")
    _common.label_bars(ax_r, xs, [v + h for v, h in zip(vals, hi)],
                       ["%.2fx" % v for v in vals], boxed=True)
    ax_r.set_yscale("log")
    ax_r.set_xticks(xs)
    ax_r.set_xticklabels([b[2] for b in bars], fontsize=7)
    ax_r.set_ylabel("oh time / other method's time (log)")
    ax_r.set_title("oh.ParallelHandler relative to TF (< 1: oh faster;\nIQR of same-round "
                   "ratios)", fontsize=9)
    ax_r.set_ylim(min(min(vals), 1.0) / 2.5, max(max(v + h for v, h in zip(vals, hi)),
                                               TARGET_RATIO) * 3)
    ax_r.grid(axis="y", alpha=0.3, which="both")
    ax_r.legend(fontsize=7, loc="upper left")
    fig.suptitle("tf-ophandlers: oh.ParallelHandler vs. TF ParallelDevice and "
                 "MirroredStrategy (2 logical CPUs, same run)", fontsize=10)
    return fig


def _pop_case(argv):
    """`--case NAME` (one case of CASES) taken out of `argv`: (NAME or None, the rest)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = [c[0] for c in CASES]
    for i, a in enumerate(argv):
        if a == "--case" or a.startswith("--case="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv)
                                                         else None)
            if value not in names:
                raise SystemExit("--case: one of %s, got %r" % (", ".join(names), value))
            return value, argv[:i] + argv[i + (1 if "=" in a else 2):]
    return None, argv


def main(argv=None):
    case_only, argv = _pop_case(argv)
    args = _common.parse_args(
        argv, __doc__, "parallel", (30, 3),
        [("n-add", "timed tf.adds per round", 500, 50),
         ("n-step", "timed training steps per round", 20, 3)], quick_s=40)
    cases = None if case_only is None else {case_only}

    start = time.perf_counter()
    tf.get_logger().addFilter(_DropMirroredEagerWarning())
    info = _common.machine_info()
    info["keras"] = keras.__version__
    try:
        w = Workload()
        configs = make_configs(w, cases)
        checks = check_results(w, configs, cases)
    except Exception as e:  # pylint: disable=broad-except
        print("sanity check failed: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return 1
    info["nconfigs"] = len(configs)
    times = _common.measure_under_load(
        info, lambda: measure(configs, args.rounds, args.n_add, args.n_step), freeze=True)
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    png_path = None
    if cases is None:  # the page shows every case: a one-case run only prints
        _, png_path = _common.publish(
            args.out, "parallel", lambda plt: plot(summary, plt),
            lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                                elapsed, checks))

    for case, _, per_op, _ in CASES:
        if case not in summary:
            continue
        unit = "us/op" if per_op else "ms"
        for key, name in METHODS[case]:
            s = summary[case][key]
            print("%-8s %-62s %9.3f %-5s  ratio to %s %6.3fx (same-round IQR %.3f - %.3f, "
                  "best rounds %.3fx)"
                  % (case, name, s["t"], unit, BASELINE[case], s["ratio"], s["ratio_q"][0],
                     s["ratio_q"][1], s["best_ratio"]))
    if "per-op" in summary:
        add = summary["per-op"]["oh"]
        print("target: per-op oh / ParallelDevice %.3fx <= %.1fx %s"
              % (add["ratio"], TARGET_RATIO, "PASS" if add["ratio"] <= TARGET_RATIO
                 else "MISS"))
    if "fit-step" in summary:
        fit = summary["fit-step"]["oh"]
        print("target: fit-step oh / MirroredStrategy %.3fx <= %.1fx %s"
              % (fit["ratio"], FIT_TARGET_RATIO, "PASS" if fit["ratio"] <= FIT_TARGET_RATIO
                 else "MISS"))
    print("other processes used %s CPU cores on average during the measurement"
          % info.get("other", "n/a"))
    if cases is None:
        _common.print_wrote(args.out, png_path, elapsed)
    else:
        print("--case %s: %.0f s; no page written (the page shows every case)"
              % (case_only, elapsed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
