"""Where one op-by-op `oh.vectorized_map` call of per-example gradients spends its time
(benchmarks/small_ops.py's pe-grads figure; `benchmarks/vectorized_map.py`'s
`Workload`: MLP 64-128-10, batch 256, `oh.GradientTape` inside the mapped function).

Prints, per call:

  counts   ops reaching the VectorizedMap handler by type and plan (forward / unbatched /
           rule / fallback), physical ops run below it by type, and calls of a converted
           pfor function (the per-op `ConcreteFunction` path); deterministic
  shares   main-thread CPU time (`time.thread_time`) inside the handler's `execute`
           (rules and plans), in the physical ops it runs (TensorFlow's eager execution
           and kernels on this thread), and outside the handler (TensorFlow's op wrappers
           and gradient functions, oh.GradientTape, the dispatcher); the timers add about
           1 us per op
  layers   process CPU time per call (`time.process_time`, all threads, minimum and
           median over rounds, configurations interleaved in each round) of: the mapped
           function on ONE example with tf.GradientTape / oh.GradientTape, the latter under
           a pass-through Python handler, oh.vectorized_map over batches of 1 and 256,
           and eager tf.vectorized_map (the figure's numerator)

    python benchmarks/vectorized_map_breakdown.py [--rounds 7] [--no-write]

Writes the printed lines to the `vectorized_map_breakdown` section of docs/benchmarks.md
(with the machine and the CPU other processes used meanwhile) unless `--no-write`.
"""
import argparse
import collections
import gc
import os
import statistics
import sys
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tf_ophandlers.core import stack as _stack  # noqa: E402
from tf_ophandlers.handlers.vectorized_map import handler as _vmap  # noqa: E402

import vectorized_map as _vm  # noqa: E402

SECTION = "vectorized_map_breakdown"
_lines = []


def out(line):
    print(line)
    _lines.append(line)


def counts_and_shares(w, calls=20):
    """Op counts and main-thread CPU shares of `calls` calls of w.grads_oh."""
    clock = time.thread_time
    handler_ops, physical, spent = (collections.Counter(), collections.Counter(),
                                    collections.defaultdict(float))
    pfor_calls = [0]
    run_vm, run_phys = _vmap.VectorizedMap.execute, _stack.PhysicalStack.execute
    run_pfor = _vmap._converted_by_pfor  # pylint: disable=protected-access

    def vm_execute(self, op, inputs):
        key = _vmap._plan_key(op, inputs)  # pylint: disable=protected-access
        plan = _vmap._plans.get(key) if key is not None else None  # pylint: disable=protected-access
        handler_ops["%s (%s)" % (op.type, plan or "generic")] += 1
        t = clock()
        try:
            return run_vm(self, op, inputs)
        finally:
            spent["handler"] += clock() - t

    def phys_execute(self, op, inputs):
        physical[op.type] += 1
        t = clock()
        try:
            return run_phys(self, op, inputs)
        finally:
            spent["physical"] += clock() - t

    def pfor(*args):
        pfor_calls[0] += 1
        return run_pfor(*args)

    _vmap.VectorizedMap.execute, _stack.PhysicalStack.execute = vm_execute, phys_execute
    _vmap._converted_by_pfor = pfor  # pylint: disable=protected-access
    try:
        t = clock()
        for _ in range(calls):
            w.grads_oh()
        total = clock() - t
    finally:
        _vmap.VectorizedMap.execute, _stack.PhysicalStack.execute = run_vm, run_phys
        _vmap._converted_by_pfor = run_pfor  # pylint: disable=protected-access
    ms = lambda s: s / calls * 1e3  # noqa: E731
    out("counts per call: %d handler ops, %d physical ops, %d pfor function calls"
          % (sum(handler_ops.values()) // calls, sum(physical.values()) // calls,
             pfor_calls[0] // calls))
    out("  handler ops: " + ", ".join("%s x%d" % (k, v // calls)
                                        for k, v in sorted(handler_ops.items())))
    out("  physical ops: " + ", ".join("%s x%d" % (k, v // calls)
                                         for k, v in sorted(physical.items())))
    own = spent["handler"] - spent["physical"]
    out("main-thread CPU per call: total %.2f ms = handler's own Python %.2f ms (%.0f%%) "
          "+ physical ops %.2f ms (%.0f%%) + outside the handler %.2f ms (%.0f%%)"
          % (ms(total), ms(own), 100 * own / total, ms(spent["physical"]),
             100 * spent["physical"] / total, ms(total - spent["handler"]),
             100 * (total - spent["handler"]) / total))


class _PassThrough(oh.OpHandler):
    pass


def layers(w, rounds):
    e0, y0 = w.X[0], w.Y[0]
    x1, y1 = w.X[:1], w.Y[:1]

    def under_pass_through():
        with _PassThrough():
            return w.pe_oh((e0, y0))

    configs = [
        ("one example, tf.GradientTape (plain eager)", lambda: w.pe_tf((e0, y0)), 10),
        ("one example, oh.GradientTape", lambda: w.pe_oh((e0, y0)), 10),
        ("one example, oh.GradientTape under a pass-through handler",
         under_pass_through, 10),
        ("oh.vectorized_map, batch 1", lambda: oh.vectorized_map(w.pe_oh, (x1, y1)), 10),
        ("oh.vectorized_map, batch 256", w.grads_oh, 10),
        ("eager tf.vectorized_map, batch 256", w.grads_eager, 1),
    ]
    times = {name: [] for name, _, _ in configs}
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn, n in configs:
                fn()
                t = time.process_time()
                for _ in range(n):
                    fn()
                times[name].append((time.process_time() - t) / n * 1e3)
            gc.collect()
    finally:
        gc.enable()
    for name, _, _ in configs:
        out("  %-60s min %7.2f  median %7.2f ms" % (name, min(times[name]),
                                                       statistics.median(times[name])))
    med = [statistics.median(times[name]) for name, _, _ in configs]
    out("  differences of medians: oh.GradientTape over tf.GradientTape %.2f ms; a Python "
        "handler's hook path %.2f ms; the map's own cost at batch 1 over a pass-through "
        "handler %.2f ms; batch 256 over batch 1 (kernels, data) %.2f ms"
        % (med[1] - med[0], med[2] - med[1], med[3] - med[2], med[4] - med[3]))
    oh_t, tf_t = times["oh.vectorized_map, batch 256"], times[
        "eager tf.vectorized_map, batch 256"]
    ratios = [a / b for a, b in zip(tf_t, oh_t)]
    out("  same-round ratio eager tf.vectorized_map / oh.vectorized_map: median %.2fx "
          "(rounds: %s)" % (statistics.median(ratios), " ".join("%.1f" % r for r in ratios)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    info, load = _common.machine_info(), _common.OtherLoad()
    w = _vm.Workload()
    for _ in range(3):
        w.grads_oh()
        w.grads_eager()
    counts_and_shares(w)
    out("process CPU per call (%d rounds):" % args.rounds)
    layers(w, args.rounds)
    other = load.cores()
    if not args.no_write:
        body = "\n".join([
            "## Where an op-by-op `oh.vectorized_map` call goes "
            "(`benchmarks/vectorized_map_breakdown.py`)", "",
            "Per-example gradients of `benchmarks/vectorized_map.py`'s MLP (the pe-grads "
            "figure of `small_ops`), %s, %d CPUs, TensorFlow %s, %s; other processes used "
            "%s cores on average meanwhile (CPU times, not wall-clock, so that the load "
            "matters less; they still vary by +-20%% under load). Method: see the script's "
            "docstring." % (info["cpu"], info["nproc"], info["tensorflow"], info["date"],
                            "%.2f" % other if other is not None else "unknown"),
            "", "```"] + _lines + ["```"])
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "docs", "benchmarks.md")
        _common.write_section(path, SECTION, body)
        print("wrote the %s section of %s" % (SECTION, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
