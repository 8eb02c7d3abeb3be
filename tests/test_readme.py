"""The README's examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.keep_default_dtype
def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    assert namespace["jac"].shape == (256, 10, 15910)
    assert namespace["dx"].shape == (100, 400, 1)
    assert namespace["dclf"].shape == (256, 10, 784)
    assert namespace["norms"].shape == (32,)
