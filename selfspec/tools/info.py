"""`python -m selfspec info`: what a bug report needs, in one screen.

Versions, the CPU and the instruction sets the kernels care about, the C compiler, each kernel's
state (built for which -march and instruction sets, and where; or why not and what fixes it), the
weight format "auto" picks for a model where that is already measured (nothing is measured here),
the KV cache it keeps, and the cache folders. `--json` prints the same as one JSON object.
"""

from __future__ import annotations

import json
import os
import platform

# the /proc/cpuinfo flags that decide which kernel paths build (x86) or could (ARM: "Features")
ISA_FLAGS = {"flags": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                       "amx_tile", "amx_int8", "amx_bf16"),
             "Features": ("asimd", "asimddp", "i8mm", "bf16", "sve")}


def cpu_info() -> dict:
    from selfspec.kernels.build import cpu

    lines = dict(ln.split(":", 1) for ln in cpu().splitlines() if ":" in ln)
    lines = {k.strip(): v.strip() for k, v in lines.items()}
    line = "Features" if "Features" in lines else "flags"
    flags, known = set(lines.get(line, "").split()), ISA_FLAGS[line]
    model = lines.get("model name") or " ".join(f"{k} {lines[k]}" for k in ("CPU implementer", "CPU part") if k in lines)
    return {"model": model or platform.processor() or "unknown", "machine": platform.machine(), "cores": os.cpu_count(),
            "isa": [f for f in known if f in flags], "isa_missing": [f for f in known if f not in flags]}


def compiler_info() -> dict:
    from selfspec.kernels import build

    cc = build.compiler()
    version = build._version(cc) if cc else None
    return {"path": cc, "version": (version or "").strip().splitlines()[0] if version else None}


def weights_info(model: str | None) -> dict:
    """The weight format and KV cache a load of `model` (the default model where None) gets, without
    measuring anything: "auto"'s choice only where it is cached already."""
    from selfspec.checkpoint import registry
    from selfspec.engine.forward.batch_forward import kv_cache_for

    kv_env = os.environ.get("SELFSPEC_KV_CACHE_DTYPE")
    name = model or os.environ.get("SELFSPEC_MODEL") or registry.DEFAULT_MODEL
    out = {"model": name, "weights": os.environ.get("SELFSPEC_WEIGHTS") or "auto", "chosen": None,
           "kv_cache": kv_env or "auto"}
    if out["weights"] == "auto":
        out["chosen"], out["note"] = _cached_choice(name)
    fmt = out["chosen"] if out["weights"] == "auto" else out["weights"]
    if not kv_env or kv_env == "auto":
        out["kv_cache"] = (kv_cache_for(fmt) if fmt else "int8 for w4a8 / int8 weights, int16 for the others")
    return out


def _cached_choice(name: str) -> tuple[str | None, str]:
    import torch

    from selfspec.checkpoint import registry
    from selfspec.checkpoint.model import load
    from selfspec.engine.measure.formats import cached_choice

    converted = os.path.join(registry.cache_root(), "models", f"{registry.DEFAULT_MODEL}-{registry.CONVERTED_FORMAT}")
    if name == registry.DEFAULT_MODEL and not os.path.isfile(os.path.join(converted, "config.json")):
        return None, "the default model is not converted yet (the first load converts it)"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        m, _ = load(registry.resolve(name, progress=False), dtype=torch.float32, draft_lora=False)
    except (OSError, ValueError, RuntimeError) as e:
        return None, f"cannot tell: the model does not load ({' '.join(str(e).split())})"
    fmt, path = cached_choice(m)
    if fmt is None:
        return None, "not measured yet (the first load with weights='auto' measures it, then caches it)"
    return fmt, f"measured earlier ({path})"


def collect(model: str | None = None) -> dict:
    import torch
    import transformers

    import selfspec
    from selfspec.checkpoint.registry import cache_root
    from selfspec.engine.measure.device_id import cache_dir
    from selfspec.kernels import build

    return {"versions": {"selfspec": selfspec.__version__, "python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "platform": platform.platform(), "torch_threads": torch.get_num_threads(), "cpu": cpu_info(),
            "compiler": compiler_info(), "kernels": build.state(), "weights": weights_info(model),
            "caches": {"root": cache_root(), "kernels": build.kernel_dir(), "models": os.path.join(cache_root(), "models"),
                       "profiles": cache_dir()}}


def render(info: dict) -> str:
    v, c, cc, w = info["versions"], info["cpu"], info["compiler"], info["weights"]
    lines = [f"selfspec {v['selfspec']}, python {v['python']}, torch {v['torch']}, transformers {v['transformers']}",
             f"platform: {info['platform']}",
             f"cpu: {c['model']} ({c['machine']}, {c['cores']} cores, torch uses {info['torch_threads']} threads)",
             f"instruction sets: {' '.join(c['isa']) or 'none of the ones the kernels use'}"
             + (f" (not: {' '.join(c['isa_missing'])})" if c["isa_missing"] else ""),
             f"C compiler: {cc['path']} ({cc['version']})" if cc["path"] else "C compiler: none on PATH (cc, gcc, clang, $CC)",
             "kernels:"]
    width = max(map(len, info["kernels"]))
    for name, s in info["kernels"].items():
        if s["loaded"]:
            lines.append(f"  {name:<{width}}  loaded, built for {s['march']} ({s['isa']}): {s['path']}")
        else:
            lines.append(f"  {name:<{width}}  not loaded, the torch fallback runs: {s['error']}"
                         + (f" (fix: {s['fix']})" if s.get("fix") else ""))
    picked = f" -> {w['chosen']}" if w["chosen"] else ""
    lines.append(f"weights for {w['model']}: {w['weights']}{picked}" + (f"; {w['note']}" if w.get("note") else ""))
    lines.append(f"KV cache: {w['kv_cache']}")
    lines.append("caches: " + ", ".join(f"{k} {p}" for k, p in info["caches"].items()))
    return "\n".join(lines)


def cmd_info(a) -> int:
    info = collect(a.model)
    print(json.dumps(info, indent=1) if a.json else render(info))
    return 0


def add_info_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, CPU, kernels, weight format and caches: what a bug report needs")
    p.add_argument("--model", default=None, help="model whose weight-format choice to show (default: the default model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)
