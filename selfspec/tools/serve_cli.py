"""`python -m selfspec serve`: the OpenAI-compatible HTTP server (`selfspec.serving.openai_api`).

Options are checked, the model is loaded and (plan "auto") the device's cost model measured for
`--max-batch` rows, all before the port is bound; then uvicorn serves until SIGTERM / Ctrl-C
drains it (exit 0). Needs the `serve` extra (Starlette, uvicorn): without it, one error line.
"""

from __future__ import annotations

import os
import sys

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve_parser(sub) -> None:
    from selfspec.tools.args import add_weights_args

    s = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (needs the serve extra)",
        description="Serve the model over an OpenAI-compatible HTTP API. Sampling: a request's temperature, top_p "
                    "and top_k win where given; those it leaves out come from the checkpoint's generation_config.json "
                    "as transformers reads it (sampled only when it says do_sample; the default model's: temperature "
                    "0.2, top-p 0.9, its card's recommendation), else greedy; its max_new_tokens is the answer length "
                    "unless --max-tokens is given. The runtime has no repetition penalty: a repetition_penalty in the "
                    "file is logged once at startup and not applied. (`generate` stays greedy unless asked.)")
    s.add_argument("--model", default=None, help="checkpoint directory or model name (default: the default model)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model's name, or its folder's name)")
    add_weights_args(s)
    s.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default cpu)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded together (cache rows; default 16)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a row; one more is a 429 (default 64)")
    s.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default $SELFSPEC_API_KEY; the variable keeps the key "
                        "out of the process list)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM / Ctrl-C (default 30)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="answer length for requests that name none (default: the model's generation_config.json "
                        "max_new_tokens, else 256; shortened to fit the context)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_decoding_args(s)
    s.set_defaults(func=cmd_serve)


def _add_decoding_args(s) -> None:
    from selfspec.tools.args import add_layout_args

    add_layout_args(s)
    s.add_argument("--block-length", type=int, default=16, help="draft block / mask-group length")
    s.add_argument("--lookup", default=None, choices=["on", "off"], help="context candidates in PRESTO trees")
    s.add_argument("--lookup-tokens", type=int, default=10, help="--mode lookup: tokens copied per round")
    s.add_argument("--no-draft-lora", action="store_true", help="ignore the checkpoint's linear_spec_lora adapter")
    s.add_argument("--sampling", default="reproducible", choices=["reproducible", "independent"],
                   help="randomness at T > 0: reproducible (default; a request's seed gives the same tokens "
                        "alone or in any batch) or one draw per tree node")
    s.add_argument("--profile", default=None, help="cost-profile JSON for --plan auto (default: measured and cached)")


def _decode_config(a):
    from selfspec.engine.options import DecodeConfig
    from selfspec.tools.args import check_profile_arg

    cfg = DecodeConfig(plan=a.plan, mode=a.mode, schedule=a.schedule, budget=a.budget, block_length=a.block_length,
                       lookup=None if a.lookup is None else a.lookup == "on", lookup_tokens=a.lookup_tokens,
                       draft_lora=not a.no_draft_lora, sampling=a.sampling)
    check_profile_arg(a, cfg)
    return cfg


def _check(a) -> None:
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0 .. 65535, got {a.port}")
    if a.max_batch < 1 or a.max_queue < 0:
        raise ValueError(f"--max-batch must be >= 1 and --max-queue >= 0, got {a.max_batch} and {a.max_queue}")
    if not a.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {a.shutdown_timeout}")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.api_key is not None and not a.api_key.strip():
        raise ValueError("--api-key is empty")


def model_names(model_arg: str | None, served: str | None) -> tuple[str, tuple[str, ...]]:
    """The id clients send (`served`, else the name, else the folder's name) and the other
    spellings accepted for it (the --model argument as given)."""
    from selfspec.checkpoint.registry import DEFAULT_MODEL

    given = model_arg or os.environ.get("SELFSPEC_MODEL") or DEFAULT_MODEL
    model_id = served or os.path.basename(os.path.normpath(given))
    return model_id, tuple(n for n in {given, os.path.basename(os.path.normpath(given))} if n != model_id)


def cmd_serve(a) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: `serve` needs the serve extra ({e.name} is not installed): pip install -e '.[serve]'",
              file=sys.stderr)
        return 2
    from selfspec.checkpoint.registry import resolve
    from selfspec.loading import load
    from selfspec.serving.openai_api.app import build_app
    from selfspec.serving.openai_api.defaults import model_defaults
    from selfspec.serving.openai_api.run import serve
    from selfspec.serving.openai_api.service import Service, ServiceOptions

    _check(a)
    cfg = _decode_config(a)  # bad options fail before the model loads
    model_id, aliases = model_names(a.model, a.served_model_name)
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device)
    options = ServiceOptions(model_id=model_id, aliases=aliases, max_batch=a.max_batch, max_queue=a.max_queue,
                             shutdown_timeout=a.shutdown_timeout,
                             defaults=model_defaults(resolve(a.model, progress=False), a.max_tokens))
    service = Service(model, tok, cfg, options, profile=a.profile)  # plan "auto": measures the cost model here
    if a.host not in LOOPBACK and not a.api_key:
        print(f"warning: serving on {a.host} without --api-key: anyone who reaches this port can use the model",
              file=sys.stderr)
    print(f"serving {model_id} (plan {cfg.plan}, mode {cfg.mode}) on http://{a.host}:{a.port}/v1 with "
          f"{a.max_batch} rows ({service.kv_cache_bytes / 2**20:.0f} MiB of KV cache reserved) and a queue of "
          f"{a.max_queue}; defaults from {options.defaults.source}", file=sys.stderr)
    return serve(build_app(service, api_key=a.api_key), service, host=a.host, port=a.port, log_level=a.log_level)
