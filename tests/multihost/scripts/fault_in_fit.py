"""A fault on the last rank (on the last host) in the middle of `fit`, or of eager collectives.

argv: MODE DIRECTORY [reference]. The faulty rank prints FAULT_AT=<time.time()> (and FAULT_HOST=<its host>)
at the fault, so the test can time detection. MODE:

  raise        it raises at batch 3 of epoch 2, while the others wait in the gradient allreduce
  sigkill      it kills itself (SIGKILL) there
  stall        it sleeps there for longer than KERASDIST_STALL_TIMEOUT_S, alive and answering
  skip         no fit: it skips one eager allreduce that every other rank makes, and goes on to
               the next one
  ckpt_kill    fit with Rank0Checkpoint(DIRECTORY/checkpoints, resume=True), every epoch saved; on the first
               attempt (KERASDIST_RESTART=0) it kills itself (SIGKILL) while rank 0 is inside
               epoch 2's save: rank 0 holds the save open (the archive written, not yet renamed
               into place) until the job is torn down around it. Later attempts run to the end
               and print RESUMED_FROM=<epoch> and, on rank 0, WEIGHTS_SHA=<hash of the weights>.
               With "reference" no fault comes: the uninterrupted run.

Every rank prints STARTED_AT=<time.time()> first, LAUNCH_PID (so that the test can kill what is
left) and, when fit ends, RANK_DONE; in ckpt_kill, rank 0 first loads every checkpoint on disk,
printing READABLE=<name>.
"""

import os
import time

print(f"STARTED_AT={time.time()}", flush=True)  # before the imports, which take seconds

import hashlib  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist.callbacks import Rank0Checkpoint  # noqa: E402

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
REFERENCE = sys.argv[3:] == ["reference"]
EPOCHS, STEPS_PER_EPOCH, BATCH = 4, 6, 8
FAULT_EPOCH, FAULT_BATCH = 1, 3  # 0-based: the middle of the second epoch

kd.init()
rank, size = kd.rank(), kd.size()
faulty = rank == size - 1
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))
print(f"LAUNCH_PID rank={rank} pid={os.getpid()}", flush=True)
checkpoints = os.path.join(DIRECTORY, "checkpoints")
saving_marker = os.path.join(DIRECTORY, "rank0-is-saving")
saving_epoch = [None]  # the epoch whose checkpoint rank 0 is writing


def fault_now():
    print(f"FAULT_AT={time.time()}", flush=True)
    print(f"FAULT_HOST={socket.gethostname()}", flush=True)


def die_by_sigkill():
    fault_now()
    os.kill(os.getpid(), signal.SIGKILL)


if MODE == "skip":
    kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")
    if not faulty:
        kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="made_by_every_rank_but_the_last")
    else:
        fault_now()
    kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="the_next_one")
    print(f"RANK_DONE rank={rank}", flush=True)
    sys.exit(0)


class FaultMidEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not faulty or (self.epoch, batch) != (FAULT_EPOCH, FAULT_BATCH):
            return
        if MODE == "raise":
            fault_now()
            raise RuntimeError(f"deliberate failure on rank {rank}")
        if MODE == "sigkill":
            die_by_sigkill()
        if MODE == "stall":
            fault_now()
            time.sleep(float(os.environ["KERASDIST_STALL_TIMEOUT_S"]) + 30)


class KillWhenRank0Saves(keras.callbacks.Callback):
    """On the faulty rank, at the end of epoch 2 (after the metric average every rank makes):
    waits until rank 0 is inside the save, then dies. The other ranks wait in the next epoch's
    first allreduce by then."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch != FAULT_EPOCH:
            return
        deadline = time.monotonic() + 60
        while not os.path.exists(saving_marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        die_by_sigkill()


unpatched_save = keras.Model.save


def save_held_open(model, path, *args, **kwargs):
    """Rank 0's save of epoch 2 on the first attempt: the archive is written under its temporary
    name, and the save waits there (for the launcher to end the job) instead of renaming it."""
    unpatched_save(model, path, *args, **kwargs)
    if saving_epoch[0] == FAULT_EPOCH:
        open(saving_marker, "w").close()
        time.sleep(120)


class NoteSavingEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        saving_epoch[0] = epoch


callbacks = kd.callbacks()
if MODE == "ckpt_kill":
    if rank == 0 and os.path.isdir(checkpoints):
        for name in sorted(os.listdir(checkpoints)):
            if name.endswith(".keras") and not name.startswith("."):
                keras.saving.load_model(os.path.join(checkpoints, name))
                print(f"READABLE={name}", flush=True)
    checkpoint = Rank0Checkpoint(checkpoints, filename="epoch{epoch:02d}.keras", monitor="loss", resume=True)
    callbacks = [NoteSavingEpoch(), *callbacks, checkpoint]
    if attempt == 0 and not REFERENCE:
        if rank == 0:
            keras.Model.save = save_held_open
        elif faulty:
            callbacks.append(KillWhenRank0Saves())
    print(f"RESUMED_FROM={checkpoint.initial_epoch}", flush=True)
    initial_epoch = checkpoint.initial_epoch
else:
    callbacks.append(FaultMidEpoch())
    initial_epoch = 0

keras.utils.set_random_seed(3)
rows = np.random.default_rng(11).normal(size=(size * STEPS_PER_EPOCH * BATCH, 16)).astype("float32")
x, y = kd.data.shard((rows, rows.sum(axis=1, keepdims=True)))
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), loss="mse")
model.fit(
    x, y, batch_size=BATCH, epochs=EPOCHS, initial_epoch=initial_epoch, shuffle=False, verbose=0, callbacks=callbacks
)
if rank == 0:
    weights = b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    print(f"WEIGHTS_SHA={hashlib.sha256(weights).hexdigest()}", flush=True)
print(f"RANK_DONE rank={rank}", flush=True)
