"""The rendered Kubernetes manifests: valid against the Kubernetes schema (offline), their
ConfigMap reads back to the config, resources and privileges follow from the config."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvstore.cli.k8s import (
    BASE_OVERHEAD_BYTES,
    CONFIG_FILE,
    manifests,
    pod_config,
    to_toml,
    to_yaml,
)
from kvstore.config import KVStoreConfig, load_config

from ..cli.helpers import invoke

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30"  # the oldest Kubernetes these manifests are checked against
MiB, GiB = 1 << 20, 1 << 30

CONFIGS = {
    "default": (DEPLOY / "kvstore.toml").read_text(),
    "tcp-tokens-remote": """
[dram]
capacity_bytes = "4GiB"
[ssd]
enabled = false
[server]
tcp_address = "0.0.0.0:7070"
data_port = 7071
tenant_tokens = { acme = "s3cret-acme", globex = "s3cret-globex" }
admin_token = "s3cret-admin"
[remote]
url = "redis://app:s3cret-redis@cache-1:6379"
write_through = true
""",
    "gpu-chain": """
[server]
metrics_port = 9500
shutdown_grace_s = 30.0
[[tiers]]
name = "gpu"
kind = "hbm"
capacity_bytes = "20GiB"
[[tiers]]
name = "host"
kind = "dram"
capacity_bytes = "64GiB"
codec = "fp8_e4m3"
[[tiers]]
name = "nvme"
kind = "ssd"
path = "/nvme/kvstore"
capacity_bytes = "2TiB"
""",
}


def load(text: str, tmp_path: Path) -> KVStoreConfig:
    path = tmp_path / "in.toml"
    path.write_text(text)
    return load_config(path, environ={})


@pytest.fixture(params=sorted(CONFIGS))
def config(request, tmp_path: Path) -> KVStoreConfig:
    return load(CONFIGS[request.param], tmp_path)


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def test_every_object_is_valid_kubernetes(config: KVStoreConfig) -> None:
    objects = list(yaml.safe_load_all(to_yaml(manifests(config))))
    assert [o["kind"] for o in objects] == ["ConfigMap", "Service", "DaemonSet"]
    for obj in objects:
        # strict: an unknown or misspelt field fails too
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_catches_mistakes(tmp_path: Path) -> None:
    daemonset = by_kind(manifests(load(CONFIGS["default"], tmp_path)))["DaemonSet"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    container["livenessProbe"]["exec"]["comand"] = ["typo"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, K8S_VERSION, strict=True)


def test_configmap_toml_reads_back_to_the_pod_config(config: KVStoreConfig,
                                                     tmp_path: Path) -> None:
    text = by_kind(manifests(config))["ConfigMap"]["data"][CONFIG_FILE]
    tomllib.loads(text)
    back = load(text, tmp_path)
    assert back == pod_config(config)
    # only paths, metrics, logging and secrets differ from what the operator wrote
    unchanged = dataclasses.replace(
        back, server=dataclasses.replace(
            back.server, socket_path=config.server.socket_path,
            metrics_host=config.server.metrics_host, metrics_port=config.server.metrics_port,
            tenant_tokens=config.server.tenant_tokens, admin_token=config.server.admin_token,
            log_json=config.server.log_json),
        ssd=dataclasses.replace(back.ssd, path=config.ssd.path),
        remote=dataclasses.replace(back.remote, url=config.remote.url),
        tiers=config.tiers if config.tiers else ())
    assert unchanged == config
    assert back.server.socket_path == "/run/kvstore/kvstore.sock"
    assert to_toml(back) == text


def test_no_secret_reaches_the_manifests(tmp_path: Path) -> None:
    config = load(CONFIGS["tcp-tokens-remote"], tmp_path)
    text = to_yaml(manifests(config))
    assert "s3cret" not in text
    env = by_kind(manifests(config))["DaemonSet"]["spec"]["template"]["spec"][
        "containers"][0]["env"]
    secret_env = {e["name"] for e in env if "valueFrom" in e}
    assert {"KVSTORE_SERVER__TENANT_TOKENS", "KVSTORE_SERVER__ADMIN_TOKEN",
            "KVSTORE_REMOTE__URL"} <= secret_env


def test_resources_ports_and_grace_follow_the_config(tmp_path: Path) -> None:
    config = load(CONFIGS["tcp-tokens-remote"], tmp_path)
    spec = by_kind(manifests(config))["DaemonSet"]["spec"]["template"]["spec"]
    daemon = spec["containers"][0]
    memory = (4 * GiB + BASE_OVERHEAD_BYTES + 2 * config.server.max_message_bytes) // MiB
    assert daemon["resources"]["requests"]["memory"] == f"{memory}Mi"
    assert daemon["resources"]["limits"]["memory"] == f"{memory}Mi"
    assert {p["name"]: p["containerPort"] for p in daemon["ports"]} == {
        "metrics": 9400, "grpc": 7070, "data": 7071}
    assert spec["terminationGracePeriodSeconds"] == 10 + 10  # no SSD: nothing to flush
    assert "state" not in {v["name"] for v in spec["volumes"]}
    assert "hostPID" not in spec


def test_gpu_chain(tmp_path: Path) -> None:
    config = load(CONFIGS["gpu-chain"], tmp_path)
    objects = by_kind(manifests(config))
    spec = objects["DaemonSet"]["spec"]["template"]["spec"]
    daemon = spec["containers"][0]
    assert spec["hostPID"] is True
    assert daemon["image"].endswith("-cuda")
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in daemon["env"]
    assert "nvidia.com/gpu" not in daemon["resources"]["limits"]  # the engines hold the GPUs
    memory = (64 * GiB + BASE_OVERHEAD_BYTES + 2 * config.server.max_message_bytes) // MiB
    assert daemon["resources"]["limits"]["memory"] == f"{memory}Mi"  # DRAM only, not HBM
    assert spec["terminationGracePeriodSeconds"] == 30 + 138 + 10  # 64 GiB at 0.5 GB/s
    toml = tomllib.loads(objects["ConfigMap"]["data"][CONFIG_FILE])
    assert [t["path"] for t in toml["tiers"] if t["kind"] == "ssd"] == ["/var/lib/kvstore/nvme"]
    assert objects["Service"]["spec"]["ports"][0]["port"] == 9500


def test_least_privilege(config: KVStoreConfig) -> None:
    spec = by_kind(manifests(config))["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["automountServiceAccountToken"] is False
    daemon = spec["containers"][0]
    assert daemon["securityContext"] == {"allowPrivilegeEscalation": False,
                                         "readOnlyRootFilesystem": True,
                                         "capabilities": {"drop": ["ALL"]}}
    init = spec["initContainers"][0]  # the only root step: chown of the hostPath dirs
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["exec"]["command"][:2] == ["kvstore", "health"]
    assert "hostNetwork" not in spec and "privileged" not in str(spec)


def test_committed_manifests_are_the_rendering_of_the_committed_config() -> None:
    """deploy/k8s/kvstore.yaml is regenerated by the command in deploy/README.md."""
    result = invoke("deploy", "k8s", "--config", str(DEPLOY / "kvstore.toml"))
    assert result.exit_code == 0, result.output
    assert result.stdout == (DEPLOY / "k8s" / "kvstore.yaml").read_text()


def test_cli_warns_about_secrets_and_needs_a_config(tmp_path: Path) -> None:
    path = tmp_path / "in.toml"
    path.write_text(CONFIGS["tcp-tokens-remote"])
    result = invoke("deploy", "k8s", "--config", str(path), "--namespace", "infra",
                    "--image", "registry.example/kvstore:1")
    assert result.exit_code == 0, result.output
    for field in ("server.tenant_tokens", "server.admin_token", "remote.url"):
        assert f"warning: {field}" in result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    assert {o["metadata"]["namespace"] for o in objects} == {"infra"}
    assert "s3cret" not in result.stdout
    missing = invoke("deploy", "k8s", env={"KVSTORE_CONFIG": ""})
    assert missing.exit_code == 2 and "give --config" in missing.stderr
