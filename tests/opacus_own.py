"""Run one of Opacus's own test files on persample, with only its imports changed.

``python tests/opacus_own.py FILE MAX_EXAMPLES OUT [--float64] [--only CLASS.TEST ...]``
reads ``FILE`` (a path under the installed ``opacus/tests``), replaces each line of
:data:`IMPORTS` (Opacus's import) by persample's, checks that nothing but import lines
changed, runs every ``unittest.TestCase`` in it (hypothesis drawing at most
``MAX_EXAMPLES`` examples per test, a settings profile: the tests' text unchanged) and
writes ``{"Class.test": [outcome, message]}`` as JSON to ``OUT``; outcome is ``pass``,
``fail``, ``error`` or ``skip``, message the exception's last line or the skip's reason.
``--float64`` runs with torch's default dtype float64.

Opacus's code is read from the installed package (the ``test`` extra installs Opacus),
never copied here. A fresh process per file: the profile, the dtype and torchvision's
loading stay out of the test session.
"""

from __future__ import annotations

import json
import pathlib
import sys
import traceback
import types
import unittest
import warnings

IMPORTS = {
    "from opacus import PrivacyEngine": "from persample.dp import PrivacyEngine",
    "from opacus.utils.batch_memory_manager import BatchMemoryManager":
        "from persample.dp import BatchMemoryManager",
    "from opacus.schedulers import StepGradClip, StepNoise":
        "from persample.dp.schedulers import StepGradClip, StepNoise",
    "from opacus.schedulers import ExponentialGradClip, LambdaGradClip, StepGradClip":
        "from persample.dp.schedulers import ExponentialGradClip, LambdaGradClip, StepGradClip",
    "from opacus.schedulers import ExponentialNoise, LambdaNoise, StepNoise":
        "from persample.dp.schedulers import ExponentialNoise, LambdaNoise, StepNoise",
    "from opacus.validators.errors import UnsupportedModuleError":
        "from persample.errors import UnsupportedModuleError",
    "from opacus.validators.module_validator import ModuleValidator":
        "from persample.dp import ModuleValidator",
    "from opacus.optimizers.optimizer import _generate_noise":
        "from persample.dp.noise import generate_noise as _generate_noise",
    # persample handles torch's own attention layer: Opacus's re-implementation of it
    # (same arguments) is not needed
    "from opacus.layers.dp_multihead_attention import DPMultiheadAttention":
        "from torch.nn import MultiheadAttention as DPMultiheadAttention",
    # test utilities, not what is tested: a state-dict comparison, opt_einsum's sum
    "from opacus.utils.module_utils import are_state_dict_equal":
        "from opacus_own import are_state_dict_equal",
    "from opt_einsum import contract": "from torch import einsum as contract",
    # the models of Opacus's tests (plain torch modules)
    "from .utils import": "from opacus.tests.utils import",
}


def are_state_dict_equal(a: dict, b: dict) -> bool:
    """Same keys, equal tensors."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in a)


def rewritten(source: str) -> str:
    """``source`` with Opacus's imports replaced by persample's.

    Raises:
        AssertionError: a line other than an import changed.
    """
    lines = source.splitlines()
    out = []
    for line in lines:
        for old, new in IMPORTS.items():
            if line.startswith(old):
                line = new + line[len(old):]
        out.append(line)
    for old, new in zip(lines, out):
        assert old == new or old.startswith(("from ", "import ")), (old, new)
    return "\n".join(out) + "\n"


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, list[str]] = {}

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return f"{type(test).__name__}.{test._testMethodName}"

    def addSuccess(self, test):  # noqa: N802 (unittest's names)
        self.outcomes.setdefault(self._name(test), ["pass", ""])

    def _last(self, err) -> str:
        return "".join(traceback.format_exception_only(err[0], err[1])).strip()

    def addFailure(self, test, err):  # noqa: N802
        self.outcomes[self._name(test)] = ["fail", self._last(err)]

    def addError(self, test, err):  # noqa: N802
        self.outcomes[self._name(test)] = ["error", self._last(err)]

    def addSkip(self, test, reason):  # noqa: N802
        self.outcomes[self._name(test)] = ["skip", reason]

    def addSubTest(self, test, subtest, err):  # noqa: N802
        if err is not None:
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            self.outcomes[self._name(test)] = [kind, self._last(err)]


def main(argv: list[str]) -> None:
    file, max_examples, out = argv[0], int(argv[1]), argv[2]
    only = set(argv[argv.index("--only") + 1:]) if "--only" in argv else None
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from persample.cli.real_models import load_torchvision

    load_torchvision()  # (.venv/vision's torchvision, as the README's set-up installs it)
    import hypothesis
    import opacus
    import torch

    warnings.simplefilter("ignore")  # (Opacus's tests take poisson_sampling=False often)
    if "--float64" in argv:
        torch.set_default_dtype(torch.float64)
    hypothesis.settings.register_profile("opacus-own", max_examples=max_examples,
                                         derandomize=True, database=None)
    hypothesis.settings.load_profile("opacus-own")
    source = (pathlib.Path(opacus.__file__).parent / "tests" / file).read_text()
    module = types.ModuleType("opacus_test_on_persample")
    sys.modules[module.__name__] = module
    exec(compile(rewritten(source), file, "exec"), module.__dict__)
    suite = unittest.TestSuite()
    for obj in list(vars(module).values()):
        if isinstance(obj, type) and issubclass(obj, unittest.TestCase):
            for test in unittest.TestLoader().loadTestsFromTestCase(obj):
                if only is None or _Result._name(test) in only:
                    suite.addTest(test)
    result = _Result()
    suite.run(result)
    pathlib.Path(out).write_text(json.dumps(result.outcomes, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
