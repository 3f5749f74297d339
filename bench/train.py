"""Training benchmarks (issue #4): Ray Train DDP step throughput vs plain PyTorch DDP; bf16 vs fp32.

    .venv/bin/python bench/train.py                                # cnn at 64 px, a few minutes
    .venv/bin/python bench/train.py --models cnn,resnet18 --steps 40 --full-path

1. step throughput: the same model, batch, optimiser (AdamW), loss and `app.model.train_epoch`,
   synthetic data generated in memory inside each worker, 2 workers with `--threads` torch threads
   each (1, as `app.train` gives a 0.5-CPU worker), gloo all-reduce:
   - Ray: `TorchTrainer` with 2 workers, `resources_per_worker={"CPU": 0.5}` as `app/train/trainer.py`
     configures it, the model through `ray.train.torch.prepare_model`;
   - plain: `torch.multiprocessing.spawn` of 2 processes, `init_process_group("gloo")`, `DDP(model)`.
   Images/s are timed between barriers after warm-up steps (trainer start-up is excluded and
   printed separately). Runs alternate Ray/plain; medians. Goal ≥ 0.95×.
2. `--full-path`: `app.train.train` over a real table snapshot (broker → produce → ingest → the
   Iceberg table's uint8 Parquet → Ray Data → TorchTrainer, augmentation off, as plain DDP has
   none), the images/s of its training passes — data path, normalisation on the worker and steps,
   what plain DDP's number covers — against plain DDP in the same run (goal ≥ 0.9×); the whole
   epoch's rate (adding the validation pass, checksums and the checkpoint) and the default
   `--augment light` rate as info.
3. bf16 autocast vs fp32 on this CPU: `train_epoch` in this process, same model, batch and
   threads, alternating; the issue says bf16 is ~40× slower here.
4. `--nodes 2` (instead of 1-3): the Ray TorchTrainer run of 1. with 1-CPU workers on two Ray
   nodes of 1 CPU each (`ray start --head` + `ray start --address` on this host, one worker per
   node) against one node of 2 CPUs holding both, alternating, fresh clusters each run: the ratio
   is what crossing nodes costs the training step (the gradient all-reduce between raylets'
   workers). Goal ≥ 0.9×.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _common as common
from _common import alternate, goal_line, median_of, print_table

GOAL = 0.95
FULL_PATH_GOAL = 0.9
NODES_GOAL = 0.9
NUM_CLASSES = 6


# ---------------------------------------------------------------- the shared measured loop


def timed_steps(model, cfg: dict, rank: int) -> dict:
    """Warm-up, then `steps` DDP steps between barriers; the slowest rank's time counts."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from app.model import train_epoch

    generator = torch.Generator().manual_seed(1000 + rank)
    n = cfg["batch_size"] * 8  # eight distinct batches in memory, cycled
    images = torch.randn(n, 3, cfg["image_size"], cfg["image_size"], generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    batches = [
        (images[i : i + cfg["batch_size"]], labels[i : i + cfg["batch_size"]])
        for i in range(0, n, cfg["batch_size"])
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    device = torch.device("cpu")

    def run(steps):
        return train_epoch(
            model, (batches[i % len(batches)] for i in range(steps)), optimizer, loss_fn, device=device
        )

    run(cfg["warmup"])
    dist.barrier()
    started = time.perf_counter()
    stats = run(cfg["steps"])
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = float(elapsed)
    world = dist.get_world_size()
    return {"images_per_s": stats["examples"] * world / seconds, "seconds": seconds, "loss": stats["loss"]}


# ---------------------------------------------------------------- Ray Train


def ray_train_loop(cfg: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from app.model import build_model

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    model = ray.train.torch.prepare_model(build_model(cfg["model"], NUM_CLASSES))
    rank = ray.train.get_context().get_world_rank()
    result = timed_steps(model, cfg, rank)
    if rank == 0:  # Train V2 attaches metrics to checkpoints only; a file is simpler here
        Path(cfg["result_path"]).write_text(json.dumps(result))


def ray_run(cfg: dict, storage: str) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    started = time.perf_counter()
    result_path = Path(storage, f"result-{time.time_ns()}.json")
    result_path.parent.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={**cfg, "result_path": str(result_path)},
        scaling_config=ray.train.ScalingConfig(
            num_workers=2, use_gpu=False, resources_per_worker={"CPU": cfg["cpus_per_worker"]}
        ),
        run_config=ray.train.RunConfig(name=f"bench-{time.time_ns()}", storage_path=storage),
    )
    result = trainer.fit()
    if result.error:
        raise RuntimeError(f"Ray Train run failed: {result.error}")
    wall = time.perf_counter() - started
    return {**json.loads(result_path.read_text()), "wall_s": wall}


# ---------------------------------------------------------------- plain torch DDP


def _ddp_worker(rank: int, world: int, port: int, cfg: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from app.model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        torch.set_num_threads(cfg["threads"])
        model = DistributedDataParallel(build_model(cfg["model"], NUM_CLASSES))
        result = timed_steps(model, cfg, rank)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def plain_ddp_run(cfg: dict) -> dict:
    import torch.multiprocessing as mp

    from app.net import free_port

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="argus-bench-ddp-") as out_dir:
        mp.spawn(_ddp_worker, args=(2, free_port(), cfg, out_dir), nprocs=2, join=True)
        result = json.loads(Path(out_dir, "result.json").read_text())
    return {**result, "wall_s": time.perf_counter() - started}


# ---------------------------------------------------------------- the full Ray Data path (info)


def full_path(args, tmp: Path) -> dict:
    from app.config import IngestConfig, Settings, TrainConfig
    from app.data.ingest import ingest
    from app.train import train

    with common.embedded_broker(tmp) as bootstrap:
        settings = Settings(
            bootstrap_servers=bootstrap,
            topic="bench-train",
            storage=str(tmp / "data"),
            image_size=args.image_size,
            model=args.full_path_model,
            partitions=2,
        )
        pool = common.synthetic_pool(600, args.image_size, seed=4)
        common.produce_records(bootstrap, settings.topic, args.full_path_records, pool, partitions=2)
        print(f"  {ingest(settings, IngestConfig(), settings.kafka_connection())}")
        rates = {}
        for augment in ("none", "light"):
            report = train(
                settings,
                TrainConfig(
                    epochs=args.full_path_epochs,
                    num_workers=2,
                    batch_size=args.batch_size,
                    augment=augment,
                    balance="none",
                    max_failures=0,
                    amp="off",
                ),
            )
            history = json.loads(Path(report_history(settings, report.run_id)).read_text())
            # The last epoch: the first also pays for the workers' first batches and the read.
            rates[augment] = {
                "train_images_per_s": history[-1]["train_images_per_second"],
                "images_per_s": history[-1]["images_per_second"],
            }
    return {"rates": rates, "epochs": report.epochs}


def report_history(settings, run_id: str) -> str:
    import mlflow

    mlflow.set_tracking_uri(settings.tracking_uri)
    return mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="history.json")


# ---------------------------------------------------------------- bf16 autocast vs fp32


def autocast_run(model_name: str, cfg: dict, amp: bool) -> dict:
    import torch
    from torch import nn

    from app.model import build_model, train_epoch

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    model = build_model(model_name, NUM_CLASSES)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(cfg["batch_size"] * 4, 3, cfg["image_size"], cfg["image_size"], generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (len(images),), generator=generator)
    batches = [
        (images[i : i + cfg["batch_size"]], labels[i : i + cfg["batch_size"]])
        for i in range(0, len(images), cfg["batch_size"])
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = torch.bfloat16 if amp else None
    steps = cfg["amp_steps"]

    def run(n):
        return train_epoch(
            model,
            (batches[i % len(batches)] for i in range(n)),
            optimizer,
            nn.CrossEntropyLoss(),
            device=torch.device("cpu"),
            amp=dtype,
        )

    run(2)
    started = time.perf_counter()
    stats = run(steps)
    seconds = time.perf_counter() - started
    return {"images_per_s": stats["examples"] / seconds, "step_ms": 1000 * seconds / steps}


def _bf16_flags() -> str:
    """The CPU features that make bf16 fast (oneDNN uses AMX / AVX512-BF16 when present)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return ", ".join(
        sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")})
    )


# ---------------------------------------------------------------- two nodes against one


def cluster_run(cfg: dict, node_cpus: list[int], tmp: Path) -> dict:
    """`ray_run` on a fresh local cluster whose nodes have `node_cpus` CPUs (the first is the head)."""
    import ray

    sys.path.insert(0, str(common.ROOT / "tests"))
    from ray_nodes import LocalRayCluster

    log_dir = Path(tempfile.mkdtemp(prefix="nodes-", dir=tmp))
    cluster = LocalRayCluster(log_dir)
    try:
        cluster.start_head(num_cpus=node_cpus[0])
        for i, cpus in enumerate(node_cpus[1:], start=1):
            cluster.add_node(f"worker{i}", num_cpus=cpus)
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        try:
            return ray_run(cfg, str(tmp / "ray"))
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def node_comparison(args, base: dict) -> int:
    rows, goals = [], []
    with common.scratch_dir("argus-bench-nodes-") as tmp:
        for model in args.models.split(","):
            cfg = {**base, "model": model, "cpus_per_worker": 1.0}
            print(
                f"\n== two nodes vs one: {model}, {args.image_size} px, batch {args.batch_size}/worker, "
                f"2 workers × 1 CPU × {args.threads} thread(s), {args.steps} timed steps"
            )
            results = alternate(
                {
                    "2 nodes × 1 CPU (one worker each)": lambda: cluster_run(cfg, [1, 1], tmp),
                    "1 node × 2 CPUs (both workers)": lambda: cluster_run(cfg, [2], tmp),
                },
                args.repeats,
                model,
            )
            rates = {name: median_of(r, "images_per_s") for name, r in results.items()}
            for name, r in results.items():
                rows.append([f"{model} · {name}", rates[name], median_of(r, "wall_s")])
            two, one = rates.values()
            goals.append(
                goal_line(f"Ray Train step throughput ({model}), 2 nodes vs 1", two / one, NODES_GOAL)
            )
    print("\n== summary")
    print_table(
        f"Ray TorchTrainer step throughput, images/s over both workers (median of {args.repeats})",
        ["run", "images/s", "wall s (incl. cluster and trainer start)"],
        rows,
    )
    print()
    for line in goals:
        print(line)
    return 0


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="cnn", help="comma list of cnn, resnet18, resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (app.train: 1)")
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--amp-models", default="cnn,resnet18", help="models for the bf16 vs fp32 comparison")
    parser.add_argument("--amp-steps", type=int, default=6)
    parser.add_argument(
        "--full-path", action="store_true", help="also time app.train.train over a table snapshot"
    )
    parser.add_argument("--full-path-model", default="cnn")
    parser.add_argument("--full-path-records", type=int, default=3000)
    parser.add_argument("--full-path-epochs", type=int, default=2)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two Ray nodes vs one")
    args = parser.parse_args()
    print(f"bench/train.py · {common.machine_line()}")
    tables, goals = [], []
    base = {
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "cpus_per_worker": args.cpus_per_worker,
    }
    if args.nodes == 2:
        return node_comparison(args, base)

    with common.scratch_dir("argus-bench-train-") as tmp, common.local_ray(num_cpus=2):
        rows = []
        plain_by_model = {}
        for model in args.models.split(","):
            cfg = {**base, "model": model}
            print(
                f"\n== step throughput: {model}, {args.image_size} px, batch {args.batch_size}/worker, "
                f"2 workers × {args.threads} thread(s), {args.steps} timed steps after {args.warmup}"
            )
            results = alternate(
                {
                    "Ray TorchTrainer": lambda: ray_run(cfg, str(tmp / "ray")),
                    "plain torch DDP": lambda: plain_ddp_run(cfg),
                },
                args.repeats,
                model,
            )
            ray_rate = median_of(results["Ray TorchTrainer"], "images_per_s")
            plain_rate = median_of(results["plain torch DDP"], "images_per_s")
            plain_by_model[model] = plain_rate
            for name, r in results.items():
                rows.append(
                    [
                        f"{model} · {name}",
                        median_of(r, "images_per_s"),
                        median_of(r, "seconds"),
                        median_of(r, "wall_s"),
                    ]
                )
            goals.append(
                goal_line(f"Ray Train step throughput ({model}) vs plain DDP", ray_rate / plain_rate, GOAL)
            )
        tables.append(
            (
                f"step throughput, images/s over both workers (median of {args.repeats})",
                ["run", "images/s", "timed s", "wall s (incl. start-up)"],
                rows,
            )
        )

        if args.full_path:
            print(
                f"\n== full path: app.train.train, {args.full_path_model}, {args.full_path_records} records"
            )
            full = full_path(args, tmp / "full")
            plain = plain_by_model.get(args.full_path_model)
            rows = []
            for augment, rate in full["rates"].items():
                for what, key in (("training passes", "train_images_per_s"), ("whole epoch", "images_per_s")):
                    rows.append(
                        [
                            f"{args.full_path_model} · app.train.train, --augment {augment}, {what}",
                            rate[key],
                            f"{rate[key] / plain:.2f}×" if plain else "-",
                        ]
                    )
            tables.append(
                (
                    f"full Ray Data path, last of {full['epochs']} epochs (whole epoch: + validation, "
                    "checksums, checkpoint)",
                    ["run", "images/s", "vs plain DDP"],
                    rows,
                )
            )
            if plain:
                goals.append(
                    goal_line(
                        "full path training passes (--augment none) vs plain DDP",
                        full["rates"]["none"]["train_images_per_s"] / plain,
                        FULL_PATH_GOAL,
                    )
                )

    amp_rows = []
    amp_ratios = []
    for model in args.amp_models.split(","):
        cfg = {**base, "amp_steps": args.amp_steps}
        print(
            f"\n== bf16 autocast vs fp32: {model}, {args.image_size} px, batch {args.batch_size}, "
            f"{args.threads} thread(s), one process"
        )
        results = alternate(
            {
                "fp32": lambda: autocast_run(model, cfg, False),
                "bf16 autocast": lambda: autocast_run(model, cfg, True),
            },
            args.repeats,
            model,
        )
        fp32, bf16 = (
            median_of(results["fp32"], "images_per_s"),
            median_of(results["bf16 autocast"], "images_per_s"),
        )
        amp_rows += [
            [f"{model} · fp32", fp32, median_of(results["fp32"], "step_ms")],
            [f"{model} · bf16 autocast", bf16, median_of(results["bf16 autocast"], "step_ms")],
        ]
        amp_ratios.append((model, bf16 / fp32))
    tables.append(
        ("bf16 autocast vs fp32 training steps on this CPU", ["run", "images/s", "ms/step"], amp_rows)
    )

    print("\n== summary")
    for title, header, rows in tables:
        print_table(title, header, rows)
    print()
    print(f"CPU bf16 features: {_bf16_flags() or 'none (no avx512_bf16 / AMX)'}")
    for model, speed in amp_ratios:
        verdict = f"{speed:.2f}× faster" if speed >= 1 else f"{1 / speed:.2f}× slower"
        print(
            f"bf16 autocast vs fp32 on this CPU ({model}): bf16 runs at {speed:.2f}× fp32's images/s, i.e. "
            f"{verdict} (the issue claims ~40× slower)"
        )
    for line in goals:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
