"""OpenAI request fields this server accepts without implementing them: each with the values that
mean "off" (accepted and ignored) and what a client is told otherwise.

Clients and SDK wrappers often send these fields with neutral values (`"logprobs": false`,
`"presence_penalty": 0`, `"tools": []`); refusing those would break them for nothing. A value
that asks for the feature (`"logprobs": true`, a tool list, a JSON schema) is refused with a 400
naming the field: silently ignoring it would hand back an answer that is not what was asked for.
A field OpenAI does not define is refused as unknown (as OpenAI does), so a typo never passes.
"""

from __future__ import annotations


def _none(v) -> bool:
    return v is None


def _zero(v) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _false(v) -> bool:
    return v is None or v is False


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


def _string(v) -> bool:
    return v is None or isinstance(v, str)


def _bool(v) -> bool:
    return v is None or isinstance(v, bool)


def _object(v) -> bool:
    return v is None or isinstance(v, dict)


def _no_tool_choice(v) -> bool:
    return v is None or v in ("none", "auto")


def _text_format(v) -> bool:
    return v is None or v == {"type": "text"}


def _text_modality(v) -> bool:
    return v is None or v == ["text"]


def _one(v) -> bool:
    return v is None or (type(v) is int and v == 1)


# field -> (accepted-value test, what is accepted, in words)
COMMON = {
    "frequency_penalty": (_zero, "0 or null"),
    "presence_penalty": (_zero, "0 or null"),
    "logit_bias": (_empty, "an empty object or null"),
    "user": (_string, "a string"),
    "metadata": (_object, "an object"),
    "store": (_false, "false or null"),
    "service_tier": (_string, "a string"),
    "prompt_cache_key": (_string, "a string"),
    "safety_identifier": (_string, "a string"),
}

CHAT = {
    **COMMON,
    "logprobs": (_false, "false or null: log-probabilities are not returned"),
    "top_logprobs": (_zero, "0 or null: log-probabilities are not returned"),
    "tools": (_empty, "an empty list or null: tool calls are not supported"),
    "tool_choice": (_no_tool_choice, "'none', 'auto' or null: tool calls are not supported"),
    "functions": (_empty, "an empty list or null: function calls are not supported"),
    "function_call": (_no_tool_choice, "'none', 'auto' or null: function calls are not supported"),
    "parallel_tool_calls": (_bool, "true, false or null (there are no tools)"),
    "response_format": (_text_format, "{'type': 'text'} or null: structured output is not supported"),
    "modalities": (_text_modality, "['text'] or null"),
    "audio": (_none, "null: audio output is not supported"),
    "prediction": (_none, "null: predicted outputs are not supported"),
    "reasoning_effort": (_none, "null"),
    "web_search_options": (_none, "null"),
    "verbosity": (_none, "null"),
}

COMPLETION = {
    **COMMON,
    "logprobs": (_none, "null: log-probabilities are not returned"),
    "echo": (_false, "false or null: the prompt is not echoed"),
    "best_of": (_one, "1 or null: one candidate per request"),
    "suffix": (_none, "null: insertion (suffix) is not supported"),
}


def check_ignored(body: dict, table: dict) -> tuple[str, str] | None:
    """The first field of `table` in `body` whose value asks for an unsupported feature, as
    `(field, what is accepted)`; None when every such field is neutral."""
    for name, (ok, accepted) in table.items():
        if name in body and not ok(body[name]):
            return name, accepted
    return None
