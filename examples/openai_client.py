"""Talk to `python -m selfspec serve` with the official OpenAI client: one answer whole, one streamed.

    python -m selfspec serve &                          # the default model on http://127.0.0.1:8000
    python examples/openai_client.py [--url http://127.0.0.1:8000/v1] [--api-key KEY]

The server speaks OpenAI's chat and text completions; beside OpenAI's fields each answer carries
`selfspec` (tau, rounds, forwards, the layouts chosen, tokens per second, time to first token).
A model without a chat template (the 9M model) is asked through the text endpoint instead.
"""

import argparse
import os

import openai


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY", "none"), help="the server's --api-key")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url, api_key=a.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    try:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
        print(r.choices[0].message.content)
        chat = True
    except openai.BadRequestError as e:  # no chat template: a text prompt instead
        if e.code != "no_chat_template":
            raise
        r = client.completions.create(model=model, prompt="def reverse(s):\n", max_tokens=64, temperature=0)
        print(r.choices[0].text)
        chat = False
    print(f"-- {r.usage.completion_tokens} tokens, tau {r.selfspec['tau']}, {r.selfspec['tokens_per_second']} tok/s, "
          f"layouts {r.selfspec['plan_hist']}")

    print("\n-- streamed:")
    if chat:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=64, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
    else:
        stream = client.completions.create(model=model, prompt="class Stack:\n", max_tokens=64, stream=True,
                                           stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].text, end="", flush=True)
    print(f"\n-- {chunk.usage.completion_tokens} tokens")


if __name__ == "__main__":
    main()
