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
    "run": ("pagedserve.services.frontend.run_cli", "offline generation for a few prompts"),
}
BENCHMARKS = {
    "blocks": ("pagedserve.benchmarks.blocks", "block-manager utilization and step latency"),
    "executor": ("pagedserve.benchmarks.executor", "generation throughput vs HF transformers generate()"),
    "kernels": ("pagedserve.benchmarks.kernels", "paged decode attention bandwidth and speed vs SDPA"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving on PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name == wanted:  # import only what is about to run
            importlib.import_module(module).add_arguments(sub)
        sub.set_defaults(module=module)
    bench = commands.add_parser("bench", help="run a benchmark (prints one JSON object)")
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        sub = benches.add_parser(name, help=help_text)
        if wanted == "bench" and len(argv) > 1 and argv[1] == name:
            importlib.import_module(module).add_arguments(sub)
        sub.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    importlib.import_module(args.module).main(args)


if __name__ == "__main__":
    main()
