"""The OpenAPI document tells the truth: schemathesis fuzzes the live endpoint (`serve`'s own
deploy, with tokens) against its /openapi.json and finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.config import ServeConfig, Settings
from app.net import free_port
from app.serve.access import AccessConfig

from served import register_untrained, token_file

ST = Path(sys.executable).with_name("st")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, ray_cluster):
    from ray import serve

    from app.serve import deploy, wait_for_version

    directory = tmp_path_factory.mktemp("fuzzed")
    settings = Settings(storage=str(directory / "data"), image_size=32, model="cnn")
    version = register_untrained(settings)
    path, tokens = token_file(directory, ["fuzz"])
    policy = AccessConfig(api_tokens=str(path), rate_limit=0)  # every generated request reaches the app
    url = deploy(settings, ServeConfig(http_port=free_port(), poll_s=0.5), blocking=False, policy=policy)
    wait_for_version(url, version, timeout_s=180)
    yield url, tokens["fuzz"], directory
    serve.shutdown()


# A schema can say "binary", not "a decodable image": random bytes that fit the schema get the
# documented 400, which is the right answer, so it counts as accepting them (only for /predict).
CONFIG = """
[[operations]]
include-path = "/predict"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "429"]
"""


def test_schemathesis_finds_nothing(fuzzed):
    url, token, directory = fuzzed
    config = directory / "schemathesis.toml"
    config.write_text(CONFIG)
    run = subprocess.run(
        [str(ST), "--config-file", str(config), "run", f"{url}/openapi.json",
         "--header", f"Authorization: Bearer {token}",
         "--max-examples", "50", "--seed", "1", "--workers", "1", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=directory,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
