"""`pagedserve operator`: runs the kopf operator for PagedModels and AutoscalingPolicies.

It needs a kubeconfig or in-cluster credentials and nothing else: no model, no torch. With `--peering`
two replicas run safely: kopf's peering lets the one with the higher priority work while the other
stands by (the priority is drawn from the pod name, so two replicas practically never tie).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket

import kopf

from . import handlers
from .kube import load_credentials


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between scrapes and decisions")
    parser.add_argument("--scrape-timeout", type=float, default=3.0, help="seconds to wait for one pod's /metrics")
    parser.add_argument("--health-listen", default="0.0.0.0:8080",
                        help="HOST:PORT of the liveness endpoint (GET /healthz)")
    parser.add_argument("--peering", metavar="NAME", help="kopf peering object: run several replicas, one active")
    parser.add_argument("--priority", type=int, help="peering priority (default: drawn from the host name)")
    parser.add_argument("--verbose", action="store_true")


def main(args: argparse.Namespace) -> None:
    if not args.namespace and not args.all_namespaces:
        raise SystemExit("pagedserve operator: give --namespace NS (repeatable) or --all-namespaces")
    if args.interval <= 0 or args.scrape_timeout <= 0:
        raise SystemExit("pagedserve operator: --interval and --scrape-timeout must be > 0")
    if not args.health_listen.rpartition(":")[2].isdigit() or int(args.health_listen.rpartition(":")[2]) == 0:
        raise SystemExit(f"pagedserve operator: --health-listen needs HOST:PORT with a port > 0, got "
                         f"{args.health_listen!r}")
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    load_credentials()
    priority = args.priority
    if priority is None:  # the pod's name where the chart sets it: replicas never tie
        name = os.environ.get("POD_NAME") or socket.gethostname()
        priority = int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")
    config = handlers.OperatorConfig(args.interval, args.scrape_timeout, args.all_namespaces)
    kopf.run(
        clusterwide=args.all_namespaces, namespaces=args.namespace,
        standalone=args.peering is None, peering_name=args.peering, priority=priority,
        liveness_endpoint=f"http://{args.health_listen}/healthz",
        memo=kopf.Memo(config=config),
    )
