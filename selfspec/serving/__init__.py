"""Bridges to serving engines: tree tensors in the EAGLE / SGLang format, and a vLLM plugin."""
