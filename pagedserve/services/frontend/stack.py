"""`pagedserve serve`: the three processes of a pod on one machine, started in order and watched.

The executor starts first (it sizes the KV cache) and the frontend right after it (its imports and tokenizer
load while the model loads; then it waits for both sidecars); the block manager is started with the
executor's numbers once the executor serves. All three talk over unix sockets in a private run directory;
only the frontend listens on TCP ports: gRPC, and with `--http-port` the OpenAI-compatible HTTP API (both
with TLS and API keys when given). The supervisor itself waits for and watches the frontend through a plain
socket in the run directory, so it needs neither a client certificate nor a key. Ctrl-C or SIGTERM stops all
three. A component that dies is reported with its last output and started again (the frontend waits for a
lost sidecar and resumes its requests; a restarted frontend loses only its own in-flight requests), unless
it keeps dying: then all three stop.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import grpc

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ..common.cache_salt import CacheSaltSecretError
from ..common.processes import ServiceProcess, start_service, stop_service, wait_serving
from ..common.tls import TlsConfigError
from ..executor.client import RemoteExecutor
from ..executor.options import ExecutorConfig, add_executor_arguments
from .auth import KeysFileError
from .public_options import add_public_arguments, load_public_settings, public_flags
from .scheduler import SWAP_WITHOUT_POOL
from .server import add_step_arguments

FRONTEND_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "preemption_mode", "ttft_slo_ms",
                  "tpot_slo_ms", "step_timeout", "recovery_timeout", "stream_interval", "spare_lookahead")
RESTART_WINDOW_S = 300.0
MODEL_LOAD_TIMEOUT_S = 1800.0  # a large model's load and warm-up on a GPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address the public API listens on")
    parser.add_argument("--port", type=int, default=50051)
    add_executor_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="cap on running sequences")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    parser.add_argument("--reserve-growth", action=argparse.BooleanOptionalAction, default=True,
                        help="admission keeps room for the running sequences to grow (on by default; "
                             "docs/scheduler.md)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="queue bound: past it new requests get RESOURCE_EXHAUSTED")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    parser.add_argument("--http-port", type=int, default=0,
                        help="also serve the OpenAI-compatible HTTP API on this port of --host (0: off)")
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="plan and send step N+1 while the executor runs step N (--no-overlap: in lock step)")
    add_step_arguments(parser)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=200.0)
    parser.add_argument("--status-interval", type=float, default=1.0, help="seconds between status lines")
    parser.add_argument("--step-timeout", type=float, default=120.0,
                        help="seconds a sidecar call (a step, at most) may take before the sidecar counts as lost")
    parser.add_argument("--recovery-timeout", type=float, default=120.0,
                        help="seconds requests wait for a lost sidecar before they fail with UNAVAILABLE")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help=f"restarts of a component within {RESTART_WINDOW_S:g} s before all stop (0: stop at once)")
    add_public_arguments(parser)


def status_line(status: pb.StatusResponse) -> str:
    return (f"running {status.num_running} | waiting {status.num_waiting} | "
            f"{status.generation_tokens_per_s:.1f} tok/s | blocks {status.num_used_blocks}/{status.num_total_blocks}"
            f" used, {status.num_cached_blocks} cached | goodput {status.goodput_rps:.2f} req/s")


class Stack:
    """The three processes; one that exits is started again with the same arguments on the same socket (the
    frontend rides out a lost sidecar), unless it died `max_restarts` times within RESTART_WINDOW_S."""

    def __init__(self, max_restarts: int = 5) -> None:
        self.services: dict[str, ServiceProcess] = {}
        self.launches: dict[str, tuple[list[str], str, float, str]] = {}  # name -> _start's arguments
        self.deaths: dict[str, list[float]] = {}  # name -> when it was found dead, within the window
        self.max_restarts = max_restarts
        self.run_dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.stopping = False
        self.frontend_local = f"unix:{self.run_dir}/frontend.sock"  # the supervisor's own, plain listener

    def start(self, args: argparse.Namespace) -> str:
        executor, block_manager = f"unix:{self.run_dir}/executor.sock", f"unix:{self.run_dir}/block-manager.sock"
        executor_argv = ["executor", *ExecutorConfig.from_args(args).to_argv()]
        self._start("executor", executor_argv, executor, timeout=MODEL_LOAD_TIMEOUT_S, wait=False)
        # started now, it imports and loads its tokenizer while the executor loads the model, then waits for both
        # sidecars (its addresses are known before they listen)
        frontend_args = ["frontend", "--block-manager", block_manager, "--executor", executor, "--model", args.model,
                         "--sidecar-timeout", str(MODEL_LOAD_TIMEOUT_S)]
        for flag in FRONTEND_FLAGS:
            frontend_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if not args.overlap:
            frontend_args.append("--no-overlap")
        if not args.reserve_growth:
            frontend_args.append("--no-reserve-growth")
        if args.metrics_port:
            frontend_args += ["--metrics-listen", f"{args.host}:{args.metrics_port}"]
        if args.http_port:
            frontend_args += ["--http-listen", f"{args.host}:{args.http_port}"]
        frontend_args += ["--local-listen", self.frontend_local, *public_flags(args)]
        self._start("frontend", frontend_args, f"{args.host}:{args.port}", timeout=MODEL_LOAD_TIMEOUT_S,
                    serving_at=self.frontend_local, wait=False)
        self._wait("executor")
        info = RemoteExecutor(executor).info()  # the block manager is sized by the cache the executor made
        self._start("block-manager", ["block-manager", "--num-blocks", str(info.num_blocks), "--block-size",
                                      str(info.block_size), "--cpu-blocks", str(info.num_cpu_blocks)], block_manager)
        self._wait("frontend")
        scheme = "https" if args.tls_cert else "http"
        http = f", OpenAI-compatible HTTP API on {scheme}://{args.host}:{args.http_port}/v1" if args.http_port else ""
        cache = f", {info.kv_cache_dtype} KV cache" if info.kv_cache_dtype else ""
        return (f"pagedserve: serving {info.model} on {args.host}:{args.port}{http} ({info.device}, {info.dtype}"
                f"{cache}, {info.kernel_backend} kernels; {info.num_blocks} KV blocks of {info.block_size} tokens, "
                f"{info.num_cpu_blocks} CPU swap blocks)")

    def _start(self, name: str, argv: list[str], listen: str, timeout: float = 300.0, serving_at: str = "",
               wait: bool = True) -> None:
        """Starts a component; waits until it is SERVING at its address, or at `serving_at` when given (with
        `wait=False`, only until it listens: `_wait` then)."""
        print(f"pagedserve: starting the {name} ...", file=sys.stderr, flush=True)
        self.launches[name] = (argv, listen, timeout, serving_at)
        self.services[name] = start_service(argv, listen=listen, timeout=timeout, until_serving=False, echo=name)
        if wait:
            self._wait(name)

    def _wait(self, name: str) -> None:
        _, _, timeout, serving_at = self.launches[name]
        service = self.services[name]
        try:
            wait_serving(serving_at or service.address, timeout, service.proc)
        except BaseException as exc:
            stop_service(service)  # not serving in time: found dead next round (a restart counts it)
            if isinstance(exc, (RuntimeError, TimeoutError)):
                raise RuntimeError(f"the {name}: {exc}") from exc
            raise

    def dead(self) -> tuple[str, ServiceProcess] | None:
        return next(((n, s) for n, s in self.services.items() if s.proc.poll() is not None), None)

    def revive(self, name: str) -> bool:
        """Starts a dead component again (after a back-off when it keeps dying); False when it died too often."""
        now = time.monotonic()
        deaths = self.deaths[name] = [t for t in self.deaths.get(name, []) if now - t < RESTART_WINDOW_S] + [now]
        if len(deaths) > self.max_restarts:
            return False
        time.sleep(min(2.0 ** (len(deaths) - 2), 30.0) if len(deaths) > 1 else 0.0)
        try:
            self._start(name, *self.launches[name])
        except Exception as exc:  # it died again while starting: found dead next round, and counted
            print(f"pagedserve: the {name} failed to start again: {exc}", file=sys.stderr, flush=True)
        return True

    def stop(self) -> None:
        for name in ("frontend", "block-manager", "executor"):
            if name in self.services:
                stop_service(self.services[name])
        shutil.rmtree(self.run_dir, ignore_errors=True)


def main(args: argparse.Namespace) -> None:
    try:  # the frontend would refuse them too, but only after the model has loaded
        load_public_settings(args)
    except (TlsConfigError, KeysFileError, CacheSaltSecretError) as exc:
        raise SystemExit(f"pagedserve: {exc}") from None
    if args.preemption_mode == "swap" and args.cpu_swap_mib == 0:
        raise SystemExit(f"pagedserve: {SWAP_WITHOUT_POOL}")
    stack = Stack(args.max_restarts)

    def request_stop(signum: int, frame: Any) -> None:
        stack.stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    code = 0
    try:
        print(stack.start(args), flush=True)
        code = watch(stack, stack.frontend_local, args.status_interval)
    except Exception as exc:  # a component failed to start: say which, with its last words
        print(f"\npagedserve: {exc}", file=sys.stderr)
        code = 1
    finally:
        stack.stop()
    raise SystemExit(code)


def watch(stack: Stack, address: str, interval: float) -> int:
    live = sys.stdout.isatty()
    last_print = 0.0
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        while not stack.stopping:
            dead = stack.dead()
            if dead is not None:
                name, service = dead
                tail = "".join(service.output[-20:])
                if not stack.stopping and stack.revive(name):
                    print(f"\npagedserve: the {name} exited with code {service.proc.returncode}; started it again"
                          f"\n{tail}", file=sys.stderr, flush=True)
                    continue
                print(f"\npagedserve: the {name} exited with code {service.proc.returncode}"
                      f" ({len(stack.deaths.get(name, []))} times in {RESTART_WINDOW_S:g} s); stopping.\n{tail}",
                      file=sys.stderr, flush=True)
                return 1
            try:
                line = status_line(stub.Status(pb.StatusRequest(), timeout=5))
            except grpc.RpcError as exc:
                line = f"status unavailable: {exc.code().name}"
            now = time.monotonic()
            if live:
                print(f"\r{line:<110}", end="", flush=True)
            elif now - last_print >= 10 * interval:  # a log, not a terminal: one line every ten intervals
                print(json.dumps({"status": line}), flush=True)
                last_print = now
            time.sleep(interval)
    print("\npagedserve: stopping", file=sys.stderr, flush=True)
    return 0
