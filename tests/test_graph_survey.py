"""``python -m persample_bench.graph_survey`` on four layers: GCN, SAGE and PPF on the rules
and equal to the loop, ChebConv without ``lambda_max`` (the largest edge weight of the
whole batch) refused by the rules, naming the op, and answered by ``torch.func``."""

from __future__ import annotations

from zoo import require


def test_the_survey_names_each_layers_path(capsys):
    require("torch_geometric")
    from persample_bench import graph_survey

    rows = graph_survey.main(["--layer", "gcn", "--layer", "sage", "--layer", "ppf",
                              "--layer", "cheb-no-lambda", "--markdown"])
    out = capsys.readouterr().out
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in out.splitlines()
             if line.startswith("| ")}
    assert lines["gcn"].startswith("| gcn | rule | "), lines["gcn"]
    assert lines["sage"].startswith("| sage | rule | "), lines["sage"]
    assert lines["ppf"].startswith("| ppf | rule | "), lines["ppf"]  # (torch.cross of
    # each edge's positions and normals, along their 3 coordinates)
    cheb = lines["cheb-no-lambda"]
    assert cheb.startswith("| cheb-no-lambda | vmap | ") and (
        "samples mixed: TensorBase.max reduces over the batch" in cheb), cheb
    assert "fell back to method='vmap'" in cheb, cheb
    by_name = {row.layer: row for row in rows}
    assert all(by_name[k].diff < 1e-8 for k in ("gcn", "sage", "ppf"))
    assert by_name["cheb-no-lambda"].diff < 1e-8  # (the whole-model answer, exact)
    assert not any(row.refused or row.error or row.needs for row in rows), rows
    assert float(lines["gcn"].split(" | ")[2]) < 1e-8
    assert "3 of 4 convolutions take the rules; not: cheb-no-lambda" in out
