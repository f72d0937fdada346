"""The package's shape, read from its source with `ast` (nothing is imported or run):

- an engine class never inherits from a class defined in another engine file (a collaborator is a
  field: `Decoder.pacing`, `Stepper.prefills`, `Planner.costs`);
- a module never imports from a higher layer (`LAYERS`), at the top of the file or inside a
  function alike.

Each rule is also run on a scratch package that breaks it, so the checks are seen to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "selfspec"

# lowest first; a module may import from its own layer and the ones below. The root package
# (`selfspec/__init__.py`, the public API) sits above what it re-exports and below the apps.
LAYERS = [
    {"kernels"},
    {"drafting"},
    {"checkpoint"},
    {"engine"},
    {"loading", "streaming", "compat", "trace", "trace_html"},
    {""},  # selfspec/__init__.py
    {"serving", "data"},
    {"tools", "training", "__main__"},
]


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken) of every import in a module, relative ones resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, target, [a.asname or a.name for a in node.names]))
    return out


def _files(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def foreign_bases(engine: Path) -> list[str]:
    """`file: Class(Base)` for each engine class whose base is a class of another engine file."""
    defined = {}  # class name -> the engine file defining it
    trees = list(_files(engine))
    for path, tree in trees:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, set()).add(path)
    bad = []
    for path, tree in trees:
        package = engine.parent.name + "." + engine.name
        imported = {}  # local name -> module, for names taken from engine modules
        for _, target, names in _imports(tree, _module(path, engine.parent), path.name == "__init__.py"):
            for name in names:
                imported[name] = target
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                source = imported.get(name, "")
                other_file = source.startswith(package) or (name in defined and path not in defined[name])
                if other_file and not any(path == p for p in defined.get(name, ())):
                    bad.append(f"{path.name}: {node.name}({name})")
    return bad


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "selfspec":
        return None
    top = parts[1] if len(parts) > 1 else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: in no layer of LAYERS (add it where it belongs)")


def upward_imports(root: Path) -> list[str]:
    """`file:line module -> imported` for each import from a higher layer."""
    bad = []
    for path, tree in _files(root):
        module = _module(path, root)
        mine = _layer(module)
        for line, target, names in _imports(tree, module, path.name == "__init__.py"):
            theirs = _layer(target)
            if theirs is None and target == "" and module.startswith("selfspec"):
                continue
            if theirs is not None and theirs > mine:
                bad.append(f"{path.relative_to(root.parent)}:{line} {module} -> {target}")
    return bad


def test_no_engine_class_inherits_from_a_class_of_another_engine_file():
    assert foreign_bases(ROOT / "engine") == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(ROOT) == []


def test_every_subpackage_and_top_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    tops = {"" if t == "__init__" else t for t in tops}
    assert tops <= set().union(*LAYERS), tops - set().union(*LAYERS)


def _scratch(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "selfspec" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "selfspec"


def test_the_checks_fail_on_a_package_that_breaks_them(tmp_path):
    """A mixin from another engine file, and a kernel importing the engine, are both reported; a
    base from the same file or from the standard library is not."""
    root = _scratch(tmp_path, {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/pacing.py": "class Pacing:\n    pass\n",
        "engine/decoder.py": ("from typing import NamedTuple\n"
                              "from selfspec.engine.pacing import Pacing\n"
                              "import selfspec.engine.pacing as p\n"
                              "class Base:\n    pass\n"
                              "class Same(Base):\n    pass\n"
                              "class Row(NamedTuple):\n    a: int\n"
                              "class Decoder(Pacing):\n    pass\n"
                              "class Other(p.Pacing):\n    pass\n"),
        "kernels/__init__.py": "",
        "kernels/block.py": "def f():\n    from selfspec.engine import decoder\n",
    })
    assert foreign_bases(root / "engine") == ["decoder.py: Decoder(Pacing)", "decoder.py: Other(Pacing)"]
    assert upward_imports(root) == ["selfspec/kernels/block.py:2 selfspec.kernels.block -> selfspec.engine"]
