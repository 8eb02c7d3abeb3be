"""persample's benchmark: every per-sample method timed side by side on real data
(``persample bench``, also ``persample-bench`` and ``python -m persample_bench``).

A package of its own beside the library, shipped in the same distribution, so that the
benchmark runs from an installed copy: the harness (:mod:`persample_bench.bench`, its
options in :mod:`persample_bench.bench_options`), the competitors it times persample
against, one module each (:mod:`persample_bench.anchors`: the loop, ``torch.func``,
Opacus, BackPACK, curvlinops, kronfluence, each imported only where it runs), the
workloads (:mod:`persample_bench.workloads`) and their real models
(:mod:`persample_bench.real_models`), and what a certificate costs
(:mod:`persample_bench.certified_cost`). It uses persample as its users do, and the
command line's helpers (threads, resident memory, the bundled data) from
:mod:`persample.cli`; persample imports nothing of it, but for the ``bench`` subcommand,
which hands its arguments to :func:`main`.
"""

from __future__ import annotations

import os

from persample.cli import _deps
from persample.errors import STRICT_ENV

from .bench_options import build_parser, plan

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None, prog: str = "persample-bench") -> int:
    """Run the benchmark with ``argv`` (default: ``sys.argv[1:]``), the options of
    ``persample bench`` (``prog`` names the command in ``--help`` and errors); returns the
    exit status, 0.

    Raises:
        SystemExit: bad arguments (argparse), an unknown workload, ``--device cuda``
            without CUDA, or a package the benchmark needs from the ``cli`` extra (tqdm,
            scikit-learn, matplotlib for ``--plot``) is not installed: checked before
            it starts.
    """
    args = build_parser(prog).parse_args(argv)
    _deps.require(args)
    # a bug of persample fails its row, never hides behind a fallback (probes inherit it)
    os.environ.setdefault(STRICT_ENV, "1")
    if args._memory_probe:
        import json

        from .bench import memory_probe

        workload, method = args._memory_probe
        print(json.dumps(memory_probe(workload, method, args.batch, args.threads,
                                      args.device)))
    else:
        from .bench import run

        chosen = plan(args)
        run(chosen.workloads, chosen.quick, chosen.batch, args.threads, args.json, args.plot,
            device=args.device, memory=chosen.memory, markdown_path=args.markdown)
    return 0
