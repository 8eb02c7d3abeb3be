"""GPT-2 4x768 for sequence classification, its real vocabulary (50,257), fitted by
laplace-torch with ``hessian_structure="kron"`` over every weight, persample as the
backend: prints the fit's time, the peak resident memory and a GLM prediction as JSON.

Run by the slow test beside it; by hand: ``python tests/laplace_gpt2_fit.py
[--backend persample|curvlinops|backpack|asdl] [--override]`` (``--override``: Laplace's
default ``fit(loader)``, which allocates its zero factors a second time).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import transformers
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader


class Classifier(nn.Module):
    """One dict argument in, the logits ``(B, 2)`` out, as Laplace calls the model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257,
                                         n_positions=1024, num_labels=2, pad_token_id=50256)
        self.model = transformers.GPT2ForSequenceClassification(config).eval()

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits


def backend(name: str) -> type:
    if name == "persample":
        from persample.integrations.laplace import PerSampleGGN
        return PerSampleGGN
    from laplace import curvature
    return {"curvlinops": curvature.CurvlinopsGGN, "backpack": curvature.BackPackGGN,
            "asdl": curvature.AsdlGGN}[name]


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="persample")
    parser.add_argument("--override", action="store_true")
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50256, (args.samples, 128), generator=g)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(128, dtype=torch.long),
             "labels": torch.randint(0, 2, (), generator=g)} for i in range(args.samples)]
    start = time.perf_counter()
    la = Laplace(Classifier(), "classification", subset_of_weights="all",
                 hessian_structure="kron", backend=backend(args.backend))
    built = time.perf_counter()
    report = {"backend": args.backend, "init_s": built - start, "init_peak_gib": peak_gib()}
    try:
        la.fit(DataLoader(rows, batch_size=8), override=args.override)
    except Exception as e:  # noqa: BLE001 (the report says what the backend raised)
        report["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(report))
        return
    report.update(fit_s=time.perf_counter() - built, fit_peak_gib=peak_gib())
    x = {"input_ids": ids[:2], "attention_mask": torch.ones(2, 128, dtype=torch.long)}
    probs = la(x, pred_type="glm", link_approx="probit")
    report.update(probs=probs.tolist(), peak_gib=peak_gib(),
                  kron_entries=[[list(f.shape) for f in fs] for fs in la.H_facs.kfacs[:3]])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
