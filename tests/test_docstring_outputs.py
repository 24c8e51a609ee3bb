"""Values that docstring examples state in comments are what the examples print.

The `Example:` sections run elsewhere (tests/keras/test_models.py, tests/optimizers/...), but a
comment such as `print(model.count_params())  # 271098` was never compared with the output. Here
every public docstring's ```python example with such a comment runs, and each commented line is
checked:

  print(EXPRESSION)  # TEXT       the printed line must read TEXT, where "..." stands for anything;
  NAME = EXPRESSION  # shape S    NAME.shape must be S.

One process: examples are written for any world size, and at size 1 nothing else runs at once.
"""

import contextlib
import importlib
import inspect
import io
import pkgutil
import re
import textwrap

import keras
import pytest

import kerasdist

PRINTED = re.compile(r"^(?P<indent>\s*)print\((?P<expression>.*)\)\s+#\s?(?P<text>.+?)\s*$")
SHAPED = re.compile(r"^(?P<indent>\s*)(?P<name>\w+) = .*#\s?shape (?P<shape>\(.*\))\s*$")
# Modules that run a program on import.
SKIPPED_MODULES = {"kerasdist.run.__main__"}


def _examples():
    """{qualified name: example code} for public docstrings with a checked comment."""
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
                objects += [(f"{module_info.name}.{name}.{attr}", member) for attr, member in vars(value).items()
                            if not attr.startswith("_") and callable(member)]
        for qualified, value in objects:
            doc = inspect.getdoc(value) or ""
            if "Example" not in doc:
                continue
            example = doc[doc.index("Example"):]
            for block in re.findall(r"```python\n(.*?)```", example, flags=re.S):
                code = textwrap.dedent(block)
                if any(PRINTED.match(line) or SHAPED.match(line) for line in code.splitlines()):
                    found[qualified] = code
    return found


EXAMPLES = _examples()


def _instrumented(code):
    """The example, each checked line made into a call that compares what it states."""
    lines = []
    for number, line in enumerate(code.splitlines(), start=1):
        printed, shaped = PRINTED.match(line), SHAPED.match(line)
        if printed:
            lines.append(f"{printed['indent']}__check_printed__(lambda: print({printed['expression']}), "
                         f"{printed['text']!r}, {number})")
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


def test_the_examples_that_state_printed_values_are_found():
    names = set(EXAMPLES)
    for expected in ("kerasdist.models.resnet.cifar_resnet", "kerasdist.models.resnet.resnet50",
                     "kerasdist.optimizers.lars.LARS", "kerasdist.batch_growth.curvature.top_hessian_eigenvalue",
                     "kerasdist.estimator.Estimator"):
        assert expected in names, sorted(names)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_prints_what_its_comments_say(name):
    keras.backend.clear_session()  # fresh layer names ("sequential", "dense"), as in a new process
    namespace = {"__check_printed__": _check_printed, "__check_shape__": _check_shape}
    exec(compile(_instrumented(EXAMPLES[name]), f"<{name} example>", "exec"), namespace)
