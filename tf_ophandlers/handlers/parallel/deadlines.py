"""Deadlines for collectives whose members are all devices of this process
(`oh.ParallelHandler.all_reduce`, handler.py).

TensorFlow's collective timeout starts an OS thread per timed collective run that sleeps
out the whole timeout, even when the collective finished at once: a custom training loop
calling `all_reduce` would accumulate sleeping threads (two per member per call). For
local components the handler passes no timeout to TensorFlow and keeps the guarantee
(a collective that cannot complete raises instead of hanging) with one watchdog thread
per process: a call that has not returned by its deadline aborts the process's
collectives with DEADLINE_EXCEEDED, which is what TensorFlow's timeout does when it
fires.
"""
import contextlib
import heapq
import itertools
import threading
import time


class _Watchdog:
    """One daemon thread serving every deadline of the process (started on first use)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap = []  # [deadline, sequence, expire callback or None once done]
        self._sequence = itertools.count()
        self._thread = None

    @contextlib.contextmanager
    def deadline(self, seconds, expire):
        """Calls `expire()` on the watchdog thread if the block is still running after
        `seconds`. Yields a list that holds True once `expire` was called."""
        fired = []
        entry = [time.monotonic() + seconds, next(self._sequence), (expire, fired)]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, daemon=True, name="oh.ParallelHandler deadlines")
                self._thread.start()
            if self._heap[0] is entry:
                self._cond.notify()
        try:
            yield fired
        finally:
            with self._cond:
                if entry[2] is not None:  # not fired: drop it now (the heap holds only
                    entry[2] = None       # the calls in flight)
                    self._heap.remove(entry)
                    heapq.heapify(self._heap)

    def _loop(self):
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - time.monotonic()
                    if wait > 0:
                        self._cond.wait(wait)
                        continue
                    entry = heapq.heappop(self._heap)
                    expire, fired = entry[2]
                    entry[2] = None
                    fired.append(True)
                    break
            try:
                expire()
            except Exception:  # pylint: disable=broad-except
                pass  # the caller reports the deadline; the watchdog must keep running


_watchdog = _Watchdog()


def deadline(seconds, expire):
    """`_Watchdog.deadline` of the process's watchdog."""
    return _watchdog.deadline(seconds, expire)

