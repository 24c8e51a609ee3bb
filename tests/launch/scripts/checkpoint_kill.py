"""Resumes from a Rank0Checkpoint directory, then saves checkpoints back to back until it kills
itself with SIGKILL at a chosen moment inside a save (or, with KILL_POINT "none", after one more
save).

First it checks what it resumed from: the latest checkpoint must load as a whole model, and its
optimizer must have made exactly one step per recorded epoch (one batch per epoch here), so the
recorded epoch belongs to the weights in the file.

The kill comes in the save after the warm-up saves, at KILL_POINT:
  "model.save:end"         when `model.save` returns (before the epoch is added to the archive);
  "model.save:F"           F (0 <= F < 1) of the warm-up saves' shortest `model.save` time into it;
  "call:I:before|after"    just before or after the I-th call of that save to os.fsync /
                           os.replace / os.remove, the moments that make a save durable and visible.
If the save ends before the chosen moment, the kill comes at its end, still before SAVED is printed.

argv: DIRECTORY FILENAME KEEP_LAST(0: keep all) SEED KILL_POINT
Prints: LAUNCH_PID, RESUMED_EPOCH=, RESTORED_ITERATIONS=, SAVING=<epoch> and SAVED=<epoch>
around each save, SAVE_CALLS=<durability calls of a completed save>, KILL_AT:<where>, DONE.
"""

import os
import signal
import sys
import threading
import time

import keras
import numpy as np

import kerasdist as kd
from kerasdist.callbacks.checkpoint import Rank0Checkpoint

WARMUP_SAVES = 2
DURABILITY_CALLS = ("fsync", "replace", "remove")

directory, filename, keep_last, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]) or None, int(sys.argv[4])
kill_point = sys.argv[5]
kill = kill_point != "none"
kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)


def die(where):
    print(f"KILL_AT:{where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class KilledWhileSaving(Rank0Checkpoint):
    """Times the warm-up saves, then kills the process inside the next one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saves_done = 0
        self.model_save_seconds = []
        self.calls = None  # durability calls so far in the current save
        self.kill_at_call = None  # (index, "before" | "after")
        self.kill_in_model_save_after = None  # seconds, or "end"
        for name in DURABILITY_CALLS:
            setattr(os, name, self._watched(name, getattr(os, name)))

    def _watched(self, name, call):
        def watched(*args, **kwargs):
            if self.calls is None:
                return call(*args, **kwargs)
            index = self.calls
            self.calls += 1
            if self.kill_at_call == (index, "before"):
                die(f"before os.{name} (call {index} of the save)")
            result = call(*args, **kwargs)
            if self.kill_at_call == (index, "after"):
                die(f"after os.{name} (call {index} of the save)")
            return result

        return watched

    def set_model(self, model):
        super().set_model(model)
        save = model.save

        def timed_save(*args, **kwargs):
            if self.kill_in_model_save_after not in (None, "end"):
                threading.Timer(self.kill_in_model_save_after, die, ("inside model.save",)).start()
            started = time.monotonic()
            save(*args, **kwargs)
            self.model_save_seconds.append(time.monotonic() - started)
            if self.kill_in_model_save_after is not None:
                die("at the end of model.save")

        model.save = timed_save

    def on_epoch_end(self, epoch, logs=None):
        print(f"SAVING={epoch + 1}", flush=True)
        if kill and self.saves_done == WARMUP_SAVES:
            kind, where = kill_point.split(":", 1)
            if kind == "call":
                index, when = where.split(":")
                self.kill_at_call = (int(index), when)
            elif where == "end":
                self.kill_in_model_save_after = "end"
            else:
                self.kill_in_model_save_after = float(where) * min(self.model_save_seconds)
        self.calls = 0
        super().on_epoch_end(epoch, logs)
        if self.kill_at_call is not None:
            die("at the end of the save")
        print(f"SAVE_CALLS={self.calls}", flush=True)
        self.calls = None
        self.saves_done += 1
        print(f"SAVED={epoch + 1}", flush=True)


class PrintRestoredIterations(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print(f"RESTORED_ITERATIONS={int(self.model.optimizer.iterations.numpy())}", flush=True)


keras.utils.set_random_seed(seed)
model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048), keras.layers.Dense(1)])
model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(1e-4, momentum=0.9)), loss="mse")
checkpoint = KilledWhileSaving(directory, filename=filename, keep_last=keep_last, resume=True)
print(f"RESUMED_EPOCH={checkpoint.initial_epoch}", flush=True)
if checkpoint.resumed_from is not None:
    saved = keras.saving.load_model(checkpoint.resumed_from.path)
    assert int(saved.optimizer.iterations.numpy()) == checkpoint.initial_epoch, checkpoint.resumed_from

x = np.ones((8, 512), "float32")
y = np.ones((8, 1), "float32")
epochs = checkpoint.initial_epoch + (WARMUP_SAVES + 1 if kill else 1)
model.fit(
    x,
    y,
    batch_size=8,
    epochs=epochs,
    initial_epoch=checkpoint.initial_epoch,
    verbose=0,
    callbacks=[checkpoint, PrintRestoredIterations()],
)
print("DONE", flush=True)
