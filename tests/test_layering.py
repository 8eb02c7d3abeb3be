"""The package is a strict stack: each module imports only its own layer and those below.

``batch`` (layouts and data flow) -> ``capture`` (one forward recorded) -> ``rules``
(per-sample results from activations and backprops) -> ``engine`` (capture, each
parameter's path, backward, every rule kind run, the exact per-op VJPs, the captured
batch) -> the public functions -> what is built on them (DP-SGD) -> the command line.
An AST scan of every module of ``src/persample`` (imports inside functions too) keeps it
so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import persample

ROOT = Path(persample.__file__).parent

# lowest first; a module may import its own layer and those below it
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"errors", "precision", "memory", "sharded", "patches", "inputs", "rng", "walk"}),
    ("batch", {"batch"}),
    ("draws", {"draws"}),
    ("capture", {"capture", "loss"}),
    ("rules", {"rules"}),
    ("engine", {"engine"}),
    ("public", {"checks", "methods", "certificate", "reference", "vmap", "whole", "api", "norms",
                "dots", "projection", "jacobian", "support", "curvature", "influence",
                "graphs", "__init__"}),
    ("applications", {"dp"}),
    ("integrations", {"integrations"}),
    ("cli", {"cli", "__main__"}),
]
RANK = {top: k for k, (_, tops) in enumerate(LAYERS) for top in tops}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every persample module ``path`` imports."""
    return _imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _is_persample(module: str) -> bool:
    """``module`` is persample or one of its modules (not ``persample_bench``, beside it)."""
    return module == "persample" or module.startswith("persample.")


def _imports_of(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    package = name if is_package else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_persample(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            elif _is_persample(node.module or ""):
                base = node.module
            else:
                continue
            subs = [f"{base}.{a.name}" for a in node.names if _exists(f"{base}.{a.name}")]
            found += [(node.lineno, m) for m in subs or [base]]
    return found


def test_every_module_has_a_layer():
    tops = {_top(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert tops <= set(RANK), f"modules with no layer: {sorted(tops - set(RANK))}"


def test_modules_import_only_their_layer_and_below():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        mine = RANK[_top(name)]
        for line, target in _imports(path):
            if RANK[_top(target)] > mine:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {name} "
                             f"({LAYERS[mine][0]}) imports {target} "
                             f"({LAYERS[RANK[_top(target)]][0]})")
    assert not wrong, "imports up the stack:\n" + "\n".join(wrong)


def test_the_scan_sees_imports_up_the_stack():
    """The scan itself: an import inside a function, two levels up, is found and is
    above the importing module's layer."""
    found = _imports_of("def f():\n    from ..engine import pullback\n",
                        "persample.rules.probe", False)
    assert found == [(2, "persample.engine.pullback")]
    assert RANK[_top(found[0][1])] > RANK[_top("persample.rules.probe")]


# the rule families (one file per family of ops, listed in persample/rules/__init__.py)
# and what they may share
RULE_FAMILIES = {"activation", "addcmul", "attention", "composite", "conv", "einsum",
                 "elementwise", "embedding", "experts", "linear", "norm", "recurrent",
                 "random_ops", "reparametrized", "resample", "sdpa", "solve", "views"}
RULES_SHARED = {"spec", "calls", "outer", "ghost"}


def _rules_module(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "rules" else None


def test_rule_families_import_no_other_family():
    rules = ROOT / "rules"
    assert {p.stem for p in rules.glob("*.py")} == RULE_FAMILIES | RULES_SHARED | {"__init__"}
    wrong = []
    for path in sorted(rules.glob("*.py")):
        if path.stem == "__init__":
            continue
        for line, target in _imports(path):
            other = _rules_module(target)
            if other is not None and other != path.stem and other not in RULES_SHARED:
                wrong.append(f"rules/{path.name}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_only_the_rules_package_names_a_family():
    """The engine, the public functions and DP reach the rules through their specs
    (``persample.rules``), never a family's own names."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent.name == "rules":
            continue
        for line, target in _imports(path):
            if _rules_module(target) in RULE_FAMILIES:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


# what a module above the engine may import from the rules: how users add and decline
# rules, nothing of their internals
RULES_PUBLIC = {"register_rule", "register_norm_rule", "Decline"}


def _rules_names(path: Path) -> list[tuple[int, str]]:
    return _rules_names_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _rules_names_of(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, name)`` for every name a module imports from ``persample.rules`` or a
    module of it (``from ..rules.ghost import Factors``: ``"ghost"``)."""
    found = [(line, target.removeprefix("persample.rules."))
             for line, target in _imports_of(source, name, is_package)
             if _top(target) == "rules" and target != "persample.rules"]
    package = name if is_package else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module or ""
        if module == "persample.rules":
            found += [(node.lineno, a.name) for a in node.names
                      if not _exists(f"{module}.{a.name}")]
    return sorted(found)


def test_only_the_engine_runs_the_rules():
    """Above the engine (the public functions, DP, the integrations, the command line) a
    module reaches the rules through the engine; it may import only how users add and
    decline rules."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if RANK[_top(_module_name(path))] <= RANK["engine"]:
            continue
        wrong += [f"{path.relative_to(ROOT.parent)}:{line} imports rules' {name}"
                  for line, name in _rules_names(path) if name not in RULES_PUBLIC]
    assert not wrong, "\n".join(wrong)


def test_the_rules_scan_sees_an_internal_name():
    source = ("from ..rules import spec_of\nfrom ..rules.ghost import Factors\n"
              "def f():\n    from ..rules import register_rule\n")
    assert _rules_names_of(source, "persample.dp.probe", False) == [
        (1, "spec_of"), (2, "ghost"), (4, "register_rule")]


def test_the_data_flow_table_imports_no_handler_family():
    """``batch/flow.py`` (the table) is imported by the handler families, never the other
    way: the package lists them."""
    for name in ("flow", "layouts", "forms"):
        targets = [t for _, t in _imports(ROOT / "batch" / f"{name}.py")]
        assert not [t for t in targets if t.split(".")[-1].startswith("ops_")], name


def _closure(module: str) -> set[str]:
    """Every persample module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        rel = Path(*name.split(".")[1:])
        path = (ROOT / rel).with_suffix(".py")
        path = path if path.exists() else ROOT / rel / "__init__.py"
        for _, target in _imports(path):
            if target not in seen and _exists(target):
                seen.add(target)
                todo.append(target)
    return seen


def test_the_reference_depends_on_nothing_it_checks():
    """The loop over samples (the oracle every fast path is tested against) imports none
    of the machinery it checks: the data flow, the capture, the rules, the plan, the
    engine, the per-sample loss."""
    checked = {"batch", "draws", "capture", "rules", "engine", "loss", "vmap", "whole",
               "api", "norms"}
    found = sorted(m for m in _closure("persample.reference") if _top(m) in checked)
    assert not found, found


def test_the_certificate_depends_on_nothing_it_checks():
    """The certificate's identities use autograd on one batch forward: it imports none of
    the capture, the rules, the plan, the engine or the whole-model fallbacks it checks
    (only the reading of inputs and each sample's loss on its rows of the output)."""
    checked = {"draws", "capture", "rules", "engine", "vmap", "whole", "api", "norms"}
    found = sorted(m for m in _closure("persample.certificate") if _top(m) in checked)
    assert not found, found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> the modules it imports) as a path, or ``None``."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            found = visit(target, path + [node])
            if found:
                return found
        done.add(node)
        return None

    return next((c for c in map(lambda n: visit(n, []), sorted(graph)) if c), None)


def test_no_module_of_dp_imports_one_that_imports_it_back():
    """Inside ``persample.dp`` (imports inside functions too) the modules form no cycle:
    the step uses the clipping and the reducers, which know nothing of the step."""
    dp = ROOT / "dp"
    names = {_module_name(p) for p in dp.glob("*.py")} - {"persample.dp"}
    graph = {_module_name(p): {m for _, m in _imports(p) if m in names}
             for p in dp.glob("*.py") if _module_name(p) in names}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# The benchmark (its harness, the competitors it times, its workloads) is a package of its
# own beside the library, src/persample_bench: persample imports it in one place only, the
# `bench` subcommand's dispatch, inside the function (so `import persample.cli` never
# loads it), and imports no competitor but, optionally, Opacus's PRV accountant.
BENCH = "persample_bench"
COMPETITORS = {"opacus", "backpack", "curvlinops", "kronfluence"}
LAZY_IMPORTS_ALLOWED = {
    ("persample.cli", "main", "persample_bench"),  # `persample bench ...`
    ("persample.dp.accounting", "_PrvAccountant.__init__", "opacus.accountants"),  # "prv"
}


def _absolute_imports_of(source: str) -> list[tuple[int, str, str | None]]:
    """``(line, module, function)`` for every absolute import in ``source``: the module
    imported (``from a.b import c``: ``a.b``) and the function (``Class.method``) the
    import runs in, or ``None`` for one that runs on import of ``source``'s module."""
    found: list[tuple[int, str, str | None]] = []

    def visit(node: ast.AST, scope: list[str], function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level:
                found.append((child.lineno, child.module or "", function))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = ".".join([*scope, child.name])
                visit(child, [*scope, child.name], function or name)
            elif isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], function)
            else:
                visit(child, scope, function)

    visit(ast.parse(source), [], None)
    return found


def _foreign_imports() -> list[tuple[str, int, str, str | None]]:
    """``(module, line, imported, function)`` for every import, in a module of
    ``src/persample``, of the benchmark or of a competitor."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for line, target, function in _absolute_imports_of(path.read_text()):
            top = target.split(".")[0]
            if top == BENCH or top in COMPETITORS:
                found.append((_module_name(path), line, target, function))
    return found


def test_the_library_imports_the_benchmark_and_competitors_only_where_allowed():
    """No module of ``src/persample`` imports ``persample_bench`` but the ``bench``
    dispatch in ``persample.cli.main``, and none imports Opacus, BackPACK, curvlinops or
    kronfluence but persample's optional PRV accountant (Opacus's, in
    ``persample.dp.accounting``); both inside the function that needs them."""
    found = _foreign_imports()
    wrong = [f"{module}:{line} imports {target}" + (f" (in {function})" if function else "")
             for module, line, target, function in found
             if (module, function, target) not in LAZY_IMPORTS_ALLOWED]
    assert not wrong, "\n".join(wrong)
    assert {(m, f, t) for m, _, t, f in found} == LAZY_IMPORTS_ALLOWED  # both still there


def test_the_import_scan_sees_where_an_import_runs():
    source = ("import opacus\nfrom persample_bench.bench import run\n"
              "class A:\n    def f(self):\n        import backpack.extensions\n"
              "def g():\n    def h():\n        from kronfluence import Analyzer\n"
              "from . import cli\n")
    assert _absolute_imports_of(source) == [
        (1, "opacus", None), (2, "persample_bench.bench", None),
        (5, "backpack.extensions", "A.f"), (8, "kronfluence", "g")]
    assert not _is_persample("persample_bench") and _is_persample("persample.cli")
