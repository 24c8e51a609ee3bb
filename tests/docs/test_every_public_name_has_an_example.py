"""Every public name kerasdist exports, and every object the API pages (docs/api/*.rst) show, has a
description and, unless it is a plain attribute (an enum member, a field), a runnable `Example:`.

The objects are read from the site `make docs` built (Sphinx's doctrees of the API pages): what a
reader sees, whatever autodoc directive put it there. An example counts when it is one that
tests/test_docstring_examples.py runs, at 1 and 2 ranks.
"""

import importlib.util
import pickle
import textwrap
from pathlib import Path

import pytest

import kerasdist

ROOT = Path(__file__).resolve().parents[2]

DOCTREES = ROOT / "build" / "docs" / "doctrees" / "api"
# Documented by description alone: their class's example shows them.
ATTRIBUTE_TYPES = {"attribute", "data"}
# Names that are another project's object, which kerasdist re-exports for its own API to take.
NOT_OURS = {
    "kerasdist.estimator.InputContext": "TensorFlow's tf.distribute.InputContext, which input_fn receives",
}


def _docstring_examples():
    """The code of every example tests/test_docstring_examples.py runs."""
    spec = importlib.util.spec_from_file_location("docstring_examples", ROOT / "tests" / "test_docstring_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.EXAMPLES.values())


@pytest.fixture(scope="module")
def documented(site):
    """{qualified name: (object type, page, the entry's content node)} of every Python object
    the API pages document."""
    from sphinx import addnodes  # docutils and Sphinx: `make docs` (the site fixture) installs them

    found = {}
    for path in sorted(DOCTREES.glob("*.doctree")):
        doctree = pickle.loads(path.read_bytes())
        for entry in doctree.findall(addnodes.desc):
            if entry.get("domain") != "py":
                continue
            signature, content = entry.children[0], entry.children[-1]
            name = (
                f"{signature['module']}.{signature['fullname']}" if signature.get("module") else signature["fullname"]
            )
            found[name] = (entry["objtype"], f"docs/api/{path.stem}.rst", content)
    return found


def _own_children(content):
    """The entry's own paragraphs and code blocks, not those of the members documented inside it."""
    from sphinx import addnodes

    return [child for child in content.children if not isinstance(child, (addnodes.desc, addnodes.index))]


def _description(content):
    from docutils import nodes

    children = _own_children(content)
    first = children[0] if children else None
    return first.astext().strip() if isinstance(first, nodes.paragraph) and first.astext() != "Example:" else ""


def _example(content):
    """The code of the entry's `Example:` python block, or None."""
    from docutils import nodes

    children = _own_children(content)
    headings = [i for i, child in enumerate(children) if child.astext().strip() in ("Example:", "Example")]
    for block in children[headings[0] + 1 :] if headings else ():
        if isinstance(block, nodes.literal_block) and block.get("language") == "python":
            return block.astext()
    return None


def _object_named(qualified):
    """The object a documented name stands for: the longest importable module, then attributes."""
    parts = qualified.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)  # a dataclass field has no class attribute
        return found
    raise ImportError(qualified)


def test_every_exported_name_is_on_an_api_page(documented):
    # A name may be documented where it is defined (kerasdist.batch_growth.GradientNoiseScale).
    documented_objects = [_object_named(name) for name in documented]
    missing = [
        f"kerasdist.{name}"
        for name in sorted(set(kerasdist.__all__) - set(kerasdist._SUBMODULES))
        if f"kerasdist.{name}" not in documented
        and not any(getattr(kerasdist, name) is shown for shown in documented_objects)
    ]
    assert not missing, f"exported by kerasdist but on no API page (docs/api/*.rst): {missing}"


def test_every_documented_object_has_a_description(documented):
    missing = [
        f"{name} ({page})" for name, (_, page, content) in sorted(documented.items()) if not _description(content)
    ]
    assert not missing, f"{len(missing)} objects of the API pages have no description: {missing}"


def test_every_documented_object_has_an_example_that_the_docstring_tests_run(documented):
    run_by_the_tests = {textwrap.dedent(code).strip() for code in _docstring_examples()}
    without, not_run = [], []
    for name, (objtype, page, content) in sorted(documented.items()):
        if objtype in ATTRIBUTE_TYPES or name in NOT_OURS:
            continue
        example = _example(content)
        if example is None:
            without.append(f"{name} ({page})")
        elif not any(textwrap.dedent(example).strip() in code for code in run_by_the_tests):
            not_run.append(name)
    assert not without, f"{len(without)} objects of the API pages have no `Example:` python block: {without}"
    assert not not_run, f"examples that tests/test_docstring_examples.py does not run: {not_run}"


def test_the_names_that_are_not_ours_say_whose_they_are(documented):
    for name, whose in NOT_OURS.items():
        assert name in documented, name
        description = _description(documented[name][2])
        assert whose.split(",")[0].split("'s ")[1] in description, (name, description)
