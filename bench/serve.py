"""Serving benchmarks (issue #6): batching on vs off, and Ray Serve vs a plain FastAPI process;
with `--ingress`, Serve's ingress modes against each other (issue #19).

    .venv/bin/python bench/serve.py                       # cnn, resnet18, resnet50 at 64 px, ~10 minutes
    .venv/bin/python bench/serve.py --requests 2000 --concurrency 64 --models resnet18
    .venv/bin/python bench/serve.py --ingress --models cnn   # proxy (Argus's default) vs HAProxy

An untrained model per architecture is registered under a fresh MLflow SQLite store in a temp dir
(weights do not change the cost of a forward pass). For each model, three endpoints on 127.0.0.1
answer `POST /predict` with PNG bodies (64 distinct synthetic screenshots, cycled):
- Ray Serve, `app.serve.build_app` with `max_batch_size` 16 (the default) — batching on;
- Ray Serve, the same with `max_batch_size` 1 — batching off;
- plain: one uvicorn process, FastAPI, the same registered model loaded with `registry.load`, the
  same `preprocess` (decode → RGB → resize → normalise) and forward pass in Starlette's thread pool,
  the same torch threads as a Serve replica (`--threads`, 1 by default).
The forward pass alone at batch 1 and 16 (in this process) is printed first: the most batching can
gain on this CPU. A closed loop of `--concurrency` aiohttp clients (32: with no more clients than
`max_batch_size` a batch could never fill, some requests being always in flight) sends `--requests`
requests per run after a warm-up; runs alternate between the endpoints, `--repeats` rounds,
medians. Goals: batching on vs off ≥ 2× throughput; Serve p50 ≤ 1.3× the plain process's p50
(throughput ratio printed too).

No `from __future__ import annotations`: FastAPI resolves the plain server's route annotations.
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import _common as common
from _common import ROOT, alternate, goal_line, median_of, print_table

BATCH_GOAL, P50_GOAL = 2.0, 1.3


# ---------------------------------------------------------------- the registered models


def register_untrained(tracking_uri: str, artifact_root: str, model: str, image_size: int) -> str:
    """An untrained `model` as version 1 (alias champion) of `bench-<model>`; returns the name."""
    import torch

    from app import registry
    from app.data import synth
    from app.model import build_model

    torch.manual_seed(0)
    name = f"bench-{model}"
    classes = list(synth.DEFAULT_CLASSES)
    with registry.start_run(tracking_uri, artifact_root, f"bench-{model}") as run:
        card = registry.ModelCard(
            arch=model,
            classes=classes,
            image_size=image_size,
            features=False,
            training_kind="bench-untrained",
            lineage={},
            metrics={},
        )
        registry.register(tracking_uri, name, run.info.run_id, build_model(model, len(classes)).eval(), card)
    return name


# ---------------------------------------------------------------- the plain baseline server


def plain_server(port: int, tracking_uri: str, models: list[str], threads: int) -> None:
    """`bench/serve.py --plain-server`: FastAPI + torch in one uvicorn process, no batching."""
    import torch
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    from app import registry
    from app.transform import BadImage, preprocess

    torch.set_num_threads(threads)
    api = FastAPI()
    loaded = {m: registry.load(tracking_uri, f"bench-{m}", "1") for m in models}

    @api.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    def answer(model: str, body: bytes) -> dict:
        current = loaded[model]
        inputs = preprocess([body], current.card.image_size)
        with torch.inference_mode():
            row = torch.softmax(current.model(inputs), dim=1)[0].tolist()
        best = max(range(len(row)), key=row.__getitem__)
        return {
            "label": current.card.classes[best],
            "scores": dict(zip(current.card.classes, row)),
            "model_version": current.version,
        }

    @api.post("/{model}/predict")
    async def predict(model: str, request: Request):
        body = await request.body()
        try:
            return JSONResponse(await run_in_threadpool(answer, model, body))
        except BadImage as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

    uvicorn.run(api, host="127.0.0.1", port=port, log_level="warning")


def start_plain_server(tracking_uri: str, models: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    from app.net import free_port

    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--plain-server",
            str(port),
            "--mlflow-uri",
            tracking_uri,
            "--models",
            ",".join(models),
            "--threads",
            str(threads),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    _wait_ok(f"{url}/healthz", 180, process)
    return process, url


def _wait_ok(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s}s")


# ---------------------------------------------------------------- the ingress modes

# Serve reads its ingress mode from the environment of the processes it starts, so each mode gets a
# Ray of its own (a child process). "proxy" is Argus's default (app.cluster.SERVE_ENV: the HTTP proxy
# reaching replicas over gRPC); "haproxy" puts Serve's HAProxy in front of per-replica HTTP ports
# (direct ingress). HAProxy asks for 2.5 file descriptors per connection of `maxconn` (default
# 20,000), more than a 20,000-descriptor ulimit allows: 4,096 here.
INGRESS_ENV = {
    "proxy": {},
    "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_MAXCONN": "4096"},
}


def ingress_server(ingress: str, tracking_uri: str, model: str, args) -> None:
    """`bench/serve.py --ingress-server MODE`: a local Ray with MODE's Serve environment, `model`
    deployed with batching on; prints its URL and serves until stdin closes."""
    os.environ.update(INGRESS_ENV[ingress])
    with common.local_ray(num_cpus=2):
        from ray import serve

        from app.net import free_port
        from app.serve import build_app

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = {"mlflow_uri": tracking_uri, "model_name": f"bench-{model}", "poll_s": 3600}
        options |= {"max_batch_size": args.batch_size, "batch_wait_timeout_s": args.batch_wait_s}
        serve.run(
            build_app(options | {"threads": args.threads}), name="bench", route_prefix="/", blocking=False
        )
        url = f"http://127.0.0.1:{port}"
        _wait_ok(f"{url}/healthz", 180)
        print(f"URL {url}", flush=True)
        sys.stdin.read()
        serve.shutdown()


def compare_ingress(args, models: list[str], bodies: list[bytes]) -> tuple[list, list]:
    rows, goals = [], []
    with common.scratch_dir("argus-bench-ingress-") as tmp:
        tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
        for model in models:
            register_untrained(tracking_uri, (tmp / "mlartifacts").as_uri(), model, args.image_size)
            servers, urls = {}, {}
            try:
                for ingress in INGRESS_ENV:
                    servers[ingress] = subprocess.Popen(
                        [sys.executable, __file__, "--ingress-server", ingress, "--mlflow-uri", tracking_uri]
                        + ["--models", model, "--threads", str(args.threads)]
                        + ["--batch-size", str(args.batch_size), "--batch-wait-s", str(args.batch_wait_s)],
                        cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                    )
                    line = next(line for line in servers[ingress].stdout if line.startswith("URL "))
                    urls[ingress] = line.split()[1] + "/predict"
                print(f"\n== {model}: {', '.join(f'{k} on {v}' for k, v in urls.items())}")
                results = alternate(
                    {
                        ingress: (
                            lambda url=url: load_run(
                                url, bodies, args.concurrency, args.requests, args.warmup
                            )
                        )
                        for ingress, url in urls.items()
                    },
                    args.repeats,
                    model,
                )
            finally:
                for server in servers.values():
                    server.stdin.close()  # the child shuts Serve and Ray down
                    try:
                        server.wait(90)
                    except subprocess.TimeoutExpired:
                        os.killpg(server.pid, 9)
            for name, r in results.items():
                rows.append(
                    [f"{model} · {name}"]
                    + [median_of(r, key) for key in ("requests_per_s", "p50_ms", "p99_ms")]
                )
            rps = {name: median_of(r, "requests_per_s") for name, r in results.items()}
            goals.append(
                goal_line(
                    f"HAProxy vs proxy ingress throughput ({model})", rps["haproxy"] / rps["proxy"], 1.0
                )
            )
    return rows, goals


# ---------------------------------------------------------------- the load generator


async def _closed_loop(url: str, bodies: list[bytes], concurrency: int, total: int) -> dict:
    import aiohttp

    latencies: list[float] = []
    failures = 0
    next_index = iter(range(total))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout
    ) as session:

        async def client():
            nonlocal failures
            for i in next_index:
                started = time.perf_counter()
                async with session.post(
                    url, data=bodies[i % len(bodies)], headers={"Content-Type": "image/png"}
                ) as response:
                    await response.read()
                    failures += response.status != 200
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": total / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "failures": failures,
    }


def load_run(url: str, bodies: list[bytes], concurrency: int, total: int, warmup: int) -> dict:
    asyncio.run(_closed_loop(url, bodies, concurrency, warmup))
    result = asyncio.run(_closed_loop(url, bodies, concurrency, total))
    if result["failures"]:
        raise RuntimeError(f"{url}: {result['failures']} of {total} requests failed")
    return result


def forward_rates(model: str, image_size: int, batch: int, threads: int, seconds: float = 2.0) -> dict:
    """The ceiling batching can reach: forward passes alone, in this process, batch 1 vs `batch`."""
    import torch

    from app.model import build_model

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    net = build_model(model, 6).eval()
    rates = {}
    try:
        for size in (1, batch):
            inputs = torch.randn(size, 3, image_size, image_size)
            with torch.inference_mode():
                net(inputs)
                started, done = time.perf_counter(), 0
                while time.perf_counter() - started < seconds:
                    net(inputs)
                    done += size
            rates[size] = done / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return {"batch1_images_per_s": rates[1], "batchN_images_per_s": rates[batch]}


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="cnn,resnet18,resnet50", help="comma list of cnn, resnet18, resnet50"
    )
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--requests", type=int, default=480, help="requests per measured run")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="clients (above --batch-size)")
    parser.add_argument("--batch-size", type=int, default=16, help="max_batch_size with batching on")
    parser.add_argument("--batch-wait-s", type=float, default=0.01)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per replica and in the plain server"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ingress", action="store_true", help="compare Serve's ingress modes (proxy vs HAProxy) only"
    )
    parser.add_argument("--plain-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--ingress-server", choices=INGRESS_ENV, help=argparse.SUPPRESS)
    parser.add_argument("--mlflow-uri", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if args.plain_server:
        plain_server(args.plain_server, args.mlflow_uri, models, args.threads)
        return 0
    if args.ingress_server:
        ingress_server(args.ingress_server, args.mlflow_uri, models[0], args)
        return 0

    print(f"bench/serve.py · {common.machine_line()}")
    from app.data import synth

    bodies = [r.value for r in synth.generate(64, seed=9, size=args.image_size)]
    if args.ingress:
        rows, goals = compare_ingress(args, models, bodies)
        print_results(args, "ingress", rows, goals)
        return 0
    rows, goals, ceiling = [], [], []
    for model in models:
        rates = alternate(
            {"forward": lambda: forward_rates(model, args.image_size, args.batch_size, args.threads)},
            args.repeats,
            f"{model} model only",
        )["forward"]
        b1, bn = median_of(rates, "batch1_images_per_s"), median_of(rates, "batchN_images_per_s")
        ceiling.append([model, b1, bn, f"{bn / b1:.2f}×"])
    with common.scratch_dir("argus-bench-serve-") as tmp:
        tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
        for model in models:
            register_untrained(tracking_uri, (tmp / "mlartifacts").as_uri(), model, args.image_size)
        plain, plain_url = start_plain_server(tracking_uri, models, args.threads)
        try:
            with common.local_ray(num_cpus=2):
                from ray import serve

                from app.net import free_port
                from app.serve import build_app

                port = free_port()
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                serve_url = f"http://127.0.0.1:{port}"
                for model in models:
                    for batch in (args.batch_size, 1):
                        prefix = f"/{model}-b{batch}"
                        serve.run(
                            build_app(
                                {
                                    "mlflow_uri": tracking_uri,
                                    "model_name": f"bench-{model}",
                                    "max_batch_size": batch,
                                    "batch_wait_timeout_s": args.batch_wait_s,
                                    "poll_s": 3600,
                                    "threads": args.threads,
                                }
                            ),
                            name=f"bench-{model}-b{batch}",
                            route_prefix=prefix,
                            blocking=False,
                        )
                        _wait_ok(f"{serve_url}{prefix}/healthz", 180)
                print(
                    f"Serve on {serve_url}, plain FastAPI on {plain_url}; "
                    f"{args.concurrency} concurrent clients, "
                    f"{args.requests} requests per run, {args.image_size} px PNG bodies"
                )

                def run(url):
                    return lambda: load_run(url, bodies, args.concurrency, args.requests, args.warmup)

                for model in models:
                    on, off, base = f"Serve batch ≤{args.batch_size}", "Serve batch 1", "plain FastAPI"
                    print(f"\n== {model}, {args.image_size} px")
                    results = alternate(
                        {
                            on: run(f"{serve_url}/{model}-b{args.batch_size}/predict"),
                            off: run(f"{serve_url}/{model}-b1/predict"),
                            base: run(f"{plain_url}/{model}/predict"),
                        },
                        args.repeats,
                        model,
                    )
                    for name, r in results.items():
                        rows.append(
                            [
                                f"{model} · {name}",
                                median_of(r, "requests_per_s"),
                                median_of(r, "p50_ms"),
                                median_of(r, "p99_ms"),
                            ]
                        )
                    rps = {name: median_of(r, "requests_per_s") for name, r in results.items()}
                    p50 = {name: median_of(r, "p50_ms") for name, r in results.items()}
                    goals.append(
                        goal_line(f"batching on vs off throughput ({model})", rps[on] / rps[off], BATCH_GOAL)
                    )
                    goals.append(
                        goal_line(
                            f"Serve (batching on) p50 vs plain FastAPI p50 ({model})",
                            p50[on] / p50[base],
                            P50_GOAL,
                            higher_is_better=False,
                            note=f"(throughput Serve/plain {rps[on] / rps[base]:.2f}×)",
                        )
                    )
                serve.shutdown()
        finally:
            plain.terminate()
            plain.wait(30)

    print("\n== summary")
    print_table(
        f"model forward only, in this process, {args.threads} torch thread(s): "
        "what batching can gain at most",
        ["model", "batch 1 img/s", f"batch {args.batch_size} img/s", "gain"],
        ceiling,
    )
    print_results(args, "endpoint", rows, goals)
    return 0


def print_results(args, kind: str, rows: list, goals: list[str]) -> None:
    print_table(
        f"{args.concurrency} concurrent clients, {args.requests} requests per run (median of {args.repeats})",
        [kind, "requests/s", "p50 ms", "p99 ms"],
        rows,
    )
    print()
    for line in goals:
        print(line)


if __name__ == "__main__":
    sys.exit(main())
