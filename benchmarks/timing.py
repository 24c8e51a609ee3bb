"""How the allreduce benchmarks time a collective (allreduce.py on one host, network_allreduce.py
across hosts): one harness, so that their figures mean the same.

A case is a function `fn(iters)` that runs `iters` ops back to back. Its time per op is the slowest
rank's time over N ops, divided by N (a collective is done when every rank is), with N calibrated
so that N ops take about `target_ms` and agreed by every rank. The cases alternate within each of
`repeats` repeats, so a slow moment of a shared machine falls on all of them; the median is
reported with the per-repeat samples.
"""

import contextlib
import statistics
import time

from mpi4py import MPI

# Steps a case that fuses runs before it is timed: the engine's fusion tuning
# (KERASDIST_FUSION_TUNING=auto) times 15 fused cycles with each of two thresholds, then keeps
# one, and the tables are of that steady state.
FUSION_TUNING_STEPS = 35


class Harness:
    def __init__(self, comm, repeats, target_ms, min_iters, max_iters):
        self.comm = comm
        self.repeats = repeats
        self.target_ms = target_ms
        self.min_iters = min_iters
        self.max_iters = max_iters

    def timed(self, fn, iters):
        """Seconds for `iters` ops on the slowest rank."""
        self.comm.Barrier()
        start = time.perf_counter()
        fn(iters)
        return self.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def calibrate(self, fn):
        """N so that N ops take about `target_ms` (the same N on every rank)."""
        fn(2)  # warm up: tracing, buffer allocation, connection setup
        probe = 1
        while True:
            seconds = self.timed(fn, probe)
            if seconds >= 0.02 or probe >= self.max_iters:
                break
            probe *= 4
        iters = int(self.target_ms / 1e3 / max(seconds / probe, 1e-7))
        return self.comm.bcast(min(max(iters, self.min_iters), self.max_iters), root=0)

    def compare(self, cases, around=None):
        """name -> dict(op_s=median seconds per op, iters=N, samples=per-repeat seconds per op).

        `around(name)`, if given, returns a context manager entered around every timed run of
        that case (allreduce.py reads the engine's phase clock there)."""
        iters = {name: self.calibrate(fn) for name, fn in cases.items()}
        samples = {name: [] for name in cases}
        for _ in range(self.repeats):
            for name, fn in cases.items():
                with around(name) if around else contextlib.nullcontext():
                    samples[name].append(self.timed(fn, iters[name]) / iters[name])
        return {
            name: dict(op_s=statistics.median(samples[name]), iters=iters[name], samples=samples[name])
            for name in cases
        }


def ratio_to_raw(results, name, raw="raw"):
    """raw time / `name`'s time: the medians', and the range over repeats (>1: `name` is faster)."""
    per_repeat = [r / o for r, o in zip(results[raw]["samples"], results[name]["samples"])]
    return results[raw]["op_s"] / results[name]["op_s"], min(per_repeat), max(per_repeat)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"
