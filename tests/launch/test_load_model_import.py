"""`import kerasdist` is enough for `keras.saving.load_model` to restore kerasdist's classes.

Each check that depends on what a process imported runs in a fresh Python: the saving process
uses kerasdist fully, the loading one imports only `kerasdist` and `keras` and touches nothing
else of kerasdist before `load_model`.
"""

import importlib
import pkgutil
import subprocess
import sys
import textwrap

import keras
import pytest
from launch_utils import SKIP_UNDER_A_LAUNCHER, child_env

import kerasdist
from kerasdist._registered_names import REGISTERED_NAMES

pytestmark = SKIP_UNDER_A_LAUNCHER
TIMEOUT_S = 120

SAVE = """
import sys, keras, numpy as np, kerasdist
from kerasdist.optimizers import LARS
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), kerasdist.SyncBatchNormalization()])
model.compile(kerasdist.DistributedOptimizer(LARS(0.1, momentum=0.9)), loss="mse")
model.fit(np.arange(12.0).reshape(4, 3), np.ones((4, 2)), batch_size=2, verbose=0)
model.save(sys.argv[1])
np.savez(sys.argv[2], *[v.numpy() for v in model.optimizer.variables])
"""

LOAD = """
import sys, numpy as np
IMPORTS
assert "kerasdist.distributed_optimizer" not in sys.modules, "the test must load with a bare import kerasdist"
model = keras.saving.load_model(sys.argv[1])
saved = np.load(sys.argv[2])
print("OPTIMIZER", type(model.optimizer).__name__, type(model.optimizer.inner_optimizer).__name__)
print("LAYER", type(model.layers[-1]).__name__)
print("STATE_EQUAL", len(saved.files) == len(model.optimizer.variables) and all(
    np.array_equal(saved[f"arr_{i}"], v.numpy()) for i, v in enumerate(model.optimizer.variables)))
"""


def run_python(code, *args):
    finished = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    return finished.stdout


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    paths = directory / "model.keras", directory / "optimizer_state.npz"
    run_python(SAVE, *paths)
    return paths


@pytest.mark.parametrize("imports", ["import kerasdist, keras", "import keras, kerasdist"])
def test_load_model_restores_kerasdist_classes_and_state_after_a_bare_import(saved_model, imports):
    output = run_python(LOAD.replace("IMPORTS", imports), *saved_model)
    assert "OPTIMIZER DistributedOptimizer LARS" in output
    assert "LAYER SyncBatchNormalization" in output
    assert "STATE_EQUAL True" in output


def test_import_kerasdist_imports_neither_keras_nor_tensorflow():
    output = run_python("import sys, kerasdist; print(sorted({'keras', 'tensorflow'} & set(sys.modules)))")
    assert output.strip() == "[]"


def test_every_registered_kerasdist_class_has_its_stand_in():
    for module in pkgutil.walk_packages(kerasdist.__path__, "kerasdist."):
        if module.name.endswith("__main__") or module.name == "kerasdist._kerasdist_ops":
            continue  # the launcher's command line; the op library, not a Python module
        importlib.import_module(module.name)
    registered = {
        name: getattr(value, "__module__", None)
        for name, value in keras.saving.get_custom_objects().items()
        if name.startswith("kerasdist>")
    }
    assert registered == REGISTERED_NAMES
