"""The `pagedserve` command: one subcommand per service or tool. Modules load lazily, so the block
manager starts without importing torch."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module that provides add_arguments(parser) and main(args), help)
COMMANDS = {
    "block-manager": ("pagedserve.services.block_manager.server", "run the KV block-manager gRPC sidecar"),
    "executor": ("pagedserve.services.executor.server", "run the model executor gRPC service"),
    "frontend": ("pagedserve.services.frontend.server", "run the public API and scheduler over the sidecars"),
    "serve": ("pagedserve.services.frontend.stack", "run block manager, executor and frontend together"),
    "router": ("pagedserve.services.router.server", "route each request to the pod that holds its prefix"),
    "run": ("pagedserve.services.frontend.run_cli", "offline generation for a few prompts"),
    "generate": ("pagedserve.services.frontend.client_cli:generate", "stream a completion from a server"),
    "chat": ("pagedserve.services.frontend.client_cli:chat", "chat with a server interactively"),
    "status": ("pagedserve.services.frontend.client_cli:status", "a server's scheduler and KV-cache state"),
    "health": ("pagedserve.services.common.health_cli", "check a service's gRPC health (exit 0 when SERVING)"),
    "operator": ("pagedserve.operator.main", "run the Kubernetes operator (PagedModel, AutoscalingPolicy)"),
    "delete-models": ("pagedserve.operator.cleanup", "delete PagedModels and wait until the operator released them"),
}
BENCHMARKS = {
    "autoscale": ("pagedserve.benchmarks.autoscale", "a simulated day: the scaling policy vs static and HPA"),
    "blocks": ("pagedserve.benchmarks.blocks", "block-manager utilization and step latency"),
    "cpu-attention": ("pagedserve.benchmarks.cpu_attention", "CPU decode attention: the C kernel vs the torch path"),
    "cpu-gemm": ("pagedserve.benchmarks.cpu_gemm", "a step's fp32 matmuls in cpu_gemm.c per row count; --ab-source"),
    "executor": ("pagedserve.benchmarks.executor", "generation throughput vs HF transformers generate()"),
    "fleet": ("pagedserve.benchmarks.fleet", "routing policies over real pods behind the router, or simulated"),
    "host-step": ("pagedserve.benchmarks.host_step", "host CPU of a steady decode step per side, in process, no gRPC"),
    "kernels": ("pagedserve.benchmarks.kernels", "paged decode attention bandwidth and speed vs SDPA"),
    "layouts": ("pagedserve.benchmarks.layouts", "paged vs virtual-memory vs static KV layouts at one KV budget"),
    "model": ("pagedserve.benchmarks.model_check", "our model vs HF transformers per dtype: greedy tokens, logprobs"),
    "offline": ("pagedserve.benchmarks.offline", "an offline batch vs HF generate() and, with --peer, vLLM (CPU)"),
    "overhead": ("pagedserve.benchmarks.overhead", "per-step cost of frontend and block manager (stand-in executor)"),
    "serve": ("pagedserve.benchmarks.serve", "the serving stack under a workload, vs HF transformers"),
    "soak": ("pagedserve.benchmarks.soak", "the stack for N minutes under cancelling, disconnecting clients: leaks"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving on PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (target, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        module, _, prefix = target.partition(":")  # module[:prefix]: prefix_main and add_prefix_arguments
        if name == wanted:  # import only what is about to run
            add = getattr(importlib.import_module(module), f"add_{prefix}_arguments" if prefix else "add_arguments")
            add(sub)
        sub.set_defaults(module=module, entry=f"{prefix}_main" if prefix else "main")
    bench = commands.add_parser("bench", help="run a benchmark (prints one JSON object)")
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        sub = benches.add_parser(name, help=help_text)
        if wanted == "bench" and len(argv) > 1 and argv[1] == name:
            importlib.import_module(module).add_arguments(sub)
        sub.set_defaults(module=module, entry="main")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    getattr(importlib.import_module(args.module), args.entry)(args)


if __name__ == "__main__":
    main()
