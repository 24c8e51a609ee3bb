"""Setup for the Keras-layer tests, applied before any test module imports kerasdist.

The same files run as one process and under ``mpiexec -n 2`` / ``-n 3`` (see
tests/conftest.py). One intra-op thread per rank, since ranks share 2 cores; a finite
stall timeout, so a rank that skipped a collective fails its test within a minute instead
of hanging the run.
"""

import os

import pytest

os.environ.setdefault("KERASDIST_STALL_WARNING_S", "20")
os.environ.setdefault("KERASDIST_STALL_TIMEOUT_S", "60")

import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # the TF context already started; harmless
    pass


@pytest.fixture
def per_batch_agreements(monkeypatch):
    """StopAgreement's per-batch stop allreduces from here on: a list that grows by one per call."""
    import kerasdist

    calls, allreduce = [], kerasdist.ops.allreduce

    def counting(tensor, *args, name=None, **kwargs):
        if name == "kerasdist.stop_or_notice":
            calls.append(name)
        return allreduce(tensor, *args, name=name, **kwargs)

    monkeypatch.setattr(kerasdist.ops, "allreduce", counting)
    return calls
