"""The README's examples run as written."""

import re
from pathlib import Path

import pytest

from zoo import load_torchvision

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.keep_default_dtype
def test_readme_python_examples_run():
    load_torchvision()  # transformers imports it (see zoo.py)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    found: dict = {}
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
        found.update(namespace)
    namespace = found
    assert namespace["lm_grads"]["transformer.wte.weight"].shape == (8, 100, 32)
    assert list(namespace["head"]) == ["3.weight", "3.bias"]
    assert namespace["set_grads"]["phi.weight"].shape == (4, 16, 3)
    assert namespace["graph_grads"]["conv.lin.weight"].shape == (6, 16, 3)
    assert namespace["jac"].shape == (256, 10, 15910)
    assert namespace["dx"].shape == (100, 400, 1)
    assert namespace["dclf"].shape == (256, 10, 784)
    assert namespace["norms"].shape == (32,)
    assert namespace["checkpoint"]["accountant"]["history"] == [  # one step per release
        [1.1, 0.256, len(namespace["sampler"])]]
    assert 0 < namespace["spent"] < 100
    private = namespace["private"]  # make_private: every planned step taken, within target
    assert private.step.accountant.steps == 2 * private.steps_per_epoch
    assert private.epsilon(1e-5) <= 3.0
    assert all(p.grad is not None for p in namespace["net"].parameters())


def test_readme_op_rule_is_the_file():
    """The op rule "Adding an op" shows is ``rules/addcmul.py`` as it is."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "@register_op_rule" in b]
    source = (README.parent / "src" / "persample" / "rules" / "addcmul.py").read_text()
    rule = block[block.index("@register_op_rule"):]
    assert rule in source


def test_readme_fsdp_example_runs_as_a_file(tmp_path):
    """The FSDP2 training loop, copied to a file and run as a reader would: two gloo
    processes, three DP steps on the sharded model."""
    import subprocess
    import sys

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "fully_shard" in b]
    script = tmp_path / "train.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
