"""The package rules of ARCHITECTURE.md, checked by parsing every module's imports.

``cli -> {trainer, reshard} -> storage -> layout`` (and ``trainer -> layout``): nothing
imports upward, the trainer never imports the offline resharder, ``layout/`` is pure (no
torch, no I/O libraries), ``storage/`` never imports ``torch.distributed``. Also the size
rules: no product module over 450 lines (issue 30: one concept per module may outgrow 400 a little; the before-stop hook warns at 450), no function over 60.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("layout", "sizing", "storage", "reshard", "trainer", "cli")
#: package -> shardsmith packages it may import (besides itself and ``shardsmith.errors``).
ALLOWED: dict[str, set[str]] = {
    "layout": set(),
    "sizing": {"layout"},
    "storage": {"layout"},
    "reshard": {"storage", "layout"},
    "trainer": {"storage", "layout"},
    "cli": {"trainer", "reshard", "sizing", "storage", "layout"},
}
#: third-party modules ``layout/`` must not import (it is pure: no torch, no I/O).
IMPURE = ("torch", "numpy", "fsspec", "safetensors", "zarr", "s3fs", "click")


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package: str) -> None:
    bad = []
    for path in _modules(package):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "shardsmith" or len(parts) < 2 or parts[1] in ("errors", package):
                continue
            if parts[1] not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_layout_is_pure_and_storage_has_no_process_groups() -> None:
    bad = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in _modules("layout")
        for n in _imports(p)
        if n.split(".")[0] in IMPURE
    ]
    bad += [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in _modules("storage")
        for n in _imports(p)
        if n.startswith("torch.distributed")
    ]
    assert not bad, "\n".join(bad)


#: Module and function caps, in lines of ruff-formatted code at 100 columns (STYLE.md: modules
#: under ~500 lines, functions that fit on a screen). The formatter, not the author, decides
#: where lines break, so the caps were set after the tree was formatted once (issue 39).
MODULE_LINES, FUNCTION_LINES = 500, 70
#: Over a cap when the tree was first formatted: each may only shrink, and leaves this table
#: when it fits (the test fails on a stale entry). Splitting them is open work.
OVER_CAP: dict[str, int] = {
    "sizing/estimate.py": 549,
    "sizing/estimate.py::estimate": 90,
    "storage/manifest/v2.py": 539,
    "storage/store/s3_reads.py::obstore_reads": 71,
    "reshard/foreign/dcp.py::import_dcp": 84,
    "reshard/foreign/megatron_export.py::export_megatron": 81,
    "reshard/posix_copy.py::write_assembled_at": 80,
    "trainer/checkpoint/policy.py": 519,
    "trainer/train.py::create": 86,
    "cli/ckpt_commands.py::gc_command": 79,
    "cli/reshard_commands.py::reshard": 71,
    "cli/train_commands.py": 693,
    "cli/train_commands.py::train_config": 103,
}


def _sizes() -> dict[str, tuple[int, int]]:
    """``path`` and ``path::function`` -> (lines, cap), for every product module and function."""
    out: dict[str, tuple[int, int]] = {}
    for package in PACKAGES:
        for path in _modules(package):
            text = path.read_text()
            name = str(path.relative_to(ROOT))
            out[name] = (text.count("\n"), MODULE_LINES)
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{name}::{node.name}"
                    length = node.end_lineno - node.lineno + 1
                    out[key] = (max(length, out.get(key, (0, 0))[0]), FUNCTION_LINES)
    return out


def test_modules_and_functions_stay_small() -> None:
    sizes = _sizes()
    bad = []
    for name, (lines, cap) in sorted(sizes.items()):
        limit = OVER_CAP.get(name, cap)
        if lines > limit:
            bad.append(f"{name}: {lines} lines (> {limit})")
    stale = [n for n, lines in OVER_CAP.items() if n not in sizes or sizes[n][0] <= sizes[n][1]]
    bad += [f"{n}: fits its cap now; remove it from OVER_CAP" for n in stale]
    assert not bad, "\n".join(bad)


def test_every_package_is_listed_in_pyproject() -> None:
    """A subpackage missing from ``[tool.setuptools] packages`` would be left out of a wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "shardsmith." + ".".join(p.parent.relative_to(ROOT).parts)
        for package in PACKAGES
        for p in (ROOT / package).rglob("__init__.py")
    }
    assert found <= listed, f"not in pyproject.toml packages: {sorted(found - listed)}"


def test_a_rank_starts_without_the_object_store_and_zarr_stacks() -> None:
    """A safetensors job on local storage never imports botocore, aiohttp, obstore or zarr
    (0.25 CPU-s of every rank's start-up here): the retry classifier looks up their exception
    classes only once they are loaded, and the zarr code is imported by the zarr paths."""
    code = (
        "import sys, shardsmith.trainer.train, shardsmith.trainer.runtime.worker, shardsmith.cli.train_commands, "
        "shardsmith.storage.store.fs, shardsmith.reshard.engine\n"
        "print(sorted(m for m in ('botocore', 'aiohttp', 'obstore', 'zarr', 's3fs') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("shardsmith",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def _import_graph() -> dict[str, set[str]]:
    """Product module -> product modules it imports anywhere: at the top, inside functions and
    under ``TYPE_CHECKING`` alike (``from package import name`` counts the package and, when
    ``name`` is a module, the module)."""
    paths = {_module_name(p): p for package in PACKAGES for p in _modules(package)}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[module] |= {t for t in targets if t in paths and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_between_product_modules() -> None:
    """A cycle, even one held open by an import inside a function, means two modules are one
    concept or a third one is missing (as ``storage/steps.py`` under commit, lineage and gc)."""
    cycles = _cycles(_import_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["storage", "trainer"])
def test_packages_are_rooms_by_concept(package: str) -> None:
    """At most 12 top-level modules: more means a sub-package (a concept) is missing."""
    top = sorted(p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, f"{package}/ has {len(top)} top-level modules: {top}"


#: Modules outside storage/formats/ that may name a tensor format, and why.
FORMAT_NAMED = {
    "reshard/api.py": "the streaming engine reads and writes safetensors; other formats convert",
    "reshard/zarr_convert.py": "the conversion writers, one per target format",
    "trainer/checkpoint/config.py": "--zarr-codec needs --format zarr",
}
_FORMAT_BRANCH = re.compile(
    r'tensor_format\s*[!=]=|[!=]=\s*"(zarr|safetensors)"|"(zarr|safetensors)"\s*[!=]='
    r"|\b(Zarr|Safetensors)Format\.name\b"
)


def test_no_module_outside_the_formats_branches_on_a_format_name() -> None:
    """Reads, checks and shared reads ask a manifest's ``traits`` or the registry
    (``storage/formats/registry.FORMATS``); comparing format names elsewhere is how a new
    format came to touch nine files."""
    found = sorted(
        {
            str(p.relative_to(ROOT))
            for package in PACKAGES
            for p in _modules(package)
            if not str(p.relative_to(ROOT)).startswith("storage/formats/")
            and _FORMAT_BRANCH.search(p.read_text())
        }
    )
    assert found == sorted(FORMAT_NAMED), found


# ---- Faces, benches, tests and documents (issue 39: every house rule in the fast loop) ----------

#: Names other packages import past a package's face (``from shardsmith.storage.commit import
#: commit``): only names that share their module's name, which a lazy face cannot export
#: unambiguously (``storage.commit.commit``, ``storage.gc.gc``, ``trainer.runtime.launch.launch``).
#: The count only goes down (420 before the faces).
MAX_FACE_BYPASSES = 7


def _packages() -> set[str]:
    return {_module_name(p) for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")}


def test_other_packages_import_a_face() -> None:
    """Product code imports another package through its face (the package or a room with an
    ``__init__``), never a module inside it; the imports that still do are counted."""
    packages = _packages()
    bypass = []
    for package in PACKAGES:
        for path in _modules(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                    continue
                parts = node.module.split(".")
                if parts[0] != "shardsmith" or len(parts) < 3 or parts[1] in (package, "errors"):
                    continue
                if node.module not in packages:
                    bypass += [
                        f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                    ]
    assert len(bypass) <= MAX_FACE_BYPASSES, "\n".join(bypass)


@pytest.mark.parametrize("package", sorted(_packages()))
def test_every_face_exports_what_it_names(package: str) -> None:
    """Each ``__init__`` declares ``__all__`` (top-level packages at least), and every name a
    face exports resolves: a stub line pointing at a moved or renamed name fails here."""
    import importlib

    module = importlib.import_module(package)
    if package.count(".") == 1:
        assert "__all__" in (ROOT / Path(*package.split(".")[1:]) / "__init__.py").read_text()
    missing = [n for n in getattr(module, "__all__", []) if not hasattr(module, n)]
    assert not missing, f"{package} exports names it cannot resolve: {missing}"


def _bench_graph() -> dict[str, set[str]]:
    """Bench script -> bench scripts it imports: they import siblings by bare name, from
    ``bench/`` or ``bench/peers/`` (each puts those folders on ``sys.path``)."""
    paths = {
        p.relative_to(ROOT / "bench").with_suffix("").as_posix(): p
        for p in (ROOT / "bench").rglob("*.py")
    }
    by_name = {name.rsplit("/", 1)[-1]: name for name in paths}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}/{a.name}" for a in node.names)]
            else:
                continue
            for t in targets:
                t = t.replace(".", "/")
                hit = paths.keys() & {t} or ({by_name[t]} if t in by_name else set())
                graph[module] |= {h for h in hit if h != module}
    return graph


def test_no_import_cycles_between_bench_scripts() -> None:
    cycles = _cycles(_bench_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in ``tests/helpers/``; a test module importing another runs the
    other's tests' set-up and couples their fixtures."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and re.search(r"(^|\.)test_", node.module)
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {node.module}")
            elif isinstance(node, ast.Import):
                bad += [
                    f"{path.relative_to(ROOT)} imports {a.name}"
                    for a in node.names
                    if re.search(r"(^|\.)test_", a.name)
                ]
    assert not bad, "\n".join(bad)


#: A repository path as documents and docstrings cite it: a top-level folder, then a file.
_CITED = re.compile(
    r"(?<![\w./-])((?:layout|sizing|storage|reshard|trainer|cli|tests|bench|docs|examples|\.ci)"
    r"/[\w./-]*\w\.(?:py|md|sh|json|toml))\b"
)


def test_every_cited_repository_path_exists() -> None:
    """Every ``folder/file.ext`` path named in a ``.md`` file, a docstring or a comment exists."""
    files = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    bad = []
    for name in files:
        if name.startswith("tests/fixtures/") or not (ROOT / name).exists():
            continue
        for i, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            bad += [
                f"{name}:{i}: {m.group(1)}"
                for m in _CITED.finditer(line)
                if not (ROOT / m.group(1)).exists()
            ]
    assert not bad, "\n".join(bad)


def test_every_markdown_link_resolves() -> None:
    """Relative links between documents (``[storage](docs/storage.md)``) point at a file."""
    files = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    bad = []
    for name in files:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", (ROOT / name).read_text()):
            if not ((ROOT / name).parent / target).exists():
                bad.append(f"{name}: {target}")
    assert not bad, "\n".join(bad)


def test_the_path_check_sees_a_missing_path() -> None:
    gone = ["{}/test_gpu_paths.py".format("tests"), "{}/x/y.py".format("storage")]
    line = f"see {gone[0]} and {gone[1]}."
    assert [m.group(1) for m in _CITED.finditer(line)] == gone


def _own_names(package_dir: Path) -> set[str]:
    """A package's submodules and the names its ``__init__.py`` itself defines."""
    names = {p.stem for p in package_dir.glob("*.py")} | {
        p.name for p in package_dir.iterdir() if (p / "__init__.py").exists()
    }
    for node in ast.parse((package_dir / "__init__.py").read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_no_module_imports_its_own_face() -> None:
    """Inside a package modules import each other directly (``from shardsmith.sizing import
    activations`` imports a module, and is fine): a module importing a name through its own
    package's lazy face would load the face's other modules and may close a cycle through it."""
    bad = []
    for package in PACKAGES:
        for path in _modules(package):
            if path.name == "__init__.py":
                continue
            own = _module_name(path).rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                    continue
                if own == node.module or own.startswith(node.module + "."):
                    allowed = _own_names(ROOT / Path(*node.module.split(".")[1:]))
                    bad += [
                        f"{path.relative_to(ROOT)} imports {node.module}.{a.name}"
                        for a in node.names
                        if a.name not in allowed
                    ]
    assert not bad, "\n".join(bad)
