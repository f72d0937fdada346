"""The layering: every module sits in one layer, imports only from its own layer or below
(nested imports included, read from the source), and no import circle exists anywhere; no engine
class inherits from a class of another engine file; the layer body is written once."""

import ast
import os
from pathlib import Path

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "selfspec")

# lowest first; a module may import from its own layer or any layer before it (kernels: C and its
# torch twins, importing nothing of ours)
LAYERS = ["kernels", "drafting", "checkpoint", "engine", "api", "serving", "tools", "training"]


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:  # a layer's package itself too
        return parts[1]
    if module == "selfspec.__main__":
        return "tools"
    return "api"  # selfspec itself and the modules at the top: load / stream / generate / traces / entry points


def modules() -> dict[str, str]:
    """Dotted name -> file of every module in the package."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(root, f)
    return out


def imports(module: str, path: str, known: set[str]) -> set[str]:
    """selfspec modules that `module` imports anywhere in its source (functions included)."""
    pkg = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module and n != "selfspec":
                found.add(n)
    return found


GRAPH = None


def graph() -> dict[str, set[str]]:
    global GRAPH
    if GRAPH is None:
        mods = modules()
        GRAPH = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    return GRAPH


def test_every_module_sits_in_a_known_layer():
    folders = {m.split(".")[1] for m in graph() if m.count(".") >= 2}
    assert folders <= set(LAYERS), f"folders outside the layer list: {folders - set(LAYERS)}"


@pytest.mark.parametrize("module", sorted(modules()))
def test_module_imports_only_its_layer_or_below(module):
    rank = LAYERS.index(layer_of(module))
    upward = sorted(d for d in graph()[module] if LAYERS.index(layer_of(d)) > rank)
    assert not upward, f"{module} ({layer_of(module)}) imports upper layers: {upward}"


# the engine's folders, lowest first, in the order of the pipeline they show: the forward and its
# K/V; what a request asks for; measuring a device; one round; planning rounds; turns
ENGINE_LAYERS = ["forward", "request", "measure", "round", "planning", "schedule"]


def engine_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) >= 4 and parts[1] == "engine" else None


def engine_upward(g: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each engine module importing from an engine folder above its own."""
    out = []
    for m, deps in sorted(g.items()):
        if (a := engine_layer(m)) is None:
            continue
        out += [f"{m} -> {d}" for d in sorted(deps)
                if (b := engine_layer(d)) is not None and ENGINE_LAYERS.index(b) > ENGINE_LAYERS.index(a)]
    return out


def test_every_engine_module_sits_in_a_pipeline_folder():
    loose = sorted(m for m in graph() if m.startswith("selfspec.engine.") and engine_layer(m) is None
                   and m.count(".") == 2 and m.split(".")[2] not in ENGINE_LAYERS)
    assert not loose, f"engine modules outside {ENGINE_LAYERS}: {loose}"
    assert {engine_layer(m) for m in graph()} - {None} == set(ENGINE_LAYERS)


def test_engine_folders_import_only_their_own_or_lower_folders():
    assert engine_upward(graph()) == []


def test_the_engine_folder_check_finds_an_upward_import():
    g = {"selfspec.engine.forward.cache": {"selfspec.engine.schedule.decoder"},
         "selfspec.engine.schedule.decoder": {"selfspec.engine.forward.cache"}}
    assert engine_upward(g) == ["selfspec.engine.forward.cache -> selfspec.engine.schedule.decoder"]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                c = visit(w)
                if c:
                    return c
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(g):
        if v not in state:
            c = visit(v)
            if c:
                return c
    return None


def test_no_import_circle_in_the_package():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_check_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_layer_check_reads_nested_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from selfspec.tools.bench import x\n")
    assert imports("selfspec.drafting.m", str(p), {"selfspec.tools.bench"}) == {"selfspec.tools.bench"}


# -- composition, not mixins across files ------------------------------------------------------------
# An engine class holds a collaborator as a field (`Scheduler.prefill`, `Prefill.stepper`,
# `Planner.costs`); a base class from another engine file splits one class over two files.
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


def test_no_engine_class_inherits_from_a_class_of_another_engine_file():
    assert foreign_bases(Path(PKG) / "engine") == []


def test_the_mixin_check_finds_a_base_from_another_engine_file(tmp_path):
    """Bases from another engine file (imported by name or through its module) are reported; a base
    from the same file or from the standard library is not."""
    engine = tmp_path / "selfspec" / "engine"
    engine.mkdir(parents=True)
    (engine / "__init__.py").write_text("")
    (engine / "pacing.py").write_text("class Pacing:\n    pass\n")
    (engine / "decoder.py").write_text("from typing import NamedTuple\n"
                                       "from selfspec.engine.pacing import Pacing\n"
                                       "import selfspec.engine.pacing as p\n"
                                       "class Base:\n    pass\n"
                                       "class Same(Base):\n    pass\n"
                                       "class Row(NamedTuple):\n    a: int\n"
                                       "class Decoder(Pacing):\n    pass\n"
                                       "class Other(p.Pacing):\n    pass\n")
    assert foreign_bases(engine) == ["decoder.py: Decoder(Pacing)", "decoder.py: Other(Pacing)"]


# -- one layer body ----------------------------------------------------------------------------------
LAYER_BODY = os.path.join("engine", "forward", "forward.py")
# the exact formats' steps (norm, RoPE, gate) are defined once, in C with their torch twins; the
# layer body in forward.py composes them
LAYER_STEPS = os.path.join("kernels", "layer.py")
BODY_OPS = {"rms_norm", "rsqrt", "roll", "silu"}  # the decoder layer's norms, RoPE and MLP activation


def body_ops(path: str) -> set[str]:
    """The layer-body operations `path` calls anywhere (by name or attribute)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in BODY_OPS:
                found.add(name)
    return found


def test_the_decoder_layer_body_is_written_once():
    """Norms, RoPE and the MLP activation of a decoder layer appear only in the runtime's layer
    body; the draft-LoRA trainer and every other module run that one."""
    others = {m: ops for m, p in modules().items()
              if not p.endswith(LAYER_BODY) and not p.endswith(LAYER_STEPS) and (ops := body_ops(p))}
    assert not others, f"layer-body operations outside {LAYER_BODY}: {others}"


def test_the_layer_body_check_finds_a_second_body(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch.nn.functional as F\ndef run(x, w):\n    return F.silu(F.rms_norm(x, (4,), w))\n")
    assert body_ops(str(p)) == {"silu", "rms_norm"}


def matmul_loops(path: str) -> list[int]:
    """Lines of the `for` loops in `path` that run matmuls: loops over a model's layers."""
    return [node.lineno for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.For)
            and any(isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", None)) == "matmul"
                    for c in ast.walk(node))]


def test_the_forward_runs_its_layers_in_one_loop():
    """One layer body for every format (the float and the exact ones differ in their steps only),
    its C twin `kernels/block.c`."""
    assert len(matmul_loops(os.path.join(PKG, LAYER_BODY))) == 1


def test_the_loop_check_finds_a_second_loop(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def run(x, ws):\n    for w in ws:\n        x = matmul(x, w)\n    for w in ws:\n"
                 "        x = q.matmul(x, w)\n    return [w for w in ws]\n")
    assert matmul_loops(str(p)) == [2, 4]


# -- short functions ---------------------------------------------------------------------------------
def long_functions(folder: str, limit: int = 60) -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(PKG, folder)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        n = node.end_lineno - node.lineno + 1
                        if n > limit:
                            out.append(f"{os.path.relpath(path, PKG)}:{node.lineno} {node.name} ({n} lines)")
    return out


@pytest.mark.parametrize("folder", ["engine", "drafting"])
def test_no_engine_or_drafting_function_runs_over_60_lines(folder):
    assert not long_functions(folder)


# -- one owner of prefix reuse ------------------------------------------------------------------------
PREFIX_CALLS = ("claim", "retain", "hold")  # the cache's calls that decide which K/V a row keeps
PREFIX_OWNER = os.path.join("engine", "schedule", "prefill.py")


def prefix_callers(root: str) -> list[str]:
    """'file:line name' of every `x.cache.<call>(...)` / `cache.<call>(...)` outside the prefill."""
    out = []
    for d, _, files in os.walk(root):
        for f in sorted(files):
            path = os.path.join(d, f)
            if not f.endswith(".py") or os.path.relpath(path, root) == PREFIX_OWNER:
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                fn = node.func if isinstance(node, ast.Call) else None
                if isinstance(fn, ast.Attribute) and fn.attr in PREFIX_CALLS:
                    owner = fn.value.attr if isinstance(fn.value, ast.Attribute) else getattr(fn.value, "id", "")
                    if owner == "cache":
                        out.append(f"{os.path.relpath(path, root)}:{node.lineno} {fn.attr}")
    return out


def test_only_the_prefill_decides_which_kv_a_row_keeps():
    """Prefix reuse has one owner: the cache's `claim`, `retain` and `hold` are called from
    `engine/schedule/prefill.py` alone (a decoder continuing a conversation hands it the past)."""
    assert not prefix_callers(PKG)


def test_the_prefix_check_finds_a_second_caller(tmp_path):
    (tmp_path / "decoder.py").write_text("def take(cache, t):\n    cache.hold(0, t)\n    self.cache.retain(1, t, 2)\n")
    assert prefix_callers(str(tmp_path)) == ["decoder.py:2 hold", "decoder.py:3 retain"]


# -- the files one round reads, as the architecture page lists them -----------------------------------
ROUND_DOC = os.path.join(os.path.dirname(PKG), "docs", "architecture.md")
LAYOUTS = {"`ar`": dict(mode="ar"), "`linear`": dict(mode="linear"),
           "`presto` one-pass": dict(mode="presto", schedule="one-pass"),
           "`presto` two-pass": dict(mode="presto", schedule="two-pass")}


def documented_round_files() -> dict[str, set[str]]:
    """The "Reading one round" table: layout -> its files ("the `x` files and ..." read as x's plus those)."""
    import re

    section = open(ROUND_DOC).read().split("### Reading one round", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] in LAYOUTS:
            base = re.match(r"the (`\w+`) files", cells[1])
            out[cells[0]] = (out[base.group(1)] if base else set()) | set(re.findall(r"`([\w/]+\.py)`", cells[1]))
    return out


def traced_round_files(model, tok, **layout) -> set[str]:
    """The package's files whose functions run during the sixth round of a generation (a decode round)."""
    import sys

    import selfspec
    from selfspec.engine.round import step as st

    seen, count, real = set(), [0], st.Stepper.step

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG + os.sep):
            seen.add(os.path.relpath(frame.f_code.co_filename, PKG).replace(os.sep, "/"))

    def step(self, *a, **k):
        count[0] += 1
        if count[0] != 6:
            return real(self, *a, **k)
        sys.setprofile(tracer)
        try:
            return real(self, *a, **k)
        finally:
            sys.setprofile(None)

    st.Stepper.step = step
    try:
        selfspec.generate(model, tok, "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", max_new_tokens=64,
                          eos_token_id=[], **layout)
    finally:
        st.Stepper.step = real
    assert count[0] > 6, "the generation ran too few rounds to trace the sixth"
    return seen


def test_one_round_reads_the_files_the_architecture_page_lists():
    import selfspec
    from selfspec.kernels import layer

    from conftest import SHIPPED

    if not layer.block_available():
        pytest.skip("the C kernels are not built here: a round runs the torch twins' files instead")
    documented = documented_round_files()
    assert set(documented) == set(LAYOUTS)
    model, tok = selfspec.load(SHIPPED, weights="w4a8", progress=False)
    for name, layout in LAYOUTS.items():
        assert traced_round_files(model, tok, **layout) == documented[name], name


def test_the_round_table_reads_a_row_built_on_another(tmp_path, monkeypatch):
    doc = tmp_path / "a.md"
    doc.write_text("### Reading one round\n| layout | files |\n|---|---|\n| `ar` | `a.py`, `b/c.py` |\n"
                   "| `linear` | the `ar` files and `d.py` |\n\n## Next\n| `presto` one-pass | `x.py` |\n")
    monkeypatch.setitem(globals(), "ROUND_DOC", str(doc))
    assert documented_round_files() == {"`ar`": {"a.py", "b/c.py"}, "`linear`": {"a.py", "b/c.py", "d.py"}}
