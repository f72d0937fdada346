"""The kernels' C reads like C: every header compiles when it is the only thing included (it
includes what it uses), and the #include graph of selfspec/kernels has no circle."""

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from selfspec.kernels import build

HEADERS = sorted(f for f in os.listdir(build.HERE) if f.endswith(".h"))
# the builds that turn every header's guarded code on: plain C, AVX2 alone, AVX-512 without VNNI, and
# AVX-512 VNNI with AMX (the vector files and w4a8_amx.h)
X86 = ("x86-64", "haswell", "skylake-avx512", "sapphirerapids")
needs_cc = pytest.mark.skipif(build.compiler() is None, reason="no C compiler here")


def includes(folder: str) -> dict[str, list[str]]:
    """Each C file of `folder` -> the local files it includes ("..."), in order."""
    graph = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(folder, name)) as f:
                graph[name] = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
    return graph


def circle(graph: dict[str, list[str]]) -> list[str] | None:
    """An include circle of `graph` (its files in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def compiles_alone(folder: str, header: str, march: str | None) -> str | None:
    """The compiler's complaint about a file holding only `#include "header"`, or None."""
    # a call to an undeclared function is an error (C89's implicit declaration would hide a missing include)
    cmd = [build.compiler(), "-fsyntax-only", "-fopenmp", "-Werror=implicit-function-declaration", "-x", "c", "-I",
           folder, "-"]
    if march:
        cmd.insert(1, f"-march={march}")
    res = subprocess.run(cmd, input=f'#include "{header}"\n', capture_output=True, text=True, timeout=60)
    return None if res.returncode == 0 else res.stderr.strip()[-600:]


def test_the_include_graph_of_the_kernels_has_no_circle():
    graph = includes(build.HERE)
    missing = {(f, i) for f, inc in graph.items() for i in inc if i not in graph}
    assert not missing, f"included but not in selfspec/kernels: {sorted(missing)}"
    assert circle(graph) is None, " -> ".join(circle(graph))


def test_the_circle_finder_finds_a_circle(tmp_path):
    """The check above fails where a header includes one that includes it back."""
    (tmp_path / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text('#include "c.h"\n')
    (tmp_path / "c.h").write_text('#include "a.h"\n')
    (tmp_path / "k.c").write_text('#include "a.h"\n')
    assert circle(includes(str(tmp_path))) == ["a.h", "b.h", "c.h", "a.h"]
    (tmp_path / "c.h").write_text("")
    assert circle(includes(str(tmp_path))) is None


@needs_cc
@pytest.mark.parametrize("march", X86 if os.uname().machine in ("x86_64", "AMD64") else [None])
def test_every_header_compiles_alone(march):
    """Each header, included first and alone, compiles for every instruction set's build: it includes
    what it uses instead of leaning on what its includer happened to include before it."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        errors = pool.map(lambda h: compiles_alone(build.HERE, h, march), HEADERS)
    bad = {h: err for h, err in zip(HEADERS, errors) if err}
    assert not bad, bad


@needs_cc
def test_a_header_that_leans_on_its_includer_is_caught(tmp_path):
    """The check above fails where a header uses what only its includer declares (here common.h's pow2)."""
    with open(os.path.join(build.HERE, "common.h")) as f:
        (tmp_path / "common.h").write_text(f.read())
    (tmp_path / "leans.h").write_text("static inline double half(void) { return pow2(-1); }\n")
    (tmp_path / "stands.h").write_text('#include "common.h"\n' + (tmp_path / "leans.h").read_text())
    assert compiles_alone(str(tmp_path), "leans.h", None) is not None
    assert compiles_alone(str(tmp_path), "stands.h", None) is None
