"""The one GPU check (issue #28): run once where a GPU is lent. Its GPU sizes (`GPU_DEFAULTS`) are
meant to fit the issue's 8 minutes on one GPU, but no GPU has run it yet: how long it takes there is
not measured.

    .venv/bin/python bench/gpu.py          # on a machine with a CUDA GPU
    .venv/bin/python bench/gpu.py --cpu    # the same code paths at toy sizes on CPU (a test runs it)

Without a GPU and without `--cpu` it prints why and exits 0: there is nothing to measure.

1. preprocess: ingest's preprocessing actors (`app.data.preprocess.preprocess_batches`) over
   `--source-size` JPEG screenshots → `--image-size` uint8, the CPU pool (one 0.5-CPU actor per core,
   as ingest runs without a GPU) against the GPU actor (one per GPU: Pillow decoding in a thread per
   CPU, resizing on the GPU). Goal: the GPU actor ≥ 2× the CPU pool. Then, in this process, what
   nvJPEG would add: `torchvision.io.decode_jpeg(..., device="cuda")` batches against Pillow
   decoding in threads, both resizing on the device (info: whether ingest should decode JPEGs there).
2. train: the full path — embedded broker → produce → ingest (on the GPU) → table snapshot → Ray Data →
   `TorchTrainer` (one GPU worker) — for ResNet-50 at 224 px under bf16 autocast and under fp16 with
   a GradScaler: the last epoch's training images/s (the first pays for start-up), against the plain
   loop's ceiling: the same model, batch, optimiser and autocast over tensors already on the GPU.
   Goals: ≥ 5,000 images/s (H200), and ≥ 0.8× the plain loop.
3. serve: `app.serve.build_app` on one GPU replica, ResNet-50 at 224 px, `max_batch_size` 32 against
   1 (batching off), a closed loop of `--concurrency` clients posting PNGs. Goal: ≥ 2× throughput.

With `--cpu` every part runs the same functions on CPU (cnn at 32 px, a few dozen records, the GPU
actor and nvJPEG on the CPU device): it proves the script runs end to end; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common as common
from _common import goal_line, print_table

PREPROCESS_GOAL, BATCH_GOAL, PLAIN_GOAL = 2.0, 2.0, 0.8
TRAIN_IMAGES_PER_S_GOAL = 5000


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def jpeg_records(n: int, size: int, seed: int) -> list:
    """`n` synthetic screenshots as JPEG records (the format nvJPEG decodes)."""
    from app.data import synth

    return list(synth.generate(n, seed=seed, size=size, image_format="JPEG", corrupt_fraction=0.0))


# ---------------------------------------------------------------- 1. preprocessing


def decode_rates(values: list[bytes], size: int, device: str, threads: int, batch: int) -> dict:
    """Images/s of Pillow decoding in `threads` threads vs nvJPEG batches, both resized on `device`."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from app.transform import decode_pixels, resize_pixels, resize_uint8

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def pillow() -> int:
        with ThreadPoolExecutor(threads) as pool:
            for start in range(0, len(values), batch):
                chunk = values[start : start + batch]
                resize_pixels(list(pool.map(decode_pixels, chunk, [size] * len(chunk))), size, device)
        return len(values)

    def nvjpeg() -> int:
        for start in range(0, len(values), batch):
            encoded = [
                torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values[start : start + batch]
            ]
            for image in decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device):
                resize_uint8(image, size)
        return len(values)

    rates = {}
    for name, run in (("pillow", pillow), ("nvjpeg", nvjpeg)):
        run()  # warm-up: CUDA context, nvJPEG handles, kernels
        sync()
        started = time.perf_counter()
        images = run()
        sync()
        rates[name] = images / (time.perf_counter() - started)
    return rates


def preprocess_part(args, device: str) -> list[str]:
    import ingest as ingest_bench  # bench/ingest.py: the actor pool exactly as ingest builds it

    records = jpeg_records(args.preprocess_records, args.source_size, seed=1)
    values, labels = [r.value for r in records], [r.label for r in records]
    rows, goals = [], []
    cpu_pool = ingest_bench.ray_preprocess(values, labels, args.image_size, args.block, use_gpu=False)
    rows.append(["CPU actors (ingest without a GPU)", cpu_pool["busy_images_per_s"], "1.00×"])
    if device == "cuda":
        gpu = ingest_bench.ray_preprocess(values, labels, args.image_size, args.block, use_gpu=True)
        ratio = gpu["busy_images_per_s"] / cpu_pool["busy_images_per_s"]
        rows.append(["GPU actor (ingest --use-gpu)", gpu["busy_images_per_s"], f"{ratio:.2f}×"])
        goals.append(goal_line("GPU preprocessing actor vs the CPU pool", ratio, PREPROCESS_GOAL))
    rates = decode_rates(values, args.image_size, device, os.cpu_count() or 2, args.block)
    rows.append([f"in process: Pillow in threads, resize on {device}", rates["pillow"], "—"])
    nv = rates["nvjpeg"] / rates["pillow"]
    decoder = "nvJPEG" if device == "cuda" else "libjpeg (torchvision's CPU decode_jpeg)"
    rows.append([f"in process: {decoder} batches", rates["nvjpeg"], f"{nv:.2f}× Pillow"])
    print_table(
        f"1. preprocess {len(values)} {args.source_size} px JPEGs → {args.image_size} px (busy images/s)",
        ["path", "images/s", "ratio"],
        rows,
    )
    return goals


# ---------------------------------------------------------------- 2. training


def plain_loop_rate(model_name: str, size: int, batch: int, amp: str, device: str, seconds: float) -> float:
    """The ceiling: `app.model.train_epoch`'s step (same model, AdamW, loss, autocast, scaler) over
    random tensors already on the device, no data path, no Ray."""
    import torch

    from app.model import amp_dtype, build_model, train_epoch

    torch_device = torch.device(device)
    model = build_model(model_name, 6).to(torch_device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = amp_dtype(amp, torch_device)
    scaler = torch.amp.GradScaler(torch_device.type) if dtype == torch.float16 else None
    images = torch.randn(batch, 3, size, size, device=torch_device)
    labels = torch.randint(0, 6, (batch,), device=torch_device)

    def steps(n: int) -> None:
        train_epoch(
            model,
            ((images, labels) for _ in range(n)),
            optimizer,
            torch.nn.CrossEntropyLoss(),
            device=torch_device,
            amp=dtype,
            scaler=scaler,
        )

    steps(3)  # warm-up: cuDNN's algorithm search, the allocator
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        steps(5)
        done += 5 * batch
    if device == "cuda":
        torch.cuda.synchronize()
    return done / (time.perf_counter() - started)


def train_part(args, device: str, tmp: Path) -> list[str]:
    import train as train_bench  # bench/train.py: reading a run's history

    from app.config import IngestConfig, Settings, TrainConfig
    from app.data.ingest import ingest
    from app.train import train

    use_gpu = device == "cuda"
    rows, goals = [], []
    with common.embedded_broker(tmp) as bootstrap:
        settings = Settings(
            bootstrap_servers=bootstrap,
            topic="bench-gpu",
            storage=str(tmp / "data"),
            image_size=args.image_size,
            model=args.model,
            partitions=4,
        )
        pool = jpeg_records(min(args.train_records, 512), args.source_size, seed=2)
        common.produce_records(bootstrap, settings.topic, args.train_records, pool, partitions=4)
        started = time.perf_counter()
        committed = ingest(settings, IngestConfig(use_gpu=use_gpu), settings.kafka_connection())
        print(f"  ingest: {committed.records} records in {time.perf_counter() - started:.1f} s")
        for amp in ("bf16", "fp16"):
            report = train(
                settings,
                TrainConfig(
                    epochs=args.epochs,
                    num_workers=1,
                    use_gpu=use_gpu,
                    cpus_per_worker=1 if use_gpu else 0.5,
                    batch_size=args.batch_size,
                    amp=amp,
                    augment="none",
                    balance="none",
                    max_failures=0,
                    run_name=f"bench-gpu-{amp}",
                ),
            )
            history = json.loads(Path(train_bench.report_history(settings, report.run_id)).read_text())
            argus = history[-1]["train_images_per_second"]
            plain = plain_loop_rate(args.model, args.image_size, args.batch_size, amp, device, args.plain_s)
            rows.append([f"{args.model} {amp}", argus, plain, f"{argus / plain:.2f}×"])
            goals.append(goal_line(f"Argus {amp} training vs the plain loop", argus / plain, PLAIN_GOAL))
            if use_gpu:
                ok = argus >= TRAIN_IMAGES_PER_S_GOAL
                goals.append(
                    f"goal: {args.model} {amp} training ≥ {TRAIN_IMAGES_PER_S_GOAL} images/s: "
                    f"measured {argus:.0f} ({'PASS' if ok else 'MISS'})"
                )
    print_table(
        f"2. train {args.model} at {args.image_size} px from a table snapshot, batch {args.batch_size} "
        "(images/s)",
        ["run", "Argus full path", "plain loop", "ratio"],
        rows,
    )
    return goals


# ---------------------------------------------------------------- 3. serving


def serve_part(args, device: str, tmp: Path) -> list[str]:
    import serve as serve_bench  # bench/serve.py: its registered model and closed-loop client
    from ray import serve

    from app.net import free_port
    from app.serve import build_app

    tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    serve_bench.register_untrained(tracking_uri, (tmp / "mlartifacts").as_uri(), args.model, args.image_size)
    # PNG: the closed-loop client sends image/png.
    bodies = [r.value for r in common.synthetic_pool(64, args.image_size, seed=9)]
    rates = {}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for batch in (args.serve_batch, 1):
            prefix = f"/b{batch}"
            serve.run(
                build_app(
                    {
                        "mlflow_uri": tracking_uri,
                        "model_name": f"bench-{args.model}",
                        "max_batch_size": batch,
                        "poll_s": 3600,
                        "num_gpus": 1 if device == "cuda" else 0,
                    }
                ),
                name=f"bench-b{batch}",
                route_prefix=prefix,
                blocking=False,
            )
            url = f"http://127.0.0.1:{port}{prefix}"
            serve_bench._wait_ok(f"{url}/healthz", timeout_s=300)
            result = serve_bench.load_run(
                f"{url}/predict", bodies, args.concurrency, args.requests, warmup=args.concurrency
            )
            rates[batch] = result["requests_per_s"]
            serve.delete(f"bench-b{batch}")
    finally:
        serve.shutdown()
    ratio = rates[args.serve_batch] / rates[1]
    print_table(
        f"3. serve {args.model} at {args.image_size} px, {args.concurrency} clients (requests/s)",
        ["max_batch_size", "requests/s"],
        [[args.serve_batch, rates[args.serve_batch]], [1, rates[1]]],
    )
    return [goal_line(f"batching on ({args.serve_batch}) vs off", ratio, BATCH_GOAL)]


# ---------------------------------------------------------------- main


GPU_DEFAULTS = dict(
    model="resnet50", image_size=224, source_size=512, preprocess_records=4096, block=256,
    train_records=16384, epochs=2, batch_size=256, plain_s=10.0, requests=3000, concurrency=64,
    serve_batch=32,
)  # fmt: skip
CPU_DEFAULTS = dict(
    model="cnn", image_size=32, source_size=64, preprocess_records=32, block=16,
    train_records=48, epochs=2, batch_size=16, plain_s=0.5, requests=32, concurrency=8,
    serve_batch=8,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="run every part on CPU at toy sizes")
    parser.add_argument("--parts", default="preprocess,train,serve", help="comma list of the parts to run")
    for name, value in GPU_DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), help=f"GPU default {value}")
    args = parser.parse_args(argv)
    if not args.cpu and not cuda_available():
        print("bench/gpu.py: skipped: no CUDA GPU here (bench/gpu.py --cpu runs the same paths on CPU)")
        return 0
    device = "cpu" if args.cpu else "cuda"
    for name, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    print(f"bench/gpu.py on {device} · {common.machine_line()}", flush=True)
    parts = {"preprocess": preprocess_part, "train": train_part, "serve": serve_part}
    goals, started = [], time.perf_counter()
    with common.local_ray(num_cpus=os.cpu_count() or 2):  # one Ray for every part: each start costs
        for name in args.parts.split(","):
            part_started = time.perf_counter()
            with common.scratch_dir(f"argus-bench-gpu-{name}-") as tmp:
                goals += parts[name](args, device) if name == "preprocess" else parts[name](args, device, tmp)
            print(f"  ({name}: {time.perf_counter() - part_started:.0f} s)", flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    for line in goals:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
