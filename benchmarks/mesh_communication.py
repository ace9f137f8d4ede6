"""oh.Mesh's communication and per-op execution choices, measured: explicit eager ops
(what oh.Mesh issues) against TensorFlow's collectives and compiled per-op functions, on
the 2x2 ("batch", "model") mesh of four logical CPUs, 64x64 float32 shards.

    python benchmarks/mesh_communication.py [--quick] [--rounds N] [--calls N]

Cases (each pair in the same process, interleaved in shuffled order per round,
`_common.run_rounds`; the ratio alternative / explicit is the result):
- per-op execution: one Mul per device, four eager ops (what oh.Mesh does), against one
  compiled tf.function holding the four Muls (a per-signature compiled op);
- all-reduce over "model" (groups {0,1}, {2,3}): AddN on the group's first device plus
  a copy (what oh.Mesh does), against `tf.distribute`'s `CollectiveAllReduce` (all members in
  one tf.function, as `oh.ParallelHandler.all_reduce` runs it);
- all-gather over "model" along axis 1: a ConcatV2 per device (what oh.Mesh does), against
  the collective all-gather (`CollectiveGatherV2` through its launcher);
- reduce-scatter over "model" along axis 1 (a row-parallel MatMul's partial sums consumed
  sharded): all-reduce then a slice per device (what oh.Mesh does), against an explicit
  reduce-scatter (each device adds its slice of the group's partial sums).
Every alternative's result is checked against the explicit one before timing.
"""
import os
import sys
import textwrap
import time

import tensorflow as tf

_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 4)

import numpy as np  # noqa: E402
from tensorflow.python.distribute import collective_util  # noqa: E402
from tensorflow.python.distribute import cross_device_ops  # noqa: E402
from tensorflow.python.distribute import cross_device_utils  # noqa: E402
from tensorflow.python.distribute import reduce_util  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SECTION = "mesh_communication"
D = ["/job:localhost/replica:0/task:0/device:CPU:%d" % i for i in range(4)]
GROUPS = ([0, 1], [2, 3])  # the "model" groups of a row-major 2x2 ("batch", "model") mesh
N = 64


class Config:
    def __init__(self, case, impl, fn):
        self.case, self.impl, self.fn, self.times = case, impl, fn, []

    def run(self, n):
        return _common.warm_time(self.fn, 2, n)


def _on(i, fn, *args):
    with tf.device(D[i]):
        return fn(*args)


def make_configs(rng):
    xs = [_on(i, tf.constant, rng.normal(size=[N, N]).astype("float32")) for i in range(4)]
    ys = [_on(i, tf.constant, rng.normal(size=[N, N]).astype("float32")) for i in range(4)]
    keys = cross_device_utils.CollectiveKeys()
    opts = collective_util.Options()
    colls = [cross_device_ops.CollectiveAllReduce(
        devices=[D[j] for j in g], group_size=2, options=opts, collective_keys=keys)
        for g in GROUPS]

    def mul_eager():
        return [_on(i, tf.multiply, xs[i], ys[i]) for i in range(4)]

    @tf.function(autograph=False)
    def mul_fn(*args):
        return [_on(i, tf.multiply, args[i], args[4 + i]) for i in range(4)]
    mul_compiled = mul_fn.get_concrete_function(*xs, *ys)

    def all_reduce_explicit():
        out = [None] * 4
        for g in GROUPS:
            total = _on(g[0], tf.add_n, [xs[j] for j in g])
            out[g[0]], out[g[1]] = total, _on(g[1], tf.identity, total)
        return out

    @tf.function(autograph=False)
    def all_reduce_fn(*args):
        return [_on(i, lambda t, i=i: colls[i // 2]._all_reduce(  # pylint: disable=protected-access
            reduce_util.ReduceOp.SUM, tf.identity(t), i % 2, opts), args[i]) for i in range(4)]
    all_reduce_coll = all_reduce_fn.get_concrete_function(*xs)

    def all_gather_explicit():
        return [_on(i, tf.concat, [xs[j] for j in GROUPS[i // 2]], 1) for i in range(4)]

    @tf.function(autograph=False)
    def all_gather_fn(*args):
        return [_on(i, lambda t, i=i: colls[i // 2]._launchers[i % 2].all_gather(  # pylint: disable=protected-access
            tf.transpose(t), 0, opts), args[i]) for i in range(4)]
    all_gather_coll = all_gather_fn.get_concrete_function(*xs)

    half = N // 2

    def reduce_scatter_via_all_reduce():
        return [_on(i, lambda t, i=i: t[:, (i % 2) * half:(i % 2 + 1) * half], t)
                for i, t in enumerate(all_reduce_explicit())]

    def reduce_scatter_explicit():
        out = []
        for i in range(4):
            c = i % 2
            parts = [_on(i, lambda t: t[:, c * half:(c + 1) * half], xs[j])
                     for j in GROUPS[i // 2]]
            out.append(_on(i, tf.add_n, parts))
        return out

    cases = [("per-op: Mul on 4 devices", "four eager ops", mul_eager,
              "one compiled tf.function (ConcreteFunction call)", lambda: mul_compiled(*xs, *ys), None),
             ("all-reduce over \"model\"", "AddN + copy", all_reduce_explicit,
              "CollectiveAllReduce (tf.function)", lambda: all_reduce_coll(*xs), None),
             ("all-gather over \"model\"", "ConcatV2 per device", all_gather_explicit,
              "collective all-gather (tf.function)", lambda: all_gather_coll(*xs),
              tf.transpose),
             ("reduce-scatter over \"model\"", "all-reduce + slice",
              reduce_scatter_via_all_reduce, "explicit reduce-scatter (eager)",
              reduce_scatter_explicit, None)]
    for _, _, explicit, _, other, post in cases:  # the same results first
        for a, b in zip(explicit(), other()):
            b = post(b) if post is not None else b
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    configs = []
    for case, name_a, fn_a, name_b, fn_b, _ in cases:
        configs += [Config(case, name_a, fn_a), Config(case, name_b, fn_b)]
    return configs


def ratios(configs):
    """Per case: (case, explicit, alternative, median of the same-round ratios
    alternative / explicit, their quartiles)."""
    out = []
    for a, b in zip(configs[::2], configs[1::2]):
        out.append((a.case, a.impl, b.impl,
                    _common.median([y / x for x, y in zip(a.times, b.times)]),
                    _common.round_ratio_quartiles(b.times, a.times)))
    return out


def plot(rows, plt):
    fig, ax = plt.subplots(figsize=(9, 4.6))
    _common.ratio_panel(
        ax, ["%s\n%s" % (case, textwrap.fill("%s vs. %s" % (a, b), 30))
             for case, a, b, _, _ in rows],
        [("alternative / explicit", "tab:orange", [r[3] for r in rows],
          [r[4] for r in rows])],
        "alternative's time / explicit ops' time (log)",
        "TensorFlow's collectives and compiled ops relative to oh.Mesh's explicit eager "
        "ops\n(> 1: explicit faster; median and quartiles of same-round ratios)")
    fig.suptitle("tf-ophandlers: oh.Mesh communication choices, 2x2 mesh of four logical "
                 "CPUs (same run)", fontsize=10)
    return fig


def render(configs, args, info, elapsed, png_name, plotted):
    rows = []
    for a, b in zip(configs[::2], configs[1::2]):
        q1, q3 = _common.round_ratio_quartiles(b.times, a.times)
        ratio = _common.median([y / x for x, y in zip(a.times, b.times)])
        rows.append([a.case, a.impl, "%.0f" % (_common.median(a.times) * 1e6), b.impl,
                     "%.0f" % (_common.median(b.times) * 1e6),
                     "**%.2f×** (%.2f–%.2f)" % (ratio, q1, q3)])
    L = ["## `oh.Mesh` communication choices (`benchmarks/mesh_communication.py`)", "",
         "What oh.Mesh issues (explicit eager ops) against TensorFlow's collectives and "
         "compiled per-op functions, 2×2 mesh of four logical CPUs, 64×64 float32 shards; "
         "one process, configurations interleaved in shuffled order, %d rounds of %d calls%s. "
         "Medians per call in µs; the ratio is the median of the same-round ratios "
         "alternative / explicit (quartiles in parentheses). Machine: %s, %s CPUs; it was "
         "shared with other jobs while measuring (load average %.1f at the end). Run on "
         "%s; run time %.0f s." % (args.rounds, args.calls,
                                   " (`--quick`: noisy)" if args.quick else "",
                                   info.get("cpu", "?"), info.get("nproc", "?"),
                                   os.getloadavg()[0], info.get("date", "?"), elapsed), "",
         _common.image_md("alternative / explicit per case", png_name, plotted), "",
         _common.md_table(["case", "explicit (oh.Mesh)", "µs", "alternative", "µs",
                           "alternative / explicit"], rows), "",
         "A ratio above 1 means oh.Mesh's explicit eager ops are faster on this machine, "
         "and oh.Mesh keeps them: a multi-device function call (compiled op or collective) "
         "costs more than the few eager ops it replaces when the devices are logical CPUs "
         "of one process; collectives add their launcher's ordering and rendezvous. An "
         "explicit reduce-scatter is more eager ops than all-reduce + slice on a 2-device "
         "group."]
    return "\n".join(L), None


def main(argv=None):
    args = _common.parse_args(argv, __doc__, SECTION, rounds=(7, 2),
                              counts=[("calls", "calls per case and round", 100, 10)])
    start = time.time()
    configs = make_configs(np.random.default_rng(0))
    _common.run_rounds(configs, args.rounds, lambda cfg: args.calls)
    info, elapsed = _common.machine_info(), time.time() - start
    rows = ratios(configs)
    _, png_path = _common.publish(
        args.out, SECTION, lambda plt: plot(rows, plt),
        lambda png_name, plotted: render(configs, args, info, elapsed, png_name, plotted))
    for case, _, _, ratio, _ in rows:
        print("%-30s alternative / explicit %.2fx" % (case, ratio))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
