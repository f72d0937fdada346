"""`python -m selfspec serve`: the OpenAI-compatible HTTP server (`selfspec.serving.openai_api`).

Options are checked, the model is loaded, the KV cache that `--max-batch` rows may grow to (of
`--max-context` tokens each when given) is checked against the engine's ceiling and the machine's
memory (`memory_plan`: one error line naming the bytes and what to lower, before the cost model is
measured or any cache allocated),
and (plan "auto") the device's cost model measured for `--max-batch` rows, all before the port is
bound; then uvicorn serves until SIGTERM / Ctrl-C drains it (exit 0). Needs the `serve` extra
(Starlette, uvicorn): without it, one error line.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass

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
    s.add_argument("--max-context", type=int, default=None,
                   help="tokens per request (prompt + answer) each of the --max-batch rows holds: the KV cache is "
                        "planned for --max-batch x --max-context and refused at startup when it does not fit the "
                        "memory; a longer request is a 400 (default: the model's context, clipped where --max-batch "
                        "such rows would pass the engine's 8 GiB ceiling)")
    s.add_argument("--burst-window-ms", type=float, default=10.0,
                   help="an idle server waits this long after a request for another, up to 10 such windows, so "
                        "that requests arriving together are prefilled together (default 10; 0: none)")
    s.add_argument("--stream-interval-ms", type=float, default=10.0,
                   help="a stream's deltas come at most this often; tokens decoded sooner join the next one "
                        "(each delta costs the server a socket write and the client a read beside the forward; "
                        "default 10, below a screen's frame; 0: every round)")
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
    from selfspec.engine.request.options import DecodeConfig
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
    if not 0 <= a.burst_window_ms <= 1000:
        raise ValueError(f"--burst-window-ms must be between 0 and 1000, got {a.burst_window_ms}")
    if not 0 <= a.stream_interval_ms <= 1000:
        raise ValueError(f"--stream-interval-ms must be between 0 and 1000, got {a.stream_interval_ms}")
    if a.max_context is not None and a.max_context < 2:
        raise ValueError(f"--max-context must be >= 2 tokens (a prompt and an answer), got {a.max_context}")
    if a.api_key is not None and not a.api_key.strip():
        raise ValueError("--api-key is empty")


@dataclass(frozen=True)
class MemoryPlan:
    """The KV cache a server's rows may grow to: `per_token` bytes (K and V, every layer), a row
    of `context` slots (the longest request the server admits: the model's context, or less where
    `rows` such rows would pass the engine's ceiling; the server refuses a longer one) is
    `per_row` bytes, and `total` for all `rows`; `available`: the device's free memory (None:
    unknown); `max_context`: the `--max-context` tokens a row's `context` slots hold (None: not
    given)."""

    per_token: int
    rows: int
    context: int
    available: int | None
    max_context: int | None = None

    @property
    def per_row(self) -> int:
        return self.per_token * self.context

    @property
    def total(self) -> int:
        return self.per_row * self.rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def memory_plan(per_token: int, rows: int, full_context: int, least_context: int, *, ceiling: int,
                available: int | None, max_context: int | None = None) -> MemoryPlan:
    """The KV cache `rows` rows may grow to, or a ValueError (one line: the bytes needed and
    available and what to lower). `full_context`: cache slots of a request that uses the model's
    whole context (with `max_context`: of a request of `max_context` tokens); `least_context`: of
    a default request (the reserved prompt and the default answer length). Refused when `rows` rows
    cannot hold even a default request under `ceiling` (the engine's MAX_CACHE_BYTES), or when the
    cache the server admits requests up to would not fit the `available` memory. `max_context`
    given: `rows` rows of exactly `full_context` slots, refused over the ceiling or the memory
    (never clipped: the server promises that length to every row)."""
    if max_context is not None:
        return _fixed_plan(per_token, rows, full_context, max_context, ceiling=ceiling, available=available)
    context = min(full_context, ceiling // (rows * per_token))
    if context < least_context:
        need = rows * least_context * per_token
        fit = max(0, ceiling // (least_context * per_token))
        raise ValueError(f"--max-batch {rows} rows x {least_context} tokens (a default request: prompt, answer, a "
                         f"round's scratch) x {per_token:,} bytes of KV cache per token = {_mib(need)}, over the "
                         f"engine's ceiling of {_mib(ceiling)}; lower --max-batch (at most {fit} rows fit) or "
                         f"--max-tokens")
    plan = MemoryPlan(per_token, rows, context, available)
    if available is not None and plan.total > available:
        fit = 0
        for r in range(rows - 1, 0, -1):
            if r * min(full_context, ceiling // (r * per_token)) * per_token <= available:
                fit = r
                break
        lower = (f"lower --max-batch (at most {fit} rows fit)" if fit else
                 "not even one row of the model's context fits: free memory, or serve a model with a shorter context")
        raise ValueError(f"--max-batch {rows} rows x {context:,} tokens of context (the longest request admitted: "
                         f"prompt + answer) x {per_token:,} bytes of KV cache per token = {_mib(plan.total)}, more "
                         f"than the {_mib(available)} of memory available; {lower}")
    return plan


def _fixed_plan(per_token: int, rows: int, slots: int, max_context: int, *, ceiling: int,
                available: int | None) -> MemoryPlan:
    """`--max-batch` x `--max-context`: `rows` rows of `slots` cache slots (`max_context` tokens and
    a round's scratch), refused in one line naming the bytes needed and the limit it passes."""
    plan = MemoryPlan(per_token, rows, slots, available, max_context)
    limit = ceiling if available is None else min(ceiling, available)
    if plan.total <= limit:
        return plan
    over = (f"the {_mib(available)} of memory available" if limit == available else
            f"the engine's ceiling of {_mib(ceiling)}" + ("" if available is None else f" ({_mib(available)} available)"))
    scratch = slots - max_context
    rows_fit = limit // (slots * per_token)
    tokens_fit = max(0, limit // (rows * per_token) - scratch)
    lower = ((f"lower --max-batch (at most {rows_fit} rows of {max_context:,} tokens fit)" if rows_fit else
              f"no row of {max_context:,} tokens fits") +
             (f" or --max-context (at most {tokens_fit:,} tokens for {rows} rows)" if tokens_fit >= 2 else ""))
    raise ValueError(f"--max-batch {rows} rows x --max-context {max_context:,} tokens (+{scratch} slots of a round's "
                     f"scratch) x {per_token:,} bytes of KV cache per token = {_mib(plan.total)} needed, more than "
                     f"{over}; {lower}")


def memory_line(plan: MemoryPlan) -> str:
    """The startup line's KV-cache budget: bytes per token, per row and for all rows at most."""
    avail = "unknown" if plan.available is None else _mib(plan.available)
    row = (f"{plan.max_context:,} tokens (--max-context; {plan.context:,} cache slots)" if plan.max_context else
           f"{plan.context:,} tokens (the longest request admitted)")
    return (f"{plan.per_token:,} bytes per token, {_mib(plan.per_row)} per row of {row}, "
            f"{_mib(plan.total)} for {plan.rows} rows at most, {avail} available")


def available_memory(device) -> int | None:
    """Free memory for the KV cache: a CUDA device's free bytes, else the machine's MemAvailable
    (/proc/meminfo); None where neither can be read."""
    import torch

    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def server_memory(model, cfg, rows: int, max_tokens: int, max_context: int | None = None) -> MemoryPlan:
    """`memory_plan` for a loaded model served with `cfg` on `rows` rows (`max_tokens`: the
    default answer length; `max_context`: tokens per request, prompt + answer, when given)."""
    from selfspec.engine.forward.batch_forward import BatchForward
    from selfspec.engine.request.request import MAX_CACHE_BYTES, lookahead, row_capacity, row_slots
    from selfspec.engine.request.sequence import SamplingParams
    from selfspec.serving.openai_api.service import RESERVED_PROMPT

    bf = BatchForward.of(model)
    per_token = bf.cache_bytes(1, 1)
    # the longest request: prompt + answer + lookahead = the model's context; its row holds prompt + answer + scratch
    full = row_slots(model.config.max_position_embeddings - lookahead(cfg), cfg)
    least = row_capacity([[0] * RESERVED_PROMPT], cfg, SamplingParams(max_new_tokens=max_tokens))
    if max_context is not None:
        limit = model.config.max_position_embeddings - lookahead(cfg)
        if max_context > limit:
            raise ValueError(f"--max-context {max_context:,} is over the model's context: max_position_embeddings "
                             f"{model.config.max_position_embeddings:,}, less {lookahead(cfg)} positions for drafting, "
                             f"leaves at most {limit:,} tokens per request")
        full = row_slots(max_context, cfg)
    device = model.get_input_embeddings().weight.device
    return memory_plan(per_token, rows, full, min(least, full), ceiling=MAX_CACHE_BYTES,
                       available=available_memory(device), max_context=max_context)


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
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype)
    defaults = model_defaults(resolve(a.model, progress=False), a.max_tokens)
    memory = server_memory(model, cfg, a.max_batch, defaults.max_tokens, a.max_context)  # before any cache or cost model
    options = ServiceOptions(model_id=model_id, aliases=aliases, max_batch=a.max_batch, max_queue=a.max_queue,
                             shutdown_timeout=a.shutdown_timeout, defaults=defaults, max_context=a.max_context,
                             burst_window=a.burst_window_ms / 1000, stream_interval=a.stream_interval_ms / 1000)
    service = Service(model, tok, cfg, options, profile=a.profile)  # plan "auto": measures the cost model here
    if a.host not in LOOPBACK and not a.api_key:
        print(f"warning: serving on {a.host} without --api-key: anyone who reaches this port can use the model",
              file=sys.stderr)
    print(f"serving {model_id} (plan {cfg.plan}, mode {cfg.mode}) on http://{a.host}:{a.port}/v1 with "
          f"{a.max_batch} rows ({service.kv_cache_bytes / 2**20:.0f} MiB of KV cache reserved; {memory_line(memory)}) "
          f"and a queue of {a.max_queue}; defaults from {options.defaults.source}", file=sys.stderr)
    # What exists now lives as long as the server: out of the collector's sight (torch and
    # transformers leave hundreds of thousands of objects, a full collection of which stalls every
    # row now and then, mid-answer); what the requests allocate is collected as before
    gc.collect()
    gc.freeze()
    return serve(build_app(service, api_key=a.api_key), service, host=a.host, port=a.port, log_level=a.log_level)
