"""`oh.DataFormat()` (a channels-first model run channels-last on the CPU) against the
channels-last twin of the same model in plain TensorFlow, in one process.

The model is a small CNN (Conv2D 3x3, BatchNormalization, ReLU, MaxPooling2D,
DepthwiseConv2D, a 1x1 Conv2D, GlobalAveragePooling2D, Dense) built twice with Keras 3,
`data_format="channels_first"` and `"channels_last"`, with the same weights; input
batch 16 of 3x64x64 (NCHW for the channels-first model, NHWC for its twin). Inference
(`training=False`). Configurations, interleaved in shuffled order every round:

  eager        twin(x_nhwc) in plain TensorFlow  vs  with oh.DataFormat(): cf(x_nchw)
  function     tf.function(twin) in plain TF     vs  with oh.DataFormat(): tf.function(cf)
               (replayed once into a cached channels-last function, then called)
  saved model  the twin's `model.export` loaded   vs  the channels-first export loaded,
               called plainly                         called under oh.DataFormat()

and then, against oneDNN's own NCHW path, one subprocess per TF_ENABLE_ONEDNN_OPTS
setting (1, 0; read at TensorFlow's import), each timing eagerly and as a `tf.function`
the channels-first model in plain TensorFlow (oneDNN's kernels take NCHW; with oneDNN
off TensorFlow refuses it), under `oh.DataFormat()` and the twin, back to back in
shuffled order each round. Target: `oh.DataFormat()` at least 1.3x faster than the
plain channels-first model with oneDNN on, in both forms.

Before timing, each pair must agree (max abs difference <= 1e-4 relative; the script
exits non-zero otherwise), and the channels-first model is run without the handler: it
fails with TensorFlow's Eigen CPU kernels; where oneDNN's eager kernels accept NCHW (TF
2.21 with oneDNN on some CPUs; TF_ENABLE_ONEDNN_OPTS=0 restores the refusal) the
section says so instead of failing the run.
Writes the `data_format` section of docs/benchmarks.md and docs/data_format.png.

    python benchmarks/data_format.py            # full run (~1 min on 2 cores)
    python benchmarks/data_format.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import os
import random
import sys
import tempfile
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tf_ophandlers.core import move_axis  # noqa: E402

SECTION = "data_format"
CASES = (("eager", "Eager Keras call", 1.2), ("function", "tf.function (replayed)", 1.1),
         ("saved", "SavedModel function (replayed)", 1.1))
BATCH, SIZE = 16, 56
# A replayed call costs ~1/5 of an eager one: its rounds run this many times more calls,
# so that every round times each side for about as long (~0.1 s).
REPLAYED_CALLS = 4


def build(data_format):
    keras.utils.set_random_seed(0)
    cf = data_format == "channels_first"
    inp = keras.Input((3, SIZE, SIZE) if cf else (SIZE, SIZE, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", data_format=data_format)(inp)
    h = keras.layers.BatchNormalization(axis=1 if cf else -1)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D(2, data_format=data_format)(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", data_format=data_format)(h)
    h = keras.layers.Conv2D(64, 1, data_format=data_format)(h)
    h = keras.layers.GlobalAveragePooling2D(data_format=data_format)(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


class Config:
    def __init__(self, case, side, fn):
        self.case, self.side, self.fn, self.times, self.cpu = case, side, fn, [], []

    def run(self, n):
        """(wall seconds, process CPU seconds) per call over `n` calls."""
        return _common.warm_time_and_cpu(self.fn, 0, n)


def shuffled_rounds(groups, rounds, rng, measure, progress=False):
    """`rounds` rounds, each visiting the groups of `groups` (name -> list of members)
    in a fresh random order and calling `measure(members)` with the group's members in a
    fresh random order: the members of a group are timed a moment apart, and a drift of
    the machine over the run hits every group alike."""
    for r in range(rounds):
        names = list(groups)
        rng.shuffle(names)
        for name in names:
            members = list(groups[name])
            rng.shuffle(members)
            measure(members)
        if progress:
            print("round %d/%d done" % (r + 1, rounds), file=sys.stderr)


def run_pairs(configs, rounds, calls_of, seed=0):
    """Each round visits the cases in a fresh random order and times a case's two sides
    back to back as A B B A (which side is A: random), each block half of the round's
    calls: a drift of the machine within the pair hits both sides alike, and the
    same-round ratio compares times taken a fraction of a second apart. A side's time in
    a round is the mean of its two blocks (wall and process CPU time per call)."""
    by_case = {}
    for c in configs:
        by_case.setdefault(c.case, []).append(c)
    for c in configs:  # warm-up (untimed)
        c.run(max(1, calls_of(c) // 5))

    def abba(pair):
        half = {id(c): max(1, calls_of(c) // 2) for c in pair}
        blocks = {id(c): [] for c in pair}
        for c in pair + pair[::-1]:
            blocks[id(c)].append(c.run(half[id(c)]))
        for c in pair:
            c.times.append(sum(w for w, _ in blocks[id(c)]) / 2)
            c.cpu.append(sum(u for _, u in blocks[id(c)]) / 2)
    shuffled_rounds(by_case, rounds, random.Random(seed), abba, progress=True)


def twins(batch=None, saved=True):
    """The model channels-first and its channels-last twin with the same weights, their
    inputs (NCHW, NHWC) and their loaded SavedModels: (cf, cl, x, xl, s_cf, s_cl) (the
    last two None unless `saved`)."""
    cf, cl = build("channels_first"), build("channels_last")
    weights = [w * 0.5 + 0.1 for w in cf.get_weights()]
    cf.set_weights(weights)
    cl.set_weights(weights)
    x = tf.random.stateless_normal([batch or BATCH, 3, SIZE, SIZE], seed=[1, 2])
    xl = tf.transpose(x, [0, 2, 3, 1])
    if not saved:
        return cf, cl, x, xl, None, None
    tmp = tempfile.mkdtemp()
    cf.export(os.path.join(tmp, "cf"), verbose=False)
    cl.export(os.path.join(tmp, "cl"), verbose=False)
    s_cf = tf.saved_model.load(os.path.join(tmp, "cf"))
    s_cl = tf.saved_model.load(os.path.join(tmp, "cl"))
    return cf, cl, x, xl, s_cf, s_cl


def under(fn, arg):
    """A call of `fn(arg)` under a fresh `oh.DataFormat()` scope, as users write it."""
    def call():
        with oh.DataFormat():
            return fn(arg).numpy()
    return call


def make_configs():
    cf, cl, x, xl, s_cf, s_cl = twins()
    f_cf, f_cl = tf.function(lambda t: cf(t)), tf.function(lambda t: cl(t))

    pairs = {
        "eager": (lambda: cl(xl).numpy(), under(cf, x), lambda: cf(x)),
        "function": (lambda: f_cl(xl).numpy(), under(f_cf, x), lambda: f_cf(x)),
        "saved": (lambda: s_cl.serve(xl).numpy(), under(s_cf.serve, x), lambda: s_cf.serve(x)),
    }
    configs = []
    runs_plain = []  # cases TensorFlow ran channels-first without the handler (oneDNN)
    for case, (twin, ours, plain) in pairs.items():
        ref, got = twin(), ours()
        err = float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))
        if not err <= 1e-4:
            sys.exit("data_format: %s differs from the twin by %g" % (case, err))
        try:
            plain()
            runs_plain.append(case)
            print("data_format: note: the channels-first %s ran without the handler "
                  "(oneDNN's kernels accept NCHW here)" % case)
        except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError):
            pass
        configs += [Config(case, "twin", twin), Config(case, "oh", ours)]
    # Information: the one transpose the handler adds (the NCHW input to channels-last,
    # which it runs at rank 3: [N, C, H*W] -> [N, H*W, C]).
    x3 = tf.reshape(x, [BATCH, 3, SIZE * SIZE])
    configs.append(Config("transpose", "info", lambda: tf.transpose(x3, [0, 2, 1]).numpy()))
    # What a replay runs for it (core/move_axis.py).
    configs.append(Config("move", "info", lambda: move_axis.move_axis(x, True).numpy()))
    return configs, runs_plain


# -- against oneDNN's own NCHW path -------------------------------------------------------
#
# TensorFlow's x86 builds run eager ops and graphs with oneDNN's custom kernels unless
# TF_ENABLE_ONEDNN_OPTS=0; those accept NCHW convolutions and poolings that the Eigen
# kernels refuse, so there a channels-first model also runs without the handler. The
# setting is read when TensorFlow is imported: each one is measured in its own process
# (`--onednn-child`), which prints its rounds as JSON for the parent to tabulate.
ONEDNN_SETTINGS = (("1", "oneDNN on (`TF_ENABLE_ONEDNN_OPTS=1`)"),
                   ("0", "oneDNN off (`TF_ENABLE_ONEDNN_OPTS=0`)"))
ONEDNN_FORMS = (("eager", "eager Keras call"), ("function", "`tf.function`"))
# channels-first plain TF, under oh.DataFormat, the twin, and the twin given the
# channels-first input with one transpose to channels-last in its call ("moved": what a
# layout handler cannot go below, the move of its input being the one it must add).
ONEDNN_SIDES = ("plain", "oh", "twin", "moved")
ONEDNN_TARGET = 1.3  # oh.DataFormat at least this much faster than the plain NCHW path


def onednn_child(rounds, calls):
    """In a process whose TF_ENABLE_ONEDNN_OPTS is set: the channels-first model without
    the handler (oneDNN's NCHW path, if TensorFlow runs it), under `oh.DataFormat()` and
    the channels-last twin, eagerly and as a `tf.function`; the three sides of a form are
    timed back to back in shuffled order each round. Returns a JSON-able dict."""
    cf, cl, x, xl, _, _ = twins(saved=False)
    f_cf, f_cl = tf.function(lambda t: cf(t)), tf.function(lambda t: cl(t))
    f_moved = tf.function(lambda v: cl(tf.transpose(v, [0, 2, 3, 1])))
    sides = {"eager": {"plain": lambda: cf(x).numpy(), "oh": under(cf, x),
                       "twin": lambda: cl(xl).numpy(),
                       "moved": lambda: cl(tf.transpose(x, [0, 2, 3, 1])).numpy()},
             "function": {"plain": lambda: f_cf(x).numpy(), "oh": under(f_cf, x),
                          "twin": lambda: f_cl(xl).numpy(),
                          "moved": lambda: f_moved(x).numpy()}}
    refused = {}
    for form, fns in sides.items():
        ref = fns["twin"]()
        for side in ("oh", "moved", "plain"):
            try:
                got = fns[side]()
            except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as e:
                if side == "oh":
                    raise
                refused[form] = "%s: %s" % (type(e).__name__, e.message.split("\n")[0][:160])
                del fns[side]
                continue
            err = float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))
            if not err <= 1e-4:
                sys.exit("data_format: %s %s differs from the twin by %g" % (form, side, err))
    n_of = {"eager": calls, "function": calls * REPLAYED_CALLS}
    times = {form: {side: [] for side in fns} for form, fns in sides.items()}
    cpu = {form: {side: [] for side in fns} for form, fns in sides.items()}

    def one_by_one(members):
        for form, side in members:
            w, c = _common.warm_time_and_cpu(sides[form][side], 0, n_of[form])
            times[form][side].append(w)
            cpu[form][side].append(c)

    def measure():
        for fns in sides.values():  # warm-up
            for fn in fns.values():
                _common.warm_time_and_cpu(fn, 1, 2)
        groups = {form: [(form, side) for side in fns] for form, fns in sides.items()}
        shuffled_rounds(groups, rounds, random.Random(1), one_by_one)

    info = {}
    _common.measure_under_load(info, measure, freeze=True)
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel
    return {"setting": os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""),
            "onednn": bool(_pywrap_util_port.IsMklEnabled()),
            "other": info["other"], "refused": refused, "times": times, "cpu": cpu}


def _onednn_default():
    """How this process's TensorFlow runs its CPU ops, for the page."""
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    state = "on" if _pywrap_util_port.IsMklEnabled() else "off"
    if setting is None:
        return "on this machine the default is " + state
    return "this run's own process has it %s (`TF_ENABLE_ONEDNN_OPTS=%s`)" % (state, setting)


def onednn_side_by_side(args):
    """Runs `onednn_child` in one subprocess per setting; returns their results."""
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    results = []
    for setting, _ in ONEDNN_SETTINGS:
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=setting)
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--onednn-child",
             str(max(4, args.rounds // 2)), str(args.calls)],
            env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print("oneDNN setting %s measured" % setting, file=sys.stderr)
    return results


def onednn_summary(result):
    """Per form: each side's stats, and the same-round ratios plain / oh (how much faster
    the handler is than the NCHW path) and oh / twin, with their quartiles."""
    out = {}
    for form, _ in ONEDNN_FORMS:
        t, c = result["times"][form], result["cpu"][form]
        s = {side: _common.stats(t[side]) for side in t}
        s["oh_twin"] = _common.median([a / b for a, b in zip(t["oh"], t["twin"])])
        s["oh_twin_q"] = _common.round_ratio_quartiles(t["oh"], t["twin"])
        if "plain" in t:
            s["speedup"] = _common.median([a / b for a, b in zip(t["plain"], t["oh"])])
            s["speedup_q"] = _common.round_ratio_quartiles(t["plain"], t["oh"])
            s["speedup_cpu"] = _common.median([a / b for a, b in zip(c["plain"], c["oh"])])
            # What a handler running exactly the twin's work would reach, and one
            # running the twin's work plus the move of its channels-first input.
            s["bound"] = _common.median([a / b for a, b in zip(t["plain"], t["twin"])])
            s["bound_q"] = _common.round_ratio_quartiles(t["plain"], t["twin"])
            s["bound_moved"] = _common.median([a / b for a, b in zip(t["plain"], t["moved"])])
            s["bound_moved_q"] = _common.round_ratio_quartiles(t["plain"], t["moved"])
        s["oh_moved"] = _common.median([a / b for a, b in zip(t["oh"], t["moved"])])
        out[form] = s
    return out


def onednn_md(results):
    """The side-by-side table and its target bullets."""
    rows, bullets = [], []
    for (setting, label), result in zip(ONEDNN_SETTINGS, results):
        summary = onednn_summary(result)
        for form, title in ONEDNN_FORMS:
            s = summary[form]
            plain = ("%.2f" % (s["plain"]["t"] * 1e3) if "plain" in s else
                     "refused (%s)" % result["refused"].get(form, "?").split(":")[0])
            speed = ("%.2fx (IQR %.2f – %.2f; CPU %.2fx)" % (
                s["speedup"], s["speedup_q"][0], s["speedup_q"][1], s["speedup_cpu"])
                if "speedup" in s else "—")
            rows.append([label, title, plain, "%.2f" % (s["oh"]["t"] * 1e3),
                         "%.2f" % (s["twin"]["t"] * 1e3), "%.2f" % (s["moved"]["t"] * 1e3),
                         speed, "%.2fx" % s["bound"] if "bound" in s else "—",
                         "%.2fx" % s["bound_moved"] if "bound_moved" in s else "—",
                         "%.2fx (IQR %.2f – %.2f)" % (s["oh_twin"], s["oh_twin_q"][0],
                                                      s["oh_twin_q"][1]),
                         "%.2fx" % s["oh_moved"], result["other"]])
            if setting == "1":
                if "speedup" in s:
                    bullets.append(
                        "- %s, oneDNN on: `oh.DataFormat()` at least %.1fx faster than the "
                        "channels-first model on oneDNN's NCHW path: %.3fx (IQR %.2f – %.2f) "
                        "— %s%s" % (title, ONEDNN_TARGET, s["speedup"], s["speedup_q"][0],
                                    s["speedup_q"][1], _common.verdict(
                                        s["speedup"] >= ONEDNN_TARGET),
                                    "" if s["bound_moved"] >= ONEDNN_TARGET else
                                    " (the twin given the channels-first input, with its "
                                    "one transpose, is only %.2fx faster than the NCHW path "
                                    "here, the twin alone %.2fx; the handler runs at %.2fx "
                                    "the former's time)"
                                    % (s["bound_moved"], s["bound"], s["oh_moved"])))
                else:
                    bullets.append("- %s, oneDNN on: TensorFlow refused the channels-first "
                                   "model here (no NCHW path to compare with)" % title)
    table = _common.md_table(
        ["TensorFlow", "form", "channels-first, plain TF ms", "channels-first, "
         "oh.DataFormat() ms", "channels-last twin ms", "twin + input transpose ms",
         "plain / oh.DataFormat() (speed-up)", "plain / twin (bound)",
         "plain / (twin + transpose) (bound with the move)", "oh.DataFormat() / twin",
         "oh.DataFormat() / (twin + transpose)", "other load (cores)"], rows)
    return table, bullets


def main(argv=None):
    args = _common.parse_args(argv, __doc__, SECTION, (30, 4),
                              [("calls", "eager calls per round (replayed: x%d)"
                                % REPLAYED_CALLS, 10, 4)])
    start = time.perf_counter()
    info = _common.machine_info()
    info["keras"] = keras.__version__
    configs, runs_plain = make_configs()
    def calls_of(c):
        return args.calls * (1 if c.case == "eager" else REPLAYED_CALLS)

    _common.measure_under_load(info, lambda: run_pairs(configs, args.rounds, calls_of),
                               freeze=True)
    by = {(c.case, c.side): c for c in configs}
    summary = {}
    for case, _, _ in CASES:
        twin, ours = by[(case, "twin")], by[(case, "oh")]
        # The verdict's ratio: the median of the same-round ratios (each round's pair
        # timed back to back), not the ratio of the two medians, whose rounds differ.
        summary[case] = {
            "twin": _common.stats(twin.times), "oh": _common.stats(ours.times),
            "ratio": _common.median([a / b for a, b in zip(ours.times, twin.times)]),
            "ratio_q": _common.round_ratio_quartiles(ours.times, twin.times),
            "cpu": _common.median([a / b for a, b in zip(ours.cpu, twin.cpu)]),
            "cpu_q": _common.round_ratio_quartiles(ours.cpu, twin.cpu)}
    # The channels-first model against oneDNN's NCHW path, each oneDNN setting in its
    # own process (after this process's rounds: the two never run at once).
    onednn = onednn_side_by_side(args)
    elapsed = time.perf_counter() - start

    # oneDNN on, where TensorFlow ran the channels-first model: the speed-up target's panel.
    onednn_on = [onednn_summary(r) for (setting, _), r in zip(ONEDNN_SETTINGS, onednn)
                 if setting == "1"]
    onednn_on = onednn_on[0] if onednn_on and all(
        "speedup" in onednn_on[0][f] for f, _ in ONEDNN_FORMS) else None

    def draw_onednn(ax):
        forms = [onednn_on[f] for f, _ in ONEDNN_FORMS]
        _common.ratio_panel(
            ax, [title.strip("`") for _, title in ONEDNN_FORMS],
            [("oh.DataFormat()", "#3b7dd8", [s["speedup"] for s in forms],
              [s["speedup_q"] for s in forms]),
             ("bound with the move (twin + input transpose)", "#bbbbbb",
              [s["bound_moved"] for s in forms], [s["bound_moved_q"] for s in forms]),
             ("bound (twin alone)", "#777777", [s["bound"] for s in forms],
              [s["bound_q"] for s in forms])],
            "speed-up over the NCHW path (log)",
            "oneDNN on: channels-first model, speed-up over oneDNN's NCHW path",
            targets=[(0, len(forms) - 1, ONEDNN_TARGET, "target %.1fx" % ONEDNN_TARGET)])

    def draw(plt):
        if onednn_on is not None:
            fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8))
            draw_onednn(ax2)
        else:
            fig, ax = plt.subplots(figsize=(7, 3.6))
        xs = np.arange(len(CASES))
        for j, (side, color, label) in enumerate((("twin", "#999999", "channels-last twin"),
                                                   ("oh", "#3b7dd8", "oh.DataFormat()"))):
            vals = [summary[c][side]["t"] * 1e3 for c, _, _ in CASES]
            ax.bar(xs + (j - 0.5) * 0.38, vals, 0.36, color=color, label=label)
        for i, (c, _, _) in enumerate(CASES):
            ax.annotate("%.2fx" % summary[c]["ratio"],
                        (i + 0.19, summary[c]["oh"]["t"] * 1e3), ha="center",
                        textcoords="offset points", xytext=(0, 3), fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels([t for _, t, _ in CASES], fontsize=8)
        ax.set_ylabel("ms per call (median)")
        ax.set_title("channels-first CNN on the CPU: oh.DataFormat() vs channels-last twin",
                     fontsize=9)
        ax.legend(fontsize=8)
        return fig

    def render(png_name, plotted):
        L = _common.intro_md(
            "`oh.DataFormat()`: channels-first CNN on the CPU (`benchmarks/data_format.py`)",
            args.quick,
            "One process times a small CNN (Conv2D 3x3 (32), BatchNormalization, ReLU, "
            "MaxPooling2D, DepthwiseConv2D, 1x1 Conv2D (64), GlobalAveragePooling2D, "
            "Dense(10); Keras 3, inference) built channels-first and run under "
            "`oh.DataFormat()` against its channels-last twin with the same weights in "
            "plain TensorFlow, on a batch of %d images 3x%dx%d: eager calls, a "
            "`tf.function` of each model (the channels-first one replayed once through the "
            "handler into a cached channels-last function), and each model's "
            "`model.export` SavedModel loaded with `tf.saved_model.load` (its `serve` "
            "function, replayed the same way). Every call includes `.numpy()`; the "
            "handler's calls include entering `with oh.DataFormat():`. Before timing the "
            "outputs must agree with the twin (<= 1e-4) and the channels-first model is run "
            "without the handler (%s). After a warm-up pass, each of %d rounds visits the "
            "cases in shuffled order and times a case's two sides back to back as A B B A "
            "(A chosen at random), each block half of the round's calls: %d eager calls "
            "per side, %d for a replayed function or SavedModel (`time.perf_counter` and "
            "`time.process_time`, gc off); a side's time in a round is the mean of its two "
            "blocks. Tables give the median over rounds, the IQR of the rounds and the best "
            "round; the ratio to the twin (and the verdict) is the median of the "
            "same-round ratios, with their IQR, and the CPU-time column the same for the "
            "process's CPU time (every thread), which other processes on the machine "
            "disturb less than wall time."
            % (BATCH, SIZE, SIZE, "it failed in every case" if not runs_plain else
               "TensorFlow ran it in the %s case(s): this build's oneDNN eager kernels "
               "accept NCHW on this CPU, which TensorFlow's Eigen kernels refuse; "
               "`TF_ENABLE_ONEDNN_OPTS=0` restores the refusal" % ", ".join(runs_plain),
               args.rounds, args.calls, args.calls * REPLAYED_CALLS),
            _common.machine_md(info, len(configs), elapsed),
            _common.image_md("time per call, oh.DataFormat vs twin", png_name, plotted))
        tr = _common.stats(by[("transpose", "info")].times)
        mv = _common.stats(by[("move", "info")].times)
        rows = []
        for case, title, _ in CASES:
            s = summary[case]
            for side, label in (("twin", "channels-last twin, plain TF"),
                                ("oh", "channels-first, oh.DataFormat()")):
                st = s[side]
                ratio = ("1.00x" if side == "twin" else "%.2fx (IQR %.2f – %.2f)"
                         % (s["ratio"], s["ratio_q"][0], s["ratio_q"][1]))
                cpu = ("1.00x" if side == "twin" else "%.2fx (IQR %.2f – %.2f)"
                       % (s["cpu"], s["cpu_q"][0], s["cpu_q"][1]))
                rows.append([title, label, "%.2f" % (st["t"] * 1e3), ratio,
                             "%.2f – %.2f" % (st["q1"] * 1e3, st["q3"] * 1e3),
                             "%.2f" % (st["min"] * 1e3), cpu])
        rows.append(["information", "the input's transpose alone (`[N, 3, H*W] -> [N, H*W, 3]`)",
                     "%.2f" % (tr["t"] * 1e3), "—", "%.2f – %.2f" % (tr["q1"] * 1e3,
                                                                 tr["q3"] * 1e3),
                     "%.2f" % (tr["min"] * 1e3), "—"])
        rows.append(["information", "the same move as one OhMoveAxis (what a replay runs)",
                     "%.2f" % (mv["t"] * 1e3), "—", "%.2f – %.2f" % (mv["q1"] * 1e3,
                                                                 mv["q3"] * 1e3),
                     "%.2f" % (mv["min"] * 1e3), "—"])
        L += [_common.md_table(["case", "model", "ms/call", "ratio to twin",
                                "IQR ms/call", "best round ms/call", "CPU-time ratio"], rows),
              ""]
        L += ["Under the handler the model runs the twin's channels-last kernels plus one "
              "transpose of its NCHW input (a 3-channel image batch; in a replayed function "
              "as one `OhMoveAxis`, the package's kernel for this move (the last row; the "
              "row before is the same move as a rank-3 Transpose, `[N, 3, H*W] -> "
              "[N, H*W, 3]`), eagerly as one 4-D Transpose: on this machine the 4-D and "
              "rank-3 Transposes cost the same and the rank-3 form adds two reshapes' eager "
              "op calls); the twin is given its input already channels-last. Eagerly, each "
              "op also crosses the handler stack: ops the handler leaves alone (variable "
              "reads and ops on constants included) are forwarded in C++, the channels-first "
              "ops, transposes and ops on channels-last data call its Python hook (16 per "
              "call, all from C++); Keras's channels-first layers run 8 ops the twin does "
              "not (BatchNormalization reshapes its statistics to [1, C, 1, 1]; pooling and "
              "the depthwise convolution transpose to channels-last and back, which the "
              "handler composes away without moving data). TensorFlow's C fast path refuses "
              "Python tuples and Keras variables as inputs, so in plain TensorFlow those ops, "
              "and every op taking a Keras variable (in the twin too), go through its slower "
              "Python eager fallback; under the handler's scope they are converted and run "
              "in C without TensorFlow's stack capture (`cc/fast/fast_convert.cc`), so the "
              "handler's eager call can run fewer instructions than the twin's. A replayed "
              "call adds the input's move and the replay's per-call Python (opening the "
              "scope, splitting the 13 arguments, one cache lookup, wrapping the result); "
              "the arguments are not copied. The replayed function is called with "
              "TensorFlow's function-call attributes, so the runtime optimizes it with "
              "grappler as it does the twin's (Conv2D and Dense fused with their biases). "
              "The SavedModel's replayed function has the same nodes as the tf.function's (one "
              "more NoOp and Identity from the loaded function's nested call, which the "
              "replay inlines) and takes the same per-call path (13 arguments, one cache "
              "lookup); the Python a loaded function adds per call (binding its "
              "arguments) runs for the twin as well, so the two replayed cases should "
              "give the same ratio, and a gap between them is measurement noise.", "",
              "Where a call's instructions go: `benchmarks/data_format_callgrind.py "
              "--breakdown` counts them with callgrind (one intra-op thread, tiny input) "
              "per call for the twin and the handler, split into the handler's C++ entry "
              "points (its device callbacks, Python hooks and shape queries, the ops they "
              "execute, the scope) and TensorFlow's Python op layer (fast-path and "
              "fallback executes, stack captures); `benchmarks/data_format_callgrind.py` "
              "alone counts entering and leaving the scope. Instruction counts do not "
              "depend on other processes' load, unlike the times above.", ""]
        onednn_table, onednn_bullets = onednn_md(onednn)
        L += ["### Against oneDNN's NCHW path", "",
              "TensorFlow runs ops with oneDNN's custom kernels with "
              "`TF_ENABLE_ONEDNN_OPTS=1`, its default on x86 CPUs with AVX-512 VNNI/BF16 or "
              "AMX (elsewhere the default is off; %s; the variable is read when "
              "TensorFlow is imported); those kernels "
              "accept NCHW convolutions and pools, so there the channels-first model also "
              "runs without the handler, on oneDNN's own NCHW path. One subprocess per "
              "setting times the same models four ways, back to back in shuffled order "
              "each round (%d rounds; %d eager calls, %d `tf.function` calls per side and "
              "round; gc off): the channels-first model in plain TensorFlow, the same "
              "model under `oh.DataFormat()` (a fresh scope per call), the channels-last "
              "twin, and the twin given the channels-first input with one "
              "`tf.transpose` to channels-last in its call (*twin + input transpose*). "
              "*Speed-up* is the median of the same-round ratios plain / "
              "`oh.DataFormat()` (IQR, and the same for process CPU time); *bound* the "
              "same-round plain / twin, the speed-up a handler adding nothing to the "
              "twin's work would reach; *bound with the move* the same-round plain / "
              "(twin + transpose): under the handler the model runs the twin's kernels "
              "plus one move of its channels-first input, which no layout handler can "
              "avoid, so this is what one adding nothing else would reach. The last "
              "column is the CPU other processes used meanwhile. With oneDNN off, "
              "TensorFlow's Eigen kernels refuse the channels-first model."
              % (_onednn_default(), max(4, args.rounds // 2), args.calls,
                 args.calls * REPLAYED_CALLS), "",
              onednn_table, ""]
        bullets = list(onednn_bullets)
        try:
            loaded = float(info["other"]) > 0.5
        except ValueError:  # "n/a"
            loaded = False
        for case, title, target in CASES:
            r = summary[case]["ratio"]
            lo, hi = summary[case]["ratio_q"]
            note = ""
            if loaded and (lo <= target < hi or hi - lo > 0.1):
                # Other processes used the cores: a median ratio whose same-round IQR is
                # wide or straddles the target says nothing either way.
                note = (" (not conclusive: other processes used %s cores, same-round "
                        "ratio IQR %.2f – %.2f)" % (info["other"], lo, hi))
            bullets.append("- %s at most %.1fx the channels-last twin's time: %.2fx — %s%s"
                           % (title, target, r, _common.verdict(r <= target), note))
        L += _common.targets_md(bullets, SECTION, args.quick, png_name, plural=True)
        return "\n".join(L), None

    _, png = _common.publish(args.out, SECTION, draw, render)
    _common.print_wrote(args.out, png, time.perf_counter() - start)
    for case, _, target in CASES:
        print("%s: %.2fx the twin (target <= %.1fx)" % (case, summary[case]["ratio"], target))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--onednn-child"]:
        import json  # noqa: E402
        print(json.dumps(onednn_child(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
