"""Federated learning benchmarks (#5, #27): Flower on Ray actors vs a plain loop in time and in quality;
memory vs clients.

    .venv/bin/python bench/fl.py                  # a few minutes on 2 cores; the table is made once
    .venv/bin/python bench/fl.py --repeats 3 --rounds 4 --skip-memory
    .venv/bin/python bench/fl.py --skip-timing --skip-memory --variant augment=light

A synthetic table commit (5,000 records of 1,400 users at 32 px, the rows ingest writes) is made
once in the Iceberg table under /tmp/argus-bench-fl-table.
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
3. Quality (#27). scikit-learn's 1,797 digit scans (shipped in the wheel; 40 users, bench/quality.py's
   records, 32 px) as a table commit under /tmp/argus-bench-fl-digits-table, 8 clients by user, 4 a round,
   2 local epochs, 5 rounds, the `cnn`, SGD lr 0.05 with momentum 0.9, batch 32: `federate` with
   its defaults against a plain PyTorch FedAvg loop in this process on the same clients' rows and
   the same event-time split, both judged on the same test slice; medians of `--seeds` seeds
   (default 10: one seed moves either side by ±0.1 here, so 3 cannot resolve the 1 % goal).
   Goal ≥ 0.99×. `--variant augment=none` (repeatable) adds an Argus row with those
   FederateConfig overrides, to find what costs accuracy.
5. Deployment (#27). The timing table's first `--devices` clients (3) as devices: each
   client's rows as PNG files in a folder of its own (`DIR/<label>/*`), one `argus device` process
   each, a SuperLink with TLS and device keys started by `federate --engine deployment`; against
   the simulation on 2 Ray actors with the same clients, seed and rounds. Round time: the fastest of
   rounds 2.., goal ≤ 1.5×. Metrics side by side: a device validates on every fifth of its images,
   not on the simulation's event-time slice, so its rows split differently and the metrics are
   near, not equal (the difference is printed). A third run adds `--secure-aggregation` (SecAgg+):
   its round time over the plain deployment's is the protocol's overhead.
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

STORAGE = Path("/tmp/argus-bench-fl-table")  # -table: the Iceberg table, not the old snapshot folders
TOPIC, SIZE = "bench-fl", 32
TIME_GOAL, MEMORY_GOAL, DEPLOYMENT_GOAL = 1.2, 1.5, 1.5


def make_table(records: int, users: int) -> None:
    """The timing runs' table commit: synthetic records straight from the generator."""
    from app.data.synth import generate
    from app.transform import decode_pixels, resize_pixels

    if _committed(settings()):
        return
    started = time.perf_counter()
    rows = list(generate(records, seed=7, users=users, size=SIZE))
    images = resize_pixels([decode_pixels(r.value) for r in rows], SIZE).numpy()
    commit_records(settings(), rows, images)
    print(
        f"  table commit: {len(rows)} records of {len({r.user_id for r in rows})} users in "
        f"{time.perf_counter() - started:.0f}s",
        flush=True,
    )


def _committed(settings) -> bool:
    from app.data.table import ImageTable

    return ImageTable.at(settings.storage, settings.catalog, settings.table).current_snapshot_id() is not None


def commit_records(settings, rows: list, images) -> int:
    """`rows` (user_id, label, event_time_ms) with their uint8 pixels `images` [N, 3, S, S] as the
    rows ingest commits, on partition 0 of the table of `settings`; the table snapshot id."""
    import pyarrow as pa

    from app.data.selection import hwc_bytes
    from app.data.table import ImageTable

    n, size = len(rows), images.shape[-1]
    table = pa.table(
        {
            "kafka_partition": pa.array([0] * n, pa.int32()),
            "kafka_offset": pa.array(range(n), pa.int64()),
            "user_id": [r.user_id for r in rows],
            "label": [r.label for r in rows],
            "event_time_ms": pa.array([r.event_time_ms for r in rows], pa.int64()),
            "device_id": [r.device_id for r in rows],
            "pixels": pa.array(hwc_bytes(images), pa.binary()),
            "height": pa.array([size] * n, pa.int32()),
            "width": pa.array([size] * n, pa.int32()),
        }
    )
    images_table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    return images_table.commit(table, {0: (0, n)}, dlq_records=0, topic=settings.topic)


def table_data(settings) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(classes, data files) of the current table snapshot, as `federate` reads them."""
    from app.data.selection import select
    from app.data.table import ImageTable

    read = select(ImageTable.at(settings.storage, settings.catalog, settings.table), settings.image_size)
    return tuple(read.classes(None)), read.files


def settings():
    from app.config import Settings

    return Settings(storage=str(STORAGE), topic=TOPIC, image_size=SIZE, model="cnn")


def sequential_fedavg(cfg) -> list[float]:
    """The baseline: each client trained in turn in this process, then the example-weighted mean."""
    import torch

    from app import model as core
    from app.fl import central_test
    from app.fl.task import exchanged_keys, load_client_data, local_evaluate, local_train, model_arrays

    classes, uris = table_data(settings())
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
            init_from=None,
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


# ---------------------------------------------------------------- 3. quality on real digits

DIGITS = Path("/tmp/argus-bench-fl-digits-table")
DIGITS_TOPIC = "bench-fl-digits"
QUALITY = dict(rounds=5, clients=8, clients_per_round=4, local_epochs=2, batch_size=32, lr=0.05)
"""#27's budget: 8 clients by user, 4 a round, 2 local epochs, 5 rounds, SGD 0.05, batch 32."""
QUALITY_GOAL = 0.99


def make_digits_table() -> None:
    """scikit-learn's 1,797 digit scans of 40 users (bench/quality.py's records) as a table commit."""
    import quality  # bench/quality.py

    from app.transform import decode_pixels, resize_pixels

    if _committed(digits_settings()):
        return
    rows = quality.digit_records(SIZE, seed=0, start_ms=1_700_000_000_000)
    images = resize_pixels([decode_pixels(r.value) for r in rows], SIZE).numpy()
    commit_records(digits_settings(), rows, images)


def digits_settings():
    from app.config import Settings

    return Settings(storage=str(DIGITS), topic=DIGITS_TOPIC, image_size=SIZE, model="cnn")


def plain_fedavg(seed: int) -> float:
    """The reference: FedAvg as a plain PyTorch loop writes it, in this process, on the same
    clients' rows (`load_client_data`: the same users per client, the same event-time split),
    judged on the same test slice. Each round 4 of the 8 clients, drawn by `random.Random(seed)`,
    copy the global model and run 2 epochs of SGD (lr 0.05, momentum 0.9, batch 32, shuffled, no
    augmentation); the server takes the example-weighted mean of their state dicts."""
    import random

    import torch
    from torch import nn

    from app import model as core
    from app.fl import central_test
    from app.fl.task import load_client_data
    from app.transform import normalize_pixels

    classes, uris = table_data(digits_settings())
    torch.manual_seed(seed)
    model = core.build_model("cnn", len(classes))
    split, central = central_test(list(uris), list(classes), 0.2, model, torch.device("cpu"))
    q = QUALITY
    data = [
        load_client_data(uris, client, q["clients"], seed, classes, split.val_from, split.test_from)
        for client in range(q["clients"])
    ]
    sampler = random.Random(seed)
    for _ in range(q["rounds"]):
        states, sizes = [], []
        for client in sampler.sample(range(q["clients"]), q["clients_per_round"]):
            local = copy.deepcopy(model).train()
            optimizer = torch.optim.SGD(local.parameters(), lr=q["lr"], momentum=0.9)
            x, y = data[client].train_x, data[client].train_y
            for _ in range(q["local_epochs"]):
                for index in torch.randperm(len(y)).split(q["batch_size"]):
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(local(normalize_pixels(x[index])), y[index])
                    loss.backward()
                    optimizer.step()
            states.append(local.state_dict())
            sizes.append(len(y))
        model.load_state_dict(
            {
                key: sum(state[key] * n for state, n in zip(states, sizes)) / sum(sizes)
                if value.is_floating_point()
                else value
                for key, value in states[0].items()
            }
        )
    return central.evaluate(model.eval())["accuracy"]


def argus_fedavg(seed: int, **overrides) -> float:
    """`federate` with its defaults at the same budget: the registered version's test-slice accuracy."""
    from app.fl import FederateConfig, federate

    cfg = FederateConfig(
        **{**QUALITY, "init_from": None, **overrides}, seed=seed, run_name=f"bench-quality-{time.time_ns()}"
    )
    return federate(digits_settings(), cfg).metrics["test_accuracy"]


def central_champion(seed: int) -> tuple[str, float]:
    """A centrally trained starting model, as `train` would register one: the cnn trained in this
    process on every client's training rows (AdamW 1e-3, 10 epochs, batch 64), registered and
    aliased `central-<seed>`. (alias, its test-slice accuracy)."""
    import pyarrow.compute as pc
    import torch
    from torch import nn

    from app import model as core
    from app import registry
    from app.data.selection import select
    from app.data.table import ImageTable
    from app.fl import central_test
    from app.fl.task import labelled_rows
    from app.transform import normalize_pixels

    settings = digits_settings()
    read = select(ImageTable.at(settings.storage, settings.catalog, settings.table), SIZE)
    classes, uris = read.classes(None), list(read.files)
    torch.manual_seed(seed)
    model = core.build_model("cnn", len(classes))
    split, central = central_test(uris, classes, 0.2, model, torch.device("cpu"))
    x, y, _ = labelled_rows(uris, classes, pc.field("event_time_ms") < split.val_from)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(10):
        for index in torch.randperm(len(y)).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(normalize_pixels(x[index])), y[index]).backward()
            optimizer.step()
    model.eval()
    card = registry.ModelCard(
        arch="cnn", classes=classes, image_size=SIZE, features=False, training_kind="ddp",
        lineage=read.lineage(), metrics={}, split=split.to_dict(),
    )  # fmt: skip
    with registry.start_run(
        settings.tracking_uri, registry.artifact_root(settings), f"central-{seed}"
    ) as run:
        version = registry.register(settings.tracking_uri, settings.model_name, run.info.run_id, model, card)
    alias = f"central-{seed}"
    registry.promote(settings.tracking_uri, settings.model_name, version, alias=alias)
    return alias, central.evaluate(model)["accuracy"]


def fine_tune_part(seeds: int, recipes: list[str]) -> list[str]:
    """`federate --init-from` a central model with each recipe: the test-slice accuracy it leaves
    against the one it started from (#27: after ≥ before − 0.005)."""
    import statistics

    make_digits_table()
    recipes = ["", *recipes]  # "": federate's defaults
    changes: dict[str, list[float]] = {r: [] for r in recipes}
    with common.local_ray(num_cpus=2):
        for seed in range(seeds):
            alias, before = central_champion(seed)
            for recipe in recipes:
                # federate's own learning rate unless the recipe sets one (QUALITY's is the fresh one)
                after = argus_fedavg(seed, init_from=alias, **{"lr": None, **_variant(recipe)})
                changes[recipe].append(after - before)
                print(
                    f"  seed {seed}: central {before:.3f} → fine-tuned ({recipe or 'defaults'}) {after:.3f}",
                    flush=True,
                )
    rows = [
        [
            recipe or "defaults",
            *(f"{c:+.3f}" for c in changes[recipe]),
            f"{statistics.median(changes[recipe]):+.3f}",
        ]
        for recipe in recipes
    ]
    print_table(
        "fine-tuning a central model: test-slice accuracy after − before, same budget as above",
        ["recipe", *(f"seed {s}" for s in range(seeds)), "median"],
        rows,
    )
    best = max(recipes, key=lambda r: statistics.median(changes[r]))
    return [
        f"goal: fine-tuning ({recipe or 'defaults'}) keeps test-slice accuracy within 0.005 (median): "
        f"measured {statistics.median(changes[recipe]):+.3f} "
        f"({'PASS' if statistics.median(changes[recipe]) >= -0.005 else 'MISS'})"
        for recipe in dict.fromkeys(["", best])
    ]


def _variant(text: str) -> dict:
    """`key=value,key=value` → FederateConfig overrides, typed like the field's default."""
    from app.fl import FederateConfig

    defaults = FederateConfig()
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        default = getattr(defaults, key)
        out[key] = value if isinstance(default, str) or default is None else type(default)(value)
    return out


def quality_part(seeds: int, variants: list[str]) -> list[str]:
    import statistics

    make_digits_table()
    rows, argus_medians = [], {}
    with common.local_ray(num_cpus=2):
        runs = {"plain PyTorch FedAvg": plain_fedavg, "Argus federate (defaults)": argus_fedavg}
        for variant in variants:
            runs[f"Argus federate {variant}"] = lambda seed, v=variant: argus_fedavg(seed, **_variant(v))
        for name, run in runs.items():
            accuracies = []
            for seed in range(seeds):
                started = time.perf_counter()
                accuracies.append(run(seed))
                print(
                    f"  {name}, seed {seed}: {accuracies[-1]:.3f} ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
            argus_medians[name] = statistics.median(accuracies)
            rows.append([name, *(f"{a:.3f}" for a in accuracies), f"{argus_medians[name]:.3f}"])
    print_table(
        f"test-slice accuracy on scikit-learn's digits, 8 clients by user, 4 a round, 2 local epochs, "
        f"5 rounds, cnn at {SIZE} px",
        ["run", *(f"seed {s}" for s in range(seeds)), "median"],
        rows,
    )
    plain = argus_medians["plain PyTorch FedAvg"]
    return [
        goal_line(
            "Argus FedAvg vs plain FedAvg (medians)",
            argus_medians["Argus federate (defaults)"] / plain,
            QUALITY_GOAL,
        )
    ]


def every_client_config(rounds: int, clients: int):
    """The timing runs' FederateConfig: every client trains every round, one local epoch."""
    from app.fl import FederateConfig

    return FederateConfig(
        rounds=rounds,
        clients=clients,
        clients_per_round=clients,
        local_epochs=1,
        batch_size=32,
        augment="none",
        init_from=None,
        num_cpus_per_client=1.0,
        seed=1,
    )


def timing_part(args) -> list[str]:
    make_table(args.records, args.users)
    from app.fl import federate

    cfg = every_client_config(args.rounds, args.clients)
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
    return goals


# ---------------------------------------------------------------- 5. deployment vs simulation


def write_device_folders(cfg, root: Path) -> list[Path]:
    """Client i's rows (training and validation, as the simulation deals them) as PNG files under
    root/device<i>/<label>/, the layout `argus device` reads."""
    import torch
    from PIL import Image

    from app import model as core
    from app.fl import central_test
    from app.fl.task import load_client_data

    classes, uris = table_data(settings())
    model = core.build_model("cnn", len(classes))
    split, _ = central_test(list(uris), list(classes), cfg.val_fraction, model, torch.device("cpu"))
    folders = []
    for client in range(cfg.clients):
        data = load_client_data(uris, client, cfg.clients, cfg.seed, classes, split.val_from, split.test_from)
        folder = root / f"device{client}"
        pixels = torch.cat([data.train_x, data.val_x]).permute(0, 2, 3, 1).numpy()
        for i, (image, label) in enumerate(zip(pixels, torch.cat([data.train_y, data.val_y]).tolist())):
            (folder / classes[label]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / classes[label] / f"{i:05d}.png")
        folders.append(folder)
    return folders


def on_devices(cfg, folders: list[Path], tmp: Path, secure_aggregation: bool = False):
    """`federate --engine deployment` (a SuperLink of its own, the devices' keys registered) with
    one `argus device` process per folder; its report."""
    import threading

    sys.path.insert(0, str(ROOT / "tests"))
    from app.fl import federate
    from app.fl.superlink import FlowerControl, stop_tree
    from app.net import free_port

    from conftest import device_keys, make_tls_files, start_device

    tls = make_tls_files(tmp / "tls")
    keys = device_keys(tmp / "keys", [f"device{i}" for i in range(len(folders))])
    address = f"127.0.0.1:{free_port()}"
    cfg = dataclasses.replace(
        cfg,
        engine="deployment",
        superlink=address,
        root_certificates=str(tls["ca"]),
        superlink_certfile=str(tls["server_cert"]),
        superlink_keyfile=str(tls["server_key"]),
        device_keys=str(tmp / "keys"),
        secure_aggregation=secure_aggregation,
        run_name=f"bench-devices-{time.time_ns()}",
    )
    outcome = {}

    def run():
        try:
            outcome["report"] = federate(settings(), cfg)
        except Exception as exc:  # raised below, in the bench's thread
            outcome["error"] = exc

    server = threading.Thread(target=run, daemon=True)
    server.start()
    control = FlowerControl(address, str(tls["ca"]), tmp / "cli")
    deadline = time.monotonic() + 300
    while True:  # the SuperLink is up with every key registered
        if not server.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the SuperLink did not register the devices: {outcome}")
        try:
            if len(control.nodes()) == len(folders):
                break
        except RuntimeError:
            pass
        time.sleep(1)
    devices = []
    try:
        for i, folder in enumerate(folders):
            devices.append(start_device(tmp, f"device{i}", folder, address, tls["ca"], keys[f"device{i}"]))
        server.join()
    finally:
        for device in devices:
            stop_tree(device)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"]


def deployment_part(args) -> list[str]:
    make_table(args.records, args.users)
    from app.fl import federate

    cfg = every_client_config(args.rounds, args.devices)
    with common.scratch_dir("argus-bench-fl-devices-") as tmp:
        folders = write_device_folders(cfg, tmp / "folders")

        def simulation():
            with common.local_ray(num_cpus=2):
                return federate(settings(), dataclasses.replace(cfg, run_name=f"bench-sim-{time.time_ns()}"))

        reports = {
            "simulation": simulation(),
            "deployment": on_devices(cfg, folders, tmp / "plain"),
            "deployment, SecAgg+": on_devices(cfg, folders, tmp / "secure", secure_aggregation=True),
        }
    rows, steady = [], {}
    for engine, report in reports.items():
        seconds = [row["round_seconds"] for row in report.history]
        steady[engine] = min(seconds[1:])
        metrics = report.metrics
        rows.append([engine, seconds[0], steady[engine], metrics["test_accuracy"], metrics["val_accuracy"]])
    print_table(
        f"deployment vs simulation, {args.devices} clients all training, {args.rounds} rounds, seed 1",
        ["engine", "first round s", "fastest later round s", "test-slice accuracy", "client val accuracy"],
        rows,
    )
    gap = rows[1][3] - rows[0][3]
    print(f"  test-slice accuracy, deployment - simulation: {gap:+.3f} (devices split their own validation)")
    overhead = steady["deployment, SecAgg+"] / steady["deployment"]
    print(f"  SecAgg+ round overhead: {overhead:.2f}× the plain deployment's steady round")
    ratio = steady["deployment"] / steady["simulation"]
    return [goal_line("steady round, devices vs simulation", ratio, DEPLOYMENT_GOAL, higher_is_better=False)]


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
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-fine-tune", action="store_true")
    parser.add_argument("--skip-deployment", action="store_true")
    parser.add_argument("--devices", type=int, default=3, help="devices (processes) in the deployment run")
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        help="a fine-tuning run with these FederateConfig overrides besides the defaults, e.g. lr=0.005",
    )
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the quality runs (medians)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="an extra Argus quality run with these FederateConfig overrides, e.g. augment=none",
    )
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return 0

    print(f"bench/fl.py · {common.machine_line()}")
    goals = []
    if not args.skip_timing:
        goals += timing_part(args)
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
    if not args.skip_quality:
        goals += quality_part(args.seeds, args.variant)
    if not args.skip_fine_tune:
        goals += fine_tune_part(args.seeds, args.recipe)
    if not args.skip_deployment:
        goals += deployment_part(args)
    print()
    for line in goals:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
