"""HTTP access (app/serve/access.py): token files, constant-time matching, the token bucket, the loopback
rule at the CLI's edge, the RayService reading its tokens from a Secret, and what the OpenAPI document
(app/serve/http.py) promises with and without tokens. No Ray cluster."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from app.errors import ConfigError
from app.serve.access import AccessConfig, RateLimiter, TokenCheck, bearer_token, is_loopback, read_token_file

from conftest import ROOT


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens.txt"
    path.write_text(text)
    return str(path)


def test_token_file_keeps_only_digests_of_plain_and_hashed_tokens(tmp_path):
    hashed = hashlib.sha256(b"second-token").hexdigest()
    digests = read_token_file(
        _file(tmp_path, f"# ops team\nfirst-token\n\n  sha256:{hashed.upper()}  \nfirst-token\n")
    )
    assert digests == (hashlib.sha256(b"first-token").hexdigest(), hashed)
    check = TokenCheck(digests)
    assert check.match("Bearer first-token") == digests[0]
    assert check.match("bearer second-token") == hashed  # the scheme is case-insensitive (RFC 6750)
    for header in (
        None,
        "",
        "Bearer",
        "Bearer wrong",
        "Basic first-token",
        "first-token",
        f"Bearer {hashed}",
    ):
        assert check.match(header) is None, header


@pytest.mark.parametrize(
    "text, message",
    [
        ("# nothing but comments\n\n", "holds no token"),
        ("sha256:abc\n", "line 1: sha256: needs 64 hex digits"),
        ("ok\nsha256:" + "g" * 64 + "\n", "line 2: sha256: needs 64 hex digits"),
    ],
)
def test_bad_token_files_are_a_config_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        read_token_file(_file(tmp_path, text))
    with pytest.raises(ConfigError, match="cannot read"):
        read_token_file(str(tmp_path / "missing.txt"))


def test_bearer_header_parsing():
    assert bearer_token("Bearer  abc ") == "abc"
    assert bearer_token("BEARER abc") == "abc"
    assert (
        bearer_token("Bearer ") is None and bearer_token(None) is None and bearer_token("Token abc") is None
    )


def test_token_bucket_allows_a_burst_then_the_rate():
    now = [100.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)  # one more after 1/rate seconds
    assert limiter.take("b") == 0.0  # each token its own bucket
    now[0] += 0.5
    assert limiter.take("a") == 0.0 and limiter.take("a") > 0
    now[0] += 60
    assert [limiter.take("a") for _ in range(4)][:3] == [0.0, 0.0, 0.0]  # refills to the burst, no more


def test_replicas_share_the_rate_so_together_they_admit_no_more_than_it():
    now = [100.0]
    replicas = [RateLimiter(rate=3.0, burst=6, clock=lambda: now[0]) for _ in range(3)]
    for limiter in replicas:
        limiter.share_among(3)
    assert {(limiter.total_rate, limiter.rate, limiter.burst) for limiter in replicas} == {(3.0, 1.0, 2)}
    admitted = sum(limiter.take("a") == 0.0 for _ in range(10) for limiter in replicas)
    assert admitted == 6  # the burst, spread over the replicas
    now[0] += 2.0
    assert sum(limiter.take("a") == 0.0 for _ in range(10) for limiter in replicas) == 6  # 2 s at 3/s
    replicas[0].share_among(1)  # alone again: the whole rate and burst
    assert (replicas[0].rate, replicas[0].burst) == (3.0, 6)
    replicas[1].share_among(10)  # more replicas than burst: each still admits one
    assert replicas[1].burst == 1


def test_loopback_hosts():
    assert all(map(is_loopback, ["127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.5", "example.internal", ""]))


def test_access_config(tmp_path):
    assert AccessConfig().burst == 100 and AccessConfig(rate_limit=0.2).burst == 1
    assert AccessConfig(rate_limit=5, rate_burst=7).burst == 7
    AccessConfig().check_host("127.0.0.1")
    with pytest.raises(ConfigError, match="--http-host 0.0.0.0 is not a loopback address: pass --api-tokens"):
        AccessConfig().check_host("0.0.0.0")
    AccessConfig(api_tokens=_file(tmp_path, "t0k3n\n")).check_host("0.0.0.0")
    with pytest.raises(ConfigError, match="--rate-limit must be >= 0"):
        AccessConfig(rate_limit=-1)


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ["--http-host", "0.0.0.0"],
            {},
            "--http-host 0.0.0.0 is not a loopback address: pass --api-tokens FILE",
        ),
        (["--api-tokens", "/nonexistent/tokens"], {}, "--api-tokens: cannot read /nonexistent/tokens"),
        (["--http-host", "0.0.0.0"], {"ARGUS_API_TOKENS": "/nonexistent/t"}, "cannot read /nonexistent/t"),
        (["--rate-limit", "-2"], {}, "--rate-limit must be >= 0"),
    ],
)
def test_serve_refuses_an_open_api_off_loopback_with_exit_2(cli, tmp_path, args, env, message):
    result = cli("serve", "--storage", str(tmp_path), *args, env=env)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("argus: error:") and message in line, line


def test_rayservice_reads_its_tokens_from_a_secret_in_every_container():
    docs = [d for d in yaml.safe_load_all((ROOT / "kuberay" / "rayservice.yaml").read_text()) if d]
    (service,) = [d for d in docs if d.get("kind") == "RayService"]
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["host"] == "0.0.0.0"
    cluster = service["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        for container in pod["containers"]:
            (path,) = [e["value"] for e in container["env"] if e["name"] == "ARGUS_API_TOKENS"]
            mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert len(mounts) == 1 and mounts[0]["name"] in secrets and mounts[0].get("readOnly"), container
            assert secrets[mounts[0]["name"]] == "argus-api-tokens"


@pytest.mark.parametrize("guarded", [True, False], ids=["tokens", "open"])
def test_the_document_guards_what_tokens_guard_and_never_admits_an_empty_image(guarded):
    import jsonschema_rs

    import app.serve.replica  # noqa: F401  (its routes are the document's operations)
    from app.serve.http import AUTHENTICATED, api, openapi_document

    document = openapi_document(api, guarded=guarded)
    assert ("securitySchemes" in document.get("components", {})) is guarded
    for path, method in AUTHENTICATED:
        operation = document["paths"][path][method]
        assert ("security" in operation) is guarded
        assert ({"401", "429"} <= set(operation["responses"])) is guarded, operation["responses"]
    assert "security" not in document["paths"]["/healthz"]["get"]
    content = dict(document["paths"]["/predict"]["post"]["requestBody"]["content"])
    images = [content.pop("multipart/form-data")["schema"]["properties"]["image"]]
    images += [media["schema"] for media in content.values()]
    assert len(images) == 5
    for schema in images:
        validator = jsonschema_rs.validator_for(schema)
        assert not validator.is_valid("") and validator.is_valid("\x89PNG"), schema
