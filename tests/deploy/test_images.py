"""The compose file and the image recipes (parsed, not built: no container runtime here)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from kvstore.cli.k8s import BASE_OVERHEAD_BYTES, dram_bytes
from kvstore.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SOCKET_DIR = "/run/kvstore"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def mounts(service: dict) -> dict[str, str]:
    """volume or host path -> where it is mounted."""
    return {v.split(":")[0]: v.split(":")[1] for v in service["volumes"]}


def test_engine_and_daemon_share_the_socket_volume() -> None:
    doc = compose()
    daemon, engine = doc["services"]["kvstore"], doc["services"]["engine"]
    shared = [name for name, path in mounts(daemon).items() if path == SOCKET_DIR]
    assert shared == ["kvstore-socket"]
    assert mounts(engine)["kvstore-socket"] == SOCKET_DIR
    assert "kvstore-socket" in doc["volumes"]
    assert engine["environment"]["KVSTORE_SERVER__SOCKET_PATH"].startswith(SOCKET_DIR + "/")
    assert engine["depends_on"]["kvstore"]["condition"] == "service_healthy"
    assert daemon["healthcheck"]["test"] == ["CMD", "kvstore", "health"]


def test_compose_least_privilege_and_memory() -> None:
    doc = compose()
    daemon, engine = doc["services"]["kvstore"], doc["services"]["engine"]
    assert daemon["user"] == engine["user"] == "10001:10001"  # the socket is 0600, dir 0700
    assert daemon["read_only"] is True and daemon["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in daemon["security_opt"]
    assert "privileged" not in daemon and "ipc" not in daemon and "pid" not in engine
    config = load_config(DEPLOY / "kvstore.toml", environ={})
    want = dram_bytes(config) + BASE_OVERHEAD_BYTES + 2 * config.server.max_message_bytes
    assert daemon["mem_limit"] == f"{want >> 20}m"
    assert config.server.socket_path.startswith(SOCKET_DIR + "/")
    tomllib.loads((DEPLOY / "kvstore.toml").read_text())


def test_images_run_as_the_kvstore_user_with_the_socket_volume() -> None:
    for name in ("Dockerfile", "Dockerfile.cuda"):
        lines = (DEPLOY / name).read_text().splitlines()
        assert "USER 10001:10001" in lines, name
        assert any(line.startswith("VOLUME") and SOCKET_DIR in line for line in lines), name
        assert any("install -d -o 10001 -g 10001 -m 0700 /run/kvstore" in line
                   for line in lines), name
        assert any(line.startswith("HEALTHCHECK") and '"health"' in line for line in lines)
    assert "[gpu,triton]" in (DEPLOY / "Dockerfile.cuda").read_text()
