"""Every flag of every command reaches its config field: each is given a valid value other than
its default, the configs are built as the CLI builds them (`app.__main__.configure`), and the
field must hold that value. A flag added without a field to land in fails here, as does one whose
`dest` no longer matches its field's name."""

from __future__ import annotations

import argparse

import pytest

from app.__main__ import build_parser, configure
from app.config import SETTINGS_ENV

# Flags that fill no config field, and why.
NOT_A_FIELD = {
    "verbose": "-v chooses where logs go (`_configure_logging`), before any config exists",
    "demo:records": "the demo's own knob: run_demo reads its few flags itself and builds the stages' configs",
    "demo:epochs": "the demo's own knob (see demo:records)",
    "demo:rounds": "the demo's own knob (see demo:records)",
    "demo:http_port": "the demo's own knob (see demo:records)",
    "demo:hold": "the demo's own knob (see demo:records)",
    "broker:port": "the broker command takes the port itself (`broker.run_foreground`): no stage config",
}

# What some commands need besides the flag under test to be valid at all.
BASELINE = {"produce": ["--synthetic", "1"], "promote": ["7"], "erase": ["--user", "u"]}

# Values a generic rule would get wrong (a format to follow, a closed set); (argument, field value).
SPECIAL = {
    "bootstrap_servers": ("127.0.0.1:9,127.0.0.2:9", "127.0.0.1:9,127.0.0.2:9"),
    "model": ("cnn", "cnn"),
    "classes": ("cat,dog", ("cat", "dog")),
    "num_workers": ("2-4", (2, 4)),
    "replicas": ("2-4", "2-4"),
    "snapshots": ("8566377926098306483", 8566377926098306483),
    "strategy": ("fedmedian", "fedmedian"),
    "superlink": ("127.0.0.2:7", "127.0.0.2:7"),
    "update_dtype": ("fp32", "fp32"),
    "table": ("lake.images", "lake.images"),
    "start_from": ("2026-12-01T00:00:00Z", "2026-12-01T00:00:00Z"),
}
# Flags only valid together with another, or instead of the baseline.
DEPLOYMENT = ["--engine", "deployment", "--superlink", "127.0.0.1:9", "--root-certificates", "ca.pem"]
TOGETHER = {
    "dp_noise": ["--dp-clip", "1.0"],
    "dp_max_epsilon": ["--dp-clip", "1.0", "--dp-noise", "1.0"],
    "engine": DEPLOYMENT[2:],
    "secure_aggregation": DEPLOYMENT,
    "superlink_certfile": ["--superlink-keyfile", "key.pem"],
    "superlink_keyfile": ["--superlink-certfile", "cert.pem"],
    "device_keys": ["--superlink-certfile", "cert.pem", "--superlink-keyfile", "key.pem"],
}
# Flags naming files or folders that must exist (`argus device` checks its own at the edge).
EXISTING_PATHS = {"from_dir", "data_dir", "root_certificates", "auth_key"}
INSTEAD_OF_BASELINE = {"from_dir"}  # produce takes exactly one of --synthetic and --from-dir


def subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def flags() -> list[tuple[str, argparse.Action]]:
    return [
        (command, action)
        for command, parser in subparsers().items()
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    ]


def built(command: str, argv: list[str]) -> list:
    settings, configs = configure(build_parser().parse_args([command, *argv]))
    return [settings, *configs]


def existing_path(directory, dest: str) -> str:
    """A folder of one labelled image for the folder flags, an empty file for the others."""
    if dest in ("from_dir", "data_dir"):
        (directory / dest / "label").mkdir(parents=True, exist_ok=True)
        (directory / dest / "label" / "0.png").write_bytes(b"")
    else:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / dest).touch()
    return str(directory / dest)


def baseline(command: str, tmp_path) -> list[str]:
    if command != "device":
        return BASELINE.get(command, [])
    paths = {
        dest: existing_path(tmp_path / "baseline", dest) for dest in sorted(EXISTING_PATHS - {"from_dir"})
    }
    return [
        "--data-dir", paths["data_dir"], "--superlink", "127.0.0.1:9",
        "--root-certificates", paths["root_certificates"], "--auth-key", paths["auth_key"],
    ]  # fmt: skip


def value_for(action: argparse.Action, default, tmp_path) -> tuple[list[str], object]:
    """Arguments giving `action` a valid value other than `default`, and the field value expected."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:
        return [flag], True
    if action.dest in SPECIAL:
        text, expected = SPECIAL[action.dest]
        return [flag, text], expected
    if action.dest == "kafka_config":
        path = tmp_path / "kafka.properties"
        path.write_text("client.id=argus-flags\n")
        return [flag, str(path)], str(path)
    if action.dest == "api_tokens":
        path = tmp_path / "tokens.txt"
        path.write_text("a-token-of-at-least-some-length\n")
        return [flag, str(path)], str(path)
    if action.dest in EXISTING_PATHS:
        path = existing_path(tmp_path / "flag", action.dest)
        return [flag, path], path
    if action.choices:
        value = next(c for c in action.choices if c != default)
    elif action.type is int:
        value = default + 1 if isinstance(default, int) else 3
    elif action.type is float:
        value = default / 2 if default else 0.5 if default == 0 else 2.5  # inside (0, 1) ranges and >= 1 ones
    else:
        value = f"{action.dest.replace('_', '-')}-value"
    return [flag, str(value)], value


@pytest.mark.parametrize("command, action", flags(), ids=[f"{c}{a.option_strings[-1]}" for c, a in flags()])
def test_every_flag_reaches_its_config_field(command, action, tmp_path, monkeypatch):
    for name in SETTINGS_ENV:  # only the flag under test may set anything
        monkeypatch.delenv(name, raising=False)
    reason = NOT_A_FIELD.get(action.dest) or NOT_A_FIELD.get(f"{command}:{action.dest}")
    given_baseline = baseline(command, tmp_path)
    defaults = [c for c in built(command, given_baseline) if hasattr(c, action.dest)]
    if reason:
        assert not defaults, f"{action.dest} is a field of {defaults} after all: drop it from NOT_A_FIELD"
        return
    assert defaults, (
        f"{command} {action.option_strings}: no config of the command has a field {action.dest!r}"
    )

    default = getattr(defaults[0], action.dest)
    argv, expected = value_for(action, default, tmp_path)
    assert expected != default, f"pick another value for {action.dest}: {expected!r} is its default"
    given = [] if action.dest in INSTEAD_OF_BASELINE else given_baseline
    configs = [
        c for c in built(command, [*given, *TOGETHER.get(action.dest, []), *argv]) if hasattr(c, action.dest)
    ]
    assert [type(c) for c in configs] == [type(c) for c in defaults]
    for config in configs:  # a flag two configs share (watch's ingest options) reaches both
        assert getattr(config, action.dest) == expected, (type(config).__name__, argv)


def test_a_positional_argument_reaches_its_field_too():
    (config,) = [c for c in built("promote", ["7"]) if hasattr(c, "version")]
    assert config.version == "7"
