"""Serving: an OpenAI-compatible HTTP server over the decoder (`openai_api`, `python -m selfspec
serve`), and bridges to serving engines: tree tensors in the EAGLE / SGLang format, a vLLM plugin."""
