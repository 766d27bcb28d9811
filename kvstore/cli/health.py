"""``kvstore health``: ask the daemon's gRPC health service; exit 0 only on SERVING.

What a container's liveness and readiness probes run. It needs no token: the daemon answers
health checks without one.
"""

from typing import Annotated

import typer

from kvstore.cli.app import AddressOpt, ConfigOpt, app, boundary
from kvstore.config import load_config

HEALTH_TIMEOUT_S = 5.0  # a daemon busy with a drain or a big put still answers well within this
UNREACHABLE = "UNREACHABLE"  # what is printed when no daemon answers


def check(target: str, service: str = "", timeout_s: float = HEALTH_TIMEOUT_S) -> tuple[str, str]:
    """The serving status ``target`` reports for ``service``, and why when it is not SERVING.

    Returns:
        (status, detail): status is SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNREACHABLE;
        detail is "" when SERVING, else a sentence for an operator.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN", f"the daemon at {target} serves no service {service!r}"
            return UNREACHABLE, (f"no kvstore daemon answers at {target} ({code.name}: "
                                 f"{exc.details()}); it is not running, or still opening its "
                                 f"tiers")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if status == "SERVING":
        return status, ""
    return status, f"the daemon at {target} is up but not serving (starting or draining)"


@app.command()
@boundary
def health(
    address: AddressOpt = None,
    config: ConfigOpt = None,
    service: Annotated[str, typer.Option(
        help="Service to ask about: '' (the whole daemon) or kvstore.v1.KVStore.")] = "",
    timeout_s: Annotated[float, typer.Option(
        "--timeout", min=0.1, help="Seconds to wait for an answer.")] = HEALTH_TIMEOUT_S,
) -> None:
    """Print the daemon's serving status; exit 0 only when it is SERVING (for probes)."""
    target = address or f"unix://{load_config(config).server.socket_path}"
    status, detail = check(target, service, timeout_s)
    typer.echo(status)
    if detail:
        typer.echo(detail, err=True)
        raise typer.Exit(1)
