"""The bundled text depends on the Python version only: not on what else is imported."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_docstrings_do_not_change_when_transformers_is_imported():
    """transformers sets a function on the standard library's logging.Logger; the corpus
    keeps the standard library's own docstrings, so it is the same before and after."""
    code = ("from persample.cli.data import stdlib_docstrings, docstring_examples\n"
            "before = stdlib_docstrings()\n"
            "import transformers\n"
            "from transformers import BertModel\n"
            "after = stdlib_docstrings()\n"
            "print(before == after, len(after), len(docstring_examples('module')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    same, texts, examples = done.stdout.split()
    assert same == "True" and int(texts) > 900 and examples == "358"
