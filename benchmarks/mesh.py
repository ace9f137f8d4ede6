"""oh.Mesh vs. TensorFlow's DTensor on the same 2x2 ("batch", "model") mesh of four
logical CPUs and the same layouts: eager per-op cost and a Megatron MLP training step.

    python benchmarks/mesh.py [--quick] [--rounds N] [--ops N] [--steps N]

Every configuration is measured in the same process, interleaved in shuffled order per
round (`_common.run_rounds`); the ratios oh.Mesh / DTensor are the result. The training
step is the same raw-TensorFlow function for both (x @ W1 -> gelu -> @ W2, mean squared
error, gradients, SGD update): W1 (None, "model"), W2 ("model", None), the batch on
"batch"; DTensor's under tf.GradientTape with DVariables, oh.Mesh's under
oh.GradientTape with variables created from sharded values. Last, oh.Mesh alone: the
same MLP as a Keras model, one `model.fit` step (`model.train_function` on the dataset
iterator, what fit calls per batch) compiled (its tf.function replayed SPMD, the batch
read before the call and sharded on "batch") vs. `run_eagerly=True`, on one mesh.
"""
import os
import sys
import time

import keras
import tensorflow as tf

_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 4)

import numpy as np  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tf_ophandlers.core.functions import call as function_calls  # noqa: E402
from tf_ophandlers.handlers.mesh import comm as mesh_comm  # noqa: E402

SECTION = "mesh"
DEVICES = ["CPU:%d" % i for i in range(4)]
N, D, F = 64, 64, 256  # batch, model width, MLP hidden width

CASES = {  # name: (function of two inputs, layout of a, layout of b, shapes)
    "mul (batch, model) * (batch, model)": (
        lambda a, b: a * b, ("batch", "model"), ("batch", "model"), ([N, D], [N, D])),
    "matmul rows x columns (no communication)": (
        tf.matmul, ("batch", None), (None, "model"), ([N, D], [D, D])),
    "matmul contracting 'model' (all-reduce)": (
        tf.matmul, (None, "model"), ("model", None), ([N, D], [D, D])),
    "reduce_sum over both sharded axes": (
        lambda a, b: tf.reduce_sum(a), ("batch", "model"), ("batch", "model"), ([N, D], [N, D])),
}


class Config:
    def __init__(self, case, impl, fn, n):
        self.case, self.impl, self.fn, self.n, self.times = case, impl, fn, n, []
        self.cpu_times = []  # the same calls' CPU seconds (all threads of the process)
        self.launches = None  # eager ops oh.Mesh launched per call (load-independent)

    def run(self, n):
        cpu = time.process_time()
        wall = _common.warm_time(self.fn, 2, n)
        self.cpu_times.append((time.process_time() - cpu) / (n + 2))
        return wall


def _dtensor_mesh():
    return dtensor.create_mesh([("batch", 2), ("model", 2)], device_type="CPU")


def _dlayout(mesh, layout):
    return dtensor.Layout([m or dtensor.UNSHARDED for m in layout], mesh)


def make_op_configs(args, dmesh, omesh, rng):
    emesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, compile_ops=True)
    configs = []
    for case, (fn, la, lb, (sa, sb)) in CASES.items():
        a0 = rng.normal(size=sa).astype("float32")
        b0 = rng.normal(size=sb).astype("float32")
        da = dtensor.copy_to_mesh(a0, dtensor.Layout.replicated(dmesh, len(sa)))
        da = dtensor.relayout(da, _dlayout(dmesh, la))
        db = dtensor.relayout(dtensor.copy_to_mesh(b0, dtensor.Layout.replicated(dmesh, len(sb))),
                              _dlayout(dmesh, lb))
        with omesh:
            oa, ob = omesh.shard(a0, la), omesh.shard(b0, lb)
        want = fn(a0, b0)
        got = fn(da, db)
        got = dtensor.relayout(got, dtensor.Layout.replicated(dmesh, got.shape.rank))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(fn(oa, ob), want, rtol=1e-4, atol=1e-4)

        def run_oh(fn=fn, oa=oa, ob=ob, mesh=omesh):
            with mesh:
                fn(oa, ob)

        with emesh:
            ea, eb = emesh.shard(a0, la), emesh.shard(b0, lb)
        np.testing.assert_allclose(fn(ea, eb), want, rtol=1e-4, atol=1e-4)
        configs.append(Config(case, "dtensor", lambda fn=fn, da=da, db=db: fn(da, db), args.ops))
        configs.append(Config(case, "oh", run_oh, args.ops))
        configs[-1].launches = count_launches(run_oh)
        configs.append(Config(case, "oh_compiled",
                              lambda fn=fn, ea=ea, eb=eb: run_oh(fn, ea, eb, emesh), args.ops))
    return configs


def count_launches(fn):
    """The eager ops oh.Mesh launches on TensorFlow's devices during one `fn()`."""
    count = [0]
    run = mesh_comm.execute_physical

    def counting(op, inputs, device):
        count[0] += 1
        return run(op, inputs, device)

    mesh_comm.execute_physical = counting
    try:
        fn()
    finally:
        mesh_comm.execute_physical = run
    return count[0]


def _mlp_loss(x, y, w1, w2):
    err = tf.matmul(tf.nn.gelu(tf.matmul(x, w1)), w2) - y
    return tf.reduce_mean(err * err)


def _sgd_step(tape_type, x, y, w1, w2):
    """One SGD step of `_mlp_loss` (every configuration's step, eager or traced)."""
    with tape_type() as tape:
        loss = _mlp_loss(x, y, w1, w2)
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.01 * g1)
    w2.assign_sub(0.01 * g2)
    return loss


def make_step_configs(args, dmesh, omesh, rng):
    x0, y0 = rng.normal(size=[N, D]).astype("float32"), rng.normal(size=[N, D]).astype("float32")
    w10 = (rng.normal(size=[D, F]) * 0.1).astype("float32")
    w20 = (rng.normal(size=[F, D]) * 0.1).astype("float32")

    def dshard(v, layout):
        return dtensor.relayout(dtensor.copy_to_mesh(v, dtensor.Layout.replicated(
            dmesh, v.ndim)), _dlayout(dmesh, layout))
    dx, dy = dshard(x0, ("batch", None)), dshard(y0, ("batch", None))
    dw1 = dtensor.DVariable(dshard(w10, (None, "model")))
    dw2 = dtensor.DVariable(dshard(w20, ("model", None)))

    # DTensor's eager gradient of this loss fails in TF 2.21 ("The op/function Mul got a
    # regular tensor for input 0 (shape [64,64]) but was expecting a DTensor"): its step
    # runs as a tf.function, DTensor's documented training path.
    @tf.function
    def step_dtensor():
        return _sgd_step(tf.GradientTape, dx, dy, dw1, dw2)

    with omesh:
        ox, oy = omesh.shard(x0, ("batch", None)), omesh.shard(y0, ("batch", None))
        ow1 = tf.Variable(omesh.shard(w10, (None, "model")))
        ow2 = tf.Variable(omesh.shard(w20, ("model", None)))
        rw1 = tf.Variable(omesh.shard(w10, (None, "model")))
        rw2 = tf.Variable(omesh.shard(w20, ("model", None)))
        cw1 = tf.Variable(omesh.shard(w10, (None, "model")))
        cw2 = tf.Variable(omesh.shard(w20, ("model", None)))

    def step_oh():
        with omesh:
            return _sgd_step(oh.GradientTape, ox, oy, ow1, ow2)

    traced_step = tf.function(  # the same step as one tf.function
        lambda x, y, w1, w2: _sgd_step(tf.GradientTape, x, y, w1, w2))

    def step_oh_replayed():  # replayed through the mesh once, then a cached function
        with omesh:
            return traced_step(ox, oy, rw1, rw2)

    @tf.function
    def captured_step():  # DTensor's form: no arguments, the tensors and variables captured
        return _sgd_step(tf.GradientTape, ox, oy, cw1, cw2)

    def step_oh_captured():
        with omesh:
            return captured_step()

    before = set(function_calls._cache)  # pylint: disable=protected-access
    for _ in range(3):  # same losses, step by step
        want = float(step_dtensor())
        np.testing.assert_allclose(float(step_oh()), want, rtol=1e-5)
        np.testing.assert_allclose(float(step_oh_replayed()), want, rtol=1e-5)
        np.testing.assert_allclose(float(step_oh_captured()), want, rtol=1e-5)
    assert not omesh.fallbacks, omesh.fallbacks
    key = [k for k in function_calls._cache if k not in before][0]  # pylint: disable=protected-access
    compiled = function_calls._cache[key].compiled  # pylint: disable=protected-access
    # The function that runs: its copy without the output gate (core/functions/ungated.py).
    fdef = (context.context().get_function_def(compiled.ungated) if compiled.ungated
            else compiled.function.function_def)
    nodes = len(fdef.node_def)
    control = sum(i.startswith("^") for n in fdef.node_def for i in n.input)
    case = "Megatron MLP training step (%dx%d, hidden %d), oh.Mesh eager" % (N, D, F)
    traced = "same step, oh.Mesh replaying a tf.function of 4 arguments"
    same = "same step, oh.Mesh replaying a tf.function capturing them (DTensor's form)"
    eager = Config(case, "oh", step_oh, args.steps)
    eager.launches = count_launches(step_oh)
    replayed = Config(traced, "oh", step_oh_replayed, args.steps)
    replayed.launches = "%d nodes, %d control edges" % (nodes, control)
    captured = Config(same, "oh", step_oh_captured, args.steps)
    captured.launches = replayed.launches
    return [Config(case, "dtensor", step_dtensor, args.steps), eager,
            Config(traced, "dtensor", step_dtensor, args.steps), replayed,
            Config(same, "dtensor", step_dtensor, args.steps), captured]


FIT = ("Keras MLP, one model.fit step (%dx%d, hidden %d), weights and batch sharded"
       % (N, D, F))


def make_fit_configs(args, rng):
    """One Keras fit step of the Megatron MLP on one mesh, compiled vs run_eagerly."""
    x = rng.normal(size=[N, D]).astype("float32")
    y = rng.normal(size=[N, D]).astype("float32")
    fmesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES, batch_dim="batch")
    weights, configs, models = None, [], []
    for impl, run_eagerly in (("fit_compiled", False), ("fit_eager", True)):
        with fmesh:
            model = keras.Sequential([keras.Input((D,)),
                                      keras.layers.Dense(F, activation="gelu"),
                                      keras.layers.Dense(D)])
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        for v, layout in zip(model.trainable_variables, [(None, "model"), ("model",),
                                                         ("model", None), (None,)]):
            fmesh.shard_variable(v, layout)
        with fmesh:
            model.compile(keras.optimizers.SGD(0.01), "mse", run_eagerly=run_eagerly)
            model.optimizer.build(model.trainable_variables)
            model.fit(x, y, batch_size=N, epochs=1, verbose=0)  # builds train_function
            # Created in the scope, as fit creates its iterator.
            it = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(N).repeat())

        def step(model=model, it=it):
            with fmesh:
                model.train_function(it)
        for _ in range(3):
            step()
        models.append(model)
        configs.append(Config(FIT, impl, step, args.steps))
    for a, b in zip(*(m.trainable_variables for m in models)):  # same steps, same values
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    assert fmesh.layout_of(models[0].layers[0].kernel) == (None, "model")
    assert not fmesh.fallbacks, fmesh.fallbacks
    return configs


def render_fit(by):
    c, e = by[FIT, "fit_compiled"], by[FIT, "fit_eager"]
    ratio = _common.median([a / b for a, b in zip(c.times, e.times)])
    q1, q3 = _common.round_ratio_quartiles(c.times, e.times)
    cpu = _common.median([a / b for a, b in zip(c.cpu_times[1:], e.cpu_times[1:])])
    c1, c3 = _common.round_ratio_quartiles(c.cpu_times[1:], e.cpu_times[1:])
    return [
        "Keras `model.fit` on the same mesh (oh.Mesh only, same rounds): one step "
        "(`model.train_function` on the dataset iterator, what fit calls per batch; "
        "W1 (None, \"model\"), W2 (\"model\", None), SGD, mse) compiled (Keras's "
        "tf.function step replayed SPMD once and cached; the batch is read before the "
        "call and sharded on \"batch\", `oh.Mesh(..., batch_dim=\"batch\")`) vs. "
        "`run_eagerly=True` (every op through the mesh's Python rules; the batch "
        "replicated).", "",
        _common.md_table(["case", "run_eagerly µs", "compiled µs", "compiled / run_eagerly",
                          "CPU time compiled / run_eagerly"],
                         [[FIT, "%.0f" % (_common.median(e.times) * 1e6),
                           "%.0f" % (_common.median(c.times) * 1e6),
                           "**%.2f×** (%.2f–%.2f)" % (ratio, q1, q3),
                           "%.2f× (%.2f–%.2f)" % (cpu, c1, c3)]])]


def _short(case):
    """A case's label under its bars in the plot."""
    if case == FIT:
        return "Keras fit step\ncompiled / run_eagerly"
    if case.startswith("Megatron"):
        return "MLP step\n(oh.Mesh eager)"
    if case.startswith("same step"):
        return "MLP step replayed\n(%s)" % ("4 arguments" if "arguments" in case
                                              else "captured")
    return case.split(" over ")[0].replace(" (", "\n(").replace(" x ", " x\n")


def ratios(configs, num, den):
    """Per case of `configs` that has both `num` and `den` (impl names): the median of
    the same-round ratios num / den and their quartiles, wall and CPU time:
    [(case, wall, (q1, q3), cpu, (q1, q3))]."""
    by = {(c.case, c.impl): c for c in configs}
    out = []
    for case in dict.fromkeys(c.case for c in configs):
        if (case, num) not in by or (case, den) not in by:
            continue
        a, b = by[case, num], by[case, den]
        # The warm-up pass's CPU time is the first entry: rounds only.
        out.append((case, _common.median([x / y for x, y in zip(a.times, b.times)]),
                    _common.round_ratio_quartiles(a.times, b.times),
                    _common.median([x / y for x, y in zip(a.cpu_times[1:], b.cpu_times[1:])]),
                    _common.round_ratio_quartiles(a.cpu_times[1:], b.cpu_times[1:])))
    return out


def plot(rows, plt):
    """`rows`: `ratios(configs, "oh", "dtensor")` followed by the fit step's
    `ratios(configs, "fit_compiled", "fit_eager")` (if it ran)."""
    fig, ax = plt.subplots(figsize=(12, 4.8))
    labels = [_short(r[0]) for r in rows]
    per_op = [i for i, r in enumerate(rows)
              if r[0] != FIT and not r[0].startswith(("Megatron", "same step"))]
    steps = [i for i, r in enumerate(rows) if r[0].startswith(("Megatron", "same step"))]
    targets = [(per_op[0], per_op[-1], 0.5, "target (per op): <= 0.5x DTensor")]
    if steps:
        targets.append((steps[0], steps[-1], 1.0, "target (step): <= 1.0x DTensor's step"))
    _common.ratio_panel(
        ax, labels, [("wall time", "tab:orange", [r[1] for r in rows], [r[2] for r in rows]),
                     ("CPU time (process)", "tab:gray", [r[3] for r in rows],
                      [r[4] for r in rows])],
        "time / other's time (log)",
        "oh.Mesh / DTensor per case (< 1: oh.Mesh faster); last: oh.Mesh's Keras fit step "
        "compiled / run_eagerly\n(median and quartiles of same-round ratios)", targets)
    fig.suptitle("tf-ophandlers: oh.Mesh vs. DTensor, 2x2 mesh of four logical CPUs "
                 "(same run)", fontsize=10)
    return fig


def render(configs, info, args, elapsed, png_name, plotted):
    fit = [c for c in configs if c.case == FIT]
    configs = [c for c in configs if c.case != FIT]
    cases = list(dict.fromkeys(c.case for c in configs))
    by = {(c.case, c.impl): c for c in configs}
    rows, ratios, compiled, cpu_ratios, spreads = [], {}, {}, {}, {}

    def verdict(cases_, target):
        """met / not met when every case's same-round quartiles are on one side of the
        target; else not shown (a loaded machine's wall-time spread)."""
        if all(spreads[c][1] <= target for c in cases_):
            return "met"
        if any(spreads[c][0] > target for c in cases_):
            return "not met"
        return "not shown: the quartiles straddle the target under this load"
    for case in cases:
        d, o = by[case, "dtensor"], by[case, "oh"]
        q1, q3 = _common.round_ratio_quartiles(o.times, d.times)
        ratio = _common.median([a / b for a, b in zip(o.times, d.times)])
        ratios[case] = ratio
        spreads[case] = (q1, q3)
        # The warm-up pass's CPU time is the first entry: rounds only.
        cpu = _common.median([a / b for a, b in zip(o.cpu_times[1:], d.cpu_times[1:])])
        c1, c3 = _common.round_ratio_quartiles(o.cpu_times[1:], d.cpu_times[1:])
        cpu_ratios[case] = cpu
        e = by.get((case, "oh_compiled"))
        eager = ["", ""]
        if e is not None:
            r = _common.median([b / a for a, b in zip(o.times, e.times)])
            eager = ["%.0f" % (_common.median(e.times) * 1e6), "%.2f×" % r]
            compiled[case] = r
        rows.append([case, "%.0f" % (_common.median(d.times) * 1e6),
                     "%.0f" % (_common.median(o.times) * 1e6),
                     "**%.2f×** (%.2f–%.2f)" % (ratio, q1, q3),
                     "%.2f× (%.2f–%.2f)" % (cpu, c1, c3),
                     "" if o.launches is None else str(o.launches)] + eager)
    step = [c for c in cases if c.startswith("Megatron")][0]
    traced, same = [c for c in cases if c.startswith("same step")]
    steps = (step, traced, same)
    per_op = [ratios[c] for c in cases if c not in steps]
    L = ["## `oh.Mesh` vs. TensorFlow's DTensor (`benchmarks/mesh.py`)", "",
         "Same 2×2 (\"batch\", \"model\") mesh of four logical CPUs, same layouts, eager; "
         "one process, configurations interleaved in shuffled order, %d rounds%s. "
         "Medians per call in µs; the ratio is the median of the same-round ratios "
         "oh.Mesh / DTensor (quartiles in parentheses). %s" % (
             args.rounds, " (`--quick`: noisy)" if args.quick else "",
             "Machine: %s; it was shared with other jobs while measuring (load average "
             "%.1f at the end; load reaches both sides of a ratio, but with the machine's "
             "cores oversubscribed the wall-time quartiles are wide). Run on %s; run time "
             "%.0f s." % (info.get("cpu", "?"), os.getloadavg()[0], info.get("date", "?"),
                          elapsed)), "",
         _common.image_md("oh.Mesh / DTensor per case, wall and CPU time", png_name,
                          plotted), "",
         _common.md_table(["case", "DTensor µs", "oh.Mesh µs", "oh.Mesh / DTensor",
                           "CPU time oh.Mesh / DTensor",
                           "eager ops launched", "oh.Mesh compile_ops=True µs",
                           "compiled / per device"],
                          rows), "",
         "Targets: per-op cost ≤ 0.5× DTensor's — %s (ratios %s). A training "
         "step ≤ 1.0× DTensor's eager step: DTensor has no eager step to compare with (its "
         "eager gradient of this loss fails in TF 2.21 with \"The op/function Mul got a "
         "regular tensor for input 0 (shape [64,64]) but was expecting a DTensor\"), so "
         "DTensor's step is a tf.function (its documented training path) in all step "
         "rows, with no arguments (it captures its tensors and variables). **The step "
         "that answers the target is the replayed one in DTensor's form**: the same "
         "tf.function, capturing its mesh tensors and variables, called in the mesh's "
         "scope, replayed once into one SPMD-expanded function and cached, is %.2f× "
         "DTensor's step (%s); the same function taking the four values as arguments is "
         "%.2f× (%s: TensorFlow's Python binding of four arguments per call, which "
         "DTensor's step does not do, and the mesh's split of them). Replays through "
         "oh.Mesh are instantiated without grappler (`Mesh.optimize_replays`: its rewrites "
         "made this step's function ~10–25%% slower in CPU time). oh.Mesh's eager step (every "
         "op through oh.GradientTape and the mesh's Python rules, %s eager ops launched) "
         "is %.2f× (%s; a compiled step is the comparison DTensor offers, and per-op "
         "Python dispatch of ~50 ops cannot match one function call)." % (
             verdict([c for c in cases if c not in steps], 0.5),
             ", ".join("%.2f" % r for r in per_op),
             ratios[same], verdict([same], 1.0), ratios[traced], verdict([traced], 1.0),
             by[step, "oh"].launches, ratios[step],
             verdict([step], 1.0)), "",
         "The CPU-time column is the same calls' CPU seconds of the whole process "
         "(`time.process_time`, every thread), the same-round ratio's median and "
         "quartiles: less disturbed than wall time when other jobs load the machine, "
         "but it counts the CPU DTensor's executor threads spend in parallel, which "
         "wall time on an idle multi-core machine would partly hide, so it flatters "
         "oh.Mesh where DTensor runs devices in parallel (per-op CPU ratios %s; "
         "replayed step %.2f×). " % (
             ", ".join("%.2f" % cpu_ratios[c] for c in cases if c not in steps),
             cpu_ratios[same]) +
         "The \"eager ops launched\" column counts the eager ops oh.Mesh issues on "
         "TensorFlow's devices per call (independent of the machine's load; for the "
         "replayed step, the nodes of the replayed function): one per device for the op "
         "itself, plus its communication — an all-reduce is one AddN per group, whose "
         "result the group's other logical CPUs read in place (no copies), a mean divides "
         "once per group. On a host-memory mesh (logical CPUs of one process) devices "
         "that hold the same tensor (a value replicated along a mesh dimension) share one "
         "op (the matmul with all-reduce: two matmuls and one AddN), and a reduction over "
         "sharded axes adds the group's shards first and reduces once per group "
         "(reduce_sum: one AddN, one Sum). Small float products (≤ 2**20 multiply-adds "
         "per device) launch as BatchMatMulV3, the same sgemm: TensorFlow's eager runtime "
         "rewrites each MatMul launch to its oneDNN op first (~2.5 µs of CPU per launch "
         "here). "
         "oh.Mesh runs an op as one eager op per device (default); the last columns "
         "time the same ops with `oh.Mesh(..., compile_ops=True)` (the per-device shards "
         "as one compiled multi-device function call, built once per op signature and "
         "cached, `handlers/mesh/compiled.py`) in the same rounds: "
         "compiled / per device %s. Communication uses explicit cross-device ops "
         "(`handlers/mesh/comm.py`), which "
         "`benchmarks/mesh_communication.py` measures against TensorFlow's collectives. "
         "DTensor runs each op as an SPMD-expanded function on its custom device with "
         "collectives." % ", ".join("%.2f" % r for r in compiled.values())]
    if fit:
        L += [""] + render_fit({(c.case, c.impl): c for c in fit})
    return "\n".join(L), None


def main(argv=None):
    args = _common.parse_args(argv, __doc__, SECTION, rounds=(7, 2),
                              counts=[("ops", "calls per op and round", 200, 20),
                                      ("steps", "training steps per round", 20, 3)])
    start = time.time()
    rng = np.random.default_rng(0)
    dmesh = _dtensor_mesh()
    omesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES)
    configs = make_op_configs(args, dmesh, omesh, rng) + make_step_configs(
        args, dmesh, omesh, rng) + make_fit_configs(args, rng)
    _common.run_rounds(configs, args.rounds, lambda cfg: cfg.n)
    info = _common.machine_info()
    elapsed = time.time() - start
    rows = ratios(configs, "oh", "dtensor") + ratios(configs, "fit_compiled", "fit_eager")
    _, png_path = _common.publish(
        args.out, SECTION, lambda plt: plot(rows, plt),
        lambda png_name, plotted: render(configs, info, args, elapsed, png_name, plotted))
    for case, wall, _, cpu, _ in rows:
        print("%-75s %.2fx wall, %.2fx CPU" % (case, wall, cpu))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
