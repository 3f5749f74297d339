"""CONTRACT.md §3: each shared option is also read from the environment, and its flag wins over
the variable. Built as the CLI builds them (`app.__main__.configure`), then followed to where the
value takes effect."""

from __future__ import annotations

import pytest

from app.__main__ import build_parser, configure
from app.cluster import joins_cluster
from app.config import SETTINGS_ENV
from app.errors import ConfigError

# CONTRACT.md §3's variables: the flag, the Settings field, a value from the environment, one from the flag.
CONTRACT_ENV = {
    "KAFKA_BOOTSTRAP_SERVERS": ("--bootstrap-servers", "bootstrap_servers", "10.0.0.1:9092", "10.0.0.2:9093"),
    "ARGUS_TOPIC": ("--topic", "topic", "from-env", "from-flag"),
    "ARGUS_STORAGE": ("--storage", "storage", "/data/from-env", "/data/from-flag"),
    "MLFLOW_TRACKING_URI": (
        "--mlflow-uri",
        "mlflow_uri",
        "http://mlflow-env:5000",
        "http://mlflow-flag:5000",
    ),
    "RAY_ADDRESS": ("--ray-address", "ray_address", "10.0.0.1:6379", "10.0.0.2:6379"),
    "KAFKA_CONFIG": ("--kafka-config", "kafka_config", "env.properties", "flag.properties"),
    "ARGUS_CATALOG": ("--catalog", "catalog", "postgresql+psycopg://env/argus", "sqlite:////flag/catalog.db"),
}
# The command each variable is tried with: the table's location only where the table is used.
COMMAND = {"ARGUS_CATALOG": "migrate"}


@pytest.fixture
def environment(monkeypatch, tmp_path):
    """Sets exactly the given Settings variables (relative KAFKA_CONFIG names: files in tmp_path)."""
    for name in SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    for name in ("env.properties", "flag.properties"):
        (tmp_path / name).write_text(f"client.id={name.split('.')[0]}\n")
    monkeypatch.chdir(tmp_path)

    def set_env(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


def settings_of(*argv: str, command: str = "train"):
    settings, _ = configure(build_parser().parse_args([command, *argv]))
    return settings


def test_the_contract_lists_exactly_the_variables_settings_read():
    assert {var: field for var, (_, field, _, _) in CONTRACT_ENV.items()} == SETTINGS_ENV


@pytest.mark.parametrize("variable", CONTRACT_ENV)
def test_a_variable_reaches_its_setting_and_its_flag_overrides_it(environment, variable):
    flag, field, from_env, from_flag = CONTRACT_ENV[variable]
    command = COMMAND.get(variable, "train")
    unset = getattr(settings_of(command=command), field)
    environment(**{variable: from_env})
    assert getattr(settings_of(command=command), field) == from_env != unset
    assert getattr(settings_of(flag, from_flag, command=command), field) == from_flag


def test_an_empty_variable_counts_as_unset(environment):
    environment(ARGUS_TOPIC="", RAY_ADDRESS="")
    settings = settings_of()
    assert settings.topic == "user_behavior_images" and settings.ray_address is None


def test_argus_storage_holds_the_default_registry_and_mlflow_uri_replaces_it(environment, tmp_path):
    environment(ARGUS_STORAGE=str(tmp_path / "store"))
    assert settings_of().tracking_uri == f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    environment(MLFLOW_TRACKING_URI="http://mlflow:5000")
    assert settings_of().tracking_uri == "http://mlflow:5000"


def test_ray_address_joins_that_cluster_instead_of_a_local_ray(environment):
    assert not joins_cluster(settings_of())
    environment(RAY_ADDRESS="10.0.0.1:6379")
    assert joins_cluster(settings_of())


def test_kafka_config_from_the_environment_configures_every_client(environment, tmp_path):
    environment(KAFKA_BOOTSTRAP_SERVERS="10.0.0.1:9092", KAFKA_CONFIG=str(tmp_path / "env.properties"))
    connection = settings_of().kafka_connection()
    assert connection.bootstrap_servers == "10.0.0.1:9092"
    assert connection.properties == {"client.id": "env"}


def test_the_environment_is_validated_like_the_flags(cli):
    result = cli("produce", "--synthetic", "3", env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("argus: error: Kafka bootstrap servers unreachable") and "127.0.0.1:1" in line
    result = cli("train", env={"ARGUS_STORAGE": "s3://AKIA:s3cret@bucket"})
    assert result.returncode == 2 and "--storage carries a password" in result.stderr


def test_the_table_location_is_validated_like_the_rest(environment):
    environment(ARGUS_CATALOG="postgresql+psycopg://argus:s3cret@db/argus")
    with pytest.raises(ConfigError, match="--catalog carries a password"):
        settings_of(command="migrate")
    environment(ARGUS_CATALOG="postgresql+psycopg://argus@db/argus")  # the password from PGPASSWORD
    with pytest.raises(ConfigError, match="--table must be namespace.table"):
        settings_of("--table", "images", command="migrate")
