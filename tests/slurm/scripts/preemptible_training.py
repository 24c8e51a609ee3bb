"""fit with Rank0Checkpoint(DIRECTORY, resume=True), and on the first attempt a fault or a pause
the Slurm tests act in.

The attempt is KERASDIST_RESTART (kerasdist-run --restarts), else SLURM_RESTART_COUNT (a batch job
Slurm requeued), else 0. On attempt 0 only:

  --raise-on-rank R --in-epoch E   rank R raises at batch 2 of epoch E (0-based)
  --slow-from-epoch E --marker F   from epoch E on every rank waits 1 s after each batch, and rank 0
                                   creates F when epoch E's first batch is done (epoch E - 1's
                                   checkpoint is then complete, and no rank is in a collective for
                                   the next second)
  --pause-in-save E --marker F     rank 0, inside the save of epoch E's checkpoint (the archive
                                   written under its temporary name, not yet renamed into place),
                                   creates F and waits 3 s before it goes on

Every rank prints LAUNCH_PID rank=R pid=P, PLACED {json: rank, local_rank, host, SLURM_PROCID,
SLURM_LOCALID} and RESUMED_FROM=<initial epoch>; rank 0 prints EPOCH_BEGAN=<epoch> and at the
end WEIGHTS=<hex of every weight>.
"""

import argparse
import json
import os
import socket
import time
from pathlib import Path

import keras
import numpy as np

import kerasdist as kd

SLOW_BATCH_S = 1
PAUSE_IN_SAVE_S = 3  # under Slurm's KillWait (5 s in the test cluster)

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--raise-on-rank", type=int)
parser.add_argument("--in-epoch", type=int)
parser.add_argument("--slow-from-epoch", type=int)
parser.add_argument("--pause-in-save", type=int)
parser.add_argument("--marker")
arguments = parser.parse_args()

kd.init()
rank = kd.rank()
attempt = int(os.environ.get("KERASDIST_RESTART") or os.environ.get("SLURM_RESTART_COUNT") or 0)
first_attempt = attempt == 0
print(f"LAUNCH_PID rank={rank} pid={os.getpid()}", flush=True)
placed = {
    "rank": rank,
    "local_rank": kd.local_rank(),
    "host": socket.gethostname(),
    "SLURM_PROCID": os.environ.get("SLURM_PROCID"),
    "SLURM_LOCALID": os.environ.get("SLURM_LOCALID"),
    "attempt": attempt,
}
print(f"PLACED {json.dumps(placed)}", flush=True)


class Faults(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if rank == 0:
            print(f"EPOCH_BEGAN={epoch}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if not first_attempt:
            return
        if rank == arguments.raise_on_rank and self.epoch == arguments.in_epoch and batch == 2:
            raise RuntimeError(f"injected fault on rank {rank} in epoch {self.epoch}")
        if arguments.slow_from_epoch is not None and self.epoch >= arguments.slow_from_epoch:
            if rank == 0 and self.epoch == arguments.slow_from_epoch and batch == 0:
                Path(arguments.marker).touch()
            time.sleep(SLOW_BATCH_S)


saving_epoch = [None]


class NoteSavingEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        saving_epoch[0] = epoch


unpatched_save = keras.Model.save


def save_with_a_pause(model, path, *args, **kwargs):
    unpatched_save(model, path, *args, **kwargs)
    if first_attempt and saving_epoch[0] == arguments.pause_in_save:
        Path(arguments.marker).touch()
        time.sleep(PAUSE_IN_SAVE_S)


keras.Model.save = save_with_a_pause

keras.utils.set_random_seed(7)
rng = np.random.default_rng([7, rank])
x = rng.normal(size=(64, 8)).astype("float32")
y = (x @ np.linspace(-1, 1, 8).reshape(8, 1)).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(arguments.directory, resume=True)
print(f"RESUMED_FROM={checkpoint.initial_epoch}", flush=True)
model.fit(
    x,
    y,
    batch_size=8,
    epochs=arguments.epochs,
    shuffle=False,
    verbose=0,
    callbacks=[*kd.callbacks(), NoteSavingEpoch(), checkpoint, Faults()],
)
if rank == 0:
    print("WEIGHTS=" + "".join(w.tobytes().hex() for w in model.get_weights()), flush=True)
