"""The measure both TPU probes share: training steps lost while a piece of work runs on a thread."""

import threading
import time


def steps_lost(step, state, job, make=None, n=40, start=3):
    """Runs ``n`` steps of ``step`` with a sync each (after two untimed), ``job`` on a thread from
    before step ``start``; with ``make``, the thread runs ``job(make(state))``, ``make`` called on this
    thread first (a device copy dispatched before the next step can donate the state).

    Returns (state, seconds of steps lost against their median, the longest step in ms, the job's
    seconds)."""
    import jax

    for _ in range(2):
        state = jax.block_until_ready(step(state))
    times, took, made = [], [0.0], []

    def timed():
        a = time.perf_counter()
        job(*made)
        took[0] = time.perf_counter() - a

    th = threading.Thread(target=timed)
    for i in range(n):
        if i == start:
            if make is not None:
                made.append(make(state))
            th.start()
        a = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - a)
    th.join()
    med = sorted(times)[len(times) // 2]
    return state, round(sum(times) - med * len(times), 3), round(max(times) * 1e3, 1), round(took[0], 3)
