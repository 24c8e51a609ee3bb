"""How the allreduce benchmarks time a collective (allreduce.py on one host, network_allreduce.py
across hosts): one harness, so that their figures mean the same.

A case is a function `fn(iters)` that runs `iters` ops back to back. Its time per op is the slowest
rank's time over N ops, divided by N (a collective is done when every rank is), with N calibrated
so that N ops take about `target_ms` and agreed by every rank. The cases alternate within each of
`repeats` repeats, so a slow moment of a shared machine falls on all of them; the median is
reported with the per-repeat samples. `compare_with_engine_phases` also splits kerasdist's time per
op by the engine thread's phases (kd.engine_times()), and `breakdown_table` prints that split.
"""

import contextlib
import statistics
import time

import numpy as np
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


def engine_busy_phases(engine_times):
    """The engine thread's working phases, as `engine_times()` (kd.engine_times) names them. Its
    idle time is left out: a stretch of idle is charged when the engine next wakes, maybe inside
    the next case."""
    return [
        key for key in engine_times() if key not in ("idle", "pickup", "cycles", "collectives", "rode", "hierarchical")
    ]


def compare_with_engine_phases(harness, cases, engine_times):
    """`harness.compare(cases)`; every case whose name does not start with "raw" also gets phases_s: where the engine
    thread's time per op went, the mean of the ranks (`phase_breakdown`)."""
    busy = engine_busy_phases(engine_times)
    keys = (*busy, "pickup", "cycles", "rode")
    spent = {name: np.zeros(len(keys)) for name in cases}

    @contextlib.contextmanager
    def engine_clock(name):
        before = engine_times()
        yield
        after = engine_times()
        spent[name] += [after[key] - before[key] for key in keys]

    results = harness.compare(cases, around=engine_clock)
    for name, result in results.items():
        if not name.startswith("raw"):
            mean = harness.comm.allreduce(spent[name], op=MPI.SUM) / harness.comm.Get_size()
            per_op = mean / (result["iters"] * harness.repeats)
            result["phases_s"] = phase_breakdown(busy, per_op, result["op_s"])
    return results


def phase_breakdown(busy, per_op, op_s):
    """The engine's `busy` phases per op, and `outside`: the rest of the op's wall time, during
    which the engine thread had nothing to do (TensorFlow between ops, the engine's wake-up)."""
    phases = dict(zip(busy, per_op[: len(busy)]))
    phases["outside"] = max(0.0, op_s - sum(phases.values()))
    phases["pickup"] = per_op[-3]  # summed over the op's collectives
    phases["cycles"] = per_op[-2]
    phases["rode"] = per_op[-1]  # collectives whose data went with the negotiation
    return phases


def breakdown_table(rows):
    """rows: (label, raw seconds, phases_s) -> the lines of a table in µs per op."""
    columns = [key for key in rows[0][2] if key not in ("outside", "pickup", "cycles", "rode")] + ["outside"]
    lines = [
        "  where kerasdist's time per op goes, µs (mean of the ranks): the engine thread's phases"
        " (kd.engine_times()),\n  `outside` = the rest of the wall time (TensorFlow between ops, waking"
        " the engine); pickup = enqueued -> taken up; rode: ops whose data went with the negotiation",
        f"  {'':<28}" + "".join(f"{c:>12}" for c in columns) + f"{'raw MPI':>10}{'pickup':>9}{'cycles':>8}{'rode':>6}",
    ]
    for label, raw_s, phases in rows:
        cells = "".join(f"{phases[c] * 1e6:12.1f}" for c in columns)
        lines.append(
            f"  {label:<28}{cells}{raw_s * 1e6:10.1f}{phases['pickup'] * 1e6:9.1f}{phases['cycles']:8.2f}"
            f"{phases['rode']:6.2f}"
        )
    return "\n".join(lines)


def ratio_to_raw(results, name, raw="raw"):
    """raw time / `name`'s time: the medians', and the range over repeats (>1: `name` is faster)."""
    per_repeat = [r / o for r, o in zip(results[raw]["samples"], results[name]["samples"])]
    return results[raw]["op_s"] / results[name]["op_s"], min(per_repeat), max(per_repeat)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"
