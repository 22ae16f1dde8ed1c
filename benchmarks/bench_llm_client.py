"""The OpenAI-compatible client's requests/s against the ideal of its concurrency bound, on a loopback server.

    python benchmarks/bench_llm_client.py [--n 4000] [--concurrency 64] [--median 0.3] [--sigma 0.75]
                                          [--invalid-rate 0.05] [--batch-size 256] [--modes window,batch] [--json PATH]

The server (``tests/fault_server.py``, in its own process) answers after a lognormal "model" latency: median
``--median`` seconds, log-space sigma ``--sigma`` (0.75: mean 1.33 x the median, p99 5.7 x), a pure function of the
request. ``--invalid-rate`` of the answers are not JSON, so they are asked again, as the tag stage does (up to 3
attempts). With C requests in flight all the time the client would do C / mean latency requests a second: the ideal.

window = ``atlas.llm.ask.ask_until_done``: the tag stage's loop, C requests in flight across all N (the client now)
batch  = the tag stage's loop before it: batches of ``--batch-size`` through ``engine.generate``, each batch and each
         retry round waiting for its slowest request. It uses only ``make_engine(...).generate``, so it also times
         an older Atlas: ``PYTHONPATH=/path/to/old/checkout python benchmarks/bench_llm_client.py --modes batch``
floor  = bare httpx: one ``asyncio.gather`` of the N first attempts under a semaphore of C, no checks, no retries:
         what any Python client on this machine gets, so that the machine's own overhead can be told apart

Prints, per mode, requests/s (retries included: every request the server answered), the ideal from the mean latency
the server really served, and their ratio (goal for window: >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _results import add_json_option, row, write_json

from atlas.config import LLMConfig
from atlas.llm.engine import LLMRequest, make_engine

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["tags"]}
MAX_ATTEMPTS = 3


def request(i: int, attempt: int, note: str | None) -> LLMRequest:
    user = f"Tag this text. Text {i}: river{i} bridge{i} granite{i} harbor{i}"
    if note:
        user += f"\n\nYour last answer was wrong ({note}). Answer with JSON only."
    return LLMRequest(key=f"item{i}#{attempt}", system="You tag texts.", user=user, schema=SCHEMA)


def check(attempt: int, result) -> str | None:
    """None when done (a JSON answer, or the last attempt), else what was wrong."""
    try:
        json.loads(result.text or "")
        return None
    except ValueError:
        return None if attempt == MAX_ATTEMPTS else "invalid_json"


def run_window(engine, n: int, batch_size: int) -> None:
    from atlas.llm.ask import ask_until_done  # not in older checkouts: those run --modes batch only

    ask_until_done(engine, None, n, lambda i, attempt, note: request(i, attempt, note),
                   lambda i, attempt, result: check(attempt, result), batch_size)


def run_batch(engine, n: int, batch_size: int) -> None:
    for start in range(0, n, batch_size):
        pending = {i: None for i in range(start, min(start + batch_size, n))}
        for attempt in range(1, MAX_ATTEMPTS + 1):
            results = engine.generate([request(i, attempt, note) for i, note in pending.items()])
            pending = {i: note for i, result in zip(list(pending), results)
                       if (note := check(attempt, result)) is not None}
            if not pending:
                break


def run_floor(base_url: str, n: int, concurrency: int) -> None:
    import asyncio

    import httpx

    async def main():
        semaphore = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
            async def one(i):
                r = request(i, 1, None)
                body = {"model": "bench", "max_tokens": 64, "messages": [{"role": "system", "content": r.system},
                        {"role": "user", "content": r.user}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
                async with semaphore:
                    (await client.post("/chat/completions", json=body)).json()

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(main())


def measure(mode: str, args) -> dict:
    """Start a fresh server (same latencies and faults for every mode), run one mode, read the server's counts."""
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fault_server.py"), "--mode", "mixed", "--faults", "invalid_json",
         "--fault-rate", str(args.invalid_rate), "--median", str(args.median), "--sigma", str(args.sigma),
         "--seed", str(args.seed)], stdout=subprocess.PIPE, text=True)
    try:
        base_url = server.stdout.readline().strip()
        engine = make_engine(LLMConfig(engine="openai", base_url=base_url, model="bench", api_key_env="",
                                       max_concurrency=args.concurrency, timeout_s=120, max_tokens=64))
        engine.setup()
        start = time.perf_counter()
        if mode == "floor":
            run_floor(base_url, args.n, args.concurrency)
        else:
            (run_window if mode == "window" else run_batch)(engine, args.n, args.batch_size)
        seconds = time.perf_counter() - start
        engine.close()
        with urllib.request.urlopen(f"{base_url}/stats") as response:
            stats = json.loads(response.read())
    finally:
        server.terminate()
        server.wait()
    mean = stats["latency_s"] / stats["requests"]
    rps, ideal = stats["requests"] / seconds, args.concurrency / mean
    return {"mode": mode, "seconds": seconds, "requests": stats["requests"], "mean_latency_s": mean, "rps": rps,
            "ideal_rps": ideal, "ratio": rps / ideal, "max_in_flight": stats["max_in_flight"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4000, help="items to ask about (retries come on top)")
    parser.add_argument("--concurrency", type=int, default=64, help="llm.max_concurrency")
    parser.add_argument("--median", type=float, default=0.3, help="median latency, seconds")
    parser.add_argument("--sigma", type=float, default=0.75, help="log-space sigma of the latency (the tail)")
    parser.add_argument("--invalid-rate", type=float, default=0.05, help="share of answers that are not JSON")
    parser.add_argument("--batch-size", type=int, default=256, help="tag.batch_size, for the batch mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="window,batch,floor",
                        help="window (the client now), batch (before), floor (bare httpx)")
    add_json_option(parser)
    args = parser.parse_args()

    results = [measure(mode, args) for mode in args.modes.split(",")]
    print(f"{args.n} items, max_concurrency {args.concurrency}, latency lognormal(median {args.median} s, "
          f"sigma {args.sigma}), {args.invalid_rate:.0%} invalid answers asked again, batch size {args.batch_size}")
    print(f"{'mode':8} {'requests':>8} {'seconds':>8} {'mean lat.':>9} {'req/s':>8} {'ideal':>8} {'ratio':>6} "
          f"{'max in flight':>13}")
    for r in results:
        print(f"{r['mode']:8} {r['requests']:8d} {r['seconds']:8.2f} {r['mean_latency_s']:9.3f} {r['rps']:8.1f} "
              f"{r['ideal_rps']:8.1f} {r['ratio']:6.2f} {r['max_in_flight']:13d}")
    rows = [row("llm_client", f"{r['mode']}: {args.n} items, C={args.concurrency}" +
                (f", batch {args.batch_size}" if r["mode"] == "batch" else ""),
                r["rps"], r["ideal_rps"], "req/s", "ideal C / mean latency",
                note={"window": "goal >= 0.9", "batch": "the batch barrier (the client before)",
                      "floor": "bare httpx, no checks or retries: this machine's own limit"}[r["mode"]])
            for r in results]
    by_mode = {r["mode"]: r for r in results}
    if {"window", "batch"} <= set(by_mode):
        rows.append(row("llm_client", "window vs batch barrier", by_mode["window"]["rps"], by_mode["batch"]["rps"],
                        "req/s", "batch barrier", note="speed-up of the rolling window"))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
