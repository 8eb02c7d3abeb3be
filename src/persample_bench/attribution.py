"""``persample attribute`` with dattri's TracIn beside persample's:
``python -m persample_bench.attribution`` takes the same options.

The same task (the digits with flipped labels, the small CNN, the same checkpoints) and
the same self-influence, ``sum_c lr |g_i|^2`` over the checkpoints (TracIn, Pruthi et
al. 2020), computed by dattri's ``TracInAttributor``: ``torch.func`` per-sample
gradients, randomly projected to 512 dimensions (its default). Each is timed as a phase
and scored by its AUC of finding the flipped labels. dattri comes with the ``bench``
extra; where it is not installed the report says so.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor, nn

from persample.cli import attribute

DATTRI = "dattri TracInAttributor (projected to 512)"


def dattri_self_influence(model: nn.Module, checkpoints: list[dict], x: Tensor, y: Tensor,
                          cfg: attribute.AttributeConfig) -> Tensor:
    """``(n,)``: dattri's TracIn self-influence of each training sample over the
    checkpoints (state dicts of ``model``), weighted by the learning rate ``cfg.lr``.

    Raises:
        ImportError: dattri is not installed.
    """
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader, TensorDataset

    def loss_func(params, data):  # one sample, as dattri vmaps it
        image, label = data
        out = torch.func.functional_call(model, params, image.unsqueeze(0))
        return nn.functional.cross_entropy(out, label.unsqueeze(0))

    task = AttributionTask(loss_func=loss_func, model=model, checkpoints=checkpoints)
    attributor = TracInAttributor(task=task, weight_list=torch.full((len(checkpoints),), cfg.lr),
                                  normalized_grad=False,
                                  projector_kwargs={"proj_dim": 512, "device": "cpu"})
    loader = DataLoader(TensorDataset(x, y), batch_size=cfg.chunk, shuffle=False)
    return attributor.self_attribute(loader)


def main(argv: list[str] | None = None) -> int:
    """Run ``persample attribute`` with ``argv``'s options and dattri beside; returns 0.

    Raises:
        SystemExit: bad arguments (argparse), as ``persample attribute`` raises them.
    """
    parser = argparse.ArgumentParser(prog="python -m persample_bench.attribution")
    attribute.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["attribute", *(sys.argv[1:] if argv is None else argv)])
    attribute.run_from_args(args, beside={DATTRI: dattri_self_influence})
    return 0


if __name__ == "__main__":
    sys.exit(main())
