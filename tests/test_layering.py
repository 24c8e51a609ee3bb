"""design.md's layering rule, read from the source: a module of kerasdist imports only modules of its
own layer or of layers below it. Imports inside functions count too: they are dependencies all the
same, only later."""

import ast
import functools
import pathlib

import pytest

import kerasdist

PACKAGE = pathlib.Path(kerasdist.__file__).parent

# Bottom to top; a module belongs to the layer of the longest prefix that names it.
LAYERS = [
    (
        "process state",
        [
            "kerasdist.runtime",
            "kerasdist.op_library",
            "kerasdist.process_tuning",
            "kerasdist.exit_policy",
            "kerasdist.notice",
            "kerasdist.devices",
            "kerasdist.knobs",
            "kerasdist._compat",
            "kerasdist._registered_names",
        ],
    ),
    ("launcher", ["kerasdist.run"]),
    ("collectives", ["kerasdist.ops"]),
    (
        "gradient reduction",
        [
            "kerasdist.distributed_optimizer",
            "kerasdist.reductions",
            "kerasdist.gradient_statistics",
            "kerasdist.wrapping_optimizer",
        ],
    ),
    (
        "Keras layer",
        [
            "kerasdist.callbacks",
            "kerasdist.optimizers",
            "kerasdist.data",
            "kerasdist.models",
            "kerasdist.layers",
            "kerasdist.batch_growth",
            "kerasdist.learning_rate",
            "kerasdist.coordination",
            "kerasdist.training_state",
            "kerasdist.replicas",
            "kerasdist.curvature",
        ],
    ),
    ("Horovod API, Estimator wrapper, the package's names", ["kerasdist.horovod", "kerasdist.estimator", "kerasdist"]),
]


def layer_of(module):
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS (and to design.md's table)"
    return max(matches)[1]


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name):
    """The module `name` stands for: a submodule, the module that defines one of the package's lazy
    names (kerasdist._EXPORTS), or the package itself."""
    if (PACKAGE.parent / (name.replace(".", "/") + ".py")).is_file() or (
        PACKAGE.parent / name.replace(".", "/")
    ).is_dir():
        return name
    package, _, attribute = name.rpartition(".")
    if package == "kerasdist" and attribute in kerasdist._EXPORTS:
        return kerasdist._EXPORTS[attribute]
    return package


def imports(path):
    """The kerasdist modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names if alias.name.split(".")[0] == "kerasdist"}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: kerasdist imports absolutely; this reader relies on it"
            if node.module.split(".")[0] == "kerasdist":
                found |= {resolve(f"{node.module}.{alias.name}") for alias in node.names}
    return found


@functools.cache
def all_imports():
    return {
        (module_name(path), target)
        for path in sorted(PACKAGE.rglob("*.py"))
        for target in imports(path)
        if target != module_name(path)
    }


def upward(edges):
    return {(source, target) for source, target in edges if layer_of(target) > layer_of(source)}


def test_imports_only_go_down_the_layers():
    against = upward(all_imports())
    assert not against, "imports against design.md's layering rule:\n" + "\n".join(
        f"  {source} ({LAYERS[layer_of(source)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for source, target in sorted(against)
    )


@pytest.mark.parametrize(
    "source, target, against_the_rule",
    [
        ("kerasdist/optimizers/larc.py", "kerasdist.wrapping_optimizer", False),
        ("kerasdist/callbacks/__init__.py", "kerasdist.runtime", False),
        ("kerasdist/horovod/tensorflow/__init__.py", "kerasdist", False),
    ],
)
def test_the_reader_sees_the_imports_it_checks(source, target, against_the_rule):
    """The check is only as good as its reading of import statements."""
    path = PACKAGE.parent / source
    assert target in imports(path)
    assert (layer_of(target) > layer_of(module_name(path))) is against_the_rule


def test_an_import_up_the_layers_is_seen_inside_a_function(tmp_path):
    module = tmp_path / "ops.py"
    module.write_text("def f():\n    from kerasdist.callbacks import Join\n", encoding="utf-8")
    assert upward({("kerasdist.ops", target) for target in imports(module)}) == {
        ("kerasdist.ops", "kerasdist.callbacks")
    }
