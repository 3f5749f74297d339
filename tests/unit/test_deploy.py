"""Deployment files: kuberay/*.yaml, cluster.yaml, Dockerfile.

The KubeRay manifests are validated against the KubeRay v1 CRD schemas, read from
$ARGUS_KUBERAY_SCHEMAS or ../shared/schemas/kuberay/ (skipped when neither exists, failed under CI).
Validation is strict: an unknown field, which the API server would silently prune, fails
too. The Serve config inside the RayService is checked with Ray Serve's own schema and
against the application `app.serve:build_app` builds from it; cluster.yaml with the cluster
launcher's own validation. Every Ray version in these files must be the installed one. Offline and fast:

    python -m pytest tests/unit/test_deploy.py -q
"""

import copy
import importlib
import inspect
import json
import os
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import ray
import yaml
from ray import serve
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from conftest import missing_dependency

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "kuberay"
MANIFESTS = {"RayCluster": "raycluster.yaml", "RayJob": "rayjob.yaml", "RayService": "rayservice.yaml"}
CONFIGMAP = "argus-config"
APP_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "ARGUS_STORAGE", "MLFLOW_TRACKING_URI")
HEAD_PORTS = {6379, 8265, 10001, 8000}
SERVE_IMPORT_PATH = "app.serve:build_app"
SERVE_DEPLOYMENT = "ArgusModel"
SERVE_ARGS = {"mlflow_uri", "model_name", "alias", "max_batch_size", "batch_wait_timeout_s", "max_body_bytes"}


# --- loading ----------------------------------------------------------------------------


def load_docs(kind: str) -> list[dict]:
    with open(KUBERAY / MANIFESTS[kind]) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def load_cr(kind: str) -> dict:
    crs = [d for d in load_docs(kind) if d.get("kind") == kind]
    assert len(crs) == 1, f"{MANIFESTS[kind]}: expected one {kind}, found {len(crs)}"
    return crs[0]


def cluster_spec(cr: dict) -> dict:
    """The RayClusterSpec inside any of the three custom resources."""
    key = {"RayCluster": None, "RayJob": "rayClusterSpec", "RayService": "rayClusterConfig"}[cr["kind"]]
    return cr["spec"] if key is None else cr["spec"][key]


def containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def gpu_capacity(spec: dict) -> int:
    """GPUs the cluster can reach at full scale."""
    return sum(
        g["maxReplicas"] * int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        for g in spec.get("workerGroupSpecs", [])
        for c in g["template"]["spec"]["containers"]
    )


def schema_dir() -> Path:
    candidates = [Path(p) for p in [os.environ.get("ARGUS_KUBERAY_SCHEMAS")] if p]
    candidates.append(REPO.parent / "shared" / "schemas" / "kuberay")
    for d in candidates:
        if d.is_dir():
            return d
    missing_dependency(
        "KubeRay CRD schemas not found "
        f"(set ARGUS_KUBERAY_SCHEMAS; looked in {', '.join(map(str, candidates))})"
    )


def strict(schema):
    """Close every object schema that lists its properties.

    A CRD schema leaves unknown fields open because the API server prunes them, so a
    misspelt field (`rayStartParam`) would validate here and then silently vanish."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = strict(out[key])
    return out


_validators: dict = {}


def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    if kind not in _validators:
        with open(schema_dir() / f"{kind}.v1.json") as f:
            schema = json.load(f)
        # Accept the whole CRD as well as its bare openAPIV3Schema.
        if schema.get("kind") == "CustomResourceDefinition":
            (version,) = [v for v in schema["spec"]["versions"] if v["name"] == "v1"]
            schema = version["schema"]["openAPIV3Schema"]
        schema = schema.get("openAPIV3Schema", schema)
        jsonschema.Draft7Validator.check_schema(schema)
        _validators[kind] = jsonschema.Draft7Validator(strict(schema))
    return _validators[kind]


# --- KubeRay: schema --------------------------------------------------------------------


@pytest.mark.parametrize("kind", MANIFESTS)
def test_manifest_matches_crd_schema(kind):
    cr = load_cr(kind)
    assert cr["apiVersion"] == "ray.io/v1"
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(kind).iter_errors(cr)
    ]
    assert not errors, f"{MANIFESTS[kind]}:\n" + "\n".join(errors)


def _set(path, value):
    def mutate(cr):
        *parents, last = path
        node = cluster_spec(cr)
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


def _rename_head_start_params(cr):
    head = cluster_spec(cr)["headGroupSpec"]
    head["rayStartParam"] = head.pop("rayStartParams")


# Each breaks one thing the API server or the operator would reject (or silently drop).
CLUSTER_BREAKS = {
    "minReplicas-as-string": _set(["workerGroupSpecs", 0, "minReplicas"], "1"),
    "rayStartParams-int-value": _set(["headGroupSpec", "rayStartParams", "num-cpus"], 0),
    "memory-not-a-quantity": _set(
        ["headGroupSpec", "template", "spec", "containers", 0, "resources", "limits", "memory"], "8GB"
    ),
    "head-template-missing": lambda cr: cluster_spec(cr)["headGroupSpec"].pop("template"),
    "worker-groupName-missing": lambda cr: cluster_spec(cr)["workerGroupSpecs"][0].pop("groupName"),
    "misspelt-field": _rename_head_start_params,
}
KIND_BREAKS = {
    "RayJob": {
        "shutdownAfterJobFinishes-as-string": lambda cr: cr["spec"].__setitem__(
            "shutdownAfterJobFinishes", "yes"
        ),
        "ttl-as-string": lambda cr: cr["spec"].__setitem__("ttlSecondsAfterFinished", "600"),
    },
    "RayCluster": {
        "gcs-backend-unknown": lambda cr: cr["spec"]["gcsFaultToleranceOptions"].__setitem__(
            "backend", "etcd"
        ),
        "upgrade-strategy-unknown": lambda cr: cr["spec"]["upgradeStrategy"].__setitem__("type", "Rolling"),
    },
    "RayService": {
        "redis-password-misspelt": lambda cr: cr["spec"]["rayClusterConfig"][
            "gcsFaultToleranceOptions"
        ].__setitem__(
            "redisPasword", cr["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"].pop("redisPassword")
        ),
        "serveConfigV2-as-mapping": lambda cr: cr["spec"].__setitem__(
            "serveConfigV2", yaml.safe_load(cr["spec"]["serveConfigV2"])
        ),
        "rayClusterConfig-missing": lambda cr: cr["spec"].pop("rayClusterConfig"),
    },
}
BREAKS = [(k, name, fn) for k in MANIFESTS for name, fn in CLUSTER_BREAKS.items()] + [
    (k, name, fn) for k, breaks in KIND_BREAKS.items() for name, fn in breaks.items()
]


@pytest.mark.parametrize("kind,name,mutate", BREAKS, ids=[f"{k}-{n}" for k, n, _ in BREAKS])
def test_broken_manifest_fails_schema(kind, name, mutate):
    broken = copy.deepcopy(load_cr(kind))
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        crd_validator(kind).validate(broken)


# --- KubeRay: what the schema cannot see --------------------------------------------------


def test_configmap_identical_in_every_manifest_and_used_by_every_container():
    maps = {}
    for kind, fname in MANIFESTS.items():
        (cm,) = [d for d in load_docs(kind) if d.get("kind") == "ConfigMap"]
        assert cm["metadata"]["name"] == CONFIGMAP
        assert all(isinstance(v, str) and v for v in cm["data"].values()), (
            f"{fname}: ConfigMap values must be strings"
        )
        maps[fname] = cm
        for c in containers(cluster_spec(load_cr(kind))):
            refs = [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
            assert CONFIGMAP in refs, f"{fname}: container {c['name']} does not read {CONFIGMAP}"
    first, *rest = maps.values()
    assert all(m == first for m in rest), "the argus-config ConfigMaps differ between manifests"
    assert set(APP_ENV) <= set(first["data"])


@pytest.mark.parametrize("kind", MANIFESTS)
def test_cluster_shape(kind):
    spec = cluster_spec(load_cr(kind))
    head = spec["headGroupSpec"]
    # The head Service routes to it; the NetworkPolicy and token auth close it.
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (head_container,) = head["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in head_container["ports"]} >= HEAD_PORTS
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"], "the head is meant to be CPU-only"
    for c in containers(spec):
        assert c["resources"]["limits"] and c["resources"]["requests"], (
            f"{c['name']}: set limits and requests"
        )
    assert spec["workerGroupSpecs"], "no worker group"
    for g in spec["workerGroupSpecs"]:
        assert g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"]
    assert gpu_capacity(spec) >= 1


RAY_AUTH_SECRET = "argus-ray-auth"
CLUSTER_LABEL = "argus.dev/ray-cluster"
# Ports a peer outside the Ray cluster may reach: Serve (behind API tokens) and metrics.
OPEN_PORTS = {"RayCluster": {8080}, "RayJob": {8080}, "RayService": {8000, 8080}}


@pytest.mark.parametrize("kind", MANIFESTS)
def test_the_control_plane_needs_ray_token_auth(kind):
    """KubeRay turns on Ray's token authentication from the Secret and calls the dashboard with it."""
    spec = cluster_spec(load_cr(kind))
    assert spec["authOptions"] == {"mode": "token", "secretName": RAY_AUTH_SECRET}
    for c in containers(spec):  # a hand-set mode or token would fight the operator's
        assert not {e["name"] for e in c.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, c["name"]
    assert "serviceType" not in spec["headGroupSpec"], "the head Service must stay ClusterIP"


@pytest.mark.parametrize("kind", MANIFESTS)
def test_ray_ports_answer_only_the_clusters_own_pods(kind):
    cr = load_cr(kind)
    spec = cluster_spec(cr)
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    labels = {g["template"]["metadata"]["labels"][CLUSTER_LABEL] for g in groups}
    assert labels == {cr["metadata"]["name"]}, labels
    (policy,) = [d for d in load_docs(kind) if d.get("kind") == "NetworkPolicy"]
    own_pods = {"podSelector": {"matchLabels": {CLUSTER_LABEL: cr["metadata"]["name"]}}}
    operator = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
    }
    assert policy["spec"]["podSelector"] == own_pods["podSelector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        if peers and all(p in (own_pods, operator) for p in peers):
            continue  # Ray's own traffic, and the operator's dashboard calls
        ports = {p["port"] for p in rule.get("ports", [])}
        assert ports and ports <= OPEN_PORTS[kind], f"{MANIFESTS[kind]}: {rule} opens {ports or 'every port'}"


def test_cluster_yaml_runs_token_auth_with_a_loopback_dashboard():
    config = launcher_config()
    assert "-e RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head_start.split()


def test_all_manifests_run_one_image():
    images = {c["image"] for kind in MANIFESTS for c in containers(cluster_spec(load_cr(kind)))}
    assert len(images) == 1, f"the manifests name several images: {sorted(images)}"
    pyproject = REPO / "pyproject.toml"
    if pyproject.exists():
        import tomllib

        version = tomllib.loads(pyproject.read_text()).get("project", {}).get("version")
        if version:  # a dynamic version cannot be checked statically
            (image,) = images
            assert image.rsplit(":", 1)[-1] == version, (
                f"{image} is not tagged with the project version {version}"
            )


def test_head_services_do_not_collide():
    # RayCluster and RayService both create `<metadata.name>-head-svc` in the namespace.
    names = [load_cr(kind)["metadata"]["name"] + "-head-svc" for kind in ("RayCluster", "RayService")]
    assert len(set(names)) == len(names), names


# --- KubeRay: the head node's loss (README.md, "What survives which failure") ------------------

FAULT_TOLERANT = ("RayCluster", "RayService")  # a RayJob's cluster lives for its one job


def load_redis() -> dict[str, dict]:
    with open(KUBERAY / "redis.yaml") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "redis.yaml: one object of each kind expected"
    return kinds


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("kind", FAULT_TOLERANT)
def test_the_heads_gcs_keeps_its_tables_in_the_redis_of_redis_yaml(kind):
    """gcsFaultToleranceOptions point at redis.yaml's Service with the password its Redis requires;
    that Redis keeps an append-only file on its claimed volume and admits the cluster's pods."""
    spec = cluster_spec(load_cr(kind))
    redis = load_redis()
    options = spec["gcsFaultToleranceOptions"]
    assert options.get("backend", "redis") == "redis"
    host, port = options["redisAddress"].rsplit(":", 1)
    service, deployment = redis["Service"], redis["Deployment"]
    assert host == service["metadata"]["name"] and int(port) in {p["port"] for p in service["spec"]["ports"]}
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert (
        secrets[_arg(args, "--requirepass").strip("$()")]
        == options["redisPassword"]["valueFrom"]["secretKeyRef"]
    )
    # What Redis holds outlives Redis's own restart.
    assert _arg(args, "--appendonly") == "yes"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == _arg(args, "--dir")]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == redis["PersistentVolumeClaim"]["metadata"]["name"]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two pods on one RWO volume
    # Only Ray pods reach it, and this cluster's pods are Ray pods.
    (rule,) = redis["NetworkPolicy"]["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchExpressions": [{"key": CLUSTER_LABEL, "operator": "Exists"}]}}
    ]
    assert {p["port"] for p in rule["ports"]} == {int(port)}
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert CLUSTER_LABEL in group["template"]["metadata"]["labels"]
    # The operator sets the head's Redis address, password and key prefix: hand-set ones would fight it.
    for c in containers(spec):
        assert not {e["name"] for e in c.get("env", [])} & {
            "RAY_REDIS_ADDRESS",
            "RAY_external_storage_namespace",
        }
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica or task dies with it


def test_serve_traffic_never_depends_on_the_head():
    """The Service reaches the workers' proxies only, every node with a replica runs one, and a new
    image brings up a whole cluster before traffic moves (a head restart loses nothing: above)."""
    cr = load_cr("RayService")
    assert cr["spec"]["excludeHeadPodFromServeSvc"] is True
    assert cr["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert yaml.safe_load(cr["spec"]["serveConfigV2"])["proxy_location"] == "EveryNode"
    assert load_cr("RayCluster")["spec"]["upgradeStrategy"] == {"type": "None"}  # never kill running jobs


# --- KubeRay: monitoring (README.md, "Monitoring") -----------------------------------------

MONITORING_NAMESPACE = "monitoring"  # where Prometheus and Grafana run, and monitoring/ applies
METRICS_TAB_ENV = ("RAY_GRAFANA_HOST", "RAY_PROMETHEUS_HOST", "RAY_GRAFANA_IFRAME_HOST")


def test_the_heads_dashboard_finds_prometheus_and_grafana():
    """The Metrics tab: the head's dashboard asks Grafana and Prometheus at their Services in the
    namespace the NetworkPolicy lets scrape the metrics port, the one monitoring/ applies to."""
    wired = {}
    for kind, fname in MANIFESTS.items():
        (head,) = cluster_spec(load_cr(kind))["headGroupSpec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in head.get("env", [])}
        assert set(METRICS_TAB_ENV) <= env.keys(), f"{fname}: head lacks {set(METRICS_TAB_ENV) - env.keys()}"
        for name in ("RAY_GRAFANA_HOST", "RAY_PROMETHEUS_HOST"):
            url = urlparse(env[name])
            assert url.scheme == "http" and url.port, f"{fname}: {name}={env[name]}"
            assert url.hostname.endswith(f".{MONITORING_NAMESPACE}.svc"), f"{fname}: {name}={env[name]}"
        assert urlparse(env["RAY_GRAFANA_IFRAME_HOST"]).scheme in {"http", "https"}, fname
        wired[fname] = {name: env[name] for name in METRICS_TAB_ENV}
        (policy,) = [d for d in load_docs(kind) if d.get("kind") == "NetworkPolicy"]
        scrapers = [
            rule
            for rule in policy["spec"]["ingress"]
            if {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}
            in rule.get("from", [])
        ]
        assert any({"port": 8080, "protocol": "TCP"} in rule.get("ports", []) for rule in scrapers), fname
    first, *rest = wired.values()
    assert all(w == first for w in rest), f"the manifests' heads disagree: {wired}"
    kustomization = yaml.safe_load((REPO / "monitoring" / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == MONITORING_NAMESPACE


def test_rayjob_runs_ingest_then_train_inside_the_job():
    cr = load_cr("RayJob")
    assert cr["spec"]["shutdownAfterJobFinishes"] is True
    assert cr["spec"]["ttlSecondsAfterFinished"] > 0
    # KubeRay pastes the entrypoint unquoted into the submitter's shell line, so a shell
    # operator at top level would run the rest of the command in the submitter pod.
    lexer = shlex.shlex(cr["spec"]["entrypoint"], posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    operators = [t for t in tokens if t and set(t) <= set("&|;<>()")]
    assert not operators, f"entrypoint has top-level shell operators {operators}: wrap it in bash -c '...'"
    command = " ".join(tokens)
    assert re.search(r"python -m app ingest\s*&&\s*python -m app train\b", command), command
    assert "--use-gpu" in command
    num_workers = int(re.search(r"--num-workers[ =](\d+)", command).group(1))
    assert num_workers <= gpu_capacity(cluster_spec(cr)), "more training workers than GPUs in the cluster"


# --- RayService: the Serve config -------------------------------------------------------


def serve_config() -> dict:
    return yaml.safe_load(load_cr("RayService")["spec"]["serveConfigV2"])


def test_serve_config_is_valid_for_ray_serve():
    config = ServeDeploySchema.model_validate(serve_config())
    (app,) = config.applications
    assert app.import_path == SERVE_IMPORT_PATH
    assert app.route_prefix == "/"
    assert [d.name for d in app.deployments] == [SERVE_DEPLOYMENT]
    assert set(app.args) <= SERVE_ARGS, f"unknown build_app args: {set(app.args) - SERVE_ARGS}"
    assert config.http_options.host == "0.0.0.0"
    head = cluster_spec(load_cr("RayService"))["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert config.http_options.port in {p["containerPort"] for p in head["ports"]}


def test_serve_config_fits_its_cluster():
    (app,) = serve_config()["applications"]
    (deployment,) = app["deployments"]
    (cm,) = [d for d in load_docs("RayService") if d.get("kind") == "ConfigMap"]
    assert app["args"]["mlflow_uri"] == cm["data"]["MLFLOW_TRACKING_URI"]
    assert deployment["max_ongoing_requests"] >= app["args"]["max_batch_size"], "batches could never fill"
    replicas = deployment.get("autoscaling_config", {}).get("max_replicas", deployment.get("num_replicas", 1))
    gpus = deployment.get("ray_actor_options", {}).get("num_gpus", 0)
    assert replicas * gpus <= gpu_capacity(cluster_spec(load_cr("RayService")))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replicas", 2),  # and autoscaling
        lambda c: c["applications"][0]["deployments"][0].__setitem__("max_ongoing_requests", "lots"),
        lambda c: c["applications"][0].pop("import_path"),
    ],
    ids=["num_replicas-with-autoscaling", "wrong-type", "no-import_path"],
)
def test_broken_serve_config_fails(mutate):
    broken = serve_config()
    mutate(broken)
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        ServeDeploySchema.model_validate(broken)


def test_serve_config_matches_app_code(monkeypatch):
    """The Serve config builds Argus's application as Serve's controller does (its import path's
    builder called with its args; no cluster needed) and tunes the deployment that application has."""
    monkeypatch.delenv("ARGUS_API_TOKENS", raising=False)  # build_app would read that file
    config = ServeDeploySchema.model_validate(serve_config())
    (app_config,) = config.applications
    module, attr = app_config.import_path.split(":")
    application = getattr(importlib.import_module(module), attr)(app_config.args)
    assert isinstance(application, serve.Application)
    deployment = application._bound_deployment  # Serve names no public accessor for it

    # Serve refuses settings for a deployment the application does not have.
    (tuning,) = app_config.deployments
    assert tuning.name == deployment.name == SERVE_DEPLOYMENT
    # Every arg reaches the replica's constructor, which takes them all, with the config's value.
    init = inspect.signature(deployment.func_or_class).bind(*deployment.init_args, **deployment.init_kwargs)
    for key, value in app_config.args.items():
        assert init.arguments[key] == value, key
    # The settings apply to that deployment (Serve's own checks) and leave the code's other ones.
    settings = tuning.model_dump(exclude_unset=True, exclude={"name"})
    tuned = deployment.options(**settings)
    assert tuned.max_ongoing_requests == settings["max_ongoing_requests"] >= init.arguments["max_batch_size"]
    assert tuned.ray_actor_options == settings["ray_actor_options"]
    autoscaling = tuned._deployment_config.autoscaling_config
    assert autoscaling.max_replicas == settings["autoscaling_config"]["max_replicas"]
    assert tuned.max_queued_requests == deployment.max_queued_requests


# --- cluster.yaml (Ray cluster launcher) --------------------------------------------------


def launcher_config() -> dict:
    with open(REPO / "cluster.yaml") as f:
        return yaml.safe_load(f)


def test_cluster_yaml_passes_ray_validation():
    # With every node type's resources given, prepare_config needs no cloud call.
    config = prepare_config(launcher_config())
    validate_config(config)
    nodes = config["available_node_types"]
    assert config["head_node_type"] in nodes
    assert any(
        t["resources"].get("GPU", 0) >= 1 for name, t in nodes.items() if name != config["head_node_type"]
    )
    for local in config["file_mounts"].values():
        if local.startswith("~"):  # the operator's own file (Ray's auth token), not the repo's
            continue
        assert (REPO / local).exists(), f"file_mounts source {local} does not exist relative to the repo root"
    assert any("pip install" in cmd and "~/argus" in cmd for cmd in config["setup_commands"])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c.__setitem__("head_node_type", "no.such.type"),
        lambda c: c.__setitem__("max_workers", "four"),
        lambda c: c.__setitem__("max_workers", -1),
        lambda c: next(t for n, t in c["available_node_types"].items() if n != c["head_node_type"])[
            "resources"
        ].__setitem__("GPU", "1"),
        lambda c: c.__setitem__("max_worker", 4),  # typo: the launcher's schema is closed
        lambda c: c.pop("provider"),
    ],
    ids=[
        "unknown-head-type",
        "max_workers-string",
        "max_workers-negative",
        "gpu-as-string",
        "misspelt",
        "no-provider",
    ],
)
def test_broken_cluster_yaml_fails(mutate):
    broken = launcher_config()
    mutate(broken)
    with pytest.raises((ValueError, KeyError, jsonschema.ValidationError)):
        validate_config(prepare_config(broken))


# --- one Ray version everywhere -----------------------------------------------------------


def test_ray_version_pinned_everywhere():
    version = ray.__version__
    for kind in MANIFESTS:
        assert cluster_spec(load_cr(kind))["rayVersion"] == version, MANIFESTS[kind]

    dockerfile = (REPO / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", dockerfile, re.M))
    assert args["RAY_VERSION"] == version
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base == f"rayproject/ray:{version}-py311-gpu", base

    launcher = (REPO / "cluster.yaml").read_text()
    tags = re.findall(r"rayproject/ray:(\S+)", launcher)
    assert tags and all(t.startswith(f"{version}-") for t in tags), tags
    pins = re.findall(r"\bray(?:\[[^\]]*\])?==([\w.]+)", launcher)
    assert pins and set(pins) == {version}, pins


def test_every_node_runs_serve_with_the_apps_serve_env():
    """The Serve settings local clusters get (app/cluster.py) are those of the image and cluster.yaml."""
    from app.cluster import SERVE_ENV

    dockerfile = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    image_env = dict(
        re.findall(r"\b(RAY_SERVE_\w+)=(\S+)", " ".join(re.findall(r"^ENV (.+)$", dockerfile, re.M)))
    )
    assert image_env == SERVE_ENV
    launcher = yaml.safe_load((REPO / "cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in launcher[key] if "ray start" in c]
        exported = dict(re.findall(r"\b(RAY_SERVE_\w+)=(\S+?);?(?=\s|$)", start.split("ray start")[0]))
        assert exported == SERVE_ENV, (key, exported)


def test_dockerignore_keeps_context_small():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", "argus-data", ".git"} <= ignored
