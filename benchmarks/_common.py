"""Small helpers shared by the benchmark scripts (timing, machine info, docs sections)."""
import argparse
import datetime
import gc
import os
import platform
import random
import re
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without PYTHONPATH / pip install -e
    sys.path.append(REPO)

DEFAULT_MD = os.path.join(REPO, "docs", "benchmarks.md")
MD_TITLE = "# Benchmarks"
MD_INTRO = (
    "Performance of tf-ophandlers, reported as ratios against the TensorFlow counterpart "
    "measured in the same run (same process, same machine, configurations interleaved). "
    "Each section below is written by one script in `benchmarks/` and is replaced "
    "wholesale when that script is rerun; absolute times depend on the machine, the "
    "ratios are the result.")


def time_per_call(fn, n):
    """Seconds per call of `fn()` over `n` back-to-back calls, gc disabled (as timeit)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        clock = time.perf_counter
        loop = range(n)
        start = clock()
        for _ in loop:
            fn()
        elapsed = clock() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed / n


def warm_time(fn, warmup, n):
    """`warmup` untimed calls of `fn()`, then its seconds per call over `n` calls."""
    for _ in range(warmup):
        fn()
    return time_per_call(fn, n)


def warm_time_and_cpu(fn, warmup, n):
    """As `warm_time`, returning (wall-clock seconds, process CPU seconds) per call. The
    CPU time counts every thread of the process (TensorFlow's kernels run on its pools);
    a loaded machine stretches wall-clock time much more than CPU time."""
    for _ in range(warmup):
        fn()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            fn()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        if enabled:
            gc.enable()
    return wall / n, cpu / n


def run_rounds(configs, rounds, n_of, run=None, seed=0):
    """The interleaved measurement every script uses.

    A warm-up pass runs each configuration once with `max(1, n // 5)` calls (untimed),
    then each of `rounds` rounds runs every configuration once, in an order shuffled
    afresh every round (`random.Random(seed)`), appending the seconds per call returned
    by `run(cfg, n)` (default `cfg.run(n)`) to `cfg.times`; `n = n_of(cfg)`. Reports
    each finished round on stderr.
    """
    if run is None:
        def run(cfg, n):
            return cfg.run(n)
    for cfg in configs:  # warm-up: one untimed pass per configuration
        run(cfg, max(1, n_of(cfg) // 5))
    rng = random.Random(seed)
    for r in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            cfg.times.append(run(cfg, n_of(cfg)))
        print("round %d/%d done" % (r + 1, rounds), file=sys.stderr)


def measure_under_load(info, measure, freeze=False):
    """Returns `measure()`, storing in `info["other"]` the CPU cores other processes used
    meanwhile ("n/a" if unknown).

    With `freeze`, the objects alive after setup (TensorFlow's included) are first moved
    out of the collector's view (`gc.collect(); gc.freeze()`), so the full
    `gc.collect()` before every timed batch takes microseconds instead of ~0.15 s.
    """
    if freeze:
        gc.collect()
        gc.freeze()
    other = OtherLoad()
    result = measure()
    cores = other.cores()
    info["other"] = "n/a" if cores is None else "%.2f" % cores
    return result


def median(xs):
    return statistics.median(xs)


def quartiles(xs):
    """(first quartile, third quartile) of `xs`."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def stats(ts, key="t"):
    """Summary of per-round times: median (under `key`), quartiles, best, the rounds."""
    q1, q3 = quartiles(ts)
    return {key: median(ts), "q1": q1, "q3": q3, "min": min(ts), "rounds": ts}


def round_ratio_quartiles(num, den):
    """Quartiles of the same-round ratios num / den (lists of per-round times): the
    spread of a ratio, each round's disturbance hitting both sides alike."""
    return quartiles([a / b for a, b in zip(num, den)])


def machine_info():
    """Dict of the facts a reader needs to interpret absolute times."""
    import tensorflow as tf
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": ncpu,
        "cpu": cpu,
        "os": "%s %s" % (platform.system(), platform.release()),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def _busy_seconds():
    """Busy CPU seconds of the whole machine (incl. VM steal) from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU used by everything except this process and the children it waited for
    (a benchmark measuring in subprocesses) between start and stop (in cores)."""

    def __init__(self):
        self.busy, self.wall = _busy_seconds(), time.perf_counter()
        self.own = self._own()

    @staticmethod
    def _own():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def cores(self):
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        own = self._own() - self.own
        return max(0.0, (busy - self.busy - own) / (time.perf_counter() - self.wall))


def write_section(path, name, body):
    """Writes `body` between `<!-- name:begin -->` / `<!-- name:end -->` in `path`.

    Only that section is replaced; the file is created (title + intro) if missing and
    the section appended if absent. For the documentation (`path` is docs/benchmarks.md,
    the default) the section becomes its own page instead (`write_page`): the benchmarks
    page lists the current run of each benchmark, one page each, and keeps no history.
    """
    if os.path.abspath(path) == os.path.abspath(DEFAULT_MD):
        write_page(name, body, path)
        return
    _replace_marked(path, name, body)


def _replace_marked(path, name, body):
    begin, end = "<!-- %s:begin -->" % name, "<!-- %s:end -->" % name
    section = "%s\n%s\n%s" % (begin, body.strip("\n"), end)
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    else:
        text = "%s\n\n%s\n" % (MD_TITLE, MD_INTRO)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_page(name, body, index=DEFAULT_MD):
    """Writes one benchmark's current results as the page `<index without .md>/<name>.md`
    (docs/benchmarks/<name>.md; replaced wholesale: the page holds this run only, what
    changed goes to CHANGELOG.md) and its line in `index`'s list: title, link, run date."""
    pages = os.path.splitext(index)[0]
    lines = body.strip("\n").split("\n")
    title = lines[0][3:] if lines[0].startswith("## ") else name
    # The plot stays next to docs/benchmarks.md; the page is one directory down.
    text = "\n".join(["# " + title] + lines[1:] if lines[0].startswith("## ") else lines)
    text = re.sub(r"!\[([^\]]*)\]\(([^/()]+\.png)\)", r"![\1](../\2)", text)
    os.makedirs(pages, exist_ok=True)
    with open(os.path.join(pages, name + ".md"), "w") as f:
        f.write(text + "\n")
    date = re.search(r"(\d{4}-\d{2}-\d{2})", body)  # the Machine paragraph's run date
    entry = "- [%s](%s/%s.md)%s" % (
        title.replace("[", "(").replace("]", ")"), os.path.basename(pages), name,
        " — run on %s" % date.group(1) if date else "")
    _replace_marked(index, name, entry)


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------

def parse_args(argv, doc, section, rounds, counts, what="calls", quick_s=30):
    """Parses the options every script has plus its per-round counts.

    `--quick`, `--out` (plot written next to it as `<section>.png`), `--rounds`
    (`rounds` = (default, quick)) and one `--NAME` per `counts` entry
    (`NAME, help, default, quick`). Unset values get their default, or with `--quick`
    their quick value.
    """
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: fewer %s and rounds (< %d s, noisy)" % (what, quick_s))
    p.add_argument("--out", default=DEFAULT_MD,
                   help="markdown file to update (default: docs/benchmarks.md); the plot "
                        "is written next to it as %s.png" % section)
    p.add_argument("--rounds", type=int, help="rounds (default %d, quick %d)" % rounds)
    for name, text, full, quick in counts:
        p.add_argument("--" + name, type=int,
                       help="%s (default %d, quick %d)" % (text, full, quick))
    args = p.parse_args(argv)
    args.rounds = args.rounds or (rounds[1] if args.quick else rounds[0])
    for name, _, full, quick in counts:
        dest = name.replace("-", "_")
        setattr(args, dest, getattr(args, dest) or (quick if args.quick else full))
    return args


# -- the markdown section ---------------------------------------------------------------

def verdict(ok):
    return "**PASS**" if ok else "**MISS**"


def intro_md(title, quick, method, machine, image, per="calls"):
    """Lines of a section's start: heading, quick-run note, Method, Machine, plot."""
    L = ["## " + title, ""]
    if quick:
        L += ["> **Quick (smoke) run**: few %s per round, numbers are noisy and not "
              "representative. Rerun without `--quick` for the real measurement." % per, ""]
    return L + ["**Method.** " + method, "", machine, "", image, ""]


def machine_md(info, nconfigs, elapsed, devices="CPU, eager"):
    """The **Machine.** paragraph (Keras's version too if `info` has it)."""
    return ("**Machine.** %(nproc)s CPU(s) available (%(cpu)s), %(os)s, Python %(python)s, "
            "TensorFlow %(tensorflow)s" % info
            + (", Keras %s" % info["keras"] if "keras" in info else "")
            + " (%s). Other processes (and VM steal) used %s CPU cores on average during "
            "the measurement; load there widens the ranges." % (devices, info["other"])
            + " Run on %s; %d configurations, %.0f s total." % (info["date"], nconfigs,
                                                              elapsed))


def image_md(alt, png_name, plotted):
    """The plot's markdown, or a note that it was not written."""
    if plotted:
        return "![%s](%s)" % (alt, png_name)
    return "(plot not written: matplotlib is not installed)"


def case_md(heading, desc, header, rows, after=()):
    """Lines of one case: `### heading`, description, table (and `after` paragraphs)."""
    L = ["### " + heading, "", desc, "", md_table(header, rows), ""]
    for text in after:
        L += [text, ""]
    return L


def targets_md(bullets, script, quick, png_name, plural=False, scope=""):
    """Lines of a section's end: the Target(s) list, how to read verdicts, how to rerun."""
    s = "s" if plural else ""
    return [
        "### Target" + s, "",
        "Target%s%s, checked against this run's medians (not tuned):"
        % (s, scope), "",
    ] + list(bullets) + [
        "",
        ("The verdicts compare the medians with the targets as measured; "
         if plural else "The verdict compares the medians with the target as measured; ")
        + "the best-round figures are context only. When other processes load the "
        "machine (see *Machine*), rerun on an idle machine before reading a MISS as a "
        "regression.",
        "",
        "Reproduce: `python benchmarks/%s.py%s` (writes this section and `%s`)."
        % (script, " --quick" if quick else "", png_name),
    ]


# -- output -----------------------------------------------------------------------------

def plot_or_skip(draw, path):
    """Calls `draw(plt)` (returns the figure; its caller sets everything but the layout)
    and saves the figure to `path`; without matplotlib, says so on stderr and returns
    False."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)
        return False
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def publish(out, section, draw, render):
    """Writes the plot `<section>.png` next to `out` (see `plot_or_skip`), then the
    section `render(png_name, plotted)` returns as (body, result) into `out`.
    Returns (result, the plot's path or None)."""
    png_name = section + ".png"
    png_path = os.path.join(os.path.dirname(os.path.abspath(out)), png_name)
    os.makedirs(os.path.dirname(png_path), exist_ok=True)
    plotted = plot_or_skip(draw, png_path)
    body, result = render(png_name, plotted)
    write_section(out, section, body)
    return result, (png_path if plotted else None)


def print_wrote(out, png_path, elapsed):
    print("wrote %s%s (%.0f s)" % (out, " and " + png_path if png_path else "", elapsed))


# -- plots ------------------------------------------------------------------------------

def iqr_err(ss, key="t"):
    """`yerr` from each `stats` dict's median (under `key`) down to q1 and up to q3."""
    return spread([s[key] for s in ss], [(s["q1"], s["q3"]) for s in ss])


def spread(vals, qs):
    """`yerr` from each value down to / up to its (low, high) pair, clamped at 0."""
    return [[max(0.0, v - q[0]) for v, q in zip(vals, qs)],
            [max(0.0, q[1] - v) for v, q in zip(vals, qs)]]


def label_bars(ax, xs, tops, texts, fontsize=8, boxed=False):
    """Writes `texts` just above the bars at `xs`, whose tops (with error bar) are `tops`;
    `boxed`: on a white box, to stay legible over lines."""
    extra = {"bbox": dict(fc="white", ec="none", pad=0.5)} if boxed else {}
    for x, top, text in zip(xs, tops, texts):
        ax.annotate(text, (x, top), textcoords="offset points", xytext=(0, 3), ha="center",
                    fontsize=fontsize, **extra)


def median_bars(ax, keys, ss, colors, labels, ylabel, title, key="t", fmt="%.2f"):
    """One case's panel: a bar per configuration (`keys`, their `stats` dicts `ss`) at the
    median under `key`, with the IQR of rounds as error bars and the value on top."""
    xs = list(range(len(keys)))
    ax.bar(xs, [s[key] for s in ss], 0.6, yerr=iqr_err(ss, key), capsize=3,
           color=[colors[k] for k in keys])
    label_bars(ax, xs, [max(s[key], s["q3"]) for s in ss], [fmt % s[key] for s in ss])
    ax.set_xticks(xs)
    ax.set_xticklabels([labels[k] for k in keys], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title("%s\n(median, IQR of rounds)" % title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, max(s["q3"] for s in ss) * 1.18)


def grouped_bars(ax, cases, keys, summary, field, colors, labels, fontsize=7):
    """Side-by-side bars, one per configuration in `keys` within each case of `cases`, of
    `summary[case][key][field]` with the IQR `summary[case][key][field + "_q"]` as error
    bars and the value on top. Returns the highest bar top (with its error bar)."""
    width = 0.8 / len(keys)
    top = 0.0
    for j, key in enumerate(keys):
        xs = [c + (j - (len(keys) - 1) / 2) * width for c in range(len(cases))]
        vals = [summary[c][key][field] for c in cases]
        lo, hi = spread(vals, [summary[c][key][field + "_q"] for c in cases])
        ax.bar(xs, vals, width * 0.9, yerr=[lo, hi], capsize=2, color=colors[key],
               label=labels[key])
        label_bars(ax, xs, [v + h for v, h in zip(vals, hi)], ["%.2fx" % v for v in vals],
                   fontsize=fontsize, boxed=True)
        top = max(top, max(v + h for v, h in zip(vals, hi)))
    return top


def ratio_panel(ax, labels, series, ylabel, title, targets=(), parity=1.0):
    """Side-by-side bars of ratios on a log scale, one group per entry of `labels`:
    `series` is a list of (legend label, color, values, [(q1, q3)] per value); the
    quartiles are the error bars, the value is written on top. `targets`: (first group,
    last group, value, legend label) drawn as dotted red lines over those groups;
    `parity` as a black line."""
    width = 0.8 / len(series)
    tops, lows = [], []
    for j, (name, color, vals, qs) in enumerate(series):
        xs = [c + (j - (len(series) - 1) / 2) * width for c in range(len(labels))]
        lo, hi = spread(vals, qs)
        ax.bar(xs, vals, width * 0.9, yerr=[lo, hi], capsize=2, color=color, label=name)
        label_bars(ax, xs, [v + h for v, h in zip(vals, hi)], ["%.2fx" % v for v in vals],
                   fontsize=7, boxed=True)
        tops += [v + h for v, h in zip(vals, hi)]
        lows += [max(v - l, 1e-3) for v, l in zip(vals, lo)]
    for first, last, value, name in targets:
        ax.hlines(value, first - 0.45, last + 0.45, colors="tab:red", linestyles=":",
                  lw=1.5, label=name)
        tops.append(value)
    ax.axhline(parity, color="black", lw=0.8, label="parity")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(min(min(lows), parity) / 2, max(max(tops), parity) * 3)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
