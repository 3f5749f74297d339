"""Federated learning benchmarks (issue #5): Flower on Ray actors vs a plain loop; memory vs clients.

    .venv/bin/python bench/fl.py                  # a few minutes on 2 cores; the snapshot is made once
    .venv/bin/python bench/fl.py --repeats 3 --rounds 4 --skip-memory

A synthetic snapshot (5,000 records of 1,400 users at 32 px, laid out as ingest writes one) is
written once under /tmp/argus-bench-fl-u8.
1. Round wall time. `federate` (Flower ServerApp + FedAvg behind the guard, the ClientApp in Ray
   actors of 1 CPU, fp16 updates, per-round checkpoints) against a plain loop in this process, no
   Ray and no Flower, that trains the same clients in turn with the same
   `app.fl.task.local_train`, takes the example-weighted mean and evaluates with
   `app.fl.task.local_evaluate`, and the server scores the test slice (`app.fl.central_test`).
   Every client trains and evaluates every round on both sides. The
   first round pays for actor start-up and data loading, so steady rounds are compared: the fastest
   of rounds 2.. of a run (a noisy neighbour can only slow a round down), then the median over
   alternating runs. Goal ≤ 1.2×.
2. Memory. `federate` with 100 and with 1,000 clients (10 sampled for training and 10 for
   evaluation per round), each in a fresh process whose whole tree (driver, GCS, raylet, actors) is
   sampled for PSS. The actor pool and each actor's data cache are bounded; goal: 10× the clients
   costs under 1.5× the memory (linear would be 10×).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import _common as common
from _common import ROOT, alternate, goal_line, median_of, print_table

STORAGE = Path("/tmp/argus-bench-fl-u8")  # -u8: uint8 pixel snapshots, not the old floats
TOPIC, SNAPSHOT, SIZE = "bench-fl", "snap-bench-fl", 32
TIME_GOAL, MEMORY_GOAL = 1.2, 1.5


def make_snapshot(records: int, users: int) -> None:
    """A snapshot as ingest lays one out (Parquet + manifest), straight from the generator."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    from app import storage
    from app.data.manifest import DataFile, WriteSpec, WriteStats, build_manifest
    from app.data.snapshot import MANIFEST
    from app.data.synth import generate
    from app.transform import decode_pixels, resize_pixels

    root = STORAGE / "snapshots" / SNAPSHOT
    if (root / MANIFEST).exists():
        return
    started = time.perf_counter()
    rows = list(generate(records, seed=7, users=users, size=SIZE))
    images = resize_pixels([decode_pixels(r.value) for r in rows], SIZE).numpy()
    table = pa.table(
        {
            "partition": pa.array([0] * len(rows), pa.int32()),
            "offset": pa.array(range(len(rows)), pa.int64()),
            "key": [r.user_id for r in rows],
            "label": [r.label for r in rows],
            "event_time": pa.array([r.event_time_ms for r in rows], pa.int64()),
            "image": ArrowTensorArray.from_numpy(images),
        }
    )
    (root / "event_date=bench").mkdir(parents=True, exist_ok=True)
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    data = buffer.getvalue().to_pybytes()
    (root / "event_date=bench" / "part-0.parquet").write_bytes(data)
    stats = WriteStats()
    for offset in range(len(rows)):
        stats.partition(0).add(offset, dead_letter=False)
    stats.labels.update(r.label for r in rows)
    stats.add_event_times(min(r.event_time_ms for r in rows), max(r.event_time_ms for r in rows))
    stats.files.append(DataFile("event_date=bench/part-0.parquet", len(data), storage.sha256(data)))
    spec = WriteSpec(
        topic=TOPIC, dlq_topic=f"{TOPIC}.dlq", image_size=SIZE, classes=None, allowed_lateness_s=3600.0
    )
    manifest = build_manifest(spec, SNAPSHOT, {0: (0, len(rows))}, {}, stats)
    (root / MANIFEST).write_text(manifest.to_json())
    print(
        f"  snapshot: {len(rows)} records of {len({r.user_id for r in rows})} users in "
        f"{time.perf_counter() - started:.0f}s",
        flush=True,
    )


def settings():
    from app.config import Settings

    return Settings(storage=str(STORAGE), topic=TOPIC, image_size=SIZE, model="cnn")


def sequential_fedavg(cfg) -> list[float]:
    """The baseline: each client trained in turn in this process, then the example-weighted mean."""
    import torch

    from app import model as core
    from app.data.snapshot import SnapshotStore
    from app.fl import central_test
    from app.fl.task import exchanged_keys, load_client_data, local_evaluate, local_train, model_arrays

    snapshots = SnapshotStore.at(settings().uri())
    classes = tuple(snapshots.read_manifest(SNAPSHOT).classes)
    uris = (snapshots.uri(SNAPSHOT),)
    torch.manual_seed(cfg.seed)
    global_model = core.build_model("cnn", len(classes))
    split, central = central_test(
        list(uris), list(classes), cfg.val_fraction, global_model, torch.device("cpu")
    )
    local, keys, datasets = copy.deepcopy(global_model), exchanged_keys(global_model), {}

    def data_of(client):  # loaded once, as an actor's cache does
        if client not in datasets:
            datasets[client] = load_client_data(
                uris, client, cfg.clients, cfg.seed, classes, split.val_from, split.test_from
            )
        return datasets[client]

    seconds = []
    for server_round in range(1, cfg.rounds + 1):
        started = time.perf_counter()
        origin = {k: v.detach().clone() for k, v in global_model.state_dict().items() if k in keys}
        total, summed = 0, {k: torch.zeros_like(v) for k, v in origin.items()}
        for client in range(cfg.clients):
            local.load_state_dict(origin, strict=False)
            local_train(
                local,
                data_of(client),
                epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                mu=0.0,
                seed=server_round * 1000 + client,
                augment=cfg.augment,
            )
            n = len(data_of(client).train_y)
            state = local.state_dict()
            for k in keys:
                summed[k] += n * (state[k].float() - origin[k])
            total += n
        global_model.load_state_dict({k: origin[k] + summed[k] / total for k in keys}, strict=False)
        for client in range(cfg.clients):
            local_evaluate(global_model, data_of(client), len(classes))
        central(server_round, model_arrays(global_model))  # as federate's server judges every round
        seconds.append(time.perf_counter() - started)
    return seconds


def _summary(seconds: list[float]) -> dict:
    """First round, and the fastest later one: a neighbour's burst can only slow a round down."""
    return {"first_s": seconds[0], "steady_s": min(seconds[1:])}


def memory_child(clients: int) -> None:
    """`--memory-child N`: one federate run with N clients in this fresh process; prints JSON."""
    from app.fl import FederateConfig, federate

    with common.local_ray(num_cpus=2):
        cfg = FederateConfig(
            rounds=2,
            clients=clients,
            clients_per_round=10,
            evaluate_clients=10,
            local_epochs=1,
            augment="none",
            run_name=f"bench-memory-{clients}-{time.time_ns()}",
        )
        report = federate(settings(), cfg)
    print(json.dumps({"actors": report.num_actors, "round_s": [r["round_seconds"] for r in report.history]}))


def measure_memory(clients: int) -> dict:
    child = subprocess.Popen(
        [sys.executable, __file__, "--memory-child", str(clients)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with common.TreeMemorySampler(child.pid, interval_s=0.5) as sampler:
        out, err = child.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if child.returncode or not lines:
        sys.exit(f"the run with {clients} clients failed:\n{err[-3000:]}")
    result = json.loads(lines[-1])
    return {
        "clients": clients,
        "pss_mb": sampler.peak_pss / 2**20,
        "rss_mb": sampler.peak_rss / 2**20,
        "processes": sampler.peak_processes,
        "actors": result["actors"],
        "steady_round_s": result["round_s"][-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--users", type=int, default=1400)
    parser.add_argument(
        "--clients", type=int, default=8, help="clients in the timing runs (all train each round)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return 0

    print(f"bench/fl.py · {common.machine_line()}")
    make_snapshot(args.records, args.users)
    from app.fl import FederateConfig, federate

    cfg = FederateConfig(
        rounds=args.rounds,
        clients=args.clients,
        clients_per_round=args.clients,
        local_epochs=1,
        batch_size=32,
        augment="none",
        num_cpus_per_client=1.0,
        seed=1,
    )
    goals = []
    with common.local_ray(num_cpus=2):

        def flower():
            report = federate(settings(), dataclasses.replace(cfg, run_name=f"bench-time-{time.time_ns()}"))
            return {
                **_summary([row["round_seconds"] for row in report.history]),
                "actors": report.num_actors,
                "mb_up": report.history[-1]["bytes_up"] / 1e6,
                "val_acc": report.metrics["val_accuracy"],
            }

        results = alternate(
            {"sequential": lambda: _summary(sequential_fedavg(cfg)), "flower+ray": flower},
            args.repeats,
            label="timing",
        )
    base, ray_ = median_of(results["sequential"], "steady_s"), median_of(results["flower+ray"], "steady_s")
    print_table(
        f"round wall time, {args.clients} clients all training and evaluating, {args.rounds} rounds "
        f"(medians of {args.repeats} runs)",
        ["driver", "first round s", "fastest later round s", "MB up/round"],
        [
            ["sequential in-process FedAvg", median_of(results["sequential"], "first_s"), base, "-"],
            [
                f"Flower on {results['flower+ray'][0]['actors']} Ray actors (fp16)",
                median_of(results["flower+ray"], "first_s"),
                ray_,
                median_of(results["flower+ray"], "mb_up"),
            ],
        ],
    )
    paired = [f["steady_s"] / s["steady_s"] for s, f in zip(results["sequential"], results["flower+ray"])]
    print(f"  per-run ratios (Flower on Ray / sequential): {', '.join(f'{r:.2f}' for r in paired)}")
    goals.append(
        goal_line("steady round, Flower on Ray vs sequential", ray_ / base, TIME_GOAL, higher_is_better=False)
    )

    if not args.skip_memory:
        small, large = measure_memory(100), measure_memory(1000)
        print_table(
            "peak memory of the whole process tree, 10 clients sampled per round, 2 rounds",
            ["clients", "PSS MB", "RSS MB", "processes", "actors", "steady round s"],
            [
                [r["clients"], r["pss_mb"], r["rss_mb"], r["processes"], r["actors"], r["steady_round_s"]]
                for r in (small, large)
            ],
        )
        goals.append(
            goal_line(
                "peak PSS, 1,000 vs 100 clients",
                large["pss_mb"] / small["pss_mb"],
                MEMORY_GOAL,
                higher_is_better=False,
                note="(linear would be 10×)",
            )
        )
    print()
    for line in goals:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
