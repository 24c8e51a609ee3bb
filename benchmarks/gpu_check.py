"""What to run first on GPUs: every collective on GPU tensors against the CPU path, then bandwidth.

How to run (one process per GPU; an op library built with `make build-nccl`):

  .venv-nccl/bin/kerasdist-run -np 4 .venv-nccl/bin/python benchmarks/gpu_check.py

Correctness: each collective runs twice on the same inputs, once on tensors placed on this
process's GPU (kerasdist.pin_gpu(); NCCL) and once on CPU tensors (MPI), and the results must
agree: allreduce with every op and dtype, scaled, grouped (fused into the device buffer) and
one tensor larger than the fusion threshold (reduced alone), allgather and alltoall with
uneven rows, broadcast from every root, reducescatter with a remainder. Integer results must be
equal; floating-point ones may differ by the order of the additions (NCCL's ring, MPI's tree).
(int32 tensors run over MPI on both sides: TensorFlow keeps them in host memory on a GPU.)
Then a tensor on the GPU on rank 0 and on the CPU elsewhere must fail on every rank with an
error naming the device, instead of hanging.

Bandwidth: one float32 allreduce (Sum) per message size, GPU and CPU, timed in a tf.function
loop; "bus" bandwidth is NCCL's convention, algorithm bandwidth x 2(n-1)/n.

Exits 1 when any check fails. On a machine without GPUs it stops with status 2, unless
--device=CPU, which runs the same script with both sides on the CPU (a smoke test of the
script itself: it proves nothing about NCCL).
"""

import argparse
import sys
import time

import numpy as np
import tensorflow as tf

import kerasdist as kd

KIB = 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="GPU", choices=["GPU", "CPU"], help="the side checked against the CPU")
    parser.add_argument(
        "--sizes_kib", type=int, nargs="+", default=[4, 64, 1024, 16 * 1024, 64 * 1024, 256 * 1024], help="messages"
    )
    parser.add_argument("--target_ms", type=float, default=200.0, help="time each bandwidth case about this long")
    parser.add_argument("--skip_bandwidth", action="store_true")
    return parser.parse_args()


ARGS = None
FAILURES = []


def say(*parts):
    if kd.rank() == 0:
        print(*parts, flush=True)


def rank_values(shape, dtype, rank, seed):
    """Inputs that differ per rank and are exactly representable in every dtype checked."""
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype in (tf.uint8, tf.bool):
        values = rng.integers(0, 2, size=shape)
    elif dtype.is_integer:
        values = rng.integers(-3, 4, size=shape)
    else:
        values = rng.integers(-8, 9, size=shape) / 4  # quarters: exact in float16 and bfloat16
    return values.astype(dtype.as_numpy_dtype)


def on(device, fn, *arrays):
    """fn of the arrays as tensors placed on `device` ("GPU" or "CPU"), results as NumPy."""
    with tf.device(f"/{device}:0"):
        tensors = [tf.identity(tf.constant(a)) for a in arrays]
        out = fn(*tensors)
    return [t.numpy() for t in (out if isinstance(out, list | tuple) else [out])]


def check(what, fn, *arrays, exact=False):
    """Runs fn on the checked device and on the CPU; records a failure when they disagree."""
    try:
        got = on(ARGS.device, fn, *arrays)
        want = on("CPU", fn, *arrays)
    except tf.errors.OpError as error:
        FAILURES.append(f"{what}: {type(error).__name__}: {error.message}")
        say(f"  FAIL {what}: {error.message}")
        return
    for g, w in zip(got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            ok = False
        elif exact or not np.issubdtype(w.dtype, np.floating):
            ok = np.array_equal(g, w)
        else:
            tolerance = 1e-2 if w.dtype.itemsize == 2 else 1e-6
            ok = np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=tolerance, atol=tolerance)
        if not ok:
            FAILURES.append(what)
            say(f"  FAIL {what}: {ARGS.device} {g.ravel()[:6]} against CPU {w.ravel()[:6]}")
            return
    say(f"  ok   {what}")


def check_collectives():
    rank, size = kd.rank(), kd.size()
    say(f"correctness: {ARGS.device} tensors against CPU tensors, {size} ranks")
    numeric = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.int8, tf.uint8]
    for dtype in numeric:
        for op in (kd.Sum, kd.Average, kd.Min, kd.Max, kd.Product):
            x = rank_values((257,), dtype, rank, seed=1)
            check(f"allreduce {op.name.title()} {dtype.name}", lambda t, op=op: kd.allreduce(t, op=op), x)
    for dtype in (tf.float32, tf.float16):
        x = rank_values((1000,), dtype, rank, seed=2)
        check(
            f"allreduce Average {dtype.name} prescale 0.5 postscale 3",
            lambda t: kd.allreduce(t, op=kd.Average, prescale_factor=0.5, postscale_factor=3.0),
            x,
        )
    group = [rank_values((n,), tf.float32, rank, seed=3 + n) for n in (1, 7, 1000, 4096, 33)]
    check("grouped_allreduce of 5 float32 (fused)", lambda *ts: kd.grouped_allreduce(list(ts), op=kd.Sum), *group)
    big = rank_values((8 << 20,), tf.float32, rank, seed=4)  # 32 MiB: above the default 16 MiB threshold
    check("allreduce Sum of 32 MiB float32 (alone)", lambda t: kd.allreduce(t, op=kd.Sum), big)
    for dtype in (tf.float32, tf.int64, tf.bool):
        rows = rank_values((rank + 1, 3), dtype, rank, seed=5)
        check(f"allgather {dtype.name}, rank r sends r+1 rows", kd.allgather, rows, exact=True)
    for root in range(size):
        x = rank_values((100, 2), tf.float32, rank, seed=6)
        check(
            f"broadcast float32 from rank {root}", lambda t, root=root: kd.broadcast(t, root_rank=root), x, exact=True
        )
    x = rank_values((2 * size + 1, 5), tf.float32, rank, seed=7)
    check("reducescatter Sum with a remainder row", lambda t: kd.reducescatter(t, op=kd.Sum), x)
    splits = [(rank + peer) % 3 for peer in range(size)]
    x = rank_values((sum(splits), 4), tf.int32, rank, seed=8)
    check(
        "alltoall int32, uneven splits",
        lambda t: kd.alltoall(t, splits=splits, return_received_splits=True),
        x,
        exact=True,
    )


def check_device_mismatch_fails():
    """A tensor on the GPU on rank 0 and on the CPU elsewhere fails on every rank."""
    if kd.size() < 2 or ARGS.device == "CPU":
        return
    device = "GPU" if kd.rank() == 0 else "CPU"
    try:
        on(device, lambda t: kd.allreduce(t, op=kd.Sum, name="gpu_check.mismatched_device"), np.ones(4, np.float32))
    except tf.errors.FailedPreconditionError as error:
        if "device" in error.message:
            say("  ok   a GPU tensor on rank 0 and CPU tensors elsewhere fail with: " + error.message[:160])
            return
    FAILURES.append("mismatched devices did not fail with a device error")
    say("  FAIL mismatched devices did not fail with a device error")


def seconds_per_allreduce(device, elements):
    with tf.device(f"/{device}:0"):
        x = tf.identity(tf.ones([elements], tf.float32))

        @tf.function
        def loop(x, iters):
            for _ in tf.range(iters):
                x = kd.allreduce(x, op=kd.Average)
            return x

        loop(x, tf.constant(2)).numpy()  # warm up: tracing, NCCL setup, buffers
        iters = 2
        while True:
            kd.barrier()
            start = time.perf_counter()
            loop(x, tf.constant(iters)).numpy()
            elapsed = kd.broadcast_object(time.perf_counter() - start)  # rank 0's time, on every rank
            if elapsed * 1e3 >= ARGS.target_ms or iters >= 1 << 14:
                return elapsed / iters
            iters *= 2


def bandwidth():
    size = kd.size()
    say(f"\nbandwidth: float32 allreduce, {size} ranks (GB/s; bus = algorithm x 2(n-1)/n)")
    say(f"{'message':>10} {ARGS.device + ' ms':>10} {ARGS.device + ' bus':>10} {'CPU ms':>10} {'CPU bus':>10}")
    for kib in ARGS.sizes_kib:
        elements = kib * KIB // 4
        row = []
        for device in (ARGS.device, "CPU"):
            seconds = seconds_per_allreduce(device, elements)
            bus = kib * KIB / seconds / 1e9 * (2 * (size - 1) / size if size > 1 else 1)
            row += [f"{seconds * 1e3:10.3f}", f"{bus:10.2f}"]
        say(f"{kib:>7} KiB " + " ".join(row))


def main():
    global ARGS
    ARGS = parse_args()
    gpu = kd.pin_gpu()
    if ARGS.device == "GPU" and gpu is None:
        print("gpu_check: this machine has no GPU; --device=CPU runs the script on CPUs only", file=sys.stderr)
        return 2
    if ARGS.device == "GPU" and not kd.nccl_built():
        print("gpu_check: the op library has no NCCL backend; build it with `make build-nccl`", file=sys.stderr)
        return 2
    say(f"kerasdist gpu_check: {kd.size()} ranks, {ARGS.device} against CPU, NCCL built: {kd.nccl_built()}")
    check_collectives()
    check_device_mismatch_fails()
    if not ARGS.skip_bandwidth:
        bandwidth()
    count = np.array([len(FAILURES)], np.int32)
    failed = int(on("CPU", lambda t: kd.allreduce(t, op=kd.Sum, name="gpu_check.failures"), count)[0][0])
    say(f"\n{f'FAILED: {failed} check(s), summed over ranks' if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
