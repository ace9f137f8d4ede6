"""`oh.Recompute()` (automatic gradient checkpointing) against no checkpointing and against
`tf.recompute_grad` with hand-chosen segments: peak memory and step time of one training
step (loss and gradients) of a deep MLP.

The model is the issue's: `layers` Dense layers of width 64 with tanh, batch 2048
(`h = tanh(h @ W + b)`, loss `mean(h * h)`); activations dominate memory. Configurations,
all measured in one process:

  tf.GradientTape                 no checkpointing, TensorFlow's tape
  oh.GradientTape                 no checkpointing, the handler tape (the baseline of the
                                  targets: oh.Recompute composes with it)
  oh.Recompute()                  inside oh.GradientTape; sqrt(n) segments, no annotation
  oh.Recompute(save=("MatMul",))  keeps matmul outputs, recomputes bias adds and tanh
  oh.Recompute(memory_budget=B)   three budgets between the minimum and no checkpointing
  tf.recompute_grad               tf.GradientTape over the model cut by hand into
                                  sqrt(layers) functions wrapped in tf.recompute_grad

Peak memory is TensorFlow's own: the process runs with `TF_CPU_ALLOCATOR_USE_BFC=true`, and
each configuration's step runs after `tf.config.experimental.reset_memory_stats("CPU:0")`;
the number reported is `get_memory_info("CPU:0")["peak"]` minus the bytes in use at the
reset (weights, inputs): the step's own peak. Gradients of every configuration must equal
tf.GradientTape's (rtol 1e-5) or the script exits non-zero. Step times: configurations
interleaved in shuffled order each round, the median over rounds. Each Recompute handler
is created once and reused per step (`with rc:`), so from its second step the sqrt policy
knows the computation's size (and the budget policy can plan). Writes the `recompute`
section of docs/benchmarks.md and docs/recompute.png.

    python benchmarks/recompute.py              # the issue's size: 256 layers, batch 2048
    python benchmarks/recompute.py --quick      # 64 layers, batch 512 (smoke run)
"""
import os
import sys
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow starts: peak bytes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _common  # noqa: E402  (also puts the repository on sys.path)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

WIDTH = 64
NAMES = {
    "tf": "tf.GradientTape (no checkpointing)",
    "tape": "oh.GradientTape (no checkpointing)",
    "recompute": "oh.Recompute() (sqrt)",
    "save": "oh.Recompute(save=(\"MatMul\",))",
    "budget1": "oh.Recompute(memory_budget=B1)",
    "budget": "oh.Recompute(memory_budget=B2)",
    "budget3": "oh.Recompute(memory_budget=B3)",
    "recompute_grad": "tf.recompute_grad, sqrt(n) hand-made segments",
}


class MLP:
    def __init__(self, layers, width, batch, seed=0):
        rng = np.random.default_rng(seed)
        self.ws = [tf.Variable(rng.standard_normal((width, width)).astype(np.float32)
                               / width ** 0.5) for _ in range(layers)]
        self.bs = [tf.Variable(rng.standard_normal(width).astype(np.float32) * 0.1)
                   for _ in range(layers)]
        self.x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))
        self.variables = self.ws + self.bs
        per = max(1, int(round(layers ** 0.5)))
        self.segments = [tf.recompute_grad(self._layers(i, min(i + per, layers)))
                         for i in range(0, layers, per)]

    def _layers(self, start, stop):
        ws, bs = self.ws[start:stop], self.bs[start:stop]

        def run(h):
            for w, b in zip(ws, bs):
                h = tf.tanh(tf.matmul(h, w) + b)
            return h
        return run

    def loss(self, x):
        h = x
        for w, b in zip(self.ws, self.bs):
            h = tf.tanh(tf.matmul(h, w) + b)
        return tf.reduce_mean(h * h)

    def loss_segments(self, x):
        h = x
        for segment in self.segments:
            h = segment(h)
        return tf.reduce_mean(h * h)


def make_step(model, key, recompute=None):
    """A function running one training step (loss and gradients) of `key`."""
    if key == "tf":
        def step():
            with tf.GradientTape() as tape:
                loss = model.loss(model.x)
            return tape.gradient(loss, model.variables)
    elif key == "recompute_grad":
        def step():
            with tf.GradientTape() as tape:
                loss = model.loss_segments(model.x)
            return tape.gradient(loss, model.variables)
    elif key == "tape":
        def step():
            with oh.GradientTape() as tape:
                loss = model.loss(model.x)
            return tape.gradient(loss, model.variables)
    else:
        def step():
            with oh.GradientTape() as tape:
                with recompute:
                    loss = model.loss(model.x)
            return tape.gradient(loss, model.variables)
    return step


def peak_bytes(step):
    """The step's own peak (BFC allocator peak minus the bytes in use before it)."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    grads = step()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
    del grads
    return peak


def measure_mlp(layers=256, width=WIDTH, batch=2048, configs=tuple(NAMES), check=True):
    """{key: {"peak": bytes, "step": callable, "handler": Recompute or None, ...}}; the
    budget configurations also give "budget" (bytes). Raises AssertionError if a
    configuration's gradients differ from tf.GradientTape's."""
    model = MLP(layers, width, batch)
    reference = make_step(model, "tf")()
    out = {}
    handlers = {"recompute": oh.Recompute(), "save": oh.Recompute(save=("MatMul",))}
    need_plan = any(k.startswith("budget") for k in configs)
    if need_plan:
        probe = oh.Recompute()
        make_step(model, "recompute", probe)()  # learns the size
        minimum = probe.minimum_budget()
        total = probe.stats["computed"]
        for k, frac in (("budget1", 0.15), ("budget", 0.4), ("budget3", 0.7)):
            budget = int(minimum + frac * (total - minimum))
            handlers[k] = oh.Recompute(memory_budget=budget)
            out.setdefault(k, {})["budget"] = budget
    for key in configs:
        handler = handlers.get(key)
        step = make_step(model, key, handler)
        grads = step()  # warm-up: traces, and a Recompute handler learns the size
        if check:
            for g, r in zip(grads, reference):
                np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6,
                                           err_msg="%s: gradients differ" % NAMES[key])
        del grads
        entry = out.setdefault(key, {})
        entry.update(peak=peak_bytes(step), step=step, handler=handler)
        if handler is not None:
            entry["stats"] = handler.stats
    return out


class _Config:
    def __init__(self, key, step):
        self.key, self.step, self.times = key, step, []

    def run(self, n):
        return _common.time_per_call(self.step, n)


def main(argv=None):
    args = _common.parse_args(argv, __doc__, "recompute", (5, 2),
                              [("layers", "layers of the MLP", 256, 64),
                               ("batch", "batch size", 2048, 512)], what="steps")
    start = time.perf_counter()
    info = _common.machine_info()
    results = measure_mlp(args.layers, WIDTH, args.batch)
    configs = [_Config(k, r["step"]) for k, r in results.items()]

    def timed():
        _common.run_rounds(configs, args.rounds, lambda cfg: 1)
    _common.measure_under_load(info, timed)
    elapsed = time.perf_counter() - start
    summary = {}
    for cfg in configs:
        r = results[cfg.key]
        summary[cfg.key] = dict(peak=r["peak"], ms=_common.median(cfg.times) * 1e3,
                                budget=r.get("budget"), stats=r.get("stats"))
    base = summary["tape"]
    lines = []
    for k, s in summary.items():
        lines.append("%-45s peak %8.1f MB  (%.1fx lower than oh.GradientTape)  step %7.1f ms"
                     " (%.2fx)" % (NAMES[k], s["peak"] / 1e6, base["peak"] / max(s["peak"], 1),
                                   s["ms"], s["ms"] / base["ms"]))
    print("\n".join(lines))
    png = os.path.join(os.path.dirname(os.path.abspath(args.out)), "recompute.png")
    _plot(summary, png)
    _common.write_section(args.out, "recompute", render_md(summary, info, args, elapsed))
    print("wrote %s and %s (%.0f s)" % (args.out, png, elapsed))


def render_md(summary, info, args, elapsed):
    base, tf_ = summary["tape"], summary["tf"]
    rows = []
    for k, s in summary.items():
        name = NAMES[k] if s["budget"] is None else NAMES[k].replace(
            "B1", "%.0f MB" % (s["budget"] / 1e6)).replace(
            "B2", "%.0f MB" % (s["budget"] / 1e6)).replace("B3", "%.0f MB" % (s["budget"] / 1e6))
        rows.append((name, "%.1f" % (s["peak"] / 1e6),
                     "%.1fx" % (base["peak"] / max(s["peak"], 1)),
                     "%.1fx" % (tf_["peak"] / max(s["peak"], 1)),
                     "%.0f" % s["ms"], "%.2fx" % (s["ms"] / base["ms"]),
                     "%.2fx" % (s["ms"] / tf_["ms"]),
                     "-" if s["budget"] is None else
                     ("yes" if s["peak"] <= s["budget"] else "**no**")))
    rc = summary["recompute"]
    budgets = [summary[k] for k in ("budget1", "budget", "budget3")]
    held = all(b["peak"] <= b["budget"] for b in budgets)
    falls = all(a["ms"] >= b["ms"] for a, b in zip(budgets, budgets[1:]))
    mem = base["peak"] / max(rc["peak"], 1)
    slow = rc["ms"] / base["ms"]
    L = ["## recompute: oh.Recompute() (gradient checkpointing)", "",
         "`python benchmarks/recompute.py%s` — deep MLP, %d layers of width %d, batch %d, "
         "tanh; one step = loss and gradients of all weights. Peak = TensorFlow's BFC CPU "
         "allocator peak during the step minus the bytes in use before it "
         "(`TF_CPU_ALLOCATOR_USE_BFC=true`, `reset_memory_stats`, `get_memory_info`). "
         "Step time: median of %d interleaved rounds. Gradients of every configuration "
         "equal tf.GradientTape's (rtol 1e-5, checked). Machine: %s, %s cores, TF %s, %s; "
         "other processes used %s cores on average while timing (the machine was shared); "
         "%.0f s." % (" --quick" if args.quick else "", args.layers, WIDTH, args.batch,
                      args.rounds, info["cpu"], info["nproc"], info["tensorflow"],
                      info["date"], info.get("other", "n/a"), elapsed), "",
         "![peak memory and step time](recompute.png)", "",
         _common.md_table(("configuration", "peak MB", "memory vs oh tape",
                           "memory vs tf tape", "step ms", "time vs oh tape",
                           "time vs tf tape", "peak <= budget"), rows), "",
         "Targets (issue 19, same run):", "",
         "- peak memory >= 5x lower with `oh.Recompute()` than without, under "
         "oh.GradientTape: **%.1fx** (%s)" % (mem, "met" if mem >= 5 else "not met"),
         "- step time <= 1.4x: **%.2fx** (%s)" % (slow, "met" if slow <= 1.4 else "not met"),
         "- `memory_budget=` holds for three budgets (peak <= budget): %s; time falls as "
         "the budget rises: %s" % ("met" if held else "**not met**",
                                   "yes" if falls else "**no** (within noise?)"),
         "- no user annotation (`tf.recompute_grad` needs the segments chosen by hand)."]
    return "\n".join(L)


def _plot(summary, path):
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    keys = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [NAMES[k].replace("oh.Recompute", "Recompute").replace(
        "(no checkpointing)", "") for k in keys]
    a.barh(labels, [summary[k]["peak"] / 1e6 for k in keys], color="tab:blue")
    a.set_xlabel("peak memory of one step (MB)")
    a.invert_yaxis()
    b.barh(labels, [summary[k]["ms"] for k in keys], color="tab:orange")
    b.set_xlabel("step time (ms, median)")
    b.invert_yaxis()
    b.set_yticklabels([])
    fig.suptitle("Deep MLP: gradient checkpointing")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
