#!/usr/bin/env python3
"""Time to first token of a fresh server: starts `dflash serve`, then sends one request at a time
with a prompt of N random token ids (a new prompt each time: no prefix-cache hits) and
max_tokens 1, and prints each request's latency (prefill + one token) and prompt tokens/s, the
first request against the median of the later ones. --json writes the rows with settings.

Usage:
  python3 tools/bench_ttft.py --dflash build/dflash --server-args "--model DIR" \\
      --prompt-tokens 512,4096 --requests 6 [--json out.json]
"""
import argparse
import http.client
import http.server
import json
import os
import random
import shlex
import statistics
import sys
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Server  # noqa: E402


def complete(server, ids):
    u = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    body = {"model": server.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    res = conn.getresponse()
    text = res.read().decode()
    elapsed = time.perf_counter() - t0
    conn.close()
    if res.status != 200:
        raise RuntimeError(f"HTTP {res.status}: {text}")
    usage = json.loads(text)["usage"]
    if usage["prompt_tokens"] != len(ids):
        raise RuntimeError(f"the server counted {usage['prompt_tokens']} prompt tokens, sent {len(ids)}")
    return elapsed


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers a completion request with its prompt count (the client's warm-up)."""

    def do_POST(self):
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        body = json.dumps({"usage": {"prompt_tokens": len(ids)}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def warm_client():
    """One exchange with a stdlib server in this process before any dflash server starts: this
    process's first HTTP exchange costs it about 2 ms more than later ones (the first prompt size
    measured 1.16-1.18 first/later at 300 tokens, 1.02-1.04 as the second size), which is the
    client's, not the server's."""
    local = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=local.serve_forever, daemon=True).start()
    fake = argparse.Namespace(url=f"http://127.0.0.1:{local.server_address[1]}", model="warm-up")
    complete(fake, list(range(100)))
    local.shutdown()
    local.server_close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--prompt-tokens", default="512")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=150000, help="token ids are drawn from [100, vocab)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(7)
    warm_client()
    rows = []
    for n in [int(x) for x in a.prompt_tokens.split(",")]:
        t0 = time.monotonic()
        server = Server(a.dflash, shlex.split(a.server_args))
        start_s = time.monotonic() - t0  # load, warm-up, until it listens
        try:
            lat = [complete(server, [rng.randrange(100, a.vocab) for _ in range(n)]) for _ in range(a.requests)]
        finally:
            server.stop()
        later = statistics.median(lat[1:]) if len(lat) > 1 else lat[0]
        row = {"prompt_tokens": n, "latency_ms": [round(x * 1e3, 2) for x in lat],
               "first_ms": round(lat[0] * 1e3, 2), "later_median_ms": round(later * 1e3, 2),
               "first_over_later": round(lat[0] / later, 3), "later_tokens_per_s": round(n / later, 1),
               "server_start_s": round(start_s, 2)}
        rows.append(row)
        print(f"prompt {n:6d}: first {row['first_ms']:9.2f} ms, later (median) {row['later_median_ms']:9.2f} ms "
              f"({row['later_tokens_per_s']:.0f} tokens/s), first/later {row['first_over_later']:.3f}; "
              f"all {row['latency_ms']}; server started in {row['server_start_s']:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
