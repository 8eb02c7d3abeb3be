"""Real data bundled with scikit-learn: the 1,797 handwritten 8x8 digits.

No download: ``sklearn.datasets.load_digits`` reads a file shipped in the
scikit-learn wheel. PERFORMANCE.md's workloads use it in two shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def digits_images(size: int = 28, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The digits as MNIST-shaped images.

    Args:
        size: side of the output images in pixels (bilinear resize from 8x8).
        dtype: floating dtype of the images.

    Returns:
        ``images (1797, 1, size, size)`` standardised to mean 0 and std 1 over the
        whole set, and ``labels (1797,)`` int64 in ``0..9``.

    Raises:
        ImportError: scikit-learn is not installed (it is a core dependency).

    Example:
        >>> x, y = digits_images()
        >>> x.shape, y.shape
        (torch.Size([1797, 1, 28, 28]), torch.Size([1797]))
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.images, dtype=torch.float64).unsqueeze(1)  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    return x.to(dtype), torch.as_tensor(digits.target, dtype=torch.int64)


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
        ImportError: scikit-learn is not installed (it is a core dependency).

    Example:
        >>> x, y = digits_features()
        >>> x.shape, int(y.max())
        (torch.Size([1797, 300]), 1)
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = torch.as_tensor(digits.data, dtype=torch.float64)  # (N, 64)
    pixels = (pixels - pixels.mean(0)) / (pixels.std(0) + 1e-8)
    gen = torch.Generator().manual_seed(seed)
    projection = torch.randn(64, features, generator=gen, dtype=torch.float64) / 8.0
    labels = torch.as_tensor(digits.target >= 5, dtype=torch.int64)
    return (pixels @ projection).to(dtype), labels
