"""The checkpoint: config schema, model, draft LoRA, tokenizer, conversion, version and file checks."""
