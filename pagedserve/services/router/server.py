"""`pagedserve router`: the fleet's front door, forwarding each request to the pod that suits it (docs/routing.md).

Its own process, without torch (it loads the model's tokenizer only, to hash prompts). It starts listening at once
(health NOT_SERVING, requests answered UNAVAILABLE naming why no pod can take them), starts one watcher per pod
(watcher.py), and reports SERVING while at least one pod is in sync (fleet.py), NOT_SERVING again while none is,
from the moment its tokenizer is settled (adopted, or known unusable): a router started or restarted beside its
pods has every pod's view within a round trip, and would otherwise take requests before it could hash them.
With `--http-listen` the same process serves the OpenAI-compatible HTTP API (http_api.py) over the same fleet,
forwarding to the pods' own HTTP APIs, on the same event loop.

The tokenizer is `--model`'s, or else the model the first accepted pod names (when this machine resolves the name).
Either way it is used only once it is known to be the fleet's (the weights digest and chat template of the fleet's
cache identity): a router hashing with another tokenizer would predict hits the pods never have, so until then,
and after a mismatch, requests are routed by load alone (request_blocks.UNKNOWN) and the mismatch is logged.

The pods are `--endpoints`, or those of `--kubernetes-service` (endpoint_slices.py), which come and go at run time:
`Members` keeps a channel and a watcher per pod, started when a pod appears and ended when it leaves (its channel
closed after `DRAIN_GRACE_S`, so that the streams still on it finish).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from transformers import PreTrainedTokenizerFast

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ..common.cache_salt import CacheSaltSecretError
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from ..common.http_server import HttpService, HttpTls
from ..common.tls import TlsConfigError
from ..executor.model.registry import ModelSource, resolve_model
from ..executor.model.tokenizer import load_tokenizer
from ..frontend.auth import ApiKeyInterceptor, KeysFileError
from .choice import Chooser
from .endpoint_slices import Endpoints, EndpointSliceWatcher, default_namespace
from .fleet import Fleet
from .http_api import HttpRouting, build_app
from .http_upstream import PodHttp
from .options import RouterConfigError, RouterSettings, add_arguments, load_settings
from .request_blocks import RequestHasher
from .servicer import RouterServicer
from .telemetry import RouterMetrics
from .upstream import PodChannels
from .watcher import PodWatcher

__all__ = ["add_arguments", "main"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
DRAIN_GRACE_S = 600.0  # a removed pod's streams in flight: a long generation may take minutes
log = logging.getLogger(__name__)


class FleetService(GrpcService):
    """Health follows the fleet once warm and the tokenizer settled: SERVING while a pod is routable, NOT_SERVING
    while none is."""

    available = False
    _warm = False
    _tokenizer_settled = False

    async def mark_serving(self) -> None:
        self._warm = True
        await self.follow(self.available)

    @property
    def settled(self) -> bool:
        return self._tokenizer_settled

    async def tokenizer_settled(self) -> None:
        self._tokenizer_settled = True
        await self.follow(self.available)

    async def follow(self, available: bool) -> None:
        self.available = available
        if self._warm and self._tokenizer_settled:
            await (super().mark_serving() if available else self.mark_not_serving())


class TokenizerAdoption:
    """The tokenizer, handed to the hasher once it is the fleet's (see the module's docstring)."""

    def __init__(self, hasher: RequestHasher, fleet: Fleet, model: str = "",
                 on_settled: Callable[[], None] = lambda: None) -> None:
        self.hasher, self.fleet, self.model, self.on_settled = hasher, fleet, model, on_settled
        self.loaded: tuple[ModelSource, PreTrainedTokenizerFast] | None = None
        self._judged = False  # adopted or refused: said once

    async def load(self, *candidates: str) -> None:
        """Loads the first candidate this machine resolves (a registered name, a directory, a GGUF file)."""
        errors = []
        for model in candidates:
            try:
                source = await asyncio.to_thread(resolve_model, model)
                self.loaded = (source, await asyncio.to_thread(load_tokenizer, source))
                break
            except (OSError, ValueError) as exc:
                errors.append(f"{model!r}: {exc}")
        else:
            log.error("cannot load a tokenizer (%s): routing by load alone", "; ".join(errors))
            self.on_settled()
            return
        self.adopt()

    def on_model(self, pod: str, model: pb.ModelInfo) -> None:
        """A pod was accepted: learn the tokenizer from it if none is given, or check the one loaded."""
        if not self.model:
            # the model's name when it is a registered one, else the tokenizer's path on the pod (a directory)
            candidates = [name for name in (model.name, model.cache_identity.tokenizer) if name]
            self.model = candidates[0] if candidates else "?"
            log.info("no --model: loading the tokenizer of %s, which %s serves", " or ".join(candidates), pod)
            _soon(self.load(*candidates))
        self.adopt()

    def adopt(self) -> None:
        identity = self.fleet.identity
        if self.loaded is None or identity is None or self._judged:
            return
        self._judged = True
        source, tokenizer = self.loaded
        if source.digest != identity.model_digest:
            log.error("the tokenizer's model %s (%s) is not the fleet's (%s): routing by load alone", source.name,
                      source.digest, identity.model_digest)
        elif (tokenizer.chat_template or "") != identity.chat_template:
            log.error("the tokenizer's chat template is not the fleet's: routing by load alone")
        else:
            self.hasher.tokenizer = tokenizer
            log.info("hashing prompts with the tokenizer of %s", source.name)
        self.on_settled()


class Members:
    """The fleet's pods at run time: a channel and a watcher each, started and ended as the endpoints change."""

    def __init__(self, fleet: Fleet, channels: PodChannels, settings: RouterSettings,
                 on_model: Callable[[str, pb.ModelInfo], None]) -> None:
        self.fleet, self.channels, self.settings, self.on_model = fleet, channels, settings, on_model
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.draining: list[str] = []

    def watch(self, address: str) -> None:
        """Follows a pod of the fleet (its watcher makes it routable once in sync)."""
        watcher = PodWatcher(self.fleet, address, self.channels.add(address), self.settings.pod_metadata,
                             self.on_model)
        self.tasks[address] = asyncio.ensure_future(watcher.run())

    def update(self, endpoints: Endpoints) -> None:
        """The endpoint set from Kubernetes: new pods followed, the not-accepting drained, the gone removed."""
        added = [address for address in endpoints if address not in self.tasks]
        for address, accepting in endpoints.items():
            self.fleet.add_pod(address)
            if address not in self.tasks:
                self.watch(address)
            self.fleet.drain(address, not accepting)
        removed = [address for address in self.tasks if address not in endpoints]
        for address in removed:
            self.tasks.pop(address).cancel()  # before the fleet forgets it: the watcher never runs again
            self.fleet.remove_pod(address)
            _soon(self.channels.remove(address, DRAIN_GRACE_S))
        draining = sorted(address for address, accepting in endpoints.items() if not accepting)
        if added or removed or draining != self.draining:
            log.info("pods: %d (added %s, removed %s, not ready or terminating %s)", len(endpoints),
                     added or "none", removed or "none", draining or "none")
        self.draining = draining

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()


async def serve(args: argparse.Namespace, settings: RouterSettings) -> None:
    interceptors = [ApiKeyInterceptor(settings.keys)] if settings.keys is not None else []
    service = FleetService(args.listen, [SERVICE_NAME], interceptors, settings.credentials, settings.max_message_bytes)
    namespace = (args.namespace or default_namespace()) if args.kubernetes_service else ""
    no_pods = (f"no pod behind Service {namespace}/{args.kubernetes_service} (its EndpointSlices list none)"
               if args.kubernetes_service else "the router has no endpoints (--endpoints is empty)")
    fleet = Fleet(args.endpoints, Chooser(args.policy),
                  on_availability=lambda available: _soon(service.follow(available)), no_pods=no_pods)
    channels = PodChannels(args.endpoints, settings.pod_credentials, settings.pod_server_name)
    hasher = RequestHasher(settings.keys, settings.cache_salt_secret)
    metrics = RouterMetrics(fleet)
    tokenizer = TokenizerAdoption(hasher, fleet, args.model, on_settled=lambda: _soon(service.tokenizer_settled()))
    pb_grpc.add_InferenceServicer_to_server(RouterServicer(fleet, channels, hasher, metrics), service.handlers)
    pod_http = PodHttp(settings.pod_ssl, settings.pod_server_name)
    http: list[HttpService] = []
    if args.http_listen:
        tls = HttpTls(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        routing = HttpRouting(fleet, pod_http, hasher, metrics, settings.keys)
        app = build_app(routing, settings.max_message_bytes, settled=lambda: service.settled)
        http.append(HttpService(app, args.http_listen, tls))

    def on_model(pod: str, model: pb.ModelInfo) -> None:
        pod_http.on_model(pod, model)
        tokenizer.on_model(pod, model)

    members = Members(fleet, channels, settings, on_model)
    slices = (EndpointSliceWatcher(args.kubernetes_service, namespace, members.update)
              if args.kubernetes_service else None)

    async def warm_up() -> None:  # returns at once: health then follows the fleet
        if args.model:
            _soon(tokenizer.load(args.model))
        for address in args.endpoints:
            members.watch(address)
        if slices is not None:
            slices.start()
            log.info("following the pods of Service %s/%s", namespace, args.kubernetes_service)

    if not args.endpoints and not args.kubernetes_service:
        log.warning("no --endpoints: every request is answered UNAVAILABLE")
    if settings.keys is not None and settings.cache_salt_secret is None:
        log.warning("API keys without --cache-salt-secret-file: keyed tenants are routed by load alone")
    if args.metrics_port:
        host = args.listen.rpartition(":")[0].strip("[]") if not args.listen.startswith("unix:") else "127.0.0.1"
        metrics.serve(host, args.metrics_port)
        log.info("metrics on http://%s:%d/metrics", host, args.metrics_port)
    try:
        await serve_until_signalled(service, warm_up=warm_up, also=http)
    finally:
        if slices is not None:
            slices.stop()
        members.close()
        await channels.close()
        await pod_http.close()


_background: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references to tasks


def _soon(coroutine: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)


def main(args: argparse.Namespace) -> None:
    try:
        settings = load_settings(args)
    except (TlsConfigError, KeysFileError, CacheSaltSecretError, RouterConfigError) as exc:
        raise SystemExit(f"router: {exc}") from None
    run(serve(args, settings), "router")
