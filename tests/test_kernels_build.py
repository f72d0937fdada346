"""The C kernels build wherever a compiler is present, for every instruction set their sources have
paths for: a source that stops compiling must fail the suite, not quietly skip the kernel tests
(which then only check the torch fallbacks) and leave users on the slow path."""

import os

import pytest

from kernel_builds import MARCHES
from selfspec.kernels import build

KERNELS = sorted(f[:-2] for f in os.listdir(build.HERE) if f.endswith(".c"))
needs_cc = pytest.mark.skipif(build.compiler() is None or bool(os.environ.get("SELFSPEC_NO_KERNELS")),
                              reason="no C compiler here (or SELFSPEC_NO_KERNELS): the fallbacks run by design")


@needs_cc
@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_builds_where_a_compiler_is_present(name):
    assert build.load(name) is not None, build.error(name)


@needs_cc
@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_compiles_for_other_cpus(kernel_build, name, march):
    """Paths this CPU does not take (scalar, AVX2, AVX-512 with and without VNNI) still compile: the
    machine a user builds on may take them. The builds are the session's, shared with the tests that
    run them (`test_w4a8`, `test_lora8`, `test_attn16`)."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction sets")
    assert os.path.isfile(kernel_build(name, march))
