"""Every public docstring's `Example:` runs as written, and prints what its comments say.

This is the one way examples are written and run: a ```python block under `Example:`, in which
a commented line states its result:

  print(EXPRESSION)  # TEXT       the printed line must read TEXT, where "..." stands for anything;
  NAME = EXPRESSION  # shape S    NAME.shape must be S.

Examples are written for any world size: `make test` runs this file in one process and again
under `mpiexec -n 2`, where every rank runs the same examples in the same order, so their
collectives pair up.
"""

import contextlib
import importlib
import inspect
import io
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import keras
import pytest

import kerasdist

PRINTED = re.compile(r"^(?P<indent>\s*)print\((?P<expression>.*)\)\s+#\s?(?P<text>.+?)\s*$")
SHAPED = re.compile(r"^(?P<indent>\s*)(?P<name>\w+) = .*#\s?shape (?P<shape>\(.*\))\s*$")
# Modules that run a program on import.
SKIPPED_MODULES = {"kerasdist.run.__main__"}
# Examples that end kerasdist in their process, which cannot start it again: each runs as a job of
# its own, of this run's size.
IN_A_JOB_OF_THEIR_OWN = {"kerasdist.runtime.shutdown"}


def _examples():
    """{qualified name: example code} for every public docstring with an `Example:` section."""
    found = {}
    for module_info in pkgutil.walk_packages(kerasdist.__path__, "kerasdist."):
        if module_info.name in SKIPPED_MODULES or any(part.startswith("_") for part in module_info.name.split(".")):
            continue  # private modules (and the op library) document no public API
        module = importlib.import_module(module_info.name)
        objects = [(module_info.name, module)]
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module_info.name:
                continue
            objects.append((f"{module_info.name}.{name}", value))
            if inspect.isclass(value):
                objects += [
                    (f"{module_info.name}.{name}.{attr}", member)
                    for attr, member in vars(value).items()
                    if not attr.startswith("_") and (callable(member) or isinstance(member, property))
                ]
        for qualified, value in objects:
            doc = inspect.getdoc(value) or ""
            if "Example" not in doc:
                continue
            example = doc[doc.index("Example") :]
            blocks = re.findall(r"```python\n(.*?)```", example, flags=re.S)
            if blocks:
                found[qualified] = "\n".join(textwrap.dedent(block) for block in blocks)
    return found


EXAMPLES = _examples()


def _instrumented(code):
    """The example, each checked line made into a call that compares what it states."""
    lines = []
    for number, line in enumerate(code.splitlines(), start=1):
        printed, shaped = PRINTED.match(line), SHAPED.match(line)
        if printed:
            lines.append(
                f"{printed['indent']}__check_printed__(lambda: print({printed['expression']}), "
                f"{printed['text']!r}, {number})"
            )
        else:
            lines.append(line)
            if shaped:
                lines.append(f"{shaped['indent']}__check_shape__({shaped['name']}, {shaped['shape']}, {number})")
    return "\n".join(lines)


def _check_printed(call, text, line):
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        call()
    pattern = ".*?".join(re.escape(part) for part in text.split("..."))
    printed = output.getvalue().strip()
    assert re.fullmatch(pattern, printed, flags=re.S), f"line {line}: printed {printed!r}; the comment says {text!r}"


def _check_shape(value, shape, line):
    assert tuple(value.shape) == tuple(shape), f"line {line}: shape {tuple(value.shape)}; the comment says {shape}"


def test_the_examples_are_found():
    names = set(EXAMPLES)
    for expected in (
        "kerasdist.models.resnet.cifar_resnet",
        "kerasdist.optimizers.lars.LARS",
        "kerasdist.ops.allreduce",
        "kerasdist.data.shard",
    ):
        assert expected in names, sorted(names)


def test_every_example_is_a_python_block_not_a_doctest():
    package = Path(kerasdist.__file__).parent
    with_doctests = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if re.search(r"^\s*>>> ", path.read_text(), flags=re.M)
    ]
    assert not with_doctests, f"write these >>> examples as ```python Example blocks: {with_doctests}"


@pytest.fixture(scope="module")
def shared_working_directory():
    """One fresh directory every rank works in, as a user's job shares its directory: examples
    write files (checkpoints) relative to it, and none may land in the checkout."""
    kerasdist.init()
    created = tempfile.mkdtemp(prefix="kerasdist_examples_") if kerasdist.rank() == 0 else None
    directory = kerasdist.broadcast_object(created, root_rank=0)
    yield directory
    kerasdist.barrier()
    if created:
        shutil.rmtree(created)


def _run_in_a_job_of_its_own(name):
    """Runs the example as a script, checked as here, in a new job of this run's size that rank 0
    starts (kerasdist-run, at more than one rank); returns its exit status and the end of its
    output on every rank."""
    result = None
    if kerasdist.rank() == 0:
        script = Path(f"{name}_example.py").resolve()
        prelude = ["import contextlib, io, re", inspect.getsource(_check_printed), inspect.getsource(_check_shape)]
        aliases = "__check_printed__, __check_shape__ = _check_printed, _check_shape"
        script.write_text("\n".join([*prelude, aliases, _instrumented(EXAMPLES[name])]) + "\n")
        # The new job's processes must not take themselves for ranks of this one.
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_"))}
        size = kerasdist.size()
        launch = [sys.executable, "-m", "kerasdist.run", "-np", str(size)] if size > 1 else [sys.executable]
        job = subprocess.run([*launch, str(script)], env=environment, capture_output=True, text=True, timeout=300)
        result = (job.returncode, (job.stdout + job.stderr)[-3000:])
    return kerasdist.broadcast_object(result, root_rank=0)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_prints_what_its_comments_say(name, shared_working_directory, monkeypatch):
    monkeypatch.chdir(shared_working_directory)
    if name in IN_A_JOB_OF_THEIR_OWN:
        status, output = _run_in_a_job_of_its_own(name)
        assert status == 0, f"the example's job ended with status {status}:\n{output}"
        return
    keras.backend.clear_session()  # fresh layer names ("sequential", "dense"), as in a new process
    namespace = {"__check_printed__": _check_printed, "__check_shape__": _check_shape}
    exec(compile(_instrumented(EXAMPLES[name]), f"<{name} example>", "exec"), namespace)
