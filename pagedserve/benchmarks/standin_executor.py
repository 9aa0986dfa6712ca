"""An executor stand-in for `bench overhead`: the real executor gRPC service, but each step is held for a
fixed time instead of running a model, standing in for an accelerator that is busy for that long. With
`--device`, the real model runs instead (on a GPU: the overhead against real steps), timed the same way.

It speaks the Executor protocol through the real servicer (request parsing, step ordering, answers), keeps
the tokens it "sampled" for LAST_SAMPLED inputs as the real runner does, and records when each step began
and ended, and when it arrived, so that the accelerator's busy share of the wall time can be measured, and
its idle time split into waiting for the frontend and the executor's own time between steps. The token it samples
for a position depends only on the position, so every mode and run produces the same text.

    python -m pagedserve.benchmarks.standin_executor --listen 127.0.0.1:0 --model M --num-blocks N
        --step-ms 10 --timeline FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import operator
import time
from itertools import compress, repeat
from pathlib import Path
from typing import Any

from ..protos import executor_pb2 as pb
from ..protos import executor_pb2_grpc as pb_grpc
from ..services.common.grpc_server import GrpcService, run, serve_until_signalled
from ..services.executor.codec import SERVICE_NAME
from ..services.executor.model.registry import resolve_model
from ..services.executor.model.tokenizer import load_tokenizer
from ..services.executor.options import ExecutorConfig
from ..services.executor.server import ExecutorServicer
from ..services.executor.step_types import LAST_SAMPLED, LastSampled, SampledToken, StepInput, new_row


class Timeline:
    """(start, end, sequences, arrived) per step run: `arrived` is when it was queued for the step thread."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int, float]] = []
        self.arrivals: dict[int, float] = {}  # step id -> when it was queued, until it runs

    def arrived(self, step_id: int) -> None:
        self.arrivals[step_id] = time.perf_counter()

    def record(self, start: float, step: StepInput) -> None:
        """The step ran from `start` until now."""
        self.steps.append((start, time.perf_counter(), len(step.sequences), self.arrivals.pop(step.step_id, start)))


class StandInRunner:
    """Holds each step for `step_s` seconds; records each in the timeline."""

    def __init__(self, step_s: float, vocab_size: int, timeline: Timeline, block_size: int = 16) -> None:
        """`block_size`: the cache's, which an in-process port (LocalExecutor) reads off its runner."""
        self.step_s, self.vocab_size, self.timeline = step_s, vocab_size, timeline
        self.block_size = block_size
        self.last_sampled = LastSampled()

    def token_at(self, position: int) -> int:
        """The token it samples for a position: the same for every sequence, distinct for each position below
        the vocabulary's size (7919 is prime), so a stop token picks where a sequence ends."""
        return 1 + position * 7919 % (self.vocab_size - 1)

    def reset(self) -> None:
        """The executor's Reset: no step may ask for what an earlier one sampled."""
        self.last_sampled.clear()

    def execute(self, step: StepInput) -> list[SampledToken]:
        """Checks what the real runner checks of LAST_SAMPLED and samples a token per sequence that wants one, by
        columns: the stand-in's own CPU shares the cores with the processes it measures."""
        start = time.perf_counter()
        last, tokens = self.last_sampled, []
        if step.sequences:
            seq_ids, token_lists, starts, _, _, samplings = zip(*step.sequences, strict=True)
            if not last.allows(step.step_id, seq_ids, token_lists):
                for i, token_ids in enumerate(token_lists):  # raises, naming the first sequence at fault
                    if LAST_SAMPLED in token_ids:
                        last.check(step.step_id, seq_ids[i], token_ids, f"sequences[{i}].token_ids")
            positions = compress(map(operator.add, starts, map(len, token_lists)), samplings)
            ids = [1 + position * 7919 % (self.vocab_size - 1) for position in positions]
            tokens = list(map(new_row, repeat(SampledToken), zip(compress(seq_ids, samplings), ids, repeat(0.0),
                                                                 repeat(()), repeat(()), strict=False)))
        last.start(step.step_id)
        last.record(tokens)
        time.sleep(max(0.0, start + self.step_s - time.perf_counter()))
        self.timeline.record(start, step)
        return tokens


class TimedRunner:
    """The real runner, each step recorded in the timeline as the stand-in's are."""

    def __init__(self, runner: Any, timeline: Timeline) -> None:
        self.runner, self.last_sampled, self.reset = runner, runner.last_sampled, runner.reset
        self.timeline = timeline

    def execute(self, step: StepInput) -> list[SampledToken]:
        start = time.perf_counter()
        tokens = self.runner.execute(step)  # returns host values: the device has finished the step
        self.timeline.record(start, step)
        return tokens


class StandInServicer(ExecutorServicer):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.timeline = Timeline()
        super().__init__(None)  # type: ignore[arg-type]  # no model to configure

    def _queue(self, request: pb.ExecuteRequest, stream: Any) -> Any:
        self.timeline.arrived(request.step_id)
        return super()._queue(request, stream)

    async def load(self) -> None:
        if self.args.device:
            await self._load_real()
            return
        source = resolve_model(self.args.model)
        vocab_size = len(load_tokenizer(source))
        stand_in = StandInRunner(self.args.step_ms / 1000, vocab_size, self.timeline)
        self.runner = stand_in  # type: ignore[assignment]  # the servicer calls only execute() and reset()
        self.info = pb.InfoResponse(
            model=self.args.model, model_digest=source.digest, dtype="float32", device="stand-in (a fixed hold)",
            vocab_size=vocab_size, max_model_len=self.args.max_model_len, block_size=self.args.block_size,
            num_blocks=self.args.num_blocks, num_cpu_blocks=0, kernel_backend="stand-in",
        )

    async def _load_real(self) -> None:
        from ..services.executor.engine_config import build_runner

        config = ExecutorConfig(model=self.args.model, device=self.args.device, block_size=self.args.block_size,
                                num_blocks=self.args.num_blocks, max_model_len=self.args.max_model_len)
        runner, info = await asyncio.get_running_loop().run_in_executor(self.thread, build_runner, config)
        self.runner = TimedRunner(runner, self.timeline)  # type: ignore[assignment]
        self.info = pb.InfoResponse(**{**vars(info), "eos_token_ids": list(info.eos_token_ids)})


async def serve(args: argparse.Namespace) -> None:
    servicer = StandInServicer(args)
    service = GrpcService(args.listen, [SERVICE_NAME])
    pb_grpc.add_ExecutorServicer_to_server(servicer, service.handlers)
    try:
        await serve_until_signalled(service, warm_up=servicer.load)
    finally:
        Path(args.timeline).write_text(json.dumps(servicer.timeline.steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--model", default="smollm2-135m", help="whose digest and tokenizer the stand-in reports")
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=0.0, help="how long each step holds the 'accelerator'")
    parser.add_argument("--device", default="", help="run the real model on this device instead (cuda, cpu)")
    parser.add_argument("--timeline", required=True,
                        help="where to write [start, end, sequences, arrived] per step at exit")
    args = parser.parse_args()
    run(serve(args), "executor-stand-in")


if __name__ == "__main__":
    main()
