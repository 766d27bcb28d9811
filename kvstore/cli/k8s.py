"""Kubernetes manifests for the per-node daemon, rendered from a kvstore config.

``manifests(config)`` returns the objects (plain dicts, in apply order): a ConfigMap holding
the daemon's TOML, a Service for its metrics port and a DaemonSet. deploy/README.md says why
each privilege is there. What the renderer decides from the config:

- paths inside the pod: the socket at ``/run/kvstore`` (a hostPath the engines mount too), SSD
  tiers under ``/var/lib/kvstore``; metrics on all interfaces (the Service scrapes them);
- memory request = limit = the DRAM tiers' capacity plus :func:`overhead_bytes`: the arenas are
  memfds the daemon faults in, charged to its cgroup and never reclaimable without swap;
- the grace period covers the drain and the flush of DRAM-only blocks to the SSD;
- a GPU tier in the chain adds what CUDA IPC with another pod needs (``hostPID``, every GPU).

Tokens never go into the ConfigMap: they come from an optional Secret, as environment
variables the daemon reads over the file (``KVSTORE_SERVER__TENANT_TOKENS`` and friends).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from kvstore import __version__
from kvstore.config import KVStoreConfig, TierConfig, redact_url

SOCKET_DIR = "/run/kvstore"
STATE_DIR = "/var/lib/kvstore"
CONFIG_DIR = "/etc/kvstore"
CONFIG_FILE = "kvstore.toml"
DEFAULT_METRICS_PORT = 9400  # the README's `kvstore serve --metrics-port` example
UID = 10001  # the image's kvstore user (deploy/Dockerfile)
SECRET_ENV = {  # environment variable -> key of the optional Secret
    "KVSTORE_SERVER__TENANT_TOKENS": "tenant_tokens",  # "acme=tok1,globex=tok2"
    "KVSTORE_SERVER__ADMIN_TOKEN": "admin_token",
    "KVSTORE_REMOTE__URL": "remote_url",  # a redis:// URL with its password
}
# The daemon at rest held 240 MiB (VmHWM, 16 MiB DRAM tier) and one `kvstore health` probe
# 243 MiB (maxrss) on the 2-core box, 2026-12-05: 512 MiB for both.
BASE_OVERHEAD_BYTES = 512 << 20
# Flushing DRAM-only blocks to the SSD at shutdown: O_DIRECT writes ran at 1.2-1.6 GB/s on the
# measured disks (DESIGN.md); assume 0.5 GB/s so a slower disk still finishes.
FLUSH_BYTES_PER_S = 0.5e9


def pod_config(config: KVStoreConfig) -> KVStoreConfig:
    """``config`` with the pod's paths, metrics on all interfaces and no secrets in it."""
    server = dataclasses.replace(
        config.server, socket_path=f"{SOCKET_DIR}/kvstore.sock", metrics_host="0.0.0.0",
        metrics_port=config.server.metrics_port or DEFAULT_METRICS_PORT,
        tenant_tokens={}, admin_token="", log_json=True)
    ssd = dataclasses.replace(config.ssd, path=f"{STATE_DIR}/ssd")
    remote = dataclasses.replace(config.remote, url=config.remote.safe_url)
    tiers = tuple(_pod_tier(t) for t in config.tiers)
    return dataclasses.replace(config, server=server, ssd=ssd, remote=remote, tiers=tiers)


def _pod_tier(tier: TierConfig) -> TierConfig:
    settings = tier.settings
    if tier.kind == "ssd":
        settings = dataclasses.replace(settings, path=f"{STATE_DIR}/{tier.name}")
    elif tier.kind == "remote":
        settings = dataclasses.replace(settings, url=settings.safe_url)
    return dataclasses.replace(tier, settings=settings)


def secrets_left_out(config: KVStoreConfig) -> list[str]:
    """The fields of ``config`` that carry secrets and are not rendered."""
    found = [name for name, value in (("server.tenant_tokens", config.server.tenant_tokens),
                                      ("server.admin_token", config.server.admin_token)) if value]
    found += [f"{where} (its password)" for where, url in _remote_urls(config)
              if url and url != redact_url(url)]
    return found


def _remote_urls(config: KVStoreConfig) -> list[tuple[str, str]]:
    urls = [("remote.url", config.remote.url)]
    return urls + [(f"tiers.{t.name}.url", t.settings.url) for t in config.tiers
                   if t.kind == "remote"]


def to_toml(config: KVStoreConfig) -> str:
    """Every field of ``config`` as TOML that ``load_config`` reads back to an equal config
    (defaults that depend on the host, such as the DRAM size, become explicit)."""
    lines: list[str] = []
    for section in ("dram", "ssd", "server", "quota", "remote"):
        lines += [f"[{section}]", *_fields(getattr(config, section)), ""]
    for tier in config.tiers:
        lines += ["[[tiers]]", f"name = {_value(tier.name)}", f"kind = {_value(tier.kind)}",
                  *_fields(tier.settings), ""]
    return "\n".join(lines)


def _fields(settings: Any) -> list[str]:
    return [f"{f.name} = {_value(getattr(settings, f.name))}"
            for f in dataclasses.fields(settings)]


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_value(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def dram_bytes(config: KVStoreConfig) -> int:
    """Host memory the DRAM tiers of the chain may fill (staging included)."""
    return sum(t.settings.capacity_bytes for t in config.tier_chain() if t.kind == "dram")


def overhead_bytes(config: KVStoreConfig) -> int:
    """Memory beyond the arenas: the process and a probe at rest, plus a request body being
    received and its decoded copy (each up to ``server.max_message_bytes``)."""
    return BASE_OVERHEAD_BYTES + 2 * config.server.max_message_bytes


def memory_quantity(num_bytes: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{-(-num_bytes // (1 << 20))}Mi"


def has_gpu_tier(config: KVStoreConfig) -> bool:
    return any(t.kind == "hbm" for t in config.tier_chain())


def grace_period_s(config: KVStoreConfig) -> int:
    """The drain, then writing the DRAM-only blocks to the SSD, with 10 s to spare."""
    flush = dram_bytes(config) / FLUSH_BYTES_PER_S if _persists(config) else 0.0
    return math.ceil(config.server.shutdown_grace_s + flush) + 10


def _persists(config: KVStoreConfig) -> bool:
    return any(t.kind == "ssd" and t.settings.persist_on_close for t in config.tier_chain())


def _ssd_tiers(config: KVStoreConfig) -> list[TierConfig]:
    return [t for t in config.tier_chain() if t.kind == "ssd"]


def _tcp_ports(config: KVStoreConfig) -> list[dict[str, Any]]:
    server = config.server
    if not server.tcp_address:
        return []
    port = int(server.tcp_address.rsplit(":", 1)[1])
    ports = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}] if port else []
    if server.data_socket and server.data_port:
        ports.append({"name": "data", "containerPort": server.data_port, "protocol": "TCP"})
    return ports


# ------------------------------------------------------------------------------ objects

def manifests(config: KVStoreConfig, image: str | None = None, namespace: str = "kvstore",
              name: str = "kvstore") -> list[dict[str, Any]]:
    """The ConfigMap, Service and DaemonSet that run ``config`` on every node.

    Args:
        config: the operator's config; its paths, metrics host and secrets are replaced by
            :func:`pod_config`.
        image: the daemon's image [default: kvstore:<version>, -cuda with a GPU tier].
        namespace: where the objects go.
        name: the objects' name and their ``app.kubernetes.io/name`` label.
    """
    pod = pod_config(config)
    image = image or f"kvstore:{__version__}{'-cuda' if has_gpu_tier(pod) else ''}"
    meta = {"name": name, "namespace": namespace,
            "labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/version": __version__}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
         "data": {CONFIG_FILE: to_toml(pod)}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": f"{name}-metrics"},
         "spec": {"selector": {"app.kubernetes.io/name": name}, "ports": [
             {"name": "metrics", "port": pod.server.metrics_port,
              "targetPort": "metrics", "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta,
         "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                  "updateStrategy": {"type": "RollingUpdate",
                                     "rollingUpdate": {"maxUnavailable": 1}},
                  "template": {"metadata": {"labels": meta["labels"]},
                               "spec": _pod_spec(pod, image, name)}}},
    ]


def _pod_spec(config: KVStoreConfig, image: str, name: str) -> dict[str, Any]:
    volumes = [
        # The engines on the node mount the same directory to reach the socket.
        {"name": "socket", "hostPath": {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}},
        {"name": "config", "configMap": {"name": name}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},  # the root file system is read-only
    ]
    if _ssd_tiers(config):
        volumes.append({"name": "state", "hostPath": {"path": STATE_DIR,
                                                      "type": "DirectoryOrCreate"}})
    spec: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": grace_period_s(config),
        "automountServiceAccountToken": False,  # the daemon never calls the API server
        "enableServiceLinks": False,
        "initContainers": [_owner_init(image, bool(_ssd_tiers(config)))],
        "containers": [_daemon_container(config, image, name)],
        "volumes": volumes,
    }
    if has_gpu_tier(config):
        spec["hostPID"] = True  # legacy CUDA IPC handles open only within one PID namespace
    return spec


def _owner_init(image: str, has_state: bool) -> dict[str, Any]:
    """The one step that runs as root: hand the hostPath directories (root's 0755 when the
    kubelet creates them) to the daemon's user, mode 0700 (the daemon refuses anything else)."""
    dirs = [SOCKET_DIR] + ([STATE_DIR] if has_state else [])
    script = " && ".join(f"chmod 0700 {d} && chown {UID}:{UID} {d}" for d in dirs)
    mounts = [{"name": "socket", "mountPath": SOCKET_DIR}]
    if has_state:
        mounts.append({"name": "state", "mountPath": STATE_DIR})
    return {
        "name": "own-dirs", "image": image, "command": ["sh", "-c", script],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                      "limits": {"memory": "64Mi"}},
        "volumeMounts": mounts,
    }


def _daemon_container(config: KVStoreConfig, image: str, name: str) -> dict[str, Any]:
    memory = memory_quantity(dram_bytes(config) + overhead_bytes(config))
    env = [{"name": "KVSTORE_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
           {"name": "HOME", "value": "/tmp"}]
    env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": f"{name}-secrets", "key": key,
                                                         "optional": True}}}
            for var, key in SECRET_ENV.items()]
    if has_gpu_tier(config):
        # Every GPU of the node without taking any from the device plugin: the engines' pods
        # hold them (deploy/README.md).
        env += [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}]
    mounts = [{"name": "socket", "mountPath": SOCKET_DIR},
              {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if _ssd_tiers(config):
        mounts.append({"name": "state", "mountPath": STATE_DIR})
    return {
        "name": "kvstore", "image": image,
        "command": ["kvstore", "serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": config.server.metrics_port,
                   "protocol": "TCP"}, *_tcp_ports(config)],
        # Guaranteed memory: the arenas cannot be reclaimed, so request what the limit allows.
        "resources": {"requests": {"cpu": "1", "memory": memory}, "limits": {"memory": memory}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
        **_probes(),
    }


def _probes() -> dict[str, Any]:
    """Exec probes running ``kvstore health`` over the socket (no token, no TCP port needed).
    One probe starts Python and imports torch: about 1.7 s and 243 MiB (2026-12-05)."""
    run = {"exec": {"command": ["kvstore", "health", "--timeout", "5"]}, "timeoutSeconds": 15}
    return {
        # Opening the tiers (the SSD index, pre-faulting the first arena chunk) may take long.
        "startupProbe": {**run, "periodSeconds": 5, "failureThreshold": 120},
        "readinessProbe": {**run, "periodSeconds": 10, "failureThreshold": 2},
        "livenessProbe": {**run, "periodSeconds": 30, "failureThreshold": 3},
    }


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """``objects`` as one YAML stream, multi-line strings (the TOML) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: spell each out
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, default_flow_style=False,
                         width=100)
