"""Real data that needs no download, for the command line (``persample dp-train``,
``attribute``, ``dp-finetune``), the benchmark's workloads and the guides' examples.

Images: scikit-learn's 1,797 handwritten 8x8 digits (``sklearn.datasets.load_digits``
reads a file shipped in the scikit-learn wheel), as images of any size and channels
or as feature vectors; scikit-learn comes with the ``cli`` extra, not with
``import persample``. Text: the docstrings of Python's standard library, with a
byte-level tokenizer built in code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _load_digits(caller: str):
    """``sklearn.datasets.load_digits()``; where scikit-learn is not installed, a
    :class:`ModuleNotFoundError` that names it and says how to install it."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as err:
        if (err.name or "sklearn").partition(".")[0] != "sklearn":
            raise  # scikit-learn is there but something it imports is not
        raise ModuleNotFoundError(
            f"persample.cli.data.{caller} needs scikit-learn (not installed): install the "
            'command line\'s extra, pip install "persample[cli]" (or pip install -e ".[cli]" '
            "from a checkout)", name="sklearn") from err
    return load_digits()


def digits_images(size: int = 28, dtype: torch.dtype = torch.float32,
                  channels: int = 1) -> tuple[Tensor, Tensor]:
    """The digits as MNIST-shaped images (or RGB-shaped, for ImageNet models).

    Args:
        size: side of the output images in pixels (bilinear resize from 8x8).
        dtype: floating dtype of the images.
        channels: the grey image repeated this many times along dim 1 (3 for a
            model that takes RGB images).

    Returns:
        ``images (1797, channels, size, size)`` standardised to mean 0 and std 1 over
        the whole set (contiguous), and ``labels (1797,)`` int64 in ``0..9``.

    Raises:
        ImportError: scikit-learn is not installed (it comes with the ``cli`` extra:
            ``pip install "persample[cli]"``).

    Examples:
        >>> x, y = digits_images()
        >>> x.shape, y.shape
        (torch.Size([1797, 1, 28, 28]), torch.Size([1797]))
        >>> digits_images(32, channels=3)[0].shape
        torch.Size([1797, 3, 32, 32])
    """
    digits = _load_digits("digits_images")
    x = torch.as_tensor(digits.images, dtype=torch.float64).unsqueeze(1)  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    return x.repeat(1, channels, 1, 1).to(dtype), labels


def digits_features(
    features: int = 300, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The digits as vectors for an MLP, with a binary label.

    The 64 pixels are standardised, then mapped by a fixed random projection
    (Gaussian, variance ``1/64``, drawn from ``seed``) to ``features`` numbers.

    Returns:
        ``x (1797, features)`` and ``labels (1797,)`` int64: 1 where the digit is 5
        or more, else 0.

    Raises:
        ImportError: scikit-learn is not installed (it comes with the ``cli`` extra:
            ``pip install "persample[cli]"``).

    Examples:
        >>> x, y = digits_features()
        >>> x.shape, int(y.max())
        (torch.Size([1797, 300]), 1)
    """
    digits = _load_digits("digits_features")
    pixels = torch.as_tensor(digits.data, dtype=torch.float64)  # (N, 64)
    pixels = (pixels - pixels.mean(0)) / (pixels.std(0) + 1e-8)
    gen = torch.Generator().manual_seed(seed)
    projection = torch.randn(64, features, generator=gen, dtype=torch.float64) / 8.0
    labels = torch.as_tensor(digits.target >= 5, dtype=torch.int64)
    return (pixels @ projection).to(dtype), labels


# ---------------------------------------------------------------------------
# Real text: the docstrings of Python's standard library, as bytes

STDLIB_MODULES = (
    "abc", "argparse", "collections", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fractions", "functools", "heapq", "inspect", "itertools",
    "json", "logging", "math", "pathlib", "pickle", "random", "re", "shutil", "statistics",
    "string", "textwrap", "typing", "unittest", "zipfile",
)
"""The modules :func:`stdlib_docstrings` reads, in this order."""


def stdlib_docstrings(modules: tuple[str, ...] = STDLIB_MODULES) -> list[str]:
    """The docstrings of some of Python's standard library modules, in a fixed order.

    For each module in ``modules`` (imported by name): its own docstring, then,
    by sorted attribute name, the docstrings of the classes and functions it
    defines (``__module__`` is the module), each class followed by its own
    methods' docstrings (sorted by name). Each text is ``inspect.cleandoc``-ed;
    empty and repeated texts are dropped. The texts depend on the Python
    version (3.11 here: 960 texts, 252,000 characters) but not on anything else.

    Args:
        modules: standard library module names.

    Returns:
        A list of ``str``, one per docstring.

    Raises:
        ImportError: a name in ``modules`` is not importable.
        RuntimeError: no docstrings found (Python runs with ``-OO``, which strips them).

    Examples:
        >>> texts = stdlib_docstrings(("json",))
        >>> texts[0].split()[:4]
        ['JSON', '(JavaScript', 'Object', 'Notation)']

    Source: the idea of a corpus that ships with every Python, so nothing is downloaded.
    """
    import importlib
    import inspect
    import warnings

    texts: list[str] = []
    seen: set[str] = set()

    def add(doc: object) -> None:
        if isinstance(doc, str) and doc.strip():
            text = inspect.cleandoc(doc)
            if text not in seen:
                seen.add(text)
                texts.append(text)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # typing.io, typing.re
        for name in modules:
            _add_module(importlib.import_module(name), name, add)
    if not texts:
        raise RuntimeError("no docstrings found: is Python running with -OO?")
    return texts


def _add_module(module, name: str, add) -> None:
    """``add`` the docstrings of ``module`` in :func:`stdlib_docstrings`'s order."""
    import inspect

    add(module.__doc__)
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) != name:
            continue
        add(obj.__doc__)
        if inspect.isclass(obj):
            for method in sorted(vars(obj)):
                member = vars(obj)[method]
                # the standard library's own: not a function another package set on
                # the class (transformers adds Logger.warning_advice to logging's Logger)
                if inspect.isfunction(member) and _in_stdlib(member):
                    add(member.__doc__)


def _in_stdlib(function) -> bool:
    import sys

    top = (function.__module__ or "").partition(".")[0]
    return top in sys.stdlib_module_names


class ByteTokenizer:
    """A byte-level tokenizer built in code: UTF-8 bytes are ids ``0..255``, and
    ``256`` marks the end of a document. No files, no training, no unknown tokens.

    Examples:
        >>> tok = ByteTokenizer()
        >>> tok.encode("héllo")
        [104, 195, 169, 108, 108, 111]
        >>> tok.decode(tok.encode("héllo") + [tok.eod])
        'héllo'
        >>> tok.vocab_size
        257

    Source: byte-level vocabularies as in GPT-2's (Radford et al., 2019), without merges.
    """

    vocab_size = 257
    eod = 256  # end-of-document id

    def encode(self, text: str) -> list[int]:
        """``text``'s UTF-8 bytes as a list of ``int`` ids in ``0..255``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | Tensor) -> str:
        """The text of ``ids`` (a list or a 1-D integer tensor); end-of-document ids and
        invalid UTF-8 are dropped."""
        ids = ids.tolist() if isinstance(ids, Tensor) else ids
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="ignore")


def docstring_batch(batch: int = 16, seq_len: int = 64,
                    device: torch.device | str = "cpu") -> tuple[dict[str, Tensor], Tensor]:
    """A batch of real text for a causal language model, as a tokenizer returns it.

    The standard library's docstrings (:func:`stdlib_docstrings`) encoded with
    :class:`ByteTokenizer`, each followed by the end-of-document id, joined, and
    cut into consecutive windows of ``seq_len`` tokens; the first ``batch``
    windows. Nothing is padded, so the attention mask is all ones.

    Args:
        batch: number of windows ``B`` (at most about 10,000 at ``seq_len=64``).
        seq_len: tokens per window ``T``.
        device: where the tensors are made.

    Returns:
        ``({"input_ids": (B, T) int64, "attention_mask": (B, T) int64}, labels)`` with
        ``labels`` a ``(B, T)`` int64 copy of ``input_ids`` (a causal LM loss shifts it).
        Ids are in ``0..256``.

    Raises:
        ValueError: the corpus has fewer than ``batch * seq_len`` tokens.

    Examples:
        >>> inputs, labels = docstring_batch(2, 8)
        >>> inputs["input_ids"].shape, inputs["attention_mask"].dtype
        (torch.Size([2, 8]), torch.int64)
        >>> ByteTokenizer().decode(inputs["input_ids"][0])
        'Abstract'
    """
    tok = ByteTokenizer()
    ids: list[int] = []
    for text in stdlib_docstrings():
        ids += tok.encode(text) + [tok.eod]
        if len(ids) >= batch * seq_len:
            break
    if len(ids) < batch * seq_len:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than "
                         f"batch * seq_len = {batch * seq_len}")
    input_ids = torch.tensor(ids[: batch * seq_len], dtype=torch.int64, device=device)
    input_ids = input_ids.view(batch, seq_len)
    mask = torch.ones_like(input_ids)
    return {"input_ids": input_ids, "attention_mask": mask}, input_ids.clone()


CLASSIFIED_MODULES = ("inspect", "logging", "pathlib", "typing")
"""The modules :func:`docstring_examples` labels in its ``"module"`` task (358 texts)."""


def docstring_examples(task: str = "causal", seq_len: int = 64, count: int | None = None,
                       modules: tuple[str, ...] = CLASSIFIED_MODULES) -> list[dict[str, Tensor]]:
    """Real text as a list of examples, the form a Hugging Face ``Trainer`` takes as its
    ``train_dataset`` (each a dict of equal-length tensors, stacked by its default
    collator).

    ``task="causal"``: :func:`docstring_batch`'s windows of ``seq_len`` tokens, each
    with ``labels`` a copy of its ``input_ids`` (a causal LM shifts them). ``task=
    "module"``: one example per docstring of ``modules`` (sequence classification:
    which module it documents, ``labels`` its index in ``modules``), the text's first
    ``seq_len`` bytes, padded with the end-of-document id (256) and masked.

    Args:
        task: ``"causal"`` or ``"module"``.
        seq_len: tokens per example ``T`` (bytes, :class:`ByteTokenizer`; ids ``0..256``).
        count: the first ``count`` examples (default: 64 windows for ``"causal"``, every
            docstring for ``"module"``).
        modules: the standard library modules of the ``"module"`` task (their order
            gives the labels).

    Returns:
        a list of dicts ``{"input_ids": (T,) int64, "attention_mask": (T,) int64,
        "labels": (T,) int64 or () int64}``.

    Raises:
        ValueError: an unknown ``task``, or more examples asked for than there are.

    Examples:
        >>> train = docstring_examples("module", seq_len=32)
        >>> len(train), train[0]["input_ids"].shape, int(train[-1]["labels"])
        (358, torch.Size([32]), 3)
        >>> docstring_examples("causal", seq_len=16, count=2)[1]["labels"].shape
        torch.Size([16])

    Source: the standard library's docstrings (:func:`stdlib_docstrings`), as bytes.
    """
    if task == "causal":
        inputs, labels = docstring_batch(64 if count is None else count, seq_len)
        return [{"input_ids": ids, "attention_mask": mask, "labels": lab}
                for ids, mask, lab in zip(inputs["input_ids"], inputs["attention_mask"], labels)]
    if task != "module":
        raise ValueError(f"task must be 'causal' or 'module', got {task!r}")
    tok = ByteTokenizer()
    examples = []
    for label, module in enumerate(modules):
        for text in stdlib_docstrings((module,)):
            ids = tok.encode(text)[:seq_len]
            pad = seq_len - len(ids)
            examples.append({
                "input_ids": torch.tensor(ids + [tok.eod] * pad, dtype=torch.int64),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.int64),
                "labels": torch.tensor(label, dtype=torch.int64)})
    if count is not None and count > len(examples):
        raise ValueError(f"the {len(modules)} modules have {len(examples)} docstrings, fewer "
                         f"than count = {count}")
    return examples[:count]
