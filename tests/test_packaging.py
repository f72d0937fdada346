import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command_verbatim():
    ci_cmd = [l for l in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in l]
    assert len(ci_cmd) == 1
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert ci_cmd[0].strip() in [b.strip() for b in blocks[:2]]


def test_readme_first_commands_pin_torch_and_run_the_main_job():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    run, test = blocks[0].strip(), blocks[1].strip()
    assert "torch==2.13.0" in run and "python -m selfspec generate" in run
    assert "torch==2.13.0" in test and "pytest" in test


def test_modules_stay_small():
    for p in (ROOT / "selfspec").rglob("*.py"):
        assert len(p.read_text().splitlines()) <= 450, p


def test_examples_and_benchmark_scripts_compile():
    import py_compile

    for p in list((ROOT / "examples").glob("*.py")) + list((ROOT / "benchmarks").glob("*.py")):
        py_compile.compile(str(p), doraise=True)


def test_render_mask_example_draws_with_the_project_builder(tmp_path):
    import subprocess
    import sys

    import pytest

    pytest.importorskip("matplotlib")
    out = tmp_path / "mask.png"
    subprocess.run([sys.executable, str(ROOT / "examples/render_mask.py"), "--out", str(out)], check=True, cwd=ROOT)
    assert out.stat().st_size > 1000


def test_batch_example_runs_a_batch_on_a_small_model(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "examples/batch_generate.py"), "--model",
                        str(ROOT / "models/pystdlib-nld-9m"), "--batch-size", "3", "--max-new-tokens", "8",
                        "--mode", "lookup", "--trace-dir", str(tmp_path / "traces")], check=True, cwd=ROOT,
                       capture_output=True, text=True)
    assert r.stdout.count("-- row ") == 4 and "tokens/s for the batch" in r.stdout
    pages = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert pages == [f"row{i}.html" for i in range(4)]
    assert all("<html" in (tmp_path / "traces" / p).read_text()[:300].lower() for p in pages)
