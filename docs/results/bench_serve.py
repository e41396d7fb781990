"""specdec serve against llama-server on the same model, side by side in one run, with `specdec bench-serve`'s load
generator (N concurrent streaming clients, closed loop, greedy, ignore_eos, -n tokens each): aggregate tok/s, time to
first token, time per output token and inter-token latency (p50 / p95) at each client count, and at 1 client the
server's decode speed (1000 / TPOT p50) beside `specdec generate`'s on the same prompts.

The servers run one at a time (never competing for the CPU), each with -np = the largest client count and the same
threads; llama-server gets -c = that many times the per-slot context (it splits -c among its slots) and requests
with "cache_prompt": false (specdec has no prompt cache; the prompts repeat across requests). The load generator
runs on the same machine, so the default threads leave it one core.

    LLAMA=../peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build-native/bin/llama-server
    python docs/results/bench_serve.py --llama-server $LLAMA
    python docs/results/bench_serve.py --llama-server PATH -m model.gguf --clients 1,4,8 -n 128 --requests 4 \\
        --spec mtp --json docs/results/serve-vs-llama.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdec.bench.prompts import load_prompts
from specdec.bench.serve import HEADER, add_arguments, bench, format_level


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    from specdec.bench.serve import _httpx

    httpx = _httpx()
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready (its log: "
                               f"{Path(tempfile.gettempdir())}/bench-serve-*.log; -4 = SIGILL: a build for another "
                               "CPU, e.g. AMX kernels where the VM does not enable AMX)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")
        time.sleep(0.25)


def run_server(name: str, cmd: list[str], port: int, args, extra: dict) -> dict:
    """Start one server, run every client count against it, stop it."""
    url = f"http://127.0.0.1:{port}"
    print(f"\n$ {' '.join(cmd)}", file=sys.stderr)
    log = open(Path(tempfile.gettempdir()) / f"bench-serve-{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc)
        ns = bench_args(args, name, extra)
        print(HEADER, file=sys.stderr)
        return asyncio.run(bench(url, ns)) | {"command": cmd}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def bench_args(args, name: str, extra: dict) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--clients", args.clients, "-n", str(args.max_tokens), "--requests", str(args.requests), "--name", name,
            "--extra", json.dumps(extra)]
    if args.prompts:
        argv += ["--prompts", args.prompts]
    if args.limit:
        argv += ["--limit", str(args.limit)]
    return p.parse_args(argv)


def generate_speed(args, model: str) -> dict:
    """`specdec generate` on the same prompts (chat template, greedy, -n tokens, EOS ignored): decode tok/s each."""
    speeds = []
    prompts = load_prompts(args.prompts, None, args.limit)[:args.generate_prompts]
    for p in prompts:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "specdec", "generate", "-m", model, "-p", p.text, "--chat", "-n",
                   str(args.max_tokens), "--temp", "0", "--ignore-eos", "-t", str(args.threads), "--json", f.name]
            if args.spec:
                cmd += ["--spec", args.spec]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            speeds.append(json.loads(Path(f.name).read_text())["stats"]["decode_tok_s"])
    return {"decode_tok_s": speeds, "median": statistics.median(speeds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="path to a llama-server binary")
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: specdec's default model)")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4, help="requests per client per level (default 4)")
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: specdec's built-in set)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("-t", "--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="threads for each server and for specdec generate (default: all cores but one, which "
                         "the load generator uses)")
    ap.add_argument("-c", "--ctx", type=int, default=2048, help="context per request / slot (default 2048)")
    ap.add_argument("--spec", default=None, help="specdec's --spec (default: its default, mtp on the default model)")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--spec-type ngram-simple'")
    ap.add_argument("--generate-prompts", type=int, default=3, help="prompts for the specdec generate reference")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from specdec.loader import resolve_model_path

    model = str(resolve_model_path(args.model))
    most = max(int(x) for x in args.clients.split(","))
    spec = ["--spec", args.spec] if args.spec else []
    specdec_cmd = [sys.executable, "-m", "specdec", "serve", "-m", model, "--port", "{port}", "-np", str(most),
                   "-t", str(args.threads), "-c", str(args.ctx), "--max-queue", str(4 * most), *spec]
    llama_cmd = [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", "{port}", "-np", str(most),
                 "-c", str(args.ctx * most), "-t", str(args.threads), "-tb", str(args.threads), "-cb", "--no-webui",
                 *args.llama_args.split()]
    report = {"model": model, "threads": args.threads, "max_tokens": args.max_tokens, "requests": args.requests}
    for name, cmd, extra in (("specdec serve", specdec_cmd, {}),
                             ("llama-server", llama_cmd, {"cache_prompt": False})):
        port = free_port()
        report[name] = run_server(name, [c.replace("{port}", str(port)) for c in cmd], port, args, extra)
    report["specdec generate"] = generate_speed(args, model)

    print("\n" + HEADER)
    for name in ("specdec serve", "llama-server"):
        for lv in report[name]["levels"]:
            print(format_level(name, lv))
    print(f"\n{'clients':>7} {'specdec tok/s':>14} {'llama-server tok/s':>19} {'ratio':>6}")
    for a, b in zip(report["specdec serve"]["levels"], report["llama-server"]["levels"], strict=True):
        print(f"{a['clients']:>7} {a['tok_s']:>14.1f} {b['tok_s']:>19.1f} {a['tok_s'] / b['tok_s']:>6.2f}")
    one = next((lv for lv in report["specdec serve"]["levels"] if lv["clients"] == 1), None)
    gen = report["specdec generate"]["median"]
    if one and one["tpot_p50_ms"]:
        served = 1e3 / one["tpot_p50_ms"]
        print(f"\n1 client: specdec serve decodes at {served:.1f} tok/s (1000 / TPOT p50; {one['tok_s']:.1f} tok/s "
              f"aggregate with the prefill), specdec generate at {gen:.1f} tok/s: {served / gen:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
