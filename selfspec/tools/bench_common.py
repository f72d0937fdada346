"""What every `bench` subcommand shares: its output folder, its prompts and the header of its
results.json (command, settings, model, versions, machine), as the decode grid writes them."""

from __future__ import annotations

import os
import platform
import time


def check_out(out: str | None) -> str:
    """The output folder, created and proven writable before any work (default bench_out/<time>)."""
    out = out or os.path.join("bench_out", time.strftime("%Y%m%d-%H%M%S"))
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write_test")
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"output folder {out} cannot be written: {e}") from None
    return out


def read_rows_prompts(a) -> tuple[list[dict], str]:
    """(the first `a.limit` prompts, their file): `a.prompts` or the model's prompts.jsonl."""
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.tools.bench_prompts import read_prompts

    if a.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {a.limit}")
    path = a.prompts or os.path.join(a.model or default_model_dir(), "prompts.jsonl")
    prompts = read_prompts(path)
    return (prompts[: a.limit] if a.limit else prompts), path


def run_info(a, model, prompts_path: str | None, n_prompts: int) -> dict:
    """The results.json header fields of the decode grid, for a subcommand's run."""
    import torch
    import transformers

    from selfspec.checkpoint.model import default_model_dir

    return {"command": "python -m selfspec " + " ".join(getattr(a, "argv", [])),
            "settings": {k: v for k, v in vars(a).items() if k not in ("func", "argv")},
            "model": os.path.abspath(a.model or default_model_dir()), "dtype": str(model.dtype),
            "device": str(model.device),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "machine": {"platform": platform.platform(), "processor": cpu_model(), "threads": torch.get_num_threads()},
            "prompts_file": os.path.abspath(prompts_path) if prompts_path else None, "n_prompts": n_prompts}


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
