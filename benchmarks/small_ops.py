"""Per-op speed: the figures of its target table in one run.

Configurations, each timed in one process with the TensorFlow counterpart interleaved
(shuffled order every round), as the time of one call:

  chain16     `h = tf.tanh(h) * 1.01`, 100 times (200 ops) on x [16, 16], then `.numpy()`
  chain256    the same chain on x [256, 256] (kernels dominate)
  tape100     `h = tf.sin(h) * 1.01`, 50 times (100 ops) on a [4, 4] watched tensor under
              a tape opened per call, forward only (no gradient call)
  pe-grads    per-example gradients of an MLP (benchmarks/vectorized_map.py's
              `Workload`: 64 -> 128 relu -> 10, batch 256), op by op

and the ratios:

  pass-through   `with oh.OpHandler():` chain16 / eager chain16
  tape forward   oh.GradientTape / tf.GradientTape on tape100
  fresh Lazy     eager chain16 / `with oh.Lazy():` chain16, a new handler per call
  Lazy XLA       `with oh.Lazy(jit_compile=True):` chain256 (a new handler per call) /
                 `tf.function(chain, jit_compile=True)` chain256
  (chunked)      the two Lazy figures again with `chunk_ops=CHUNK_OPS`: compiled chunks
                 launched asynchronously while recording goes on (information: the
                 default is `chunk_ops=None`; overlap needs a free core)
  (collector on) Lazy XLA again, both sides timed with the garbage collector enabled,
                 as a program runs them (information)
  vectorized_map eager `tf.vectorized_map` / `oh.vectorized_map` on pe-grads (the mapped
                 function uses `tf.GradientTape` / `oh.GradientTape`)
  Async          `with runner:` chain16 (one `oh.Async()` created once) / eager chain16

Before timing every configuration must give the eager result (allclose), a fresh
`oh.Lazy()` of an already seen structure must hit the process-wide cache (no compile),
and `Lazy(jit_compile=True)` must call an XLA-compiled function. The script exits
non-zero otherwise. Writes the `small_ops` section of docs/benchmarks.md and
docs/small_ops.png.

    python benchmarks/small_ops.py            # full run (~2 min on 2 loaded cores)
    python benchmarks/small_ops.py --quick    # smoke run (noisy)
"""
import logging
import os
import re
import sys
import textwrap
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

import vectorized_map as _vm  # noqa: E402  (benchmarks/vectorized_map.py's Workload)

SECTION = "small_ops"
TOLERANCE = 1e-4
CHUNK_OPS = 64  # the chunked Lazy configurations' `chunk_ops`


def chain(h):
    for _ in range(100):
        h = tf.tanh(h) * 1.01
    return h


def sin_chain(h):
    for _ in range(50):
        h = tf.sin(h) * 1.01
    return h


class Workload:
    def __init__(self):
        self.x16 = tf.random.stateless_uniform([16, 16], seed=[1, 2])
        self.x256 = tf.random.stateless_uniform([256, 256], seed=[1, 2])
        self.a4 = tf.random.stateless_uniform([4, 4], seed=[3, 4])
        self.xla = tf.function(chain, jit_compile=True)
        self.graph = tf.function(chain)
        self.runner = oh.Async()
        self.vm = _vm.Workload()

    # chain16
    def eager16(self):
        return chain(self.x16).numpy()

    def pass16(self):
        with oh.OpHandler():
            return chain(self.x16).numpy()

    def lazy16(self):
        with oh.Lazy():
            return chain(self.x16).numpy()

    def lazy16c(self):
        with oh.Lazy(chunk_ops=CHUNK_OPS):
            return chain(self.x16).numpy()

    def async16(self):
        with self.runner:
            return chain(self.x16).numpy()

    # chain256
    def eager256(self):
        return chain(self.x256).numpy()

    def xla256(self):
        return self.xla(self.x256).numpy()

    def graph256(self):
        return self.graph(self.x256).numpy()

    def lazy256(self):
        with oh.Lazy():
            return chain(self.x256).numpy()

    def lazyxla256(self):
        with oh.Lazy(jit_compile=True):
            return chain(self.x256).numpy()

    # the same two with the garbage collector on (Config.run: keys ending in "gc")
    xla256gc = xla256
    lazyxla256gc = lazyxla256

    def lazyxla256c(self):
        with oh.Lazy(jit_compile=True, chunk_ops=CHUNK_OPS):
            return chain(self.x256).numpy()

    # tape100 (forward only)
    def tape_tf(self):
        with tf.GradientTape() as t:
            t.watch(self.a4)
            h = sin_chain(self.a4)
        return h

    def tape_oh(self):
        with oh.GradientTape() as t:
            t.watch(self.a4)
            h = sin_chain(self.a4)
        return h

    # pe-grads
    def vm_oh(self):
        return self.vm.grads_oh()

    def vm_tf(self):
        return self.vm.grads_eager()


CONFIGS = (
    # key, description, calls per round (full, quick)
    ("eager16", "eager chain16", (10, 3)),
    ("pass16", "oh.OpHandler() (pass-through) chain16", (10, 3)),
    ("lazy16", "fresh oh.Lazy() chain16", (10, 3)),
    ("lazy16c", "fresh oh.Lazy(chunk_ops=%d) chain16 (information)" % CHUNK_OPS, (10, 3)),
    ("async16", "oh.Async() chain16", (10, 3)),
    ("eager256", "eager chain256", (3, 1)),
    ("xla256", "tf.function(jit_compile=True) chain256", (3, 1)),
    ("graph256", "tf.function chain256 (information)", (3, 1)),
    ("lazy256", "fresh oh.Lazy() chain256 (information)", (3, 1)),
    ("lazyxla256", "fresh oh.Lazy(jit_compile=True) chain256", (3, 1)),
    ("lazyxla256c", "fresh oh.Lazy(jit_compile=True, chunk_ops=%d) chain256 (information)"
     % CHUNK_OPS, (3, 1)),
    ("xla256gc", "tf.function(jit_compile=True) chain256, collector on (information)",
     (10, 2)),
    ("lazyxla256gc", "fresh oh.Lazy(jit_compile=True) chain256, collector on (information)",
     (10, 2)),
    ("tape_tf", "tf.GradientTape tape100 forward", (20, 5)),
    ("tape_oh", "oh.GradientTape tape100 forward", (20, 5)),
    ("vm_tf", "eager tf.vectorized_map pe-grads", (1, 1)),
    ("vm_oh", "oh.vectorized_map pe-grads (op by op)", (5, 2)),
)
# figure, numerator, denominator, target, higher is better
FIGURES = (
    ("pass-through Python handler per small op / plain eager", "pass16", "eager16",
     1.25, False),
    ("100-op small chain forward under the tape, oh / tf", "tape_oh", "tape_tf",
     1.3, False),
    ("`with oh.Lazy():` fresh per call, 200 small ops on 16x16: eager / lazy", "eager16",
     "lazy16", 1.0, True),
    ("`oh.Lazy(jit_compile=True)`, 200 elementwise ops on 256x256: time / "
     "`tf.function(jit_compile=True)`", "lazyxla256", "xla256", 1.2, False),
    ("(information) the same, `chunk_ops=%d`: eager / lazy" % CHUNK_OPS, "eager16",
     "lazy16c", 1.0, True),
    ("(information) the same, `chunk_ops=%d`: time / `tf.function(jit_compile=True)`"
     % CHUNK_OPS, "lazyxla256c", "xla256", 1.3, False),
    ("(information) `oh.Lazy(jit_compile=True)` per call with the garbage collector on "
     "(as a program runs): time / `tf.function(jit_compile=True)`, collector on",
     "lazyxla256gc", "xla256gc", 1.2, False),
    ("per-example grads op by op: eager `tf.vectorized_map` / `oh.vectorized_map`",
     "vm_tf", "vm_oh", 15.0, True),
    ("`oh.Async` per tiny op / eager", "async16", "eager16", 1.5, False),
)


class SanityError(AssertionError):
    pass


class Floor(oh.OpHandler):
    """The recording floor: a handler whose execute hook returns a prepared value and
    does nothing else (TensorFlow's op wrappers, the dispatcher and one Python hook call
    per op): what recording an op costs before Lazy's own work."""

    needs_copy = staticmethod(oh.never_copy)

    def __init__(self, value):
        self.out = [value]

    def execute(self, op, inputs):
        return self.out


class Config:
    def __init__(self, w, key, desc, n):
        self.key, self.desc, self.n = key, desc, n
        self.call = getattr(w, key)
        self.times = []

    def run(self, n):
        if not self.key.endswith("gc"):
            return _common.warm_time(self.call, 1, n)
        # The collector on, as a program runs: what the objects a call leaves for it
        # cost (young collections; a rare full one lands in some rounds).
        self.call()
        clock = time.perf_counter
        start = clock()
        for _ in range(n):
            self.call()
        return (clock() - start) / n


def _close(name, got, want):
    got, want = tf.nest.flatten(got), tf.nest.flatten(want)
    for g, e in zip(got, want):
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape or not np.allclose(g, e, rtol=TOLERANCE, atol=TOLERANCE):
            raise SanityError("%s: result differs from the reference" % name)


def check(w):
    """Values equal the references; fresh Lazy scopes hit the shared cache; the XLA
    Lazy runs an XLA-compiled function."""
    _close("pass16", w.pass16(), w.eager16())
    _close("async16", w.async16(), w.eager16())
    for name in ("lazy16", "lazy256"):
        _close(name, getattr(w, name)(), chain(w.x16 if name == "lazy16" else w.x256))
    lazy = oh.Lazy()
    with lazy:
        chain(w.x16).numpy()
    if (lazy.compiled, lazy.cache_hits) != (0, 1):
        raise SanityError("a fresh oh.Lazy() of a seen structure compiled %d functions "
                          "(cache hits %d); expected a cache hit" % (lazy.compiled,
                                                                     lazy.cache_hits))
    w.lazyxla256()
    lazy = oh.Lazy(jit_compile=True)
    with lazy:
        got = chain(w.x256).numpy()
    if lazy.compiled or not lazy.last_function.function_def.attr["_XlaMustCompile"].b:
        raise SanityError("oh.Lazy(jit_compile=True) did not hit an XLA-compiled function")
    _close("lazyxla256", got, w.xla256())
    for name, ref in (("lazy16c", w.eager16), ("lazyxla256c", w.xla256)):
        getattr(w, name)()  # compiles the chunks
        lazy = oh.Lazy(jit_compile=name == "lazyxla256c", chunk_ops=CHUNK_OPS)
        with lazy:
            got = chain(w.x16 if name == "lazy16c" else w.x256).numpy()
        if lazy.compiled or lazy.chunks != 200 // CHUNK_OPS:
            raise SanityError("%s: compiled %d functions, launched %d chunks" % (
                name, lazy.compiled, lazy.chunks))
        _close(name, got, ref())
    _close("xla256", w.xla256(), w.eager256())
    _close("tape_oh", w.tape_oh(), w.tape_tf())
    _close("vm_oh", w.vm_oh(), w.vm_tf())


def breakdown(w, n):
    """Where a fresh `oh.Lazy()`'s time goes, per call (medians of `n` interleaved calls):
    recording the 200 ops, then the value request (plan, key, cache lookup and the
    compiled call), next to the same chain as one `tf.function` call (what the compiled
    call alone costs) and eagerly. Wall clock, and this thread's CPU time in brackets
    (the thread that records; a kernel on another thread is not in it), which a loaded
    machine disturbs less."""
    wall, cpu = time.perf_counter, time.thread_time
    rows = []
    for name, x, jit, compiled, chunk in (
            ("chain16, `oh.Lazy()`", w.x16, False, w.graph, None),
            ("chain16, `oh.Lazy(chunk_ops=%d)`" % CHUNK_OPS, w.x16, False, w.graph,
             CHUNK_OPS),
            ("chain256, `oh.Lazy(jit_compile=True)`", w.x256, True, w.xla, None),
            ("chain256, `oh.Lazy(jit_compile=True, chunk_ops=%d)`" % CHUNK_OPS, w.x256,
             True, w.xla, CHUNK_OPS)):
        compiled(x).numpy()
        times = {k: [] for k in ("record", "request", "function", "eager", "floor")}
        for _ in range(n):
            t0 = (wall(), cpu())
            with oh.Lazy(jit_compile=jit, chunk_ops=chunk):
                h = chain(x)
                t1 = (wall(), cpu())
                h.numpy()
                t2 = (wall(), cpu())
            compiled(x).numpy()
            t3 = (wall(), cpu())
            chain(x).numpy()
            t4 = (wall(), cpu())
            with Floor(x):
                t5 = (wall(), cpu())
                chain(x)
                t6 = (wall(), cpu())
            for k, (a, b) in zip(times, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t5, t6))):
                times[k].append((b[0] - a[0], b[1] - a[1]))
        cells, med = [], {}
        for k in times:
            wall_ms = _common.median([t[0] for t in times[k]]) * 1e3
            cpu_ms = _common.median([t[1] for t in times[k]]) * 1e3
            med[k] = wall_ms
            cells.append("%.2f (%.2f)" % (wall_ms, cpu_ms))
        # A Lazy recording at the floor plus the compiled call, without overlap:
        # (floor + tf.function) / tf.function (its C recording can go slightly under).
        bound = (med["floor"] + med["function"]) / med["function"]
        rows.append([name] + cells + ["%.2fx" % bound])
    return rows


def summarize(configs):
    by = {c.key: c for c in configs}
    rows = []
    for key, desc, _ in CONFIGS:
        s = _common.stats(by[key].times)
        rows.append([desc, "%.3f" % (s["t"] * 1e3), "%.3f – %.3f" % (s["q1"] * 1e3,
                                                                    s["q3"] * 1e3),
                     "%.3f" % (s["min"] * 1e3)])
    figures, points = [], []
    for title, num, den, target, higher in FIGURES:
        ratios = [a / b for a, b in zip(by[num].times, by[den].times)]
        r = _common.median(ratios)
        q1, q3 = _common.quartiles(ratios)
        ok = r >= target if higher else r <= target
        figures.append([title, ("≥ %.3gx" if higher else "≤ %.3gx") % target,
                        "%.2fx (IQR %.2f – %.2f)" % (r, q1, q3), _common.verdict(ok)])
        points.append((title, r, (q1, q3), target, higher))
    return rows, figures, points


def draw(plt, points):
    """Each figure's same-round ratio (bar, IQR whiskers) against its target (red tick),
    on a log scale: the ratios span 1x to 20x."""
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(points) + 1.2))
    ys = list(range(len(points)))[::-1]
    for y, (title, r, (q1, q3), target, higher) in zip(ys, points):
        ok = r >= target if higher else r <= target
        ax.barh(y, r, 0.6, color="#3b7dd8" if ok else "#d8743b",
                xerr=[[max(0.0, r - q1)], [max(0.0, q3 - r)]], capsize=2)
        ax.plot([target, target], [y - 0.4, y + 0.4], color="tab:red", lw=2)
        ax.annotate("%.2fx (%s %.3gx)" % (r, "≥" if higher else "≤", target), (max(r, q3), y),
                    textcoords="offset points", xytext=(4, -3), fontsize=7)
    labels = [re.sub(r"[`*]", "", title) for title, *_ in points]
    ax.set_yticks(ys)
    ax.set_yticklabels([textwrap.shorten(l, 52, placeholder=" …") for l in labels], fontsize=6)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlim(0.5, max(max(q3 for _, _, (_, q3), _, _ in points),
                         max(t for *_, t, _ in points)) * 2.5)
    ax.set_xlabel("ratio (median of same-round ratios, log); red: target; orange bar: missed")
    ax.set_title("small ops: each figure against its target", fontsize=9)
    ax.grid(axis="x", alpha=0.3, which="both")
    return fig


def render(info, rows, figures, rounds, elapsed, quick, split=(), image=""):
    method = (
        "One process times every configuration below; after a warm-up pass, each of %d "
        "rounds runs every configuration once in a freshly shuffled order, as 1 untimed + "
        "N timed back-to-back calls with the garbage collector off. Ratios are medians of "
        "the same-round ratios (their IQR in brackets), so a disturbance of one round hits "
        "both sides alike. Cases: *chain16* `h = tf.tanh(h) * 1.01` 100 times (200 ops) "
        "on x [16, 16], then `.numpy()`; *chain256* the same on [256, 256]; *tape100* "
        "`h = tf.sin(h) * 1.01` 50 times on a watched [4, 4] tensor under a tape opened "
        "per call, forward only; *pe-grads* per-example gradients of "
        "`benchmarks/vectorized_map.py`'s MLP (batch 256) with the mapped function run op "
        "by op. Every `oh.Lazy` configuration opens a **new** handler per call (the way "
        "one writes `with tf.GradientTape():`), so its compiled function comes from the "
        "process-wide cache; `oh.Async()` is created once. The script first checks that "
        "every configuration gives the reference values, that a fresh Lazy hits the "
        "cache and that `Lazy(jit_compile=True)` runs an XLA-compiled function. The "
        "*information* rows with `chunk_ops=%d` launch every %d pending ops as a cached "
        "compiled call on an asynchronous executor while recording goes on (the default "
        "is `chunk_ops=None`); overlapping needs a free core. The *collector on* rows "
        "time their back-to-back calls with the garbage collector enabled, as a program "
        "runs them (what the objects a call leaves for the collector cost; a full "
        "collection, which walks TensorFlow's whole heap, lands in a round now and then)."
        % (rounds, CHUNK_OPS, CHUNK_OPS))
    lines = _common.intro_md("Per-op speed: small ops under each handler (`benchmarks/small_ops.py`)",
                             quick, method, _common.machine_md(info, len(CONFIGS), elapsed),
                             image)
    lines += ["### Figures", "",
              _common.md_table(["figure", "target", "this run", "verdict"], figures), "",
              "### Times", "",
              _common.md_table(["configuration", "ms/call", "IQR ms/call (rounds)",
                                "best round ms/call"], rows), "",
              "### Where a fresh Lazy's time goes", "",
              "Per call, medians of interleaved calls after the rounds above: ms wall "
              "clock (in brackets: CPU ms of the recording thread; a kernel another "
              "thread runs is not in it). *record*: the 200 ops under a new "
              "`oh.Lazy()` (with `chunk_ops`: including launching the chunks, whose "
              "kernels run on the executor's thread); *value request*: `.numpy()`, i.e. "
              "plan, key, cache lookup and the compiled call (with `chunk_ops`: waiting "
              "for the chunks, then the last ops); *tf.function*: the same chain as one compiled call "
              "(`jit_compile` as the Lazy); *eager*: the chain without a handler; "
              "*record floor*: the same 200 ops under a handler whose `execute` returns "
              "a prepared value (TensorFlow's op wrappers, the dispatcher and one Python "
              "hook call per op, nothing of Lazy's); *bound*: (record floor + "
              "tf.function) / tf.function, what a Lazy without overlap whose recording "
              "cost the floor would take (`oh.Lazy` records its common ops in C, without "
              "the floor's Python hook call, so it can go slightly under).", "",
              _common.md_table(["case", "record", "value request", "tf.function",
                                "eager", "record floor", "bound"], list(split)), "",
              "The verdicts compare this run's medians with the targets as measured. The "
              "machine was shared with other jobs while measuring (see *Machine*); rerun "
              "on an idle machine before reading a MISS as a regression.", "",
              "Reproduce: `python benchmarks/small_ops.py` (writes this section and `small_ops.png`)."]
    return "\n".join(lines)


def main(argv=None):
    args = _common.parse_args(argv, __doc__, SECTION, (9, 2), [])
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    w = Workload()
    check(w)
    configs = [Config(w, key, desc, n[1] if args.quick else n[0])
               for key, desc, n in CONFIGS]
    info = _common.machine_info()
    t0 = time.perf_counter()
    _common.measure_under_load(
        info, lambda: _common.run_rounds(configs, args.rounds, lambda c: c.n))
    split = breakdown(w, 5 if args.quick else 30)
    elapsed = time.perf_counter() - t0
    rows, figures, points = summarize(configs)
    _, png = _common.publish(
        args.out, SECTION, lambda plt: draw(plt, points),
        lambda png_name, plotted: (render(
            info, rows, figures, args.rounds, elapsed, args.quick, split,
            _common.image_md("each figure against its target", png_name, plotted)), None))
    for f in figures:
        print("%s: %s %s" % (f[0], f[2], f[3]))
    _common.print_wrote(args.out, png, elapsed)


if __name__ == "__main__":
    try:
        main()
    except SanityError as e:
        print("sanity check failed: %s" % e, file=sys.stderr)
        sys.exit(1)
