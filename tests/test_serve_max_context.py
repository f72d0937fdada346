"""`serve --max-context N`: the KV cache is planned for `--max-batch` rows of N tokens (prompt +
answer) and refused at startup, in one line naming the bytes needed and available, when it does not
fit; a request longer than N is a 400 `context_length_exceeded` naming N."""

import pytest

from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.request.request import ROUND_SCRATCH, scratch
from selfspec.tools.serve_cli import memory_line, memory_plan, server_memory

from conftest import SHIPPED, tiny_model

MiB = 2**20


def test_max_context_plans_every_row_at_that_length_and_the_line_says_so():
    p = memory_plan(1000, 4, 1100, 300, ceiling=1 << 40, available=None, max_context=1000)
    assert (p.context, p.per_row, p.total, p.max_context) == (1100, 1_100_000, 4_400_000, 1000)
    line = memory_line(p)
    assert "1,000 bytes per token" in line and "per row of 1,000 tokens (--max-context; 1,100 cache slots)" in line
    assert "4.2 MiB for 4 rows" in line
    # without it, the longest request is the model's context (clipped by the ceiling), as before
    assert memory_plan(1000, 4, 2048, 300, ceiling=4_000_000, available=None).context == 1000


def test_a_max_context_plan_over_the_available_memory_is_refused_naming_needed_and_available():
    memory_plan(1000, 4, 1100, 300, ceiling=1 << 40, available=4_400_000, max_context=1000)  # exactly fits
    with pytest.raises(ValueError) as e:
        memory_plan(1000, 4, 1100, 300, ceiling=1 << 40, available=4_400_000 - 1, max_context=1000)
    msg = str(e.value)
    assert "--max-batch 4 rows x --max-context 1,000 tokens" in msg and "1,000 bytes of KV cache per token" in msg
    assert "= 4.2 MiB needed, more than the 4.2 MiB of memory available" in msg
    assert "at most 3 rows of 1,000 tokens fit" in msg and "--max-context (at most 999 tokens for 4 rows)" in msg


def test_a_max_context_plan_over_the_ceiling_is_refused_not_clipped():
    with pytest.raises(ValueError) as e:  # without --max-context this plan would clip the context to fit
        memory_plan(1000, 4, 1100, 300, ceiling=4_000_000, available=1 << 40, max_context=1000)
    msg = str(e.value)
    assert "4.2 MiB needed, more than the engine's ceiling of 3.8 MiB (1,048,576.0 MiB available)" in msg
    with pytest.raises(ValueError, match="no row of 1,000 tokens fits"):
        memory_plan(1000, 4, 1100, 300, ceiling=1 << 40, available=500_000, max_context=1000)


def test_the_servers_max_context_plan_is_the_rows_capacity_and_stays_within_the_model():
    m = tiny_model()  # 256 positions
    cfg = DecodeConfig(mode="lookup")
    p = server_memory(m, cfg, 3, 16, max_context=100)
    assert p.max_context == 100 and p.context == 100 + min(scratch(cfg), ROUND_SCRATCH) + 1 and p.rows == 3
    with pytest.raises(ValueError, match="--max-context 250 is over the model's context: max_position_embeddings 256"):
        server_memory(m, cfg, 3, 16, max_context=250)


def test_serve_refuses_a_max_context_that_does_not_fit_in_one_line_before_it_binds(monkeypatch, capsys):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from selfspec.tools.cli import main

    monkeypatch.setattr("selfspec.tools.serve_cli.available_memory", lambda device: 64 * MiB)
    assert main(["serve", "--model", SHIPPED, "--mode", "lookup", "--max-batch", "8", "--max-context", "4000",
                 "--port", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "--max-batch 8 rows x --max-context 4,000 tokens" in lines[0]
    assert "MiB needed, more than the 64.0 MiB of memory available" in lines[0] and "serving" not in err
    assert main(["serve", "--model", SHIPPED, "--max-context", "1"]) == 2
    assert "--max-context must be >= 2" in capsys.readouterr().err


# -- the API ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from test_server import LiveServer, TemplatedTokenizer

    import os

    import selfspec

    model, _ = selfspec.load("pystdlib-nld-9m", weights="fp32", progress=False)
    srv = LiveServer(model, TemplatedTokenizer(os.path.join(SHIPPED, "tokenizer.model")), max_batch=2, max_queue=2,
                     max_context=64)
    yield srv
    srv.close()


def _post(server, path, body):
    import httpx

    return httpx.post(server.url + path, json={"model": "pystdlib-nld-9m", **body}, timeout=60)


@pytest.mark.parametrize("body, param", [({"prompt": [5] * 60, "max_tokens": 10}, "max_tokens"),
                                         ({"prompt": [5] * 64}, "prompt"),
                                         ({"prompt": [5] * 55, "max_tokens": 10}, "max_tokens")])
def test_a_request_longer_than_max_context_is_a_400_naming_it(server, body, param):
    """The param is the field that is over: max_tokens where the prompt alone fits."""
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert "maximum context is 64 tokens per request" in err["message"] and "--max-context" in err["message"]


def test_a_chat_over_max_context_names_messages(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 80}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_requests_within_max_context_are_served_and_a_default_length_shrinks_to_fit(server):
    r = _post(server, "/v1/completions", {"prompt": [5] * 54, "max_tokens": 10, "temperature": 0})  # exactly 64
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"prompt": [5] * 60, "temperature": 0})  # default 12 tokens: 4 fit
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def test_a_service_whose_max_context_passes_the_models_context_is_refused():
    from selfspec.serving.openai_api.service import Service, ServiceOptions

    with pytest.raises(ValueError, match="max_context 300 is over the model's context"):
        Service(tiny_model(), None, DecodeConfig(mode="ar"), ServiceOptions(model_id="m", max_context=300))
    with pytest.raises(ValueError, match="max_context must be an integer >= 2"):
        ServiceOptions(model_id="m", max_context=1)
