"""pyproject.toml declares what the code imports, and `pip install .` gives a `layerscope` command that runs.

The backend (every module of layerscope/ but the app's side) and the `layerscope` command may import only what
[project] dependencies declares; the app's side (layerscope/ui/, app.py, app_pages/) what
those and the `app` extra declare. Every import statement counts, at the top of a file or inside a function, and
so does importlib.import_module("a literal name"); an import inside `try: ... except ImportError` is optional and
does not. An import name is mapped to its distribution with importlib.metadata.packages_distributions() (`yaml` is
PyYAML), or taken as is where the package is not installed here.

test_pip_install_gives_a_working_cli (marked `install`; about 40 s here, most of it pip; `-m "not install"` leaves
it out) installs a copy of the package with `pip install .` into a new virtual environment that holds nothing but
this environment's torch (linked, not reinstalled), as a user without the script has it, and runs the command.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.meta.test_imports import import_graph

try:
    import tomllib
except ImportError:                                  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"layerscope", "app_pages", "tests"}
# Declared but never imported, each with its reason (a declaration nothing needs any more fails the test).
NOT_IMPORTED = {
    "accelerate": "transformers requires it to load a GGUF file (both real models)",
    "numpy": "torch's Tensor.numpy() (store.py) needs it, and torch does not require it",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1))


def declared() -> tuple[set[str], set[str]]:
    """The distributions [project] dependencies declares, and those of the `app` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return ({requirement_name(s) for s in project["dependencies"]},
            {requirement_name(s) for s in project["optional-dependencies"]["app"]})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_app_side(path: Path) -> bool:
    name = module_name(path)
    return not name.startswith("layerscope.") or name.startswith("layerscope.ui")


def source_files() -> list[Path]:
    return [*sorted((ROOT / "layerscope").rglob("*.py")), ROOT / "app.py", *sorted((ROOT / "app_pages").rglob("*.py"))]


def third_party_imports(path: Path) -> list[tuple[str, int]]:
    """(top-level module, line) of every required import of a module outside the standard library and this project."""
    tree = ast.parse(path.read_text(), filename=str(path))
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = set()
            for handler in node.handlers:
                types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                caught |= {t.id for t in types if isinstance(t, ast.Name)}
            if caught & {"ImportError", "ModuleNotFoundError"}:
                optional |= {id(n) for statement in node.body for n in ast.walk(statement)}
    found = []
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.level == 0 and node.module else []
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                found.append((top, node.lineno))
    return found


@functools.cache
def distributions_of(module: str) -> list[str]:
    return [normalize(d) for d in _packages_distributions().get(module, [module])]


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()          # reads every installed package's file list: once


def test_every_third_party_import_is_declared():
    core, app = declared()
    missing, used = [], set()
    for path in source_files():
        app_side = is_app_side(path)
        allowed = core | app if app_side else core
        for module, line in third_party_imports(path):
            dists = distributions_of(module)
            used |= {(d, app_side) for d in dists}
            if not set(dists) & allowed:
                where = "[project] dependencies or the `app` extra" if app_side else "[project] dependencies (the backend)"
                missing.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({' or '.join(dists)}), not in {where}")
    assert not missing, "pyproject.toml does not declare what the code imports:\n" + "\n".join(sorted(set(missing)))

    unused = sorted(d for d in core if (d, False) not in used and d not in NOT_IMPORTED)
    unused += sorted(f"{d} (app extra)" for d in app if (d, True) not in used)
    assert not unused, f"declared in pyproject.toml but imported nowhere (or NOT_IMPORTED lacks its reason): {unused}"
    assert not set(NOT_IMPORTED) & {d for d, _ in used}, "a NOT_IMPORTED distribution is imported now: drop it there"


def test_the_check_sees_imports_inside_functions_and_the_ones_it_must_skip(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / "layerscope" / "mod.py"
    path.parent.mkdir()
    path.write_text("import os\nimport torch.nn\nfrom . import fmt\nfrom layerscope import store\n\n"
                    "def f():\n    import pyarrow as pa\n    from yaml import safe_load\n"
                    "    importlib.import_module('gguf.constants')\n\n"
                    "try:\n    import kaleido\nexcept ImportError:\n    kaleido = None\n")
    assert third_party_imports(path) == [("torch", 2), ("pyarrow", 7), ("yaml", 8), ("gguf", 9)]
    assert not is_app_side(path)
    assert is_app_side(tmp_path / "layerscope" / "ui" / "views.py") and is_app_side(tmp_path / "layerscope" / "ui" / "plots.py")
    assert is_app_side(tmp_path / "app_pages" / "home.py")


def test_the_backend_never_imports_the_app_side():
    """So the command (and any backend module) runs without the `app` extra, as the test above assumes."""
    def app_side(module: str) -> bool:
        return module.startswith("layerscope.ui")

    wrong = {m: sorted(filter(app_side, edges)) for m, edges in import_graph().items() if not app_side(m)}
    assert not {m: e for m, e in wrong.items() if e}, wrong


def test_requirements_txt_pins_what_pyproject_declares():
    """requirements.txt (the CPU set-up scripts/dev.sh installs) lists the backend and the app extra with the same
    ranges, except torch, which it pins to the CPU build on this machine's disk."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {requirement_name(s): s for s in [*project["dependencies"], *project["optional-dependencies"]["app"]]}
    pinned = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            pinned[requirement_name(line)] = line

    def ranges(spec: str) -> list[str]:
        return sorted(re.sub(r"^[A-Za-z0-9._-]+", "", re.sub(r"\s+", "", spec)).split(","))

    assert set(pinned) == set(wanted), (f"only in pyproject.toml: {sorted(set(wanted) - set(pinned))}; "
                                        f"only in requirements.txt: {sorted(set(pinned) - set(wanted))}")
    differ = [(wanted[n], pinned[n]) for n in wanted if n != "torch" and ranges(wanted[n]) != ranges(pinned[n])]
    assert not differ, differ


def torch_paths() -> list[Path]:
    """The files and folders at the top of site-packages that make up this environment's torch and what it requires
    (typing_extensions, sympy, ...; setuptools and pip excepted: a new virtual environment has its own)."""
    paths, seen, todo = [], set(), ["torch"]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = normalize(dist.metadata["Name"])
        if name in seen or name in ("setuptools", "pip"):
            continue
        seen.add(name)
        tops = {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        paths += [Path(dist.locate_file(t)) for t in sorted(tops) if not t.endswith(".pth")]
        for spec in dist.requires or []:
            requirement, _, marker = spec.partition(";")
            if "extra" not in marker and (not marker.strip() or _marker_holds(marker)):
                todo.append(requirement_name(requirement))
    return [p for p in paths if p.exists()]


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker  # transformers requires packaging

    return Marker(marker.strip()).evaluate()


def run(args: list, env: dict, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, args))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


@pytest.mark.install
def test_pip_install_gives_a_working_cli(tmp_path):
    try:
        importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed here: the new environment takes this one's")
    source = tmp_path / "src"                       # a copy: `pip install .` builds in the tree it is given
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "layerscope", source / "layerscope", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], env, tmp_path, 300)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, tmp_path, 60)
                   .stdout.strip())
    assert purelib != Path(sysconfig.get_paths()["purelib"])
    # torch "preinstalled": links to this environment's torch and its requirements, in a folder a .pth file adds to
    # the new environment's path (after its own site-packages), so pip sees torch installed and keeps it
    linked = tmp_path / "torch-site"
    linked.mkdir()
    for path in torch_paths():
        (linked / path.name).symlink_to(path, target_is_directory=path.is_dir())
    (purelib / "layerscope-test-torch.pth").write_text(f"{linked}\n")

    run([python, "-m", "pip", "install", "--no-compile", source], env, tmp_path, 600)
    check = ("import importlib.util, torch; "
             "print(torch.__file__, [m for m in ('streamlit', 'plotly') if importlib.util.find_spec(m)])")
    where, extras = run([python, "-c", check], env, tmp_path, 120).stdout.strip().split(" ", 1)
    assert Path(where).is_relative_to(linked) and extras == "[]", (where, extras)   # the same torch; no app extra

    store = tmp_path / "store"
    layerscope = bin_dir / "layerscope"
    out = run([layerscope, "capture", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "2",
               "--max-new-tokens", "4", "--store", store, "--json"], env, tmp_path, 300)
    key = json.loads(out.stdout)["key"]
    out = run([layerscope, "analyze", key, "--store", store, "--json"], env, tmp_path, 300)
    assert len(json.loads(out.stdout)["entropy"]) == 5                                # tiny-llama: 4 layers + embeddings
    out = run([layerscope, "export-states", key, "--layers", "1,2", "--out", tmp_path / "export", "--store", store,
               "--json"], env, tmp_path, 300)
    assert json.loads(out.stdout)["tokens"] > 0 and (tmp_path / "export" / "data-00000-of-00001.arrow").is_file()  # pyarrow
    shutil.rmtree(venv)                        # 225 MB; pytest keeps its last three temporary folders (links: unlinked)
    shutil.rmtree(source)
