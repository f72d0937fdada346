"""`python -m selfspec bench serve`: `python -m selfspec serve` against in-process `generate`.

It starts a server on a free loopback port (`--max-batch` rows) and loads the same model in this
process, then per prompt, in mirrored order per repeat (A B C, C B A), runs each request in-process,
served whole and served streamed (greedy, `--max-new-tokens` each, one kept-alive connection, as
an SDK's): each row's tok/s and its ratio to in-process. Then, per `--clients` count C, C streamed
requests at once (C threads, one connection each): the served rows' total tok/s, time to first
token and between tokens (p50 / p95) and requests lost; `--join-tokens N`: the same again with a
prompt of ~N tokens joining the running streams. The server is stopped with SIGTERM and its exit
code kept.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from selfspec.tools.bench_common import check_out, read_rows_prompts, run_info

ROWS = ("in-process", "served", "served (stream)")


class Client:
    """One kept-alive HTTP connection to the server; a request's (new tokens, seconds, first-token seconds)."""

    def __init__(self, port: int, max_tokens: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.max_tokens = max_tokens

    def request(self, prompt, *, stream: bool, gaps: list | None = None, max_tokens: int | None = None,
                on_first=None) -> tuple[int, float, float | None]:
        """`gaps`: a streamed chunk of k tokens adds k gaps of its delay / k (the time between tokens)."""
        chat = not isinstance(prompt, str)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"messages" if chat else "prompt": prompt, "model": "bench", "temperature": 0, "stream": stream,
                "max_tokens": max_tokens or self.max_tokens, "return_token_ids": gaps is not None}
        t0, first, n, last = time.perf_counter(), None, 0, None
        self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"server answered {r.status}: {r.read()[:200]!r}")
        if not stream:
            n = json.loads(r.read())["usage"]["completion_tokens"]
            return n, time.perf_counter() - t0, None
        for line in r:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                if first is None and on_first is not None:
                    on_first()
                first = first or now
                chunk = json.loads(line[6:])
                n = (chunk.get("usage") or {}).get("completion_tokens", n)
                k = sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [])
                if gaps is not None and k:
                    if last is not None:
                        gaps.extend([(now - last) / k] * k)
                    last = now
        return n, time.perf_counter() - t0, None if first is None else first - t0

    def close(self):
        self.conn.close()


def long_text(tok, n_tokens: int) -> str:
    """About n_tokens of the long suite's text (its ~3,000-token prompts, joined), as a plain prompt."""
    from selfspec.tools.bench_prompts import read_suite

    text = "\n\n".join(m["content"] for p in read_suite("long") if p["length"] == "3k"
                       for m in (p["prompt"] if isinstance(p["prompt"], list) else [{"content": p["prompt"]}]))
    return tok.decode(tok.encode(text)[:n_tokens])


def start_server(a) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "selfspec", "serve", "--port", str(port), "--max-batch", str(a.max_batch),
           "--log-level", "warning", "--served-model-name", "bench"]
    for flag, v in (("--model", a.model), ("--weights", a.weights), ("--mode", a.mode)):
        cmd += [flag, v] if v else []
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise ValueError(f"the server did not come up ({' '.join(cmd)}; exit {proc.poll()})")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.3)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def concurrent(port, prompts, n_clients, max_tokens, join: str | None = None) -> dict:
    """n_clients streamed requests at once (prompts taken in turn): total tok/s, first-token times,
    the gaps between their tokens, lost requests. `join`: a long prompt sent once every client has
    its first token (a few tokens of answer); the row then says how it slowed the running streams."""
    got, lost, gaps, joined, firsts_seen = [], [], [], [], []
    all_started = threading.Event()

    def first_token():
        firsts_seen.append(1)  # list.append is atomic: the count of clients that have their first token
        if len(firsts_seen) == n_clients:
            all_started.set()

    def one(p):
        c = Client(port, max_tokens)
        try:
            mine = []
            got.append(c.request(p, stream=True, gaps=mine, on_first=first_token))
            gaps.extend(mine)
        except Exception as e:  # a lost request is counted, not raised: the row says how many
            lost.append(f"{type(e).__name__}: {e}")
            all_started.set()  # the long prompt waits for no client that failed
        finally:
            c.close()

    def joiner():
        all_started.wait(600)
        c = Client(port, max_tokens)
        try:
            joined.append(c.request(join, stream=True, max_tokens=4))
        except Exception as e:
            lost.append(f"joining prompt: {type(e).__name__}: {e}")
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(prompts[i % len(prompts)]["prompt"],)) for i in range(n_clients)]
    threads += [threading.Thread(target=joiner)] if join else []
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    firsts = [f for _, _, f in got if f is not None]
    tokens = sum(n for n, _, _ in got)
    row = {"label": f"served x{n_clients} concurrent (stream)" + (" + a long prompt joining" if join else ""),
           "mode": "served-join" if join else "served-concurrent", "temperature": 0.0, "clients": n_clients,
           "new_tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
           "ttft_p50_seconds": pct(firsts, 0.5), "ttft_p95_seconds": pct(firsts, 0.95),
           "itl_p50_seconds": pct(gaps, 0.5), "itl_p95_seconds": pct(gaps, 0.95), "lost": len(lost), "errors": lost[:3]}
    if join:
        row["join_ttft_seconds"] = joined[0][2] if joined else None
    return row


def sequential(a, model, tok, client, prompts) -> list[dict]:
    from selfspec.streaming import generate

    layout = {"mode": a.mode} if a.mode else {}
    runs = {"in-process": lambda p: (len(generate(model, tok, p, max_new_tokens=a.max_new_tokens, **layout).token_ids),),
            "served": lambda p: client.request(p, stream=False),
            "served (stream)": lambda p: client.request(p, stream=True)}
    totals = {k: [0, 0.0] for k in ROWS}
    for name in ROWS:  # warm-up (and plan auto's cost model, measured once per process)
        runs[name](prompts[0]["prompt"])
    for rep in range(a.repeats):
        for p in prompts:
            for name in (ROWS if rep % 2 == 0 else ROWS[::-1]):
                t0 = time.perf_counter()
                n = runs[name](p["prompt"])[0]
                totals[name][0] += n
                totals[name][1] += time.perf_counter() - t0
    base = totals["in-process"][0] / totals["in-process"][1]
    return [{"label": k, "mode": k, "temperature": 0.0, "new_tokens": n, "seconds": s, "tokens_per_second": n / s,
             "vs_in_process": n / s / base} for k, (n, s) in totals.items()]


def table(rows) -> str:
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
    lines = ["| row | tokens | seconds | tok/s | vs in-process | first token p50 / p95 s | between tokens p50 / p95 ms "
             "| long prompt's first token s | lost |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['new_tokens']} | {r['seconds']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{f(r.get('vs_in_process'))} | {f(r.get('ttft_p50_seconds'))} / {f(r.get('ttft_p95_seconds'))} | "
                     f"{ms(r.get('itl_p50_seconds'))} / {ms(r.get('itl_p95_seconds'))} | "
                     f"{f(r.get('join_ttft_seconds'))} | {r.get('lost', '-')} |")
    return "\n".join(lines)


def cmd_serve_bench(a) -> int:
    if a.repeats < 1 or a.max_new_tokens < 1 or a.max_batch < 1 or any(c < 1 for c in a.clients):
        raise ValueError("--repeats, --max-new-tokens, --max-batch and --clients take integers >= 1")
    if a.join_tokens < 0:
        raise ValueError(f"--join-tokens must be >= 0, got {a.join_tokens}")
    from selfspec.loading import load

    prompts, prompts_path = read_rows_prompts(a)
    out = check_out(a.out)
    t0 = time.time()
    model, tok = load(a.model, weights=a.weights, progress=False)
    proc, port = start_server(a)
    client = Client(port, a.max_new_tokens)
    try:
        rows = sequential(a, model, tok, client, prompts)
        rows += [concurrent(port, prompts, c, a.max_new_tokens) for c in a.clients]
        if a.join_tokens:
            rows.append(concurrent(port, prompts, max(a.clients or [4]), a.max_new_tokens, join=long_text(tok, a.join_tokens)))
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    text = table(rows)
    print(text)
    result = {**run_info(a, model, prompts_path, len(prompts)), "wall_seconds": round(time.time() - t0, 1),
              "server_exit_code": code, "rows": rows}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    return 0 if code == 0 and not any(r.get("lost") for r in rows) else 1


def add_serve_bench_parser(sub) -> None:
    from selfspec.tools.args import add_weights_args

    s = sub.add_parser("serve", help="the server against in-process generate, one at a time and under load")
    s.add_argument("--model", default=None, help="checkpoint directory or model name (default: the shipped model)")
    add_weights_args(s)
    s.add_argument("--mode", default=None, choices=["auto", "ar", "linear", "presto", "lookup"],
                   help="a fixed layout for both (default: plan auto)")
    s.add_argument("--prompts", default=None, help="JSONL prompt file (default: the model's prompts.jsonl)")
    s.add_argument("--limit", type=int, default=8, help="the first N prompts (default 8; 0 = all)")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=2, help="mirrored passes over the prompts (default 2)")
    s.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    s.add_argument("--clients", nargs="*", type=int, default=[4],
                   help="concurrent streamed requests, one row per count (default 4; none: --clients)")
    s.add_argument("--join-tokens", type=int, default=0,
                   help="then the largest --clients count again with a prompt of about this many tokens joining "
                        "once every stream has its first token: the streams' gaps between tokens (p50 / p95) "
                        "beside the row without it, and the long prompt's time to first token (default 0: off)")
    s.add_argument("--out", default=None, help="output folder (default bench_out/<time>)")
    s.set_defaults(func=cmd_serve_bench)
