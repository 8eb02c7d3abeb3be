"""persample inside the training loops people already use.

- :mod:`persample.integrations.transformers`: :class:`PrivateTrainer`, a Hugging Face
  ``transformers.Trainer`` that trains with DP-SGD (per-sample clipping, Poisson-sampled
  logical batches, noise once per logical step, epsilon in its logs), configured with
  :class:`PrivacyArguments`.
- :mod:`persample.integrations.laplace`: :class:`PerSampleGGN` and :class:`PerSampleEF`,
  curvature backends of ``laplace-torch`` (its ``diag``, ``kron`` and ``full``
  structures) from persample's per-sample Jacobians, gradients and K-FAC factors.

Nothing here is imported by ``import persample``: import the submodule (it imports
``transformers`` or ``laplace``).
"""
