"""Where a sidecar may listen: a unix socket or a loopback address, since it authenticates no one.

The block manager and the executor trust every caller (a Step can free any sequence, an Execute can
overwrite any KV block). In a pod they listen on unix sockets in a shared emptyDir; a TCP address on a
reachable interface would hand that trust to the network, so it takes an explicit `--allow-remote`.
"""

from __future__ import annotations

import argparse
import ipaddress


def listen_host(listen: str) -> str | None:
    """The host part of a `HOST:PORT` or `[IPV6]:PORT` listen address; None for `unix:PATH`."""
    if listen.startswith(("unix:", "unix-abstract:")):
        return None
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_local_address(listen: str) -> bool:
    """True for unix sockets, `localhost` and loopback IPs; an empty host or 0.0.0.0 (every interface),
    another name (it may resolve anywhere) or any other IP is not local."""
    host = listen_host(listen)
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_allow_remote_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-remote", action="store_true",
                        help="accept a --listen address that is not a unix socket or loopback (this service has "
                             "no authentication: only on a network you trust)")


def check_sidecar_listen(service: str, listen: str, allow_remote: bool) -> None:
    """Exits with a clear message when a sidecar would listen beyond this machine without `--allow-remote`."""
    if not allow_remote and not is_local_address(listen):
        raise SystemExit(
            f"{service}: --listen {listen} is reachable from other machines, and the {service} authenticates no "
            "one. Listen on unix:PATH or a loopback address (127.0.0.1:PORT, [::1]:PORT), or pass --allow-remote "
            "on a network you trust."
        )
