"""A conversation of several turns through `python -m selfspec serve`: each turn sends the whole
history again (as every OpenAI client does), and the server copies the part an earlier answer left
in its cache instead of prefilling it. Prints each turn's prompt tokens, time to first token and
prefill forwards (the server's `selfspec` field).

    python -m selfspec serve &                          # the default model on http://127.0.0.1:8000
    python examples/chat_turns_client.py [--url http://127.0.0.1:8000/v1] [--file selfspec/streaming.py]

The first turn pastes `--file` (default: this example) and asks about it; the next ones ask
follow-up questions. Their first tokens come sooner than the first turn's although their prompts
are longer: only the new message is prefilled (the exact weight formats, a server with
`--max-batch` 2 or more; docs/serving.md).
"""

import argparse
import os

import openai

QUESTIONS = ["What does this file do? Answer in two sentences.", "Which function would you test first, and why?",
             "Say that again in one sentence."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY", "none"), help="the server's --api-key")
    ap.add_argument("--file", default=__file__, help="the text the conversation is about")
    ap.add_argument("--max-chars", type=int, default=3000, help="of --file, its start")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url, api_key=a.api_key)
    model = client.models.list().data[0].id
    with open(a.file, encoding="utf-8") as f:
        text = f.read()[: a.max_chars]
    messages = [{"role": "system", "content": "You are a careful Python expert."}]
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": (f"```\n{text}\n```\n\n" if i == 0 else "") + question})
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
        answer = r.choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        s = r.selfspec
        print(f"-- turn {i + 1}: {r.usage.prompt_tokens} prompt tokens, first token after "
              f"{s['time_to_first_token']} s, {s['prefill_forwards']} prefill forward(s)")
        print(answer.strip(), "\n")


if __name__ == "__main__":
    main()
