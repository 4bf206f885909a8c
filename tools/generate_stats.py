#!/usr/bin/env python3
"""One line of step statistics from `dflash generate --json` (read from stdin):
steps, tau, decode time, ms per step, generated tokens per second and the
decoding forwards run as CUDA-graph replays (and graph captures)."""
import json
import sys

r = json.load(sys.stdin)
t = r["timings_ms"]
steps = max(r["n_steps"], 1)
n = len(r["tokens"])
print(json.dumps({"tokens": n, "steps": r["n_steps"], "tau": round(r["tau"], 3), "decode_ms": round(t["decode"], 1),
                  "ms_per_step": round(t["decode"] / steps, 3), "draft_ms": round(t["draft"], 1),
                  "verify_ms": round(t["verify"], 1), "tok_s": round(n / (t["total"] / 1e3), 1),
                  "graph_replays": r.get("graph_replays", 0), "graph_captures": r.get("graph_captures", 0),
                  "graph_capture_ms": round(r.get("graph_capture_ms", 0), 1)}))
