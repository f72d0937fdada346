"""Turns: rows leave, prompts enter (prefill), one round runs."""
