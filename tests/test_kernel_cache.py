"""The kernel cache heals and says so (issue 75): a truncated, empty or foreign-owned cached kernel is
built again with one line instead of killing the run or leaving it on the slow path; a compiler that
fails is one warning a process with its reason, the torch fallback gives the kernels' tokens, and a
later process does not compile again; a choice measured without kernels is not reused with them.
Every run here is a subprocess with its own SELFSPEC_CACHE (a damaged cache kills a process)."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from selfspec.kernels import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = ["-m", "selfspec", "generate", "--model", "pystdlib-nld-9m", "--weights", "w4a8", "--mode", "ar",
            "--prompt", "import os", "--max-new-tokens", "8", "--json"]
needs_cc = pytest.mark.skipif(build.compiler() is None or bool(os.environ.get("SELFSPEC_NO_KERNELS")),
                              reason="no C compiler here (or SELFSPEC_NO_KERNELS): nothing to build")
# a compiler that answers --version and fails every build with one error line (first writing half a
# library, as a killed build would), counting the builds it was asked for
FAKE_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi
echo build >> "{count}"
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo half > "$2"; fi; shift; done
echo "fakecc: error: this compiler is broken" >&2
echo "fakecc: note: a second line" >&2
exit 1
"""


def run(args, cache, path_dir=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("SELFSPEC_NO_KERNELS", "CC")}
    env["SELFSPEC_CACHE"] = str(cache)
    if path_dir:
        env["PATH"] = f"{path_dir}{os.pathsep}{env['PATH']}"
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout, res.stderr.splitlines()


def generate(cache, path_dir=None):
    rc, out, err = run(GENERATE, cache, path_dir)
    assert rc == 0, (rc, err)
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache whose kernels were built by a process of their own, and that process's tokens."""
    cache = tmp_path_factory.mktemp("built")
    rec, _ = generate(cache)
    assert all(s["loaded"] for s in rec["kernels"].values()), rec["kernels"]
    return cache, rec


def kernel_file(cache, name):
    [so] = [f for f in os.listdir(cache / "kernels") if f.startswith(name + "-") and f.endswith(".so")]
    return cache / "kernels" / so


def damage(so, how):
    if how == "truncated":
        data = so.read_bytes()
        so.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        so.write_bytes(b"")
    else:
        os.chown(so, 65534, -1)


@needs_cc
@pytest.mark.parametrize("how", ["truncated", "empty", "foreign"])
def test_a_damaged_cached_kernel_is_built_again_with_one_line(built, tmp_path, how):
    if how == "foreign" and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache = tmp_path / "cache"
    shutil.copytree(built[0], cache)
    so = kernel_file(cache, "layer")
    damage(so, how)
    rec, err = generate(cache)  # a truncated library mapped as it is kills the process (SIGBUS)
    assert all(s["loaded"] for s in rec["kernels"].values()), rec["kernels"]
    assert rec["token_ids"] == built[1]["token_ids"]
    assert len(err) == 1 and "layer kernel" in err[0] and "building it again" in err[0], err
    st = os.stat(so)
    assert st.st_uid == os.getuid() and st.st_size == os.stat(kernel_file(built[0], "layer")).st_size
    assert stat.S_IMODE(st.st_mode) == 0o644  # readable by others who share the cache
    _, err = generate(cache)
    assert err == []  # healed: the next run says nothing


@needs_cc
def test_a_failing_compiler_is_one_warning_the_same_tokens_and_no_second_compile(built, tmp_path):
    bin_dir, count = tmp_path / "bin", tmp_path / "count"
    bin_dir.mkdir()
    (bin_dir / "cc").write_text(FAKE_CC.format(count=count))
    (bin_dir / "cc").chmod(0o755)
    cache = tmp_path / "cache"
    rec, err = generate(cache, bin_dir)
    assert not any(s["loaded"] for s in rec["kernels"].values())
    assert rec["token_ids"] == built[1]["token_ids"]  # the torch fallback's tokens are the kernels'
    warnings = [line for line in err if "warning" in line]
    assert len(warnings) == 1 and "fakecc: error: this compiler is broken" in warnings[0], err
    assert "apt-get install gcc" in warnings[0]
    assert len([line for line in err if "building the" in line]) <= 1
    compiles = count.read_text().count("build")
    assert compiles >= len(build.names())
    assert all(f.endswith(".failed.json") for f in os.listdir(cache / "kernels"))  # no half-built library left
    rec, err = generate(cache, bin_dir)
    assert count.read_text().count("build") == compiles  # remembered: not compiled again
    assert len(err) == 1 and "this compiler is broken" in err[0] and "remembered" in err[0], err
    state = json.loads(run(["-m", "selfspec", "info", "--json"], cache, bin_dir)[1])["kernels"]
    assert all("this compiler is broken" in s["error"] for s in state.values())


KEYS = """
import torch
from selfspec.checkpoint.model import load
from selfspec.engine.measure import cost
from selfspec.engine.measure import formats
m, _ = load("pystdlib-nld-9m", dtype=torch.float32, draft_lora=False)
print(formats._cache_path(m)); print(cost.default_path(m))
"""


@needs_cc
def test_a_choice_measured_without_kernels_is_not_reused_with_them(built, tmp_path):
    """The format choice and the cost model are keyed by which kernels loaded: a process whose
    compiler fails gets other files than one with the kernels, and two with kernels the same."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cc").write_text(FAKE_CC.format(count=tmp_path / "count"))
    (bin_dir / "cc").chmod(0o755)
    cache = tmp_path / "cache"
    shutil.copytree(built[0], cache)
    with_kernels = [run(["-c", KEYS], cache)[1] for _ in range(2)]
    failed = run(["-c", KEYS], cache, bin_dir)[1]  # another compiler: no kernel (the fake fails)
    assert with_kernels[0] == with_kernels[1] and len(with_kernels[0].split()) == 2
    assert not set(failed.split()) & set(with_kernels[0].split())


@needs_cc
def test_a_cache_folder_others_can_write_is_not_loaded_from(built, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built[0], cache)
    os.chmod(cache / "kernels", 0o777)  # no sticky bit: anyone could swap a library in
    rc, out, err = run(["-c", "from selfspec.kernels import build; import json; print(json.dumps(build.state()))"],
                       cache)
    state = json.loads(out)
    assert rc == 0 and all(s["loaded"] and not s["path"].startswith(str(cache)) for s in state.values()), state
    assert len(err) == 1 and "not safe" in err[0] and "can be written by every user" in err[0], err


def test_a_build_that_times_out_leaves_nothing_and_is_not_remembered(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cc").write_text('#!/bin/sh\n[ "$1" = "--version" ] && { echo slowcc; exit 0; }\n'
                                'while [ $# -gt 0 ]; do [ "$1" = "-o" ] && echo half > "$2"; shift; done\nsleep 30\n')
    (bin_dir / "cc").chmod(0o755)
    rc, _, err = run(["-c", "from selfspec.kernels import build; build.TIMEOUT_S = 1; print(build.load('block'))"],
                     tmp_path / "cache", bin_dir, timeout=120)
    assert rc == 0 and any("took over 1 s" in line for line in err), err
    assert os.listdir(tmp_path / "cache" / "kernels") == []  # no tmp*.so, no remembered failure


AARCH64 = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(AARCH64 is None, reason="no aarch64 cross compiler here (apt-get install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("name", build.names())
def test_every_kernel_compiles_for_aarch64_and_other_cpus(tmp_path, name):
    """The portable C builds where the x86 vector paths cannot (no x86 flag, no intrinsic outside
    its guard): ARM's flags (a named core for -mcpu=native, which a cross compiler cannot resolve;
    then the armv8-a fallback) and the plain flags of any other architecture."""
    sets = [[f.replace("-mcpu=native", "-mcpu=neoverse-v1") for f in s] for s in build.flag_sets("aarch64")]
    sets += build.flag_sets("riscv64")
    assert not any(f.startswith(("-march=native", "-mprefer")) for s in sets for f in s)
    for i, flags in enumerate(sets):
        err = build.compile_c(AARCH64, os.path.join(build.HERE, f"{name}.c"), str(tmp_path / f"{name}{i}.so"), flags)
        assert err is None, (flags, err)


def test_which_cache_folders_are_trusted(tmp_path):
    from selfspec.kernels.cache import unsafe_folder

    d = tmp_path / "kernels"
    d.mkdir()
    os.chmod(d, 0o755)
    assert unsafe_folder(str(d)) is None and unsafe_folder(str(d / "not yet made")) is None
    os.chmod(d, 0o777)
    assert "can be written by every user" in unsafe_folder(str(d / "not yet made"))
    os.chmod(d, 0o1777)  # sticky, as /tmp: others cannot rename or remove what is yours
    assert unsafe_folder(str(d)) is None
    if os.getuid() == 0:
        os.chown(d, -1, 65534)
        os.chmod(d, 0o775)
        assert "members of group 65534" in unsafe_folder(str(d))
        os.chown(d, 65534, -1)
        os.chmod(d, 0o755)
        assert "belongs to uid 65534" in unsafe_folder(str(d))


def test_a_cache_that_cannot_be_written_gives_a_private_folder_and_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "file"))  # a folder under a file: never writable
    monkeypatch.setattr(build, "_private", {})
    folder = build._folder()
    assert build._folder() == folder and os.path.isdir(folder) and not folder.startswith(str(tmp_path))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "cannot be written" in err[0] and "SELFSPEC_CACHE" in err[0], err
    shutil.rmtree(folder)
