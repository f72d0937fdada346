"""Load on `python -m selfspec serve`: concurrent streaming clients against the same requests in a row.

    python benchmarks/serve_load.py                                   # starts a server: default model, plan auto
    python benchmarks/serve_load.py --model pystdlib-nld-9m --mode lookup --clients 2 --max-tokens 8   # a smoke run
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --api-key KEY       # a server already running

First, before it starts the server, the same requests run one after another through
`selfspec.generate` in this process on its main thread (the in-process baseline row; skipped with
--url or --no-baseline). For each client count C (default 1, 4, 16) it sends C streaming requests (`--max-tokens` each,
greedy, prompts from the model's `prompts.jsonl`) at once, then the same C requests one after
another, and reports for both: total tokens per second (tokens / wall time), time to first token
and inter-token latency (p50 / p95; a chunk of k tokens counts k gaps of its delay / k) and the
requests lost (errors, or streams that ended without a finish reason; must be 0). Bounded: at
most `--clients` requests at a time, `--timeout` seconds per request and `--budget` seconds in
all; loopback only (a --url elsewhere is refused). Prints one JSON record with the command.
A server it started is stopped with SIGTERM, and its exit code is reported (0 expected).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def load_prompts(names, chat: bool) -> list[tuple[str, dict]]:
    """(endpoint, body) pairs from the first prompts.jsonl found: in a checkpoint folder given as
    the model, else in this repository's models/<name>/ (chat records only when the server has a
    chat template)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
    paths = [os.path.join(n, "prompts.jsonl") for n in names if n and os.path.isdir(n)]
    paths += [os.path.join(here, os.path.basename(os.path.normpath(n)), "prompts.jsonl") for n in names if n]
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        raise SystemExit(f"error: no prompts.jsonl for {names}")
    bodies = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "prompt" in rec:
                bodies.append(("/v1/completions", {"prompt": rec["prompt"]}))
            elif chat and "messages" in rec:
                bodies.append(("/v1/chat/completions", {"messages": rec["messages"]}))
    if not bodies:
        raise SystemExit(f"error: no usable prompts in {path}")
    return bodies


def has_chat_template(url, headers, model_id) -> bool:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120).status_code == 200


def one_request(http, path, body, timeout) -> dict:
    """Stream one request; its token count, time to first token, inter-token gaps, and whether it finished."""
    t0 = time.perf_counter()
    out = {"tokens": 0, "ttft": None, "gaps": [], "finished": False, "error": None}
    last = None
    try:
        with http.stream("POST", path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"].get("message")
                    continue
                for c in chunk.get("choices", []):
                    n = len(c.get("token_ids") or [])
                    now = time.perf_counter()
                    if n:
                        if last is None:
                            out["ttft"] = now - t0
                        else:
                            out["gaps"] += [(now - last) / n] * n
                        last, out["tokens"] = now, out["tokens"] + n
                    out["finished"] = out["finished"] or c.get("finish_reason") is not None
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_phase(url, headers, jobs, concurrent: bool, timeout) -> dict:
    results = [None] * len(jobs)
    with httpx.Client(base_url=url, headers=headers, limits=httpx.Limits(max_connections=len(jobs))) as http:
        def work(i):
            results[i] = one_request(http, jobs[i][0], jobs[i][1], timeout)

        t0 = time.perf_counter()
        if concurrent:
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i in range(len(jobs)):
                work(i)
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    lost = [r["error"] or "no finish reason" for r in results if r["error"] or not r["finished"]]
    return {"requests": len(jobs), "tokens": tokens, "wall_seconds": round(wall, 3),
            "tokens_per_second": round(tokens / wall, 2) if wall else None,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "itl_p50": percentile(gaps, 0.5), "itl_p95": percentile(gaps, 0.95),
            "lost": len(lost), "lost_reasons": lost[:5]}


def in_process(a, bodies, n: int) -> dict:
    """The first n requests through `selfspec.generate`, one after another, on this main thread:
    what a served request is measured against (same model, weights, layout, greedy, max tokens)."""
    import selfspec

    model, tok = selfspec.load(a.model, weights=a.weights, progress=False)
    layout = {k: getattr(a, k) for k in ("mode", "plan") if getattr(a, k) is not None}
    if not getattr(tok, "chat_template", None):  # as the server: chat records only with a template
        bodies = [(path, b) for path, b in bodies if "prompt" in b]
    prompts = [b.get("prompt", b.get("messages")) for _, b in (bodies[i % len(bodies)] for i in range(n))]
    selfspec.generate(model, tok, prompts[0], max_new_tokens=8, **layout)  # warm-up (and the cost model)
    tokens, t0 = 0, time.perf_counter()
    for p in prompts:
        tokens += len(selfspec.generate(model, tok, p, max_new_tokens=a.max_tokens, **layout).token_ids)
    wall = time.perf_counter() - t0
    del model
    return {"requests": n, "tokens": tokens, "wall_seconds": round(wall, 3), "tokens_per_second": round(tokens / wall, 2)}


def start_server(a, port):
    cmd = [sys.executable, "-m", "selfspec", "serve", "--port", str(port), "--max-batch", str(max(a.clients)),
           "--max-queue", str(max(a.clients)), "--log-level", "warning"]
    for flag in ("model", "weights", "mode", "plan", "stream_interval_ms"):
        if getattr(a, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", getattr(a, flag)]
    proc = subprocess.Popen(cmd)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + a.startup_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with {proc.returncode} before it answered")
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"error: the server did not answer /health within {a.startup_timeout} s")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, cmd
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server on this machine (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY"))
    ap.add_argument("--model", default=None, help="model to serve (default: the default model)")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--mode", default=None, help="force a layout (default: plan auto)")
    ap.add_argument("--plan", default=None)
    ap.add_argument("--stream-interval-ms", default=None, help="the started server's (default: its own, 10)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request")
    ap.add_argument("--no-baseline", action="store_true", help="skip the in-process generate baseline")
    ap.add_argument("--budget", type=float, default=1800, help="seconds for the whole run; later phases are skipped")
    ap.add_argument("--startup-timeout", type=float, default=600, help="seconds for a started server to come up")
    a = ap.parse_args()
    if a.url and urlparse(a.url).hostname not in LOOPBACK:
        raise SystemExit("error: --url must be a loopback address (this load test never leaves the machine)")
    if not all(1 <= c <= 64 for c in a.clients) or not 1 <= a.max_tokens <= 4096:
        raise SystemExit("error: --clients must be in 1 .. 64 and --max-tokens in 1 .. 4096")
    return a


def main() -> None:
    a = parse_args()
    t_start = time.time()
    proc, server_cmd, baseline = None, None, None
    if a.url is None and not a.no_baseline:  # before the server exists: nothing else runs
        names = [a.model, os.environ.get("SELFSPEC_MODEL"), "smollm2-135m-instruct"]
        baseline = in_process(a, load_prompts(names, chat=True), max(a.clients))
    if a.url is None:
        proc, url, server_cmd = start_server(a, free_port())
    else:
        url = a.url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        model_id = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        names = [a.model, model_id, os.environ.get("SELFSPEC_MODEL"), "smollm2-135m-instruct"]
        bodies = load_prompts(names, has_chat_template(url, headers, model_id))
        extra = {"model": model_id, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
                 "return_token_ids": True}
        run_phase(url, headers, [(bodies[0][0], {**bodies[0][1], **extra})], False, a.timeout)  # warm-up
        results = []
        for c in a.clients:
            if time.time() - t_start > a.budget:
                results.append({"clients": c, "skipped": "over --budget"})
                continue
            jobs = [(p, {**b, **extra}) for p, b in (bodies[i % len(bodies)] for i in range(c))]
            conc = run_phase(url, headers, jobs, True, a.timeout)
            seq = run_phase(url, headers, jobs, False, a.timeout)
            speedup = conc["tokens_per_second"] / seq["tokens_per_second"] if seq["tokens_per_second"] else None
            row = {"clients": c, "concurrent": conc, "sequential": seq,
                   "speedup": None if speedup is None else round(speedup, 3)}
            if baseline and baseline["tokens_per_second"]:
                # the same requests in a row, served, against generate in-process; and c at once against them
                first = baseline["tokens_per_second"]
                row["sequential_vs_in_process"] = round(seq["tokens_per_second"] / first, 3)
                row["concurrent_vs_in_process"] = round(conc["tokens_per_second"] / first, 3)
            results.append(row)
    finally:
        exit_code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "server_command":
                      server_cmd and " ".join(server_cmd[1:]), "url": url, "max_tokens": a.max_tokens,
                      "in_process_generate": baseline, "results": results, "server_exit_code": exit_code, "seconds": round(time.time() - t_start, 1)},
                     indent=2))


if __name__ == "__main__":
    main()
