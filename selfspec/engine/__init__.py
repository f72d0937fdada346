"""The engine: compact forward, KV cache, masks, the decoder, planner, calibration, cost profile, stats."""
