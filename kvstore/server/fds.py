"""The daemon's file descriptors: the soft limit raised to the hard one at start, and split
among the listening sockets so a flood on one cannot take what the others and the tiers need.

Every accepted connection is a descriptor, and so is every SSD segment, the LMDB index, each
DRAM growth step's memfd and every Unix client. With the usual soft limit of 1,024 and a
per-socket cap of 1,024, 1,100 connections to the TCP port took them all and the daemon's
Unix clients then failed with UNAVAILABLE. So the caps are sized here from the limit: all
listeners at their caps together leave ``reserved_fds`` for everything else.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from kvstore.config import ServerConfig

_log = logging.getLogger("kvstore.server.fds")

# Kept out of every listener's reach: SSD segments (a few dozen open at once), the LMDB index,
# one memfd per DRAM growth step per tenant, the daemon's own pipes and eventfds. A quarter of
# the limit, at least 128: a daemon at the common 1,024 keeps 256 for them.
RESERVED_FRACTION = 0.25
MIN_RESERVED_FDS = 128
MIN_LISTENER_CONNECTIONS = 4  # however low the limit, each socket still takes a few
DESCRIPTOR_CONNECTIONS = 64  # descriptor exchanges in flight (each answered in microseconds)
METRICS_CONNECTIONS = 8  # concurrent scrapes (Prometheus scrapes one at a time)


def raise_nofile_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the soft limit now. Logs
    both before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # a container that forbids it keeps its limit
            _log.warning("could not raise the descriptor limit from %d to %d: %s",
                         soft, wanted, exc)
    new_soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    _log.info("descriptor limit", extra={"soft_before": soft, "soft": new_soft,
                                         "hard": hard})
    return new_soft if new_soft != resource.RLIM_INFINITY else wanted


@dataclass(frozen=True, slots=True)
class ConnectionBudget:
    """How many connections each listening socket may hold at once (per listener).

    Attributes:
        soft_limit: the descriptor limit the budget was cut from.
        reserved_fds: what no listener may take (tiers, index, memfds, the rest).
        grpc_connections: per gRPC listener (Unix, TCP): ``grpc.max_allowed_incoming_connections``.
        data_connections: per data-socket listener (Unix, TCP), waiting hellos included.
        descriptor_connections: on the descriptor socket.
        metrics_connections: on the metrics port (handler threads).
    """

    soft_limit: int
    reserved_fds: int
    grpc_connections: int
    data_connections: int
    descriptor_connections: int
    metrics_connections: int

    @property
    def unauthenticated_share(self) -> int:
        """Connections not yet authenticated one TCP gRPC or data listener keeps: a quarter,
        so three quarters stay for clients that have shown a token."""
        return max(MIN_LISTENER_CONNECTIONS // 2, self.grpc_connections // 4)

    @classmethod
    def split(cls, soft_limit: int, server: ServerConfig) -> ConnectionBudget:
        """Each listener's cap: as configured (``server.max_connections``) where they all fit
        in the limit less the reserve; all scaled down alike where they do not."""
        reserved = max(MIN_RESERVED_FDS, int(soft_limit * RESERVED_FRACTION))
        num_grpc = 1 + bool(server.tcp_address)
        num_data = num_grpc if server.data_socket else 0
        wanted = {"grpc": server.max_connections, "data": server.max_connections,
                  "descriptor": DESCRIPTOR_CONNECTIONS,
                  "metrics": METRICS_CONNECTIONS if server.metrics_port else 0}
        counts = {"grpc": num_grpc, "data": num_data, "descriptor": 1, "metrics": 1}
        # each listener keeps a floor; what is above it is scaled down alike to fit the room
        floor = MIN_LISTENER_CONNECTIONS
        above = sum(max(0, wanted[k] - floor) * counts[k] for k in wanted)
        room = soft_limit - reserved - sum(floor * counts[k] for k in wanted if wanted[k])
        scale = min(1.0, max(0, room) / above) if above else 1.0
        caps = {k: floor + int(max(0, v - floor) * scale) for k, v in wanted.items()}
        budget = cls(soft_limit=soft_limit, reserved_fds=reserved,
                     grpc_connections=caps["grpc"], data_connections=caps["data"],
                     descriptor_connections=caps["descriptor"],
                     metrics_connections=caps["metrics"])
        if scale < 1.0:
            _log.warning("descriptor limit %d is below what the configured connection caps "
                         "need; caps per listener lowered to gRPC %d, data %d, descriptor %d "
                         "(raise the hard limit, e.g. LimitNOFILE=, to keep %d)", soft_limit,
                         budget.grpc_connections, budget.data_connections,
                         budget.descriptor_connections, server.max_connections)
        return budget
