"""The `Example:` sections of the public docstrings run as written."""

import re

import pytest

from kerasdist.callbacks.trust_ratio_logger import TrustRatioLogger
from kerasdist.optimizers import LAMB, LARS
from kerasdist.optimizers.trust_ratio import trust_ratio

DOCUMENTED = {"LARS": LARS, "LAMB": LAMB, "TrustRatioLogger": TrustRatioLogger, "trust_ratio": trust_ratio}


def example_code(obj):
    doc = obj.__doc__
    example = doc[doc.index("Example:") :]
    blocks = re.findall(r"```python\n(.*?)```", example, flags=re.S)
    assert blocks, f"{obj.__name__} has no ```python block under Example:"
    return "\n".join(_dedent_block(b) for b in blocks)


def _dedent_block(block):
    lines = block.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_example_runs(name, capsys):
    exec(compile(example_code(DOCUMENTED[name]), f"<{name} example>", "exec"), {})
