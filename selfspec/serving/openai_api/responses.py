"""Response bodies and stream chunks in OpenAI's shapes, for chat and text completions.

Beside OpenAI's fields every answer carries `selfspec`: what decoding measured (tau, rounds,
forwards, the layout histogram `plan_hist`, tokens per second, time to first token; see
`engine.stats.Stats`). Streams put it on the chunk that carries `finish_reason`. Usage: in every
non-streamed answer; in a stream, OpenAI's way with `stream_options.include_usage` (one last
chunk with empty `choices`, `usage: null` on the others), else on the finishing chunk.
"""

from __future__ import annotations

import time
import uuid

from selfspec.serving.openai_api.engine import Finished
from selfspec.serving.openai_api.protocol import GenerationRequest


class Shape:
    """One request's response: its id, creation time and model, and the bodies it sends."""

    def __init__(self, req: GenerationRequest, model_id: str):
        self.req, self.chat, self.model = req, req.kind == "chat", model_id
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(fin: Finished) -> dict:
        n = len(fin.token_ids)
        return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": n, "total_tokens": fin.prompt_tokens + n}

    @staticmethod
    def extension(fin: Finished, first_token_seconds: float | None) -> dict:
        ttft = None if first_token_seconds is None else round(first_token_seconds, 4)
        return {**fin.stats, "time_to_first_token": ttft}

    def full(self, text: str, fin: Finished, first_token_seconds: float | None) -> dict:
        """The whole answer (stream false)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=fin.reason)
        if self.req.return_token_ids:
            choice["token_ids"] = list(fin.token_ids)
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=[choice], usage=self.usage(fin), selfspec=self.extension(fin, first_token_seconds))
        return body

    def chunk(self, text: str | None = None, ids: list[int] | None = None, *, role: bool = False,
              fin: Finished | None = None, first_token_seconds: float | None = None) -> dict:
        """One stream chunk: the role (chat's first), a text delta, or the finishing chunk."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=None if fin is None else fin.reason)
        if self.req.return_token_ids and ids is not None:
            choice["token_ids"] = list(ids)
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        if fin is not None:
            if not self.req.include_usage:
                body["usage"] = self.usage(fin)
            body["selfspec"] = self.extension(fin, first_token_seconds)
        return body

    def usage_chunk(self, fin: Finished) -> dict:
        """stream_options.include_usage: the last chunk, usage and no choices."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=self.usage(fin))
        return body
