"""Memory you can plan: `serve` says the KV cache's bytes per token and per row at startup, and
refuses (one error line, before the cost model or any cache) a `--max-batch` whose rows cannot
hold a default request under the engine's ceiling, or whose cache would outgrow the machine."""

import subprocess
import sys

import pytest

from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.request.request import MAX_CACHE_BYTES
from selfspec.tools.serve_cli import memory_line, memory_plan, server_memory

from conftest import SHIPPED, tiny_model

MiB = 2**20


def test_the_plan_is_rows_times_the_longest_request_times_bytes_per_token():
    p = memory_plan(1000, 4, 2048, 300, ceiling=1 << 40, available=None)
    assert (p.per_token, p.per_row, p.total, p.context) == (1000, 2_048_000, 8_192_000, 2048)
    line = memory_line(p)
    assert "1,000 bytes per token" in line and "2.0 MiB per row of 2,048 tokens" in line and "unknown available" in line
    # the ceiling clips the longest request the server admits (its per-request check refuses longer ones)
    assert memory_plan(1000, 4, 2048, 300, ceiling=4_000_000, available=None).context == 1000


def test_rows_that_cannot_hold_a_default_request_under_the_ceiling_are_refused_with_the_numbers():
    memory_plan(1000, 4, 2048, 300, ceiling=4 * 300 * 1000, available=None)  # exactly fits
    with pytest.raises(ValueError) as e:
        memory_plan(1000, 4, 2048, 300, ceiling=4 * 300 * 1000 - 1, available=None)
    msg = str(e.value)
    assert "--max-batch 4 rows x 300 tokens" in msg and "1,000 bytes" in msg and "1.1 MiB" in msg
    assert "lower --max-batch (at most 3 rows fit) or --max-tokens" in msg


def test_a_cache_over_the_available_memory_is_refused_naming_needed_available_and_the_rows_that_fit():
    memory_plan(1000, 4, 2048, 300, ceiling=1 << 40, available=4 * 2048 * 1000)  # exactly fits
    with pytest.raises(ValueError) as e:
        memory_plan(1000, 4, 2048, 300, ceiling=1 << 40, available=4 * 2048 * 1000 - 1)
    msg = str(e.value)
    assert "7.8 MiB" in msg and "more than the 7.8 MiB of memory available" in msg
    assert "--max-batch 4 rows x 2,048 tokens" in msg and "at most 3 rows fit" in msg
    with pytest.raises(ValueError, match="not even one row"):
        memory_plan(1000, 4, 2048, 300, ceiling=1 << 40, available=1000 * 1000)


def test_the_servers_bytes_per_token_are_the_forwards_formula():
    from selfspec.engine.forward.batch_forward import BatchForward

    m = tiny_model()
    cfg = DecodeConfig(mode="lookup")
    p = server_memory(m, cfg, 3, 16)
    bf = BatchForward.of(m)
    assert p.per_token == bf.cache_bytes(1, 1) and p.rows == 3
    assert bf.cache_bytes(3, p.context) == p.total <= MAX_CACHE_BYTES
    assert p.context >= m.config.max_position_embeddings - 16  # the model's context, less the lookahead


def test_serve_refuses_a_max_batch_over_the_ceiling_in_one_line_before_it_binds():
    proc = subprocess.run([sys.executable, "-m", "selfspec", "serve", "--model", SHIPPED, "--mode", "lookup",
                           "--max-batch", "100000", "--port", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "--max-batch 100000 rows" in err[0] and "ceiling" in err[0] and "rows fit" in err[0]
    assert "serving" not in proc.stderr
