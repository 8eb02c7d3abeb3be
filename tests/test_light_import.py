"""``import persample`` needs only torch, numpy and dp-accounting: the command line's
packages (the ``cli`` extra: tqdm, scikit-learn, matplotlib) are neither imported by it
nor needed for it, and a command that needs one that is missing says to install the extra.

Each check runs in a fresh interpreter, where ``sys.modules[name] = None`` makes
``import name`` fail as if the package were not installed."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each test runs a fresh interpreter

CLI_EXTRA = ("tqdm", "sklearn", "matplotlib")
INSTALL = 'pip install "persample[cli]"'


def python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def without_cli_extra(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the ``cli`` extra's packages cannot be
    imported."""
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in CLI_EXTRA)
    return python("import sys\n" + block + code)


def test_import_persample_loads_none_of_the_cli_extra():
    # torch itself imports tqdm when it is installed (torch.hub: `from tqdm import tqdm`,
    # with a stand-in where it is not), so tqdm is compared with what `import torch`
    # alone loads; scikit-learn and matplotlib must not be loaded at all. dp_accounting
    # (persample.dp) brings scipy but none of these, so persample.dp is checked too.
    done = python(
        "import json, sys\n"
        f"names = {CLI_EXTRA!r}\n"
        "loaded = lambda: [n for n in names if n in sys.modules]\n"
        "import torch\n"
        "by_torch = loaded()\n"
        "import persample\n"
        "after_persample = loaded()\n"
        "import persample.dp\n"
        "print(json.dumps([by_torch, after_persample, loaded()]))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    by_torch, after_persample, after_dp = json.loads(done.stdout.splitlines()[-1])
    assert set(by_torch) <= {"tqdm"}
    assert after_persample == by_torch, "import persample loaded the cli extra's packages"
    assert after_dp == by_torch, "import persample.dp loaded the cli extra's packages"


def test_persample_imports_and_runs_without_the_cli_extra():
    done = without_cli_extra(
        "import torch, persample, persample.dp, persample.cli.data\n"
        "model = torch.nn.Linear(3, 2)\n"
        "x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))\n"
        "loss = torch.nn.CrossEntropyLoss(reduction='none')\n"
        "grads = persample.per_sample_grads(model, x, y, loss)\n"
        "print(tuple(grads['weight'].shape))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "(4, 2, 3)"


def test_help_works_without_the_cli_extra():
    done = without_cli_extra("from persample.cli import main\nmain(['bench', '--help'])\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--workload" in done.stdout


@pytest.mark.parametrize("argv, names", [
    (["bench", "--quick"], ["tqdm", "scikit-learn"]),
    (["dp-train", "--plot", "curves.png"], ["tqdm", "scikit-learn", "matplotlib"]),
])
def test_a_command_without_the_cli_extra_says_to_install_it(argv, names):
    done = without_cli_extra(f"from persample.cli import main\nmain({argv!r})\n")
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"persample {argv[0]} needs ")
    assert all(name in message for name in names), message
    assert INSTALL in message and 'pip install -e ".[cli]"' in message


def test_only_what_the_command_uses_is_required(monkeypatch):
    from persample.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit, match=r"persample bench needs matplotlib \(not installed\)"):
        main(["bench", "--quick", "--workload", "deep-mlp-grads", "--plot", "bench.png"])
    with pytest.raises(SystemExit, match="persample dp-train needs matplotlib .*persample"):
        main(["dp-train", "--plot", "curves.png"])


def test_the_digits_without_scikit_learn_say_to_install_the_extra(monkeypatch):
    from persample.cli.data import digits_features, digits_images

    for name in [m for m in sys.modules if m.partition(".")[0] == "sklearn"] + ["sklearn"]:
        monkeypatch.setitem(sys.modules, name, None)  # (loaded by earlier tests: all of it)
    for load in (digits_images, digits_features):
        with pytest.raises(ModuleNotFoundError, match=r"needs scikit-learn") as info:
            load()
        assert INSTALL in str(info.value) and info.value.name == "sklearn"


def test_first_call_loads_no_heavy_machinery():
    """The first per_sample_grads with a mean-reduced torch.nn loss and a first PrivateStep
    release, in a fresh process, import neither FSDP (nothing is sharded) nor the
    decompositions torch.func's first vmap of a loss pulls in (sympy): together about a
    second that the first call no longer pays."""
    done = python(
        "import json, sys, torch, persample\n"
        "from torch import nn\n"
        "from persample.dp import PrivateStep\n"
        "model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))\n"
        "x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))\n"
        "before = {m for m in ('sympy', 'torch.distributed.fsdp') if m in sys.modules}\n"
        "persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss())\n"
        "step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=1.0,\n"
        "                   noise_multiplier=1.0, expected_batch_size=8)\n"
        "step.accumulate(x, y)\n"
        "step.release()\n"
        "after = {m for m in ('sympy', 'torch.distributed.fsdp') if m in sys.modules}\n"
        "print(json.dumps([sorted(before), sorted(after)]))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = json.loads(done.stdout.splitlines()[-1])
    assert after == before, f"the first call imported {sorted(set(after) - set(before))}"
