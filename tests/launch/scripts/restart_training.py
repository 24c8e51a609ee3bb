"""fit with Rank0Checkpoint(resume=True); on the job's first attempt (KERASDIST_RESTART=0) rank 1
raises in the middle of epoch FAIL_EPOCH (-1: never). DIRECTORY: the checkpoint directory.

FAULTS, optional: JSON, a list of {"attempt", "rank", "epoch", and "batch" or "in_save"}:
in that attempt that rank kills itself (SIGKILL, no clean-up) after that batch of that epoch, or
("in_save": true) in the middle of that epoch's checkpoint save, after the archive is written and
before it is renamed into place.

--per-rank-state MODE trains with a DistributedOptimizer whose state differs between ranks:
delay_gradients, one_bit_gradients, or accumulation (3 micro-batches an update, so windows span
the ends of the 8-step epochs). --epochs: how many epochs fit runs (default 4).

Rank 0 first loads every checkpoint in the directory (what the previous attempts left; printing
READABLE=<name>, or failing). Prints RESUMED_FROM=<epoch this attempt started at> and, at the end,
WEIGHTS=<hex of every weight>.
"""

import argparse
import json
import os
import signal

import keras
import numpy as np

import kerasdist as kd

PER_RANK_STATE = {
    "delay_gradients": {"delay_gradients": True},
    "one_bit_gradients": {"one_bit_gradients": True},
    "accumulation": {"backward_passes_per_step": 3},
}
parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("fail_epoch", type=int)
parser.add_argument("faults", nargs="?", default="[]")
parser.add_argument("--per-rank-state", choices=sorted(PER_RANK_STATE))
parser.add_argument("--epochs", type=int, default=4)
arguments = parser.parse_args()

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
directory, fail_epoch = arguments.directory, arguments.fail_epoch
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))


class FailOnce(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if attempt == 0 and kd.rank() == 1 and self._epoch == fail_epoch and batch == 2:
            raise RuntimeError(f"injected fault in epoch {fail_epoch}")


faults = [f for f in json.loads(arguments.faults) if f["attempt"] == attempt and f["rank"] == kd.rank()]


class Killed(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if any(f["epoch"] == self._epoch and f.get("batch") == batch for f in faults):
            print(f"KILLED attempt {attempt} rank {kd.rank()} epoch {self._epoch} batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


saving_epoch = [None]  # the epoch whose checkpoint Rank0Checkpoint is writing
unpatched_save = keras.Model.save


def save_then_maybe_die(model, path, *args, **kwargs):
    unpatched_save(model, path, *args, **kwargs)
    if any(f["epoch"] == saving_epoch[0] and f.get("in_save") for f in faults):
        print(f"KILLED attempt {attempt} rank {kd.rank()} saving epoch {saving_epoch[0]}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class NoteSavingEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        saving_epoch[0] = epoch


keras.Model.save = save_then_maybe_die
if kd.rank() == 0 and os.path.isdir(directory):
    for name in sorted(os.listdir(directory)):
        if name.endswith(".keras") and not name.startswith("."):
            keras.saving.load_model(os.path.join(directory, name), compile=False)
            print(f"READABLE={name}", flush=True)

keras.utils.set_random_seed(7)
rng = np.random.default_rng([7, kd.rank()])
x = rng.normal(size=(64, 8)).astype("float32")
y = (x @ np.linspace(-1, 1, 8).reshape(8, 1)).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
options = PER_RANK_STATE.get(arguments.per_rank_state, {})
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01), **options), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(directory, resume=True)
print(f"RESUMED_FROM={checkpoint.initial_epoch}", flush=True)
model.fit(
    x,
    y,
    batch_size=8,
    epochs=arguments.epochs,
    shuffle=False,
    verbose=0,
    callbacks=[*kd.callbacks(), NoteSavingEpoch(), checkpoint, FailOnce(), Killed()],
)
if kd.rank() == 0:
    print("WEIGHTS=" + "".join(w.tobytes().hex() for w in model.get_weights()), flush=True)
