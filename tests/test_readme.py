"""The README and the documentation run as written: every Python block of ``README.md``
and ``docs/`` in a fresh process of the environment the README's set-up makes, every
page in the site's navigation, and the set-up, test and documentation commands are
those CI runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
BLOCKS = [b for page in PAGES
          for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
# a block that is a file of the package as it is ("Adding an op" shows rules/addcmul.py):
# compared with the file (test_readme_op_rule_is_the_file), not run on its own, where it
# would register the op a second time
FILES = [b for b in BLOCKS if "register(OpSpec(" in b]
RUN = [b for b in BLOCKS if b not in FILES]

# What a block must have computed, checked in the block's own process when the block
# defines the name (each check prints its name; the test asserts every check ran).
CHECKS = {
    # the questions, worked: each answer equal to the question's loop
    "all_outputs": ("all_outputs.shape == (64, 10, 15910) and torch.allclose("
                    "all_outputs, calculate_gradients_loop(mlp_model, X), atol=1e-6)"),
    "dt": ("dt.shape == (3, 4, 1) and torch.allclose(dt, torch.stack("
           "[full[i, :, i] for i in range(3)]), atol=1e-6)"),  # (float32 rounding)
    "by_class": ("by_class.shape == (128, 5, 30) and torch.allclose("
                 "by_class, compute_grad(inputs, clf), atol=1e-6)"),
    "each": ('each["6.weight"].shape == (64, 128, 9216) and all(torch.allclose('
             'each[k][:4], loop[k], atol=1e-6) for k in loop)'),
    "jacobian": "jacobian.shape == (32, 4, 1604)",
    # Opacus's checkpoints, accountant and ModuleValidator
    "checkpoint_engine": ("checkpoint_engine.accountant.steps == 4 and len(accountant) == 1 "
                          "and type(cnn._module[1]).__name__ == 'GroupNorm'"),
    # a sample that is not finite: its rows, and a warning naming it
    "nan_warning": ("torch.isnan(nan_grads['0.weight'][3]).all() and not torch.isnan("
                    "nan_grads['0.weight'][[0, 1, 2, 4, 5]]).any() and nan_warning"
                    ".startswith('per_sample_grads: the loss of samples [3] is not finite')"),
    # the README's quick start
    "quick_grads": 'quick_grads["0.weight"].shape == (32, 64, 20)',
    "quick_jac": "quick_jac.shape == (32, 4, 1604)",
    "lm_grads": 'lm_grads["transformer.wte.weight"].shape == (8, 100, 32)',
    "head": 'list(head) == ["3.weight", "3.bias"]',
    "set_grads": 'set_grads["phi.weight"].shape == (4, 16, 3)',
    "graph_grads": 'graph_grads["conv.lin.weight"].shape == (6, 16, 3)',
    # a call replayed from a CUDA graph (without a GPU: the call itself)
    "replayed": 'replayed["0.weight"].shape == (64, 32, 12)',
    "jac": "jac.shape == (256, 10, 15910)",
    "dx": "dx.shape == (100, 400, 1)",
    "dclf": "dclf.shape == (256, 10, 784)",
    "norms": "norms.shape == (32,)",
    # one accounted step per release, with the step's own noise and sample rate
    "checkpoint": 'checkpoint["accountant"]["history"] == [[1.1, 0.256, len(sampler)]]',
    "spent": "0 < spent < 100",
    # make_private: every planned step taken, within the target
    "private": ("private.step.accountant.steps == 2 * private.steps_per_epoch"
                " and private.epsilon(1e-5) <= 3.0"),
    # make_private from a DataLoader: the dataset's samples, the loader's batch size
    "from_loader": ("from_loader.sample_rate == 256 / 1797 and from_loader.steps_per_epoch"
                    " == 7 == from_loader.step.accountant.steps"),
    "net": "all(p.grad is not None for p in net.parameters())",
    # correlated noise: less noise on the prefix sums, the target spent in the run
    "rmse_ratio": "0.3 < rmse_ratio < 1",
    "banded": ("banded.step.noise.t == banded.step.mechanism.steps == 60 and "
               "banded.epsilon(1e-5) <= 4.0 + 1e-9"),
    "plan": "plan.participations(300) == 15 and plan.sensitivity > 1",
    "buffered": ("buffered.step.noise.t == buffered.step.mechanism.steps == 60 and "
                 "buffered.epsilon(1e-5) <= 4.0 + 1e-9 and "
                 "buffered.step.mechanism.cycle_length == 20"),
    # user-level DP: each sample's norm its user's; every planned user-level step taken
    "user_norms": "len(user_norms.unique()) == 4",
    "by_user": ("by_user.sample_rate == 20 / len(owners.unique()) and "
                "by_user.step.accountant.steps == 2 * by_user.steps_per_epoch"
                " and by_user.epsilon(1e-3) <= 4.0"),
    # an Opacus script through persample's PrivacyEngine: every step accounted
    "privacy_engine": ("privacy_engine.accountant.steps == 20"
                       " and privacy_engine.get_epsilon(1e-5) > 0"),
    # Opacus's BatchMemoryManager: one accounted step per logical batch, several physical
    "bmm_engine": ("bmm_engine.accountant.steps == 5 and max(physical_sizes) <= 128"
                   " and len(physical_sizes) > 10"),
    # adaptive clipping: C came down from 10 towards the median norm
    "adaptive": "adaptive.max_grad_norm < 10.0 and adaptive.accountant.steps == 10",
    # secure mode: the step's noise source is the OS's
    "secure_step": "type(secure_step.generator).__name__ == 'SecureSource'",
    # curvature: K-FAC's factors, the per-sample GGN diagonal, influence scores
    "first": "first.A.shape == (10, 10) and first.G.shape == (32, 32) and first.rows == 'G'",
    "per_sample_diag": "per_sample_diag['0.weight'].shape == (8, 32, 10)",
    "scores": "scores.shape == (5, 200) and bool(torch.isfinite(scores).all())",
    "projected": "projected.shape == (5, 200) and not torch.equal(projected, scores)",
    # the Laplace backend: a kron fit with the table's input side a vector; probabilities
    "probs": ("probs.shape == (5, 3) and torch.allclose(probs.sum(-1), torch.ones(5))"
              " and la.H_facs.kfacs[0][0].shape == (100,)"),
    # the audit of a correct step: no leak
    "checked": "not checked.leaks and checked.gradient.epsilon < checked.epsilon",
    # automatic clipping: each sample's losses and gradient norms
    "automatic": "automatic.losses.shape == automatic.norms.shape == (32,)",
    # PrivateTrainer: within the target after the planned steps; the LoRA run accounted
    "trainer": ("trainer.private_step.accountant.steps == trainer.state.global_step == 48"
                " and 7.9 < trainer.epsilon() <= 8.0"),
    "lm_trainer": "lm_trainer.private_step.accountant.steps == 10 and lm_trainer.epsilon() > 0",
    # TracIn: scores of the training set against the test set; flipped labels found
    "flagged": ("(flagged < 100).float().mean() > 0.5 and tracin.shape == (1500, 297)"
                " and bool(torch.isfinite(tracin).all())"),
}


def _checked(block: str) -> str:
    """The block, then each check whose name it assigns."""
    lines = [block]
    for name, check in CHECKS.items():
        if re.search(rf"^{name}\s*=", block, flags=re.M):
            lines.append(f"assert {check}, {name!r}\nprint('checked', {name!r})")
    return "\n".join(lines)


def _fresh_env() -> dict:
    """The environment a reader's shell has: nothing of this test process's sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env


def _label(block: str) -> str:
    first = next(line for line in block.splitlines()
                 if line.strip() and not line.startswith(("import", "from")))
    return re.sub(r"\W+", "_", first)[:40]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[_label(b) for b in RUN])
def test_readme_block_runs_in_a_fresh_process(block, tmp_path):
    """Each block copied into a file and run by the environment's python in an empty
    folder, as a reader would (``import transformers`` included: torchvision is kept out
    of the environment, see the README's set-up)."""
    script = tmp_path / "block.py"
    script.write_text(_checked(block))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_fresh_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [n for n in CHECKS if re.search(rf"^{n}\s*=", block, flags=re.M)]
    assert re.findall(r"^checked (\w+)$", done.stdout, flags=re.M) == expected


def test_every_check_has_its_block():
    """No check is left without the block that defines its name (a renamed variable
    would otherwise drop its check silently)."""
    defined = {n for n in CHECKS for b in BLOCKS if re.search(rf"^{n}\s*=", b, flags=re.M)}
    assert defined == set(CHECKS)


def test_ci_runs_the_readme_commands():
    """.ci/run's set-up, test and documentation commands are the README's, character for
    character, in that order."""
    ci = (ROOT / ".ci" / "run").read_text()
    bash = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    setup, test, slow, docs = (b.strip() for b in bash[:4])
    assert test.startswith(".venv/bin/python -m pytest -q")  # (spread over the cores)
    assert slow == ".venv/bin/python -m pytest -q -m slow"  # one process: memory
    assert docs == ".venv/bin/mkdocs build --strict"
    assert setup in ci and f"run {test}\n" in ci and f"run {slow}\n" in ci
    assert ci.index(f"run {slow}\n") < ci.index(f"\n{docs}\n")


def test_every_page_is_in_the_navigation():
    """Each page of ``docs/`` is reachable from the site's navigation (mkdocs warns of an
    omitted page, which the strict build turns into a failure; this says which)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in nav, page


@pytest.mark.slow
def test_transformers_imports_after_the_set_up():
    """The environment the README makes imports transformers' models in a fresh process,
    and torchvision is not importable in it without :data:`VISION_DIR` on the path."""
    code = ("import importlib.util\nfrom transformers import GPT2LMHeadModel\n"
            "print(importlib.util.find_spec('torchvision') is None)")
    done = subprocess.run([sys.executable, "-c", code], env=_fresh_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True"


def test_readme_op_rule_is_the_file():
    """The op rule "Adding an op" shows is ``rules/addcmul.py`` as it is."""
    (block,) = FILES
    source = (ROOT / "src" / "persample" / "rules" / "addcmul.py").read_text()
    rule = block[block.index("def addcmul("):]
    assert rule in source
    assert "from persample.rules.spec import" in block


def test_api_reference_has_every_public_name(tmp_path):
    """The site builds in strict mode, and its API reference has an entry for every name
    in ``persample.__all__``, ``persample.dp.__all__`` and the integrations' classes."""
    import persample
    import persample.dp

    env = {**_fresh_env(), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([str(Path(sys.executable).with_name("mkdocs")), "build", "--strict",
                           "-d", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    api = tmp_path / "site" / "api"
    pages = {persample: api / "persample" / "index.html", persample.dp: api / "dp" / "index.html"}
    for module, page in pages.items():
        html = page.read_text()
        missing = [n for n in module.__all__ if f'id="{module.__name__}.{n}"' not in html]
        assert not missing, (module.__name__, missing)
    html = (api / "integrations" / "index.html").read_text()
    for name in ("transformers.PrivateTrainer", "transformers.PrivacyArguments",
                 "laplace.PerSampleGGN", "laplace.PerSampleEF", "laplace.DiagonalKron"):
        assert f'id="persample.integrations.{name}"' in html, name
