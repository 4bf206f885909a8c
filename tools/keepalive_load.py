#!/usr/bin/env python3
"""Keep-alive load on a running `dflash serve`: N clients, each with one kept-alive connection,
send small completion requests back to back for T seconds. Prints how many requests were
answered, how many clients got no answer while the load lasted (their first answer came after
T), and the latest first answer. A server that serves a connection on one thread for as long as
the client keeps it open, from a fixed pool, leaves the clients beyond the pool unanswered.
Python's standard library only.

Usage:
  python3 tools/keepalive_load.py --port PORT [--clients 200] [--seconds 20] [--max-tokens 4]
"""
import argparse
import http.client
import json
import threading
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=4)
    a = ap.parse_args()
    n, t_end = a.clients, a.seconds
    done, first, errors = [0] * n, [None] * n, [0] * n
    body = json.dumps({"prompt": "def f(x):", "max_tokens": a.max_tokens})
    t0 = time.time()

    def client(i):
        c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=120)
        while time.time() - t0 < t_end:
            try:
                c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                c.getresponse().read()
                done[i] += 1
                if first[i] is None:
                    first[i] = time.time() - t0
            except Exception:  # counted; a new connection for the next request
                errors[i] += 1
                c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=120)
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answered = [f for f in first if f is not None]
    late = sum(1 for f in answered if f > t_end)
    print(f"clients {n}, {t_end:.0f} s: requests answered {sum(done)}, errors {sum(errors)}, "
          f"clients with no answer during the load {late + n - len(answered)}, "
          f"latest first answer {max(answered):.1f} s, wall {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
