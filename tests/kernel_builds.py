"""The C kernels built for other CPUs than this one, once a test run: the tests of the paths this
CPU does not take by default (plain C, AVX2, AVX-512 with and without VNNI) share one build per
(kernel, -march) through conftest's session fixture `kernel_build`."""

from __future__ import annotations

import os

from selfspec.kernels import build

# each vector path's -march: plain C, AVX2, AVX-512 without VNNI, AVX-512 with VNNI
MARCHES = ("x86-64", "haswell", "skylake-avx512", "icelake-server")


def flags(march: str) -> list[str]:
    """The build's own flags with -march=native replaced by `march`."""
    return [f for f in build.FLAGS if f != "-march=native"] + [f"-march={march}"]


class KernelBuilds:
    """build(name, march) -> the path of `<name>.c` compiled for -march into `folder`; asserts that
    it compiled (a source that stops compiling for some CPU fails the test that asked)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._done: dict[tuple[str, str], tuple[str, str | None]] = {}

    def __call__(self, name: str, march: str) -> str:
        if (name, march) not in self._done:
            out = os.path.join(self.folder, f"{name}-{march}.so")
            err = build.compile_c(build.compiler(), os.path.join(build.HERE, f"{name}.c"), out, flags(march))
            self._done[name, march] = out, err
        out, err = self._done[name, march]
        assert err is None, err
        return out

    def count(self) -> int:
        """How many builds this run has made."""
        return len(self._done)
