"""``kvstore doctor``: checks of the host and the daemon that a kvstore deployment depends on."""

from __future__ import annotations

import errno
import importlib
import mmap
import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.config import KVStoreConfig, RemoteConfig
from kvstore.errors import KVStoreError

DIRECT_PROBE_BYTES = 4096  # one logical block: the O_DIRECT alignment unit on common disks
DAEMON_TIMEOUT_S = 5.0  # a healthy daemon answers Health in milliseconds


@dataclass(frozen=True, slots=True)
class Check:
    """One diagnostic: ``ok`` False on a ``required`` check means kvstore will not work."""

    name: str
    ok: bool
    detail: str
    required: bool = True

    @property
    def status(self) -> str:
        """ok; warn when an optional check failed; fail when a required one did."""
        if self.ok:
            return "ok"
        return "fail" if self.required else "warn"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "status": self.status}


def format_bytes(nbytes: int) -> str:
    """``1536`` -> ``1.5 KiB``: binary units, one decimal."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = nbytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def check_torch() -> Check:
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        return Check("torch", False, f"not importable: {exc}")
    return Check("torch", True, f"torch {torch.__version__}")


def check_cuda() -> Check:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return Check("cuda", False, "torch missing", required=False)
    if not torch.cuda.is_available():
        return Check("cuda", False, "no CUDA device: HBM tier and GPU kernels off, DRAM/SSD work",
                     required=False)
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Check("cuda", True, f"CUDA {torch.version.cuda}: {names}", required=False)


def check_module(module: str, purpose: str) -> Check:
    """An optional module: missing is a warning naming what it is for."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken optional install is also "not usable"
        return Check(module, False, f"not importable ({type(exc).__name__}: {exc}); "
                     f"needed for {purpose}", required=False)
    return Check(module, True, f"{module} {getattr(mod, '__version__', '(version unknown)')}",
                 required=False)


def check_shm(config: KVStoreConfig) -> Check:
    """The DRAM arena's directory: present, and how much it can hold."""
    shm_dir = config.dram.shm_dir
    if not os.path.isdir(shm_dir):
        return Check("shm", False, f"{shm_dir} missing: the DRAM arena falls back to "
                     f"{tempfile.gettempdir()} (disk-backed, slower, not shareable as well)",
                     required=False)
    usage = shutil.disk_usage(shm_dir)
    want = config.dram.capacity_bytes
    detail = (f"{shm_dir}: size {format_bytes(usage.total)}, free {format_bytes(usage.free)}, "
              f"dram.capacity_bytes {format_bytes(want)}")
    if usage.free < want:
        return Check("shm", False, detail + ": the arena cannot grow to its capacity",
                     required=False)
    return Check("shm", True, detail, required=False)


def check_memlock(config: KVStoreConfig, has_cuda: bool) -> Check:
    """RLIMIT_MEMLOCK bounds how much host memory a process may lock (pin for DMA)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not has_cuda:
        return Check("memlock", True, f"RLIMIT_MEMLOCK {format_bytes(soft)}; unused without CUDA "
                     "(the arena is only pinned for GPU copies)", required=False)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", True, "RLIMIT_MEMLOCK unlimited", required=False)
    want = config.dram.capacity_bytes
    detail = f"RLIMIT_MEMLOCK {format_bytes(soft)}, dram.capacity_bytes {format_bytes(want)}"
    if soft < want:
        return Check("memlock", False, detail + ": pinning the arena may fail; raise it with "
                     "`ulimit -l unlimited` or LimitMEMLOCK=infinity", required=False)
    return Check("memlock", True, detail, required=False)


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_ssd_dir(config: KVStoreConfig) -> Check:
    """The SSD directory exists and is writable, or can be created."""
    path = Path(config.ssd.path)
    if path.is_dir():
        ok = os.access(path, os.W_OK | os.X_OK)
        return Check("ssd dir", ok, f"{path} exists" + ("" if ok else " but is not writable"))
    if path.exists():
        return Check("ssd dir", False, f"{path} exists and is not a directory")
    parent = nearest_existing(path)
    ok = parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
    return Check("ssd dir", ok, f"{path} does not exist; "
                 + (f"creatable under {parent}" if ok else f"{parent} is not writable"))


def check_disk_space(config: KVStoreConfig) -> Check:
    """Free space where the SSD tier writes, against its configured capacity."""
    where = nearest_existing(Path(config.ssd.path))
    usage = shutil.disk_usage(where)
    want = config.ssd.capacity_bytes
    detail = f"{where}: free {format_bytes(usage.free)} of {format_bytes(usage.total)}, " \
             f"ssd.capacity_bytes {format_bytes(want)}"
    if usage.free < want:
        return Check("disk space", False, detail + ": the SSD tier will fill the disk first",
                     required=False)
    return Check("disk space", True, detail, required=False)


def probe_o_direct(directory: Path) -> tuple[bool, str]:
    """Write and read back one aligned block with O_DIRECT in ``directory``."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    buf = mmap.mmap(-1, DIRECT_PROBE_BYTES)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(DIRECT_PROBE_BYTES))
    back = mmap.mmap(-1, DIRECT_PROBE_BYTES)
    fd, name = tempfile.mkstemp(prefix=".kvstore-doctor-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwrite(fd, buf, 0)
            os.preadv(fd, [back], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        reason = "refused by the file system" if exc.errno == errno.EINVAL else exc.strerror
        return False, f"O_DIRECT {reason} in {directory}; the SSD tier uses buffered I/O"
    finally:
        os.unlink(name)
    if back[:] != buf[:]:
        return False, f"O_DIRECT read back different bytes in {directory}"
    return True, f"O_DIRECT write and read work in {directory}"


def check_o_direct(config: KVStoreConfig) -> Check:
    where = nearest_existing(Path(config.ssd.path))
    if not os.access(where, os.W_OK | os.X_OK):
        return Check("o_direct", False, f"cannot probe: {where} is not writable", required=False)
    try:
        ok, detail = probe_o_direct(where)
    except OSError as exc:
        return Check("o_direct", False, f"cannot probe in {where}: {exc.strerror}",
                     required=False)
    return Check("o_direct", ok, detail, required=False)


def check_daemon(address: str, token: str | None) -> Check:
    """Health through the client. No socket file at all is a warning (nothing started yet);
    a socket or TCP address that does not answer is a failure."""
    if address.startswith("unix://") and not os.path.exists(address[len("unix://"):]):
        return Check("daemon", False, f"no daemon at {address}; start one with `kvstore serve`",
                     required=False)
    try:
        from kvstore.client import NO_RETRY, Client
    except ImportError as exc:
        return Check("daemon", False, f"the client is not part of this build: {exc}")
    try:
        with Client(address, token=token, retry=NO_RETRY, timeout_s=DAEMON_TIMEOUT_S) as client:
            health = client.health()
    except KVStoreError as exc:
        return Check("daemon", False, f"{address}: {exc}")
    return Check("daemon", health.status == "SERVING",
                 f"{address}: {health.status}, version {health.version}, pid {health.pid}, "
                 f"up {health.uptime_s:.0f} s")


def run_checks(config: KVStoreConfig, address: str, token: str | None = None) -> list[Check]:
    """Every check, in the order ``kvstore doctor`` prints them."""
    cuda = check_cuda()
    checks: list[Callable[[], Check]] = [
        check_torch,
        lambda: cuda,
        lambda: check_module("cupy", "CUDA IPC export of the HBM pool"),
        lambda: check_module("triton", "GPU codec kernels"),
        lambda: check_shm(config),
        lambda: check_memlock(config, cuda.ok),
    ]
    if config.ssd.enabled:
        checks += [lambda: check_ssd_dir(config), lambda: check_disk_space(config),
                   lambda: check_o_direct(config)]
    if config.remote.url:
        checks.append(lambda: check_remote(config.remote))
    checks.append(lambda: check_daemon(address, token))
    results = [check() for check in checks]
    if results[-1].ok:
        tiers = check_daemon_tiers(address, token)
        if tiers is not None:
            results.append(tiers)
    return results


def failed(checks: list[Check]) -> list[Check]:
    """The required checks that did not pass."""
    return [c for c in checks if c.status == "fail"]


def check_remote(remote: RemoteConfig) -> Check:
    """Reach the shared tier's store with its own time bound and credentials."""
    import asyncio

    from kvstore.tiers.remote.link import RedisLink

    async def probe() -> tuple[str, str]:
        link = RedisLink(remote)
        try:
            await link.open()
            return await _describe(link)
        finally:
            await link.aclose()

    try:
        found, error = asyncio.run(probe())
    except KVStoreError as exc:
        return Check("remote", False, str(exc))
    if error:
        return Check("remote", False, f"{remote.safe_url} unreachable: {error}; the daemon "
                     "serves from its local tiers until it answers")
    return Check("remote", True, f"{remote.safe_url}: {found}")


async def _describe(link) -> tuple[str, str]:
    """What the store is (version, standalone or cluster), or what is wrong with it."""
    info = await link.call("info", lambda client: client.info("server"))
    if info is None:
        return "", link.last_error or "no answer"
    # A cluster answers per node ({node: info}) or, from one node, like a server.
    nodes = [v for v in info.values() if isinstance(v, dict)] or [info]
    version = nodes[0].get("redis_version", "?")
    if not link.is_cluster:
        return f"redis {version} (standalone)", ""
    down = await link.call("nodes", _primaries_down, DAEMON_TIMEOUT_S)
    if down is None:
        return "", link.last_error or "the cluster's nodes did not answer"
    if down:
        return "", f"cluster node(s) {', '.join(down)} do not answer"
    return f"redis {version} (cluster)", ""


async def _primaries_down(client) -> list[str]:
    """The cluster's primaries that do not answer a PING, or that the nodes which answer see
    as failing or disconnected (CLUSTER NODES)."""
    from redis.exceptions import RedisError

    down: set[str] = set()
    view = ""
    for node in client.get_primaries():
        try:
            await client.ping(target_nodes=node)
            view = view or await client.execute_command("CLUSTER NODES", target_nodes=node)
        except (RedisError, OSError, TimeoutError):
            down.add(node.name)
    if isinstance(view, bytes):
        view = view.decode()
    for line in (view if isinstance(view, str) else "").splitlines():
        fields = line.split()
        if len(fields) > 7 and "master" in fields[2] and (
                "fail" in fields[2] or fields[7] == "disconnected"):
            down.add(fields[1].split("@")[0])
    return sorted(down)


def check_daemon_tiers(address: str, token: str | None) -> Check | None:
    """What the daemon's shared tier says of its store, if it has one."""
    try:
        from kvstore.client import NO_RETRY, Client

        with Client(address, token=token, retry=NO_RETRY, timeout_s=DAEMON_TIMEOUT_S) as client:
            tiers = client.stats().tiers
    except (ImportError, KVStoreError):
        return None
    shared = [t for t in tiers.values() if "breaker_open" in t.extra]
    if not shared:
        return None
    down = [t for t in shared if not t.extra.get("available")]
    if not down:
        return Check("daemon remote", True, ", ".join(f"{t.name}: available" for t in shared))
    return Check("daemon remote", False, "; ".join(
        f"{t.name}: unreachable (breaker {'open' if t.extra['breaker_open'] else 'closed'}, "
        f"{int(t.extra.get('errors', 0))} errors, {int(t.extra.get('timeouts', 0))} "
        "timeouts): lookups and gets miss it, local tiers keep serving" for t in down))
