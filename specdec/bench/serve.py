"""`specdec bench-serve`: a load generator for any OpenAI-compatible server (specdec serve, llama-server, vLLM).

For each client count N, N clients run concurrently, each sending its requests one after another (a closed loop,
as vLLM's benchmark_serving with max concurrency N): streamed chat completions (or completions) of -n tokens at
temperature 0, with `ignore_eos` (llama-server's and specdec's extension; `--no-ignore-eos` for servers without
it) so every request generates exactly -n tokens. Measured per request: time to first token (TTFT, from sending the
request to the first streamed text), time per output token after the first (TPOT = (t_last - t_first) / (tokens -
1)) and inter-token latency (ITL: the gaps between streamed chunks; a speculating server may send several tokens in
one chunk, so TPOT is the per-token comparison). Reported per client count: aggregate tok/s (all completion tokens
/ wall time of the measured phase), requests, p50 / p95 of TTFT, TPOT and ITL. One warm-up request precedes each
measured phase. Tokens are the server's usage counts (stream_options.include_usage) when it sends them, else the
number of streamed chunks with text.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field


def _httpx():
    """httpx's API: the `httpx2` package the openai client depends on here, else httpx."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (default http://127.0.0.1:8080;"
                                                                  " /v1 is added when missing)")
    p.add_argument("--clients", default="1,4,8", help="concurrent client counts to run, comma-separated "
                                                      "(default 1,4,8)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--requests", type=int, default=2, help="requests each client sends per level (default 2)")
    p.add_argument("--prompts", default=None, help="JSONL prompts (Spec-Bench question.jsonl or {\"prompt\": ...}; "
                                                   "default: a small built-in set)")
    p.add_argument("--category", default=None, help="only prompts of these categories (comma-separated)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token")
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"), help="chat (default) or "
                                                                                     "completions")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers without it)")
    p.add_argument("--extra", default=None, help="JSON object merged into every request body, e.g. "
                                                 "'{\"speculative\": {\"type\": \"ngram\"}}'")
    p.add_argument("--name", default=None, help="label of this server in the report (default: the URL)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--json", default=None, help="write every number to this JSON file")


@dataclass
class RequestResult:
    ttft: float  # seconds from sending to the first text
    elapsed: float  # seconds from sending to the end of the stream
    tokens: int
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between streamed text chunks
    text: str = ""
    elapsed_text: float = 0.0  # seconds from the first text to the last

    @property
    def tpot(self) -> float | None:
        return (self.elapsed_text / (self.tokens - 1)) if self.tokens > 1 else None


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def one_request(client, url: str, body: dict, headers: dict) -> RequestResult:
    """Send one streamed request and time its chunks."""
    t0 = time.perf_counter()
    first = last = None
    gaps, parts, usage_tokens, chunks = [], [], None, 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            detail = (await r.aread()).decode("utf-8", "replace")[:300]
            raise RuntimeError(f"{url} answered {r.status_code}: {detail}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"{url} failed mid-stream: {obj['error']}")
            if obj.get("usage"):
                usage_tokens = obj["usage"].get("completion_tokens")
            for c in obj.get("choices") or []:
                text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                if text:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    parts.append(text)
                    chunks += 1
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url} streamed no text")
    tokens = usage_tokens if usage_tokens else chunks
    return RequestResult(first - t0, end - t0, tokens, gaps, "".join(parts), last - first)


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def parse_extra(text: str | None) -> dict:
    """--extra's JSON object, or a one-line error that names the flag."""
    try:
        extra = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra is not JSON ({e.msg} at character {e.pos}): give an object like "
                         "'{\"temperature\": 0}'") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra must be a JSON object like '{\"temperature\": 0}'")
    return extra


async def run_level(url: str, clients: int, requests: int, prompts: list[str], args, model: str) -> dict:
    """N concurrent clients, `requests` each -> the level's aggregate numbers."""
    httpx = _httpx()
    endpoint = f"{base_url(url)}/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = parse_extra(args.extra)

    def body(prompt: str) -> dict:
        b = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temp, "stream": True,
             "stream_options": {"include_usage": True}, **extra}
        if not args.no_ignore_eos:
            b["ignore_eos"] = True
        if args.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        return b

    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        await one_request(client, endpoint, body(prompts[0]), headers)  # warm-up
        results: list[RequestResult] = []

        async def worker(i: int) -> None:
            for r in range(requests):
                results.append(await one_request(client, endpoint, body(prompts[(i * requests + r) % len(prompts)]),
                                                 headers))

        import asyncio

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results)
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    itl = [g for r in results for g in r.chunk_gaps]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p95_ms": _ms(_pct(ttft, 95)),
            "tpot_p50_ms": _ms(_pct(tpot, 50)), "tpot_p95_ms": _ms(_pct(tpot, 95)),
            "itl_p50_ms": _ms(_pct(itl, 50)), "itl_p95_ms": _ms(_pct(itl, 95)),
            "tokens_per_chunk": tokens / max(1, sum(len(r.chunk_gaps) + 1 for r in results)),
            "per_request": [asdict(r) | {"text": r.text[:80]} for r in results]}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


async def first_model(url: str, api_key: str | None) -> str:
    httpx = _httpx()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(f"{base_url(url)}/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def parse_clients(value: str) -> list[int]:
    try:
        counts = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--clients takes counts like 1,4,8, not '{value}'") from None
    if not counts or min(counts) < 1:
        raise ValueError("--clients counts must be >= 1")
    return counts


async def bench(url: str, args) -> dict:
    """Every client count against one server -> {name, url, model, levels: [...]}."""
    from .prompts import load_prompts

    prompts = [p.text for p in load_prompts(args.prompts, args.category, args.limit)]
    model = args.model or await first_model(url, args.api_key)
    levels = []
    for n in parse_clients(args.clients):
        level = await run_level(url, n, args.requests, prompts, args, model)
        levels.append(level)
        print(format_level(args.name or url, level), file=sys.stderr, flush=True)
    return {"name": args.name or url, "url": url, "model": model, "max_tokens": args.max_tokens,
            "endpoint": args.endpoint, "temperature": args.temp, "levels": levels}


HEADER = (f"{'server':<24} {'clients':>7} {'reqs':>5} {'tokens':>7} {'tok/s':>8} {'TTFT p50/p95 ms':>17} "
          f"{'TPOT p50/p95 ms':>17} {'ITL p50/p95 ms':>16} {'tok/chunk':>9}")


def format_level(name: str, lv: dict) -> str:
    def pair(a, b) -> str:
        return f"{a:.1f}/{b:.1f}" if a is not None and b is not None else "-"

    return (f"{name[:24]:<24} {lv['clients']:>7} {lv['requests']:>5} {lv['tokens']:>7} {lv['tok_s']:>8.1f} "
            f"{pair(lv['ttft_p50_ms'], lv['ttft_p95_ms']):>17} {pair(lv['tpot_p50_ms'], lv['tpot_p95_ms']):>17} "
            f"{pair(lv['itl_p50_ms'], lv['itl_p95_ms']):>16} {lv['tokens_per_chunk']:>9.2f}")


def cmd_bench_serve(args) -> int:
    if args.max_tokens < 1:
        raise ValueError("-n must be >= 1")
    if args.requests < 1:
        raise ValueError("--requests must be >= 1")
    parse_clients(args.clients)
    parse_extra(args.extra)  # before any request
    print(HEADER, file=sys.stderr)
    import asyncio  # here, not at the top: `specdec generate` builds this command's parser too

    try:
        report = asyncio.run(bench(args.url, args))
    except OSError as e:
        raise OSError(f"cannot reach {args.url}: {e}") from None
    except Exception as e:
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise OSError(f"cannot reach {args.url}: {type(e).__name__}: {e}") from None
        raise
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
