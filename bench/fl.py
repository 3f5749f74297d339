"""Federated rounds on Ray actors vs a plain sequential FedAvg loop; memory with 100 vs 1,000 clients.

    python bench/fl.py                       # writes a synthetic snapshot once under /tmp/argus-bench-fl

1. Round wall time. The same snapshot, clients, local training (`app.fl.local_train`) and
   evaluation, driven two ways: `federate` (Flower ServerApp and strategy, ClientApp in Ray actors,
   fp16 updates, guard, checkpoints) and a loop in this process with no Ray and no Flower that trains
   each client in turn and takes the example-weighted mean. Steady-state rounds (after the first,
   which pays for actor start-up and data loading on both sides) are compared; goal ≤ 1.2×.
2. Memory. `federate` with 100 and then 1,000 clients (10 sampled per round), each in a fresh
   process: peak RSS of the driver and of its whole process tree (Ray's GCS, raylet, actors). The
   actor pool and each actor's data cache are bounded, so 10× the clients should not cost 10×.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STORAGE = "/tmp/argus-bench-fl"
TOPIC = "bench-fl"
SNAPSHOT = "snap-bench-fl"
SIZE = 32


def make_snapshot(records: int, users: int) -> None:
    """A snapshot laid out as ingest writes one (Parquet + manifest), straight from the generator."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    from app.data import preprocess
    from app.synth import generate

    root = Path(STORAGE, "snapshots", SNAPSHOT)
    if (root / "_manifest.json").exists():
        return
    started = time.perf_counter()
    rows = list(generate(records, seed=7, users=users, size=SIZE))
    images = np.concatenate([preprocess([r.value for r in rows[i:i + 256]], SIZE).numpy()
                             for i in range(0, len(rows), 256)])
    table = pa.table({"partition": pa.array([0] * len(rows), pa.int32()), "offset": pa.array(range(len(rows)), pa.int64()),
                      "key": [r.user_id for r in rows], "label": [r.label for r in rows],
                      "event_time": pa.array([r.event_time_ms for r in rows], pa.int64()),
                      "image": ArrowTensorArray.from_numpy(images)})
    (root / "event_date=bench").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / "event_date=bench" / "part-0.parquet")
    labels = sorted({r.label for r in rows})
    manifest = {"snapshot_id": SNAPSHOT, "topic": TOPIC, "records": len(rows), "image_size": SIZE, "features": None,
                "classes": labels, "label_counts": {c: sum(r.label == c for r in rows) for c in labels},
                "files": ["event_date=bench/part-0.parquet"], "offsets": {"0": {"start": 0, "end": len(rows)}}}
    (root / "_manifest.json").write_text(json.dumps(manifest))
    print(f"snapshot: {len(rows)} records, {len({r.user_id for r in rows})} users, {time.perf_counter() - started:.0f}s")


def settings():
    from app.config import Settings

    return Settings(storage=STORAGE, topic=TOPIC, image_size=SIZE, model="cnn")


def sequential_fedavg(cfg, rounds: int) -> list[float]:
    """The baseline: one process, each client trained in turn, then the example-weighted mean."""
    import torch

    from app import fl
    from app import model as core
    from app.data import snapshot_uri

    classes = tuple(json.loads(Path(STORAGE, "snapshots", SNAPSHOT, "_manifest.json").read_text())["classes"])
    uris = (snapshot_uri(settings(), SNAPSHOT),)
    torch.manual_seed(cfg.seed)
    global_model = core.build_model("cnn", len(classes))
    keys = fl.exchanged_keys(global_model)
    local = copy.deepcopy(global_model)
    datasets = {}  # loaded once, as the actors' caches do

    def data_of(client):
        if client not in datasets:
            datasets[client] = fl.load_client_data(uris, client, cfg.clients, cfg.seed, classes, cfg.val_fraction)
        return datasets[client]

    seconds = []
    for server_round in range(1, rounds + 1):
        started = time.perf_counter()
        origin = {k: v.detach().clone() for k, v in global_model.state_dict().items() if k in keys}
        total, summed = 0, {k: torch.zeros_like(v) for k, v in origin.items()}
        for client in range(cfg.clients):
            data = data_of(client)
            local.load_state_dict(origin, strict=False)
            fl.local_train(local, data, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, mu=0.0,
                           seed=server_round * 1000 + client, augment=cfg.augment)
            n = len(data.train_y)
            for k, v in local.state_dict().items():
                if k in summed:
                    summed[k] += n * (v.float() - origin[k])
            total += n
        global_model.load_state_dict({k: origin[k] + summed[k] / total for k in keys}, strict=False)
        for client in range(cfg.clients):
            fl.local_evaluate(global_model, data_of(client), len(classes))
        seconds.append(time.perf_counter() - started)
    return seconds


def _tree_rss_mb(root: int) -> float:
    """RSS of `root` and all its descendants, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def memory_child(clients: int) -> None:
    """One `federate` run in this fresh process; prints peak memory as JSON."""
    from app.fl import FederateConfig, federate

    peak = [0.0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss_mb(os.getpid()))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cfg = FederateConfig(rounds=2, clients=clients, clients_per_round=10, evaluate_clients=10, local_epochs=1,
                         augment=False, num_cpus_per_client=0.5, run_name=f"bench-memory-{clients}-{time.time_ns()}")
    report = federate(settings(), cfg)
    stop.set()
    sampler.join()
    print(json.dumps({"clients": clients, "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "tree_peak_mb": peak[0], "actors": report.num_actors,
                      "round_seconds": [round(r["round_seconds"], 2) for r in report.history]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--users", type=int, default=1400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    make_snapshot(args.records, args.users)

    from app.fl import FederateConfig, federate

    cfg = FederateConfig(rounds=args.rounds, clients=args.clients, clients_per_round=args.clients, local_epochs=1,
                         batch_size=32, augment=False, num_cpus_per_client=1.0, seed=1,
                         run_name=f"bench-time-{time.time_ns()}")
    baseline = sequential_fedavg(cfg, args.rounds)
    report = federate(settings(), cfg)
    flower = [row["round_seconds"] for row in report.history]
    steady_base, steady_flower = statistics.median(baseline[1:]), statistics.median(flower[1:])
    print(f"round wall time, {args.clients} clients all sampled, {report.num_actors} actors x "
          f"{cfg.num_cpus_per_client:g} CPU (first round, then median of the rest):")
    print(f"  sequential in-process FedAvg : {baseline[0]:6.2f}s  {steady_base:6.2f}s  {[round(s, 2) for s in baseline]}")
    print(f"  Flower on Ray actors         : {flower[0]:6.2f}s  {steady_flower:6.2f}s  {[round(s, 2) for s in flower]}")
    print(f"  ratio (steady)               : {steady_flower / steady_base:.2f}x   (goal <= 1.2x)")
    print(f"  bytes up per round           : {report.history[-1]['bytes_up'] / 1e6:.2f} MB (fp16), "
          f"val_accuracy {report.metrics.get('val_accuracy', float('nan')):.3f}")
    if args.skip_memory:
        return
    results = []
    for clients in (100, 1000):
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(clients)], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = [l for l in out.stdout.splitlines() if l.startswith("{")]
        if out.returncode or not line:
            sys.exit(f"memory run with {clients} clients failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[-1]))
    print("peak memory, 10 clients sampled per round, 2 rounds:")
    for r in results:
        print(f"  {r['clients']:5d} clients: driver {r['driver_peak_mb']:7.0f} MB, whole tree {r['tree_peak_mb']:7.0f} MB "
              f"({r['actors']} actors), rounds {r['round_seconds']}")
    small, large = results
    print(f"  1,000 vs 100 clients: driver {large['driver_peak_mb'] / small['driver_peak_mb']:.2f}x, "
          f"tree {large['tree_peak_mb'] / small['tree_peak_mb']:.2f}x   (linear would be 10x)")


if __name__ == "__main__":
    main()
