"""The package's layers: every import of src/dtrain goes downwards (docs/development.md).

Read from the source with `ast`, nothing imported: module-level and function-level imports
count alike (a function-level import is a dependency all the same); imports under
`if TYPE_CHECKING:` do not (they never run). `make lint` runs this file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dtrain"

# Top to bottom: a unit (a top-level package or module of dtrain) imports only units below it.
LAYERS = [
    "__main__",
    "cli",
    "commands",
    "run",
    "loop",
    "checkpoint",
    "parallel",
    "tasks",
    "models",
    "data",
    "observe",
    "process",
    "files",
    "config",
    "core",
    "__init__",  # the version, nothing else
]
# The layers below `process` run without torch: `dtrain verify`, `runs` and `tokenize` load fast.
TORCH_FREE = {"files", "config", "core", "__init__"}
MAX_TOP_LEVEL_MODULES = 6


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(name: str) -> str:
    """The dtrain module that `name` (a module or a name in one) is, or lies in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                    "typing.TYPE_CHECKING"):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if id(n) not in skipped]


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported dtrain module, the name taken from it or "", line) for each import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(_resolve(a.name), "", node.lineno) for a in node.names
                      if a.name.split(".")[0] == "dtrain"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            if full.split(".")[0] != "dtrain":
                continue
            for alias in node.names:
                sub = f"{full}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in MODULES
                             else (_resolve(full), alias.name, node.lineno))
    return found


IMPORTS = {m: _imports(m) for m in MODULES}
GRAPH = {m: {target for target, _, _ in IMPORTS[m] if target != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_unit_has_a_place_in_the_layers() -> None:
    assert sorted({_unit(m) for m in MODULES}) == sorted(LAYERS)


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_cycle_between_top_level_units() -> None:
    units: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets)
    for unit, targets in units.items():
        targets.discard(unit)
    assert _cycles(units) == [], _cycles(units)


def test_imports_only_go_down_the_layers() -> None:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    upward = [
        f"{MODULES[m].relative_to(SRC)}:{line} imports {target}"
        for m in MODULES
        for target, _, line in IMPORTS[m]
        if _unit(target) != _unit(m) and rank[_unit(target)] <= rank[_unit(m)]
    ]
    assert upward == []


def test_no_command_imports_another() -> None:
    """A command is a module of commands/ or one of its subpackages (plan/, export/, ...)."""

    def command_of(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:3]) if parts[1:2] == ["commands"] and len(parts) > 2 else None

    crossing = [
        f"{MODULES[m].relative_to(SRC)}:{line} imports {target}"
        for m in MODULES
        for target, _, line in IMPORTS[m]
        if command_of(m) and command_of(target) and command_of(target) != command_of(m)
    ]
    assert crossing == []


def test_few_modules_directly_in_the_package() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_private_name_of_one_module_is_used_by_another() -> None:
    """`from dtrain.x import _name`, or `_name` read off a dtrain module bound by an import."""
    used = []
    for module, path in MODULES.items():
        bound: dict[str, str] = {}
        for target, name, line in IMPORTS[module]:
            if name.startswith("_") and target != module:
                used.append(f"{path.relative_to(SRC)}:{line} imports {target}.{name}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in MODULES:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and node.attr.startswith("_")
                    and not node.attr.startswith("__") and bound[node.value.id] != module):
                used.append(f"{path.relative_to(SRC)}:{node.lineno} uses "
                            f"{bound[node.value.id]}.{node.attr}")
    assert used == []


@pytest.mark.parametrize("unit", sorted(TORCH_FREE))
def test_the_lowest_layers_import_no_torch(unit: str) -> None:
    heavy = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for module, path in MODULES.items()
        if _unit(module) == unit
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8")))
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("torch", "numpy")
                                                 for a in node.names))
        or (isinstance(node, ast.ImportFrom) and not node.level
            and (node.module or "").split(".")[0] in ("torch", "numpy"))
    ]
    assert heavy == []


def test_torchs_private_modules_are_imported_only_by_compat() -> None:
    """torch's private API lives in process/compat.py, each use checked by tests/test_compat.py."""
    private = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for module, path in MODULES.items()
        if module != "dtrain.process.compat"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if any(part.startswith("_") and not part.startswith("__")
               for name in ([node.module or ""] if isinstance(node, ast.ImportFrom)
                            else [a.name for a in node.names] if isinstance(node, ast.Import)
                            else [])
               if name.split(".")[0] == "torch"
               for part in name.split("."))
    ]
    assert private == []


def _torch_private_attribute(node: ast.AST) -> bool:
    """`torch._x` or `torch.a._x` (a private function or module reached by attribute)."""
    if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
        return False
    if node.attr.startswith("__"):
        return False
    base = node.value
    while isinstance(base, ast.Attribute):
        base = base.value
    return isinstance(base, ast.Name) and base.id == "torch"


def test_torchs_private_functions_are_called_only_by_compat() -> None:
    """`torch._foreach_*` and the like are private API too: reached only through compat."""
    private = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for module, path in MODULES.items()
        if module != "dtrain.process.compat"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if _torch_private_attribute(node)
    ]
    assert private == []


# ---- Seams: each capability lives in one place (docs/architecture.md) ----------------------

BELOW_RUN = set(LAYERS[LAYERS.index("run") + 1:]) - {"config", "__init__"}
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
PARALLEL_MODES = {"none", "ddp", "fsdp", "hsdp"}
EXPORT_FORMATS = {"state_dict", "torchscript", "exported", "onnx", "safetensors", "hf", "peft",
                  "sharded"}
TREES = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in MODULES.items()}


def _where(module: str, node: ast.AST) -> str:
    return f"{MODULES[module].relative_to(SRC)}:{getattr(node, 'lineno', 0)}"


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_below_run_takes_the_whole_config() -> None:
    """Each component takes its own section; only run/ and the commands hold the whole Config."""
    whole = [
        f"{_where(m, fn)} {fn.name}({arg.arg})"
        for m, tree in TREES.items()
        if _unit(m) in BELOW_RUN
        for fn in _functions(tree)
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        if arg.annotation is not None
        and ast.unparse(arg.annotation).strip("'\"").rpartition(".")[2] == "Config"
    ]
    assert whole == [], whole


def test_a_models_capabilities_are_read_in_one_place() -> None:
    """Whether a model trains adapters is the model spec's to say (models/spec.py)."""
    reads = [
        _where(m, node)
        for m, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("lora.enabled", "enabled")
        or isinstance(node, ast.Attribute) and ast.unparse(node).endswith(".lora.enabled")
    ]
    assert len(reads) <= 2, reads
    flags = [_where(m, n) for m, tree in TREES.items() for n in ast.walk(tree)
             if isinstance(n, (ast.Name, ast.arg, ast.keyword, ast.Attribute))
             and "adapters_only" in (getattr(n, "id", None) or getattr(n, "arg", None)
                                     or getattr(n, "attr", None) or "")]
    assert flags == [], flags


def _compares_with(node: ast.AST, constants: set[str]) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    values = set()
    for side in sides:
        if isinstance(side, ast.Constant) and isinstance(side.value, str):
            values.add(side.value)
        elif isinstance(side, (ast.Tuple, ast.Set, ast.List)):
            values.update(e.value for e in side.elts if isinstance(e, ast.Constant))
    return bool(values & constants)


def test_nothing_outside_parallel_branches_on_the_parallel_mode() -> None:
    """The strategy object (parallel/) answers what differs between none, DDP, FSDP and HSDP."""
    branches = [
        _where(m, node)
        for m, tree in TREES.items()
        if _unit(m) != "parallel"
        for node in ast.walk(tree)
        if (_compares_with(node, PARALLEL_MODES) and "mode" in ast.unparse(node))
        or (isinstance(node, ast.Attribute) and node.attr == "is_fsdp")
    ]
    assert len(branches) <= 2, branches


def test_export_picks_no_format_by_its_name() -> None:
    """Export formats are a registry of objects: the command never tests a format's name."""
    tests = [
        _where(m, node)
        for m, tree in TREES.items()
        if m.startswith("dtrain.commands.export")
        for node in ast.walk(tree)
        if _compares_with(node, EXPORT_FORMATS)
    ]
    assert tests == [], tests


def test_no_import_cycle_even_counting_type_only_imports() -> None:
    every: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(TREES[module]):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                full = ".".join(base + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom):
                full = node.module or ""
            elif isinstance(node, ast.Import):
                full = node.names[0].name
            else:
                continue
            if full.split(".")[0] != "dtrain":
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [""]
            for name in names:
                target = f"{full}.{name}" if f"{full}.{name}" in MODULES else _resolve(full)
                if target != module:
                    every.setdefault(module, set()).add(target)
    assert _cycles(every) == [], _cycles(every)
    units: dict[str, set[str]] = {}
    for module, targets in every.items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets)
    for unit, targets in units.items():
        targets.discard(unit)
    assert _cycles(units) == [], _cycles(units)


def test_modules_and_functions_stay_small() -> None:
    long_modules = [f"{p.relative_to(SRC)} ({n})" for p in MODULES.values()
                    if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    long_functions = [
        f"{_where(m, fn)} {fn.name} ({fn.end_lineno - fn.lineno + 1})"
        for m, tree in TREES.items()
        for fn in _functions(tree)
        if fn.end_lineno and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long_modules + long_functions == [], long_modules + long_functions


def test_every_package_says_what_it_holds() -> None:
    """A package docstring is a sentence about its contents, not the package's name."""
    bare = []
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(TREES[module]) or ""
        if len(doc.split()) < 6:
            bare.append(f"{path.relative_to(SRC)}: {doc!r}")
    assert bare == [], bare


def test_the_architecture_page_lists_the_layers() -> None:
    """docs/architecture.md has one row per unit, top to bottom, as LAYERS."""
    page = (SRC.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = [line.split("|")[1].strip().strip("`").rstrip("/").removesuffix(".py")
              for line in page.splitlines()
              if line.startswith("| `")]
    assert listed == LAYERS
