"""Request bodies -> a checked `GenerationRequest`: every field typed and ranged here, written out
by hand so each refusal is an OpenAI-shaped 400 naming the field (no schema library between the
body and the message a client reads).

What is checked later, against the model: the model name (404), the chat template, the prompt's
token ids and the context length (`service.Service.encode`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from selfspec.serving.openai_api.errors import invalid
from selfspec.serving.openai_api.fields import CHAT, COMPLETION, check_ignored

MAX_STOPS = 4  # OpenAI's limit
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# the fields each endpoint implements; `fields.py` lists the accepted-but-ignored ones
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "n", "stream", "stream_options", "return_token_ids"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                     "stream_options", "return_token_ids"}


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request. None means "the server's default" (the model's generation config)."""

    kind: str  # "chat" or "completion"
    model: str
    prompt: object  # text, a list of token ids, or chat messages [{"role", "content"}]
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (chat: or max_completion_tokens)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: the generated ids beside the text


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; NaN / Infinity literals and anything but an object are refused."""
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise invalid(f"the request body is not valid JSON: {_short(e)}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_kind(body)}", code="invalid_json")
    return body


def parse_request(kind: str, body: dict) -> GenerationRequest:
    """A chat ("chat") or text ("completion") request body, checked field by field."""
    chat = kind == "chat"
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, CHAT if chat else COMPLETION)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter (a non-empty string; GET /v1/models lists it)", "model")
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"))
    _n(body.get("n"))
    stream = _typed(body, "stream", bool) or False
    max_tokens, max_tokens_param = _max_tokens(body, chat)
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_top_p(body), top_k=_top_k(body),
        seed=_seed(body), stop=_stop(body.get("stop")), stream=stream,
        include_usage=_stream_options(body.get("stream_options"), stream),
        return_token_ids=_typed(body, "return_token_ids", bool) or False)


def _check_fields(body: dict, known: set, ignored: dict) -> None:
    for name in body:
        if name not in known and name not in ignored:
            raise invalid(f"unrecognized request argument supplied: {_shown(name)}", _param(name), "unknown_parameter")
    bad = check_ignored(body, ignored)
    if bad is not None:
        name, accepted = bad
        raise invalid(f"{name}={_shown(body[name])} is not supported by this server (accepted: {accepted})", name,
                      "unsupported_parameter")


# -- prompts ---------------------------------------------------------------------------------------
def _messages(messages) -> list[dict]:
    if not isinstance(messages, list):
        raise invalid(f"messages must be a list of chat messages, got {_kind(messages)}", "messages")
    if not messages:
        raise invalid("messages must hold at least one message", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"{where} must be an object with 'role' and 'content', got {_kind(m)}", where)
    for key, value in m.items():
        if key in ("tool_calls", "function_call", "audio", "refusal"):
            if value not in (None, []):
                raise invalid(f"{where}.{key} is not supported by this server (text messages only)", f"{where}.{key}")
        elif key not in ("role", "content", "name"):
            raise invalid(f"{where} has an unrecognized field {_shown(key)}", f"{where}.{_param(key)}")
    role = m.get("role")
    if role not in ROLES:
        known = "'system', 'developer', 'user' or 'assistant'"
        raise invalid(f"{where}.role must be {known} (tool messages are not supported), got {_shown(role)}",
                      f"{where}.role")
    if "name" in m and not isinstance(m["name"], str):
        raise invalid(f"{where}.name must be a string, got {_kind(m['name'])}", f"{where}.name")
    return {"role": ROLES[role], "content": _content(m.get("content"), f"{where}.content")}


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined); images and audio are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts, got {_kind(content)}", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}] must be a text part {{'type': 'text', 'text': '...'}} (this server reads "
                          f"text only)", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _prompt(prompt):
    """Text, or token ids; a list holding one of them is that one (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("one prompt per request is supported (send the prompts as separate requests)", "prompt")
    raise invalid(f"prompt must be a non-empty string or a non-empty list of token ids, got {_kind(prompt)}",
                  "prompt")


# -- sampling and output fields --------------------------------------------------------------------
def _typed(body: dict, name: str, kind: type):
    v = body.get(name)
    if v is not None and type(v) is not kind:
        raise invalid(f"{name} must be {'a boolean' if kind is bool else 'an integer'}, got {_kind(v)}", name)
    return v


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) not in (int, float) or (type(v) is float and not math.isfinite(v)):
        raise invalid(f"{name} must be a number, got {_kind(v)}", name)
    if not lo <= v <= hi:
        raise invalid(f"{name} must be between {lo:g} and {hi:g}, got {v}", name)
    return float(v)


def _top_p(body: dict) -> float | None:
    v = _number(body, "top_p", 0.0, 1.0)
    if v == 0.0:
        raise invalid("top_p must be above 0 (use temperature 0 for greedy decoding)", "top_p")
    return v


def _top_k(body: dict) -> int | None:
    v = _typed(body, "top_k", int)
    if v is not None and v < -1:
        raise invalid(f"top_k must be >= 0 (0 or -1: off), got {v}", "top_k")
    return None if v is None else max(v, 0)


def _max_tokens(body: dict, chat: bool) -> tuple[int | None, str]:
    """The answer's length limit, if given, and the field it came in."""
    names = ["max_completion_tokens", "max_tokens"] if chat else ["max_tokens"]
    given = {n: _typed(body, n, int) for n in names if body.get(n) is not None}
    if len(set(given.values())) > 1:
        raise invalid("max_tokens and max_completion_tokens disagree; give one of them", "max_completion_tokens")
    for name, v in given.items():
        if v < 1:
            raise invalid(f"{name} must be at least 1, got {v}", name)
        return v, name
    return None, "max_tokens"


def _seed(body: dict) -> int | None:
    v = _typed(body, "seed", int)
    if v is not None and not SEED_RANGE[0] <= v <= SEED_RANGE[1]:
        raise invalid(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {v}", "seed")
    return v


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(f"stop must be a string or a list of strings, got {_kind(stop)}", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if not all(stops):
        raise invalid("stop strings must not be empty", "stop")
    return tuple(stops)


def _n(n) -> None:
    if n is None:
        return
    if type(n) is not int:
        raise invalid(f"n must be an integer, got {_kind(n)}", "n")
    if n != 1:
        raise invalid(f"n={n} is not supported: this server returns one choice per request (n=1)", "n",
                      "unsupported_parameter")


def _stream_options(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise invalid(f"stream_options must be an object, got {_kind(options)}", "stream_options")
    for key in options:
        if key != "include_usage":
            raise invalid(f"stream_options has an unrecognized field {_shown(key)} (known: include_usage)",
                          "stream_options")
    return bool(_typed(options, "include_usage", bool))


# -- messages about values -------------------------------------------------------------------------
def _kind(v) -> str:
    """A JSON value's type in JSON's words, with a short rendering of the value."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    kind = names.get(type(v), type(v).__name__)
    return kind if isinstance(v, (list, dict, type(None))) else f"{kind} ({_shown(v)})"


def _shown(v) -> str:
    s = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _param(name: str) -> str:
    return name if len(name) <= 40 else name[:37] + "..."


def _short(e: Exception) -> str:
    s = str(e) or type(e).__name__
    return s if len(s) <= 120 else s[:117] + "..."
