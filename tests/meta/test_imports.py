"""LayerScope's modules import each other without cycles: every import statement counts, at the top or inside
a function, and so does importlib.import_module("a literal name")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_graph() -> dict[str, set[str]]:
    """module -> the layerscope modules it imports (a name resolved to the deepest module that exists)."""
    files = {}
    for path in (ROOT / "layerscope").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets += [f"{base}.{a.name}" for a in node.names]      # a module, or a name in `base`
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                targets.append(node.args[0].value)
        graph[name] = {m for m in map(module_of, targets) if m is not None and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], 0
    for start, edges in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(edges)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert {"layerscope.capture.run", "layerscope.distributed", "layerscope.ui.tasks", "layerscope.ui.worker"} <= set(graph)
    assert cycles(graph) == []


# The layers docs/architecture.md draws, lowest first. A module imports only from its own layer or below:
# stats never imports draft, decoding or study; decoding never imports study; nothing below the faces
# (commands, the CLI, the app's ui package) imports them.
LAYERS = [
    ("infrastructure", {"errors", "blas", "fmt", "jsonsafe", "paths", "validate", "layerset", "distributed", "store",
                        "quietness", "disk", "eta"}),
    ("target and prompts", {"target", "prompts"}),
    ("capture", {"capture"}),
    ("stats", {"stats"}),
    ("draft", {"draft"}),
    ("decoding", {"decoding"}),
    ("study", {"study"}),
    ("steps", {"steps", "session"}),
    ("faces", {"commands", "__main__", "ui", ""}),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of a layerscope module (the package itself counts with the faces)."""
    top = module.removeprefix("layerscope").lstrip(".").split(".")[0]
    for i, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and to docs/architecture.md's map")


def test_the_layer_rule_sees_an_upward_import():
    assert layer_of("layerscope.stats.cka") < layer_of("layerscope.decoding.bench") < layer_of("layerscope.study.run")
    assert layer_of("layerscope.store") == 0 and layer_of("layerscope.ui.tasks") == len(LAYERS) - 1


def test_every_import_goes_down_the_layers():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in sorted(import_graph().items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert upward == []


def test_the_cost_model_does_not_plan_benchmarks():
    """Benchmark planning lives in decoding.bench, which uses the cost model; never the other way round."""
    assert "layerscope.decoding.bench" not in import_graph()["layerscope.decoding.costmodel"]


def test_the_draft_model_imports_neither_training_nor_export():
    """draft/ is one layer: draft/training and draft/export build on the draft's model and files (model, size,
    checkpoint, engines, init_from), which never import them, and the two subpackages never import each other.
    builtin.py (simulated_acc_len for TRAINED.md) and probe.py (training's splits) sit above draft/training."""
    graph, pkg = import_graph(), "layerscope.draft"
    core = [f"{pkg}.{m}" for m in ("model", "size", "checkpoint", "engines", "init_from")]
    wrong = [f"{m} imports {d}" for m in core for d in sorted(graph[m]) if d.startswith((f"{pkg}.training", f"{pkg}.export"))]
    for a, b in (("training", "export"), ("export", "training")):
        wrong += [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith(f"{pkg}.{a}")
                  for d in sorted(deps) if d.startswith(f"{pkg}.{b}")]
    assert wrong == []


def test_the_architecture_map_lists_every_module():
    """docs/architecture.md's map names every module: a flat one as `name.py`, one in a package within the
    package's entry (the lines from `  pkg/` down to the next entry)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    layout = doc[doc.index("## The layout of the code"):]

    def entry(package: str) -> str:
        found = re.search(rf"^  {re.escape(package)}/ .*?(?=^  \S|^```)", layout, re.M | re.S)
        return found.group(0) if found else ""

    missing = []
    for path in sorted((ROOT / "layerscope").rglob("*.py")):
        rel = path.relative_to(ROOT / "layerscope")
        if rel.name == "__init__.py":
            continue
        where = entry(rel.parts[0]) if len(rel.parts) > 1 else layout
        if not re.search(rf"(?<![\w/]){re.escape(rel.name)}", where):
            missing.append(str(rel))
    assert missing == []


def test_every_name_imported_from_layerscope_exists():
    """`from layerscope.x import a` names a module or a name x defines, in the package, the app, the tests, the
    benchmarks and the scripts: import_graph resolves an unknown name to its package, so a stale path after a move
    (layerscope.draft.probe, once) would pass the layer rules and fail only where it runs."""
    import importlib.util

    missing = []
    for folder in ("layerscope", "app_pages", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("layerscope")):
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path.relative_to(ROOT)}: from {node.module} import {alias.name}")
    assert missing == []


# The finer rules inside the layers (docs/architecture.md, "How we write code"): the math is pure functions on
# tensors, so stats' math modules reach no store, capture or file; Streamlit lives only in the app's ui package.
PURE_MATH = ["layerscope.stats." + m for m in ("entropy", "cka", "compartments", "tokens", "correlation", "bootstrap",
                                               "ridge")]


def test_the_math_modules_import_only_math_and_errors():
    graph = import_graph()
    allowed = set(PURE_MATH) | {"layerscope.errors", "layerscope.stats"}
    wrong = [f"{m} imports {d}" for m in PURE_MATH for d in sorted(graph[m]) if d not in allowed]
    assert wrong == []


def test_streamlit_is_imported_only_by_the_apps_ui_package():
    wrong = []
    for path in sorted((ROOT / "layerscope").rglob("*.py")):
        if path.is_relative_to(ROOT / "layerscope" / "ui"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] == "streamlit"]
    assert wrong == []
