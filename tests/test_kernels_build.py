"""The C kernels build wherever a compiler is present, for every instruction set their sources have
paths for: a source that stops compiling must fail the suite, not quietly skip the kernel tests
(which then only check the torch fallbacks) and leave users on the slow path."""

import os

import pytest

from selfspec.kernels import build

KERNELS = sorted(f[:-2] for f in os.listdir(build.HERE) if f.endswith(".c"))
needs_cc = pytest.mark.skipif(build.compiler() is None or bool(os.environ.get("SELFSPEC_NO_KERNELS")),
                              reason="no C compiler here (or SELFSPEC_NO_KERNELS): the fallbacks run by design")


@needs_cc
@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_builds_where_a_compiler_is_present(name):
    assert build.load(name) is not None, build.error(name)


@needs_cc
@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512", "icelake-server"])
@pytest.mark.parametrize("name", ["attn16", "layer"])
def test_the_attention_and_layer_kernels_compile_for_other_cpus(tmp_path, name, march):
    """Paths this CPU does not take (scalar, AVX2, AVX-512 without VNNI) still compile: the machine
    a user builds on may take them."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction sets")
    flags = [f for f in build.FLAGS if f != "-march=native"] + [f"-march={march}"]
    err = build.compile_c(build.compiler(), os.path.join(build.HERE, f"{name}.c"), str(tmp_path / f"{name}.so"), flags)
    assert err is None, err
