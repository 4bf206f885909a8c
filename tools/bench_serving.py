#!/usr/bin/env python3
"""Serving sweep: starts `dflash serve` twice (baseline --speculative none, and
DFlash), sends a prompt set at each concurrency with streaming requests, and
prints concurrency x {baseline, dflash} x {output tok/s, TTFT (mean, largest),
TPOT, tau, speedup}, like SGLang's DFlash sweep; --json writes the rows with
settings, each request's start / first token / end, and the server's counters
over each sweep.
Python's standard library only, so it runs wherever dflash runs.

Usage:
  python3 tools/bench_serving.py --dflash build/dflash --data bench/data/humaneval.jsonl \\
      --n 32 --concurrency 1,4,16 --max-tokens 128 [--mode completion|chat] \\
      [--temperature T --top-k K] [--server-args "--model DIR --draft DIR"] [--json out.json]

Prompt sets are JSONL rows with "turns" (the first turn is used). completion
mode sends the code inside the turn's ``` fence (or the whole turn) to
/v1/completions; chat mode sends the turn as a user message. tau comes from the
server's /metrics (acceptance-length histogram) over each sweep.
"""
import argparse
import http.client
import json
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request


def load_prompts(path, n, mode):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            turn = json.loads(line)["turns"][0]
            if mode == "completion":
                m = re.search(r"```(?:python)?\n([\s\S]*?)```", turn)
                turn = m.group(1) if m else turn
            out.append(turn)
            if len(out) == n:
                break
    return out


class Server:
    def __init__(self, binary, args):
        self.proc = subprocess.Popen([binary, "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log = ""
        for line in self.proc.stdout:
            self.log += line
            m = re.search(r"'([^']+)' at (http://\S+)/v1", line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                break
        else:
            sys.exit(f"server exited with {self.proc.wait()}: {self.log}")
        # Keep draining its output so that it never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self):
        self.proc.terminate()
        self.proc.wait()

    def metrics(self):
        """The server's /metrics values by name: those without labels or with the model's alone."""
        text = urllib.request.urlopen(f"{self.url}/metrics").read().decode()
        out = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#"):
                name = parts[0].replace(f'{{model="{self.model}"}}', "")
                if "{" not in name:
                    out[name] = float(parts[1])
        return out


# Server counters whose change over a sweep goes into --json, to tell where a sweep's time went.
SWEEP_COUNTERS = ["dflash_engine_steps_total", "dflash_graph_steps_total", "dflash_dflash_steps_total",
                  "dflash_prompt_tokens_total", "dflash_generation_tokens_total",
                  "dflash_prefix_cache_hit_pages_total", "dflash_preemptions_total"]


def request(server, prompt, max_tokens, mode, sampling=None):
    """One streaming request: (completion tokens, TTFT s, TPOT s, start s, end s); start and end
    on time.perf_counter's clock. sampling: request fields (temperature, top_k), else the server's
    defaults."""
    chat = mode == "chat"
    body = {"model": server.model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    u = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        raise RuntimeError(f"HTTP {res.status}: {res.read().decode()}")
    first = last = 0.0
    usage = None
    for raw in res:  # SSE: one "data: {...}" line per event
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        j = json.loads(line[6:])
        if j.get("usage"):
            usage = j["usage"]
        c = j["choices"][0] if j["choices"] else None
        if c and (c.get("text") or (c.get("delta") or {}).get("content")):
            last = time.perf_counter()
            first = first or last
    conn.close()
    tokens = usage["completion_tokens"]
    return tokens, first - t0, (last - first) / (tokens - 1) if tokens > 1 else 0.0, t0, time.perf_counter()


def sweep_one(server, prompts, c, max_tokens, mode, sampling=None):
    acc0 = server.metrics()
    results, errors, lock = [], [], threading.Lock()
    queue = list(prompts)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            try:
                r = request(server, p, max_tokens, mode, sampling)
            except Exception as e:  # reported after the sweep
                with lock:
                    errors.append(str(e))
                return
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        sys.exit(f"requests failed: {errors[:3]}")
    acc1 = server.metrics()
    delta = lambda name: acc1.get(name, 0.0) - acc0.get(name, 0.0)
    tokens = sum(r[0] for r in results)
    steps = delta("dflash_acceptance_length_count")
    ttfts = sorted(1000 * r[1] for r in results)
    ms = lambda t: round(1000 * (t - t0), 2)
    return {"output_tok_s": tokens / wall, "ttft_ms": sum(ttfts) / len(ttfts),
            "ttft_ms_p50": ttfts[len(ttfts) // 2], "ttft_ms_max": ttfts[-1],
            "tpot_ms": 1000 * sum(r[2] for r in results) / len(results),
            "tau": delta("dflash_acceptance_length_sum") / steps if steps > 0 else 1.0, "tokens": tokens,
            "wall_s": wall, "server": {name: delta(name) for name in SWEEP_COUNTERS},
            # Each request in start order: [start, first token, end] in ms from the sweep's start, tokens.
            "requests": [[ms(r[3]), ms(r[3] + r[1]), ms(r[4]), r[0]] for r in sorted(results, key=lambda r: r[3])]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dflash", default="build/dflash")
    ap.add_argument("--data", default="bench/data/humaneval.jsonl")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=["completion", "chat"], default="completion")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--temperature", type=float, help="sampled requests at this temperature (default: the server's)")
    ap.add_argument("--top-k", type=int, help="the requests' top_k (default: the server's)")
    ap.add_argument("--json")
    a = ap.parse_args()
    sampling = {k: v for k, v in (("temperature", a.temperature), ("top_k", a.top_k)) if v is not None}
    conc = [int(x) for x in a.concurrency.split(",")]
    prompts = load_prompts(a.data, a.n, a.mode)
    rows = []
    for variant in ("baseline", "dflash"):
        args = shlex.split(a.server_args) + ["--max-num-seqs", str(max(conc))]
        if variant == "baseline":
            args += ["--speculative", "none"]
        server = Server(a.dflash, args)
        sys.stderr.write(server.log)
        try:
            request(server, prompts[0], 8, a.mode, sampling)  # warm-up
            for c in conc:
                r = sweep_one(server, prompts, c, a.max_tokens, a.mode, sampling)
                rows.append({"variant": variant, "concurrency": c, **r})
                sys.stderr.write(f"{variant} c={c}: {r['output_tok_s']:.1f} tok/s\n")
        finally:
            server.stop()
    print("concurrency | variant  | output tok/s | TTFT ms | TTFT max | TPOT ms | tau  | speedup")
    for c in conc:
        base = next(r for r in rows if r["variant"] == "baseline" and r["concurrency"] == c)
        for r in (x for x in rows if x["concurrency"] == c):
            r["speedup"] = r["output_tok_s"] / base["output_tok_s"]
            print(f"{c:>11} | {r['variant']:<8} | {r['output_tok_s']:>12.1f} | {r['ttft_ms']:>7.1f} | "
                  f"{r['ttft_ms_max']:>8.1f} | {r['tpot_ms']:>7.2f} | {r['tau']:.2f} | {r['speedup']:.2f}x")
    if a.json:
        settings = {"data": a.data, "n": a.n, "max_tokens": a.max_tokens, "mode": a.mode, "sampling": sampling,
                    "server_args": a.server_args, "concurrency": conc}
        with open(a.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
