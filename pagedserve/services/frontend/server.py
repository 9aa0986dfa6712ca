"""`pagedserve frontend`: the public API over a running block manager and executor.

At start it checks that the two agree on the KV cache (block size and count, CPU pool), and that the
tokenizer it loads belongs to the weights the executor serves; a mismatch is a clear startup error. After
that, a lost sidecar is waited for (recovery.py): health is NOT_SERVING until both answer again. So
is a bad TLS or keys file (public_options.py), before anything is started. With `--http-listen` the same
process serves the OpenAI-compatible HTTP API (http_api.py) over the same engine, on the same event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ..block_manager.client import RemoteBlockManager
from ..common.addresses import is_local_address
from ..common.cache_identity import CacheIdentity
from ..common.cache_salt import CacheSaltSecretError
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from ..common.http_server import HttpService, HttpTls, parse_listen
from ..common.processes import wait_serving
from ..common.tls import TlsConfigError
from ..executor.client import RemoteExecutor
from ..executor.model.registry import ModelSource, resolve_model
from ..executor.model.tokenizer import load_tokenizer
from .api import InferenceServicer
from .auth import ApiKeyInterceptor, KeysFileError
from .engine import Engine, EngineLimits
from .engine_loop import EngineLoop
from .exporter import start_exporter
from .generation import Backend, Serving
from .http_api import build_app
from .kv_relay import KvEventRelay
from .metrics import ServingMetrics
from .public_options import PublicSettings, add_public_arguments, load_public_settings, non_negative_int, positive_int
from .recovery import CacheMismatch, Sidecars
from .scheduler import SWAP_WITHOUT_POOL, Scheduler, SchedulerConfig, shares_kv

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051", help="unix:PATH or HOST:PORT")
    parser.add_argument("--local-listen", metavar="unix:PATH", default="",
                        help="also a plain unix socket for a supervisor on this machine (no TLS; health, Status, "
                             "ListModels and Tokenize without a key; generation still needs one)")
    parser.add_argument("--block-manager", required=True, help="address of the block manager")
    parser.add_argument("--executor", required=True, help="address of the executor")
    parser.add_argument("--sidecar-timeout", type=float, default=300.0,
                        help="seconds to wait for the executor and block manager to serve (model load)")
    parser.add_argument("--step-timeout", type=float, default=120.0,
                        help="seconds a sidecar call (a step, at most) may take before the sidecar counts as lost")
    parser.add_argument("--recovery-timeout", type=float, default=120.0,
                        help="seconds requests wait for a lost sidecar before they fail with UNAVAILABLE")
    parser.add_argument("--model", default="smollm2-135m", help="the model the executor serves (for its tokenizer)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64, help="cap on running sequences")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="token budget per step")
    parser.add_argument("--reserve-growth", action=argparse.BooleanOptionalAction, default=True,
                        help="admit a request only if the running sequences keep room to grow at their expected "
                             "peak (on by default; --no-reserve-growth admits while blocks last: docs/scheduler.md)")
    parser.add_argument("--max-waiting-requests", type=positive_int, default=256,
                        help="queue bound: past it new requests get RESOURCE_EXHAUSTED")
    parser.add_argument("--metrics-listen", default="", help="HOST:PORT to serve Prometheus /metrics on (off if empty)")
    parser.add_argument("--http-listen", default="", metavar="HOST:PORT",
                        help="also serve the OpenAI-compatible HTTP API here (off if empty); TLS and keys as gRPC's")
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="plan and send step N+1 while the executor runs step N (--no-overlap: in lock step)")
    add_step_arguments(parser)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="time-to-first-token objective")
    parser.add_argument("--tpot-slo-ms", type=float, default=200.0, help="time-per-output-token objective")
    add_public_arguments(parser)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The frontend's step flags that `serve` passes on too."""
    parser.add_argument("--stream-interval", type=positive_int, default=1, metavar="STEPS",
                        help="a streaming request gets its first token at once, then a chunk every this many steps"
                             " (fewer, larger messages for many streams; a caller that falls behind gets what it"
                             " missed in one chunk anyway)")
    parser.add_argument("--spare-lookahead", type=non_negative_int, default=SchedulerConfig.spare_lookahead,
                        metavar="SLOTS", help="a block-manager call also takes a spare block for each decoding"
                        " sequence with fewer free slots than this, so the next steps need no call (0: no spares)")


def connect(args: argparse.Namespace, max_n: int, on_availability: Callable[[bool], None]) -> Backend:
    """Blocking: checks the sidecars agree, loads the tokenizer (on a thread of its own from the start, while
    the executor may still be loading the model; its errors come after the sidecars'), starts the engine
    thread."""
    source = resolve_model(args.model)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer") as loading:
        tokenizer_loaded = loading.submit(load_tokenizer, source)
        executor, block_manager, sidecars = _sidecars(args, source)
        tokenizer = tokenizer_loaded.result()
    info = sidecars.info
    assert info is not None
    scheduler = Scheduler(
        SchedulerConfig(info.block_size, info.max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                        args.preemption_mode, shares_kv(info.kv_layout), spare_lookahead=args.spare_lookahead,
                        reserve_growth=args.reserve_growth),
        block_manager,
    )
    eos = frozenset(info.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    limits = EngineLimits(info.vocab_size, info.max_model_len, info.num_blocks, info.block_size, eos, max_n)
    identity = CacheIdentity(info.model_digest, tokenizer.name_or_path or info.model, tokenizer.chat_template or "",
                             info.cache_dtype, info.block_size)
    metrics = ServingMetrics(args.ttft_slo_ms, args.tpot_slo_ms)
    loop = EngineLoop(Engine(scheduler, executor, limits, identity, args.overlap), metrics, args.max_waiting_requests,
                      sidecars, args.recovery_timeout, on_availability, args.stream_interval)
    loop.start()
    return Backend(loop, tokenizer, info)


def _sidecars(args: argparse.Namespace, source: ModelSource) -> tuple[RemoteExecutor, RemoteBlockManager, Sidecars]:
    """Waits for both sidecars, starts them clean, and checks that they agree with each other and with us."""
    for address in (args.executor, args.block_manager):  # in a pod all three containers start at once
        wait_serving(address, args.sidecar_timeout)
    executor = RemoteExecutor(args.executor, timeout=args.step_timeout)
    block_manager = RemoteBlockManager(args.block_manager, timeout=args.step_timeout)
    sidecars = Sidecars(executor, block_manager)
    try:  # nothing in the cache is ours, and no step of an earlier frontend may still run: start clean
        sidecars.sync()
    except CacheMismatch as exc:
        raise StartupError(str(exc)) from None
    info = sidecars.info
    assert info is not None
    if source.digest != info.model_digest:
        raise StartupError(f"--model {args.model} ({source.digest}) is not what the executor serves "
                           f"({info.model}, {info.model_digest})")
    if args.preemption_mode == "swap" and info.num_cpu_blocks == 0:
        raise StartupError(SWAP_WITHOUT_POOL)
    return executor, block_manager, sidecars


async def serve(args: argparse.Namespace, settings: PublicSettings) -> None:
    if settings.keys is not None:
        log.info("API keys of %d tenants: every call needs one", len(settings.keys.tenants))
    else:
        for listen in filter(None, (args.listen, args.http_listen)):
            if not is_local_address(listen):
                log.warning("no --api-keys-file: every caller that reaches %s is trusted", listen)
    interceptors = [ApiKeyInterceptor(settings.keys)] if settings.keys is not None else []
    service = GrpcService(args.listen, [SERVICE_NAME], interceptors, settings.credentials, settings.max_message_bytes)
    # the supervisor's socket: plain, without the interceptor (the servicer still wants a key to generate)
    local = [GrpcService(args.local_listen, [SERVICE_NAME])] if args.local_listen else []
    serving = Serving(settings.keys, settings.limits, settings.cache_salt_secret)  # one engine, salt secret, count
    relay = KvEventRelay(args.block_manager)
    http: list[HttpService] = []
    if args.http_listen:  # answers 503 until the warm-up attaches the engine
        tls = HttpTls(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        http.append(HttpService(build_app(serving, settings.max_message_bytes), args.http_listen, tls))
    # ListModels names the HTTP port (bound by then: the listeners start before the warm-up), for a router
    servicer = InferenceServicer(serving=serving, kv_events=relay, http_port=lambda: http[0].port if http else 0)
    for each in (service, *local):
        pb_grpc.add_InferenceServicer_to_server(servicer, each.handlers)
    service.on_stop.append(relay.close)  # the relayed event streams never end by themselves

    event_loop = asyncio.get_running_loop()

    def on_availability(available: bool) -> None:  # from the engine thread
        for each in (service, *local):
            mark = each.mark_serving if available else each.mark_not_serving
            asyncio.run_coroutine_threadsafe(mark(), event_loop)

    async def warm_up() -> None:
        serving.attach(await asyncio.to_thread(connect, args, settings.limits.max_n, on_availability))

    exporter = None
    if args.metrics_listen:
        exporter, _ = start_exporter(args.metrics_listen, lambda: serving.backend.loop if serving.ready else None)
        log.info("metrics on http://%s/metrics", args.metrics_listen)
    try:
        await serve_until_signalled(service, warm_up=warm_up, also=[*local, *http])
    finally:
        if exporter is not None:
            exporter.shutdown()
        if serving.ready:
            serving.backend.loop.stop()


def main(args: argparse.Namespace) -> None:
    if args.local_listen and not args.local_listen.startswith("unix:"):
        raise SystemExit(f"frontend: --local-listen {args.local_listen}: must be unix:PATH (it asks no client "
                         "certificate; the socket's file permissions guard it)")
    if args.http_listen:
        try:
            parse_listen(args.http_listen)
        except ValueError as exc:
            raise SystemExit(f"frontend: --http-listen {exc}") from None
    try:
        settings = load_public_settings(args)
    except (TlsConfigError, KeysFileError, CacheSaltSecretError) as exc:
        raise SystemExit(f"frontend: {exc}") from None
    try:
        run(serve(args, settings), "frontend")
    except StartupError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
