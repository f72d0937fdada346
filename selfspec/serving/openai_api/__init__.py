"""An OpenAI-compatible HTTP server over the selfspec decoder (`python -m selfspec serve`).

    errors.py     OpenAI-shaped errors ({"error": {"message", "type", "param", "code"}})
    protocol.py   request bodies -> a checked `GenerationRequest` (every field typed and ranged)
    fields.py     the OpenAI fields this server accepts but does not implement, and their neutral values
    defaults.py   per-model defaults from the checkpoint's generation_config.json
    engine.py     the engine thread: one `Decoder`, turns, continuous batching, events to asyncio
    service.py    the asyncio side: admission (bounded queue), prompt encoding, draining
    responses.py  response and stream-chunk bodies (chat and text completions)
    app.py        the Starlette application: routes, API-key check, server-sent events
    run.py        uvicorn with a graceful drain on SIGTERM / Ctrl-C

Only `app.py` and `run.py` import Starlette / uvicorn (the `serve` extra); the rest is plain Python.
"""
