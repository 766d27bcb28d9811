"""``kvstore deploy k8s``: print the Kubernetes manifests that run a config on every node."""

from pathlib import Path
from typing import Annotated

import typer

from kvstore.cli.app import ConfigOpt, app, boundary, usage_error
from kvstore.config import load_config

deploy_app = typer.Typer(no_args_is_help=True,
                         help="Deployment manifests rendered from a kvstore config.")
app.add_typer(deploy_app, name="deploy")


@deploy_app.command("k8s")
@boundary
def k8s(
    config: ConfigOpt = None,
    image: Annotated[str | None, typer.Option(
        show_default=False, help="Daemon image [default: kvstore:<version>, -cuda with a GPU "
                                 "tier].")] = None,
    namespace: Annotated[str, typer.Option(help="Namespace of the objects.")] = "kvstore",
    name: Annotated[str, typer.Option(help="Name and app label of the objects.")] = "kvstore",
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", dir_okay=False, show_default=False,
        help="Write the YAML here instead of stdout.")] = None,
) -> None:
    """ConfigMap (the TOML), metrics Service and DaemonSet, as YAML (kubectl apply -f -).

    Paths become the pod's (/run/kvstore, /var/lib/kvstore); tokens and URL passwords are left
    out of the ConfigMap (put them in the <name>-secrets Secret: see deploy/README.md).
    """
    from kvstore.cli.k8s import manifests, secrets_left_out, to_yaml

    if config is None:
        usage_error("give --config: the defaults (the DRAM size) depend on the host rendering "
                    "them, not on the nodes")
    cfg = load_config(config)
    for field in secrets_left_out(cfg):
        typer.echo(f"warning: {field} is left out of the ConfigMap; put it in the Secret "
                   f"{name}-secrets", err=True)
    text = to_yaml(manifests(cfg, image=image, namespace=namespace, name=name))
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
