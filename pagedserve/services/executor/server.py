"""`pagedserve executor`: the model behind gRPC. Loads weights, sizes the KV cache, warms up, then serves.

Health stays NOT_SERVING until the weights are loaded and a warm-up step has run. A frontend's steps come on
one stream, in the order they run: one at a time on a dedicated thread, so the event loop keeps reading the
next step and answering health checks during a forward pass. Steps carry
the epoch of the frontend's last `Reset`: one of an older epoch (sent before the frontend lost this
executor or its block manager) is refused, or skipped if it was queued already, and never touches the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, chain, compress, repeat

import grpc.aio

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.addresses import add_allow_remote_argument, check_sidecar_listen
from ..common.errors import InvalidRequest, NotReady
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from ..common.tracing import message_span
from .client import EXECUTE_METHOD
from .engine_config import build_runner
from .options import ExecutorConfig, add_executor_arguments
from .runner import ModelRunner
from .step_types import HeldInputs, SampledToken, SamplingParams, SequenceInput, StepInput, new_row

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


# a step's per-sequence fields: a `same_batch` step has none
SEQUENCE_FIELDS = ("seq_ids", "num_tokens", "start_positions", "block_table_lens", "sample", "token_ids",
                   "slot_mapping", "block_tables", "temperature", "top_k", "top_p", "seed", "num_top_logprobs",
                   "table_held", "table_kept", "sampling_held")


def step_from_proto(r: pb.ExecuteRequest, held: HeldInputs | None = None, block_size: int = 0) -> StepInput:
    """Splits the packed arrays into sequences, with the tables and sampling parameters `held` for them filled in
    (`table_held`, `table_kept`, `sampling_held`), or a `same_batch` step's from the held batch (its slots by the
    slot rule over `block_size`); InvalidRequest when their lengths disagree or an input is not held. Each
    repeated field is read once (a pass over one makes its ints anew), and in the steady state (every sequence
    decodes, every input held) nothing is walked by a Python loop."""
    held = held if held is not None else HeldInputs()
    swap_out, swap_in, copies = ([(c.src, c.dst) for c in moves] for moves in (r.swap_out, r.swap_in, r.copies))
    if r.same_batch:
        named = next((name for name in SEQUENCE_FIELDS if len(getattr(r, name))), None)
        if named is not None:
            raise InvalidRequest(f"{named}: must be empty in a same_batch step (its sequences are the last step's)")
        if block_size <= 0:
            raise ValueError("a same_batch step needs the cache's block size for its slots")
        return StepInput(held.repeated_batch(r.step_id, block_size), swap_out, swap_in, copies, r.step_id,
                         list(r.released_seq_ids), same_batch=True)
    seq_ids = list(r.seq_ids)
    num_seqs = len(seq_ids)
    for name in ("num_tokens", "start_positions", "block_table_lens", "sample"):
        if len(getattr(r, name)) != num_seqs:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries for {num_seqs} sequences")
    num_tokens, table_lens, table_held = list(r.num_tokens), list(r.block_table_lens), list(r.table_held)
    if table_held:
        if len(table_held) != num_seqs:
            raise InvalidRequest(f"table_held: {len(table_held)} entries for {num_seqs} sequences (or none)")
        if any(table_lens) and any(map(operator.and_, table_held, table_lens)):  # in C; the index for the error
            bad = next(i for i, (is_held, n) in enumerate(zip(table_held, table_lens, strict=True)) if is_held and n)
            raise InvalidRequest(f"block_table_lens[{bad}]: {table_lens[bad]} blocks for a table the executor holds"
                                 " (table_held): must be 0")
    decodes = num_tokens.count(1) == num_seqs  # one token each
    num_all_tokens = num_seqs if decodes else sum(num_tokens)
    for name, wanted in (("token_ids", num_all_tokens), ("slot_mapping", num_all_tokens),
                         ("block_tables", sum(table_lens))):
        if len(getattr(r, name)) != wanted:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries, the sequences' lengths add up to {wanted}")
    flags = list(r.sample)
    for name in ("top_k", "top_p", "seed", "num_top_logprobs"):
        if len(getattr(r, name)) != len(r.temperature):
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries for {len(r.temperature)} temperatures")
    top_p = list(r.top_p)
    if top_p and min(top_p) <= 0:  # unset: off
        top_p = [p if p > 0 else 1.0 for p in top_p]
    sent = list(map(new_row, repeat(SamplingParams),  # checked equally long just above
                    zip(r.temperature, r.top_k, top_p, r.seed, r.num_top_logprobs, strict=True)))
    all_sample = flags.count(True) == num_seqs
    sampled = held.resolve_sampling(seq_ids if all_sample else list(compress(seq_ids, flags)), list(r.sampling_held),
                                    sent)
    params: Sequence[SamplingParams | None] = sampled
    if not all_sample:  # some sequences do not sample (prefill chunks)
        each = iter(sampled)
        params = [next(each) if sample else None for sample in flags]
    tokens, slots, tables = list(r.token_ids), list(r.slot_mapping), list(r.block_tables)
    if decodes:
        token_lists, slot_lists = [[t] for t in tokens], [[s] for s in slots]
    else:
        ends = list(accumulate(num_tokens))
        token_lists = [tokens[end - n : end] for n, end in zip(num_tokens, ends, strict=True)]
        slot_lists = [slots[end - n : end] for n, end in zip(num_tokens, ends, strict=True)]
    table_lists: Sequence[Sequence[int]] = [()] * num_seqs  # every table held: `resolve_tables` fills them all
    if tables:
        table_lists = [tables[end - n : end] for n, end in zip(table_lens, accumulate(table_lens), strict=True)]
    table_kept = list(r.table_kept)
    if table_held or table_kept:
        table_lists = held.resolve_tables(seq_ids, table_lists, table_held, table_kept)
    # columns to rows in C (map over the columns), not one Python pass per sequence
    sequences = list(map(new_row, repeat(SequenceInput),
                         zip(seq_ids, token_lists, r.start_positions, table_lists, slot_lists, params, strict=True)))
    return StepInput(sequences, swap_out, swap_in, copies, r.step_id, list(r.released_seq_ids))


def tokens_to_proto(tokens: list[SampledToken]) -> pb.ExecuteResponse:
    if not tokens:
        return pb.ExecuteResponse()
    seq_ids, token_ids, logprobs, top_ids, top_values = zip(*tokens, strict=True)  # columns, in C
    response = pb.ExecuteResponse(seq_ids=seq_ids, token_ids=token_ids, logprobs=logprobs)
    if any(top_ids):
        response.num_top.extend(map(len, top_ids))
        response.top_token_ids.extend(chain.from_iterable(top_ids))
        response.top_logprobs.extend(chain.from_iterable(top_values))
    return response


class _Stream:
    """One Execute call's state, as the step thread sees it."""

    failed = False


def _failed(exc: Exception) -> asyncio.Future[list[SampledToken]]:
    future: asyncio.Future[list[SampledToken]] = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None
        self.info: pb.InfoResponse | None = None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
        self.epoch = 0
        self.tables = HeldInputs()  # the block tables and sampling parameters of the sequences running here

    async def load(self) -> None:
        """Loads the model and runs the warm-up step on the step thread, off the event loop."""
        loop = asyncio.get_running_loop()
        runner, info = await loop.run_in_executor(self.thread, build_runner, self.config)
        self.info = pb.InfoResponse(**{**vars(info), "eos_token_ids": list(info.eos_token_ids)})
        self.runner = runner

    async def Execute(self, requests: AsyncIterator[pb.ExecuteRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecuteResponse]:
        """Steps are queued for the step thread as they arrive (N+1 waits behind N there, not here) and answered
        in that order. The first that fails ends the stream with its status; none queued after it runs."""
        queued: asyncio.Queue[tuple[str, asyncio.Future[list[SampledToken]], StepInput | None] | None] = (
            asyncio.Queue())
        stream = _Stream()

        async def arrive() -> None:
            try:
                async for request in requests:
                    running, step = self._queue(request, stream)
                    queued.put_nowait((request.traceparent, running, step))
                    if running.done():  # refused before it was queued: nothing after it is
                        break
            except Exception as exc:  # a message that does not parse, or a stopping service: answered in turn
                queued.put_nowait(("", _failed(exc), None))
            finally:
                queued.put_nowait(None)

        arriving = asyncio.ensure_future(arrive())
        try:
            while (item := await queued.get()) is not None:
                # The step's input is held here until its answer is sent, so that it is freed on this thread,
                # not on the step thread between two steps (thousands of objects at 256 sequences: ~0.3 ms
                # the accelerator would wait).
                traceparent, running, _input = item
                with message_span(EXECUTE_METHOD, traceparent):
                    response = tokens_to_proto(await running)
                yield response
                del item, _input
        finally:
            arriving.cancel()

    def accept(self, request: pb.ExecuteRequest) -> StepInput:
        """The step a request asks for, with the held tables and sampling parameters filled in, its own recorded
        as held; or the error that refuses it (nothing recorded). Held inputs are those of the steps that
        arrived before it (a step behind a failed one never runs)."""
        if self.runner is None:
            raise NotReady("the model is still loading")
        if request.epoch != self.epoch:  # UNAVAILABLE: to its sender this executor is lost (restarted, or reset);
            # checked first: its held inputs are another epoch's, unknown here
            raise NotReady(f"epoch: the step is of epoch {request.epoch}, the executor's is {self.epoch}")
        assert self.info is not None  # loaded with the runner
        step = step_from_proto(request, self.tables, self.info.block_size)
        if step.same_batch:
            self.tables.commit_repeated(step)
        else:
            self.tables.commit(step, samplings_sent=len(request.temperature) > 0)
        return step

    def _queue(self, request: pb.ExecuteRequest,
               stream: _Stream) -> tuple[asyncio.Future[list[SampledToken]], StepInput | None]:
        """The step, queued for the step thread, and its input; or its error, to be answered in its turn. It is
        accepted here, while the step before runs, not between two steps on the step thread."""
        runner = self.runner
        try:
            step = self.accept(request)
        except Exception as exc:
            return _failed(exc), None
        assert runner is not None  # else accept refused it
        return asyncio.get_running_loop().run_in_executor(self.thread, self._run_step, runner, step, request.epoch,
                                                          stream), step

    def _run_step(self, runner: ModelRunner, step: StepInput, epoch: int, stream: _Stream) -> list[SampledToken]:
        """On the step thread, in step order: a step queued before a Reset, or behind a failed step of its
        stream, is void."""
        if epoch != self.epoch:
            raise NotReady(f"epoch: the step is of epoch {epoch}, the executor moved on to {self.epoch}")
        if stream.failed:
            raise InvalidRequest("an earlier step on this stream failed: this one is void")
        try:
            return runner.execute(step)
        except Exception:
            stream.failed = True
            raise

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        runner = self.runner
        if runner is None or self.info is None:
            raise NotReady("the model is still loading")
        self.epoch = request.epoch
        self.tables.clear()  # the steps queued before have theirs filled in already, and are void
        # the step thread runs in order: once this has run, every step queued before has run or been skipped
        await asyncio.get_running_loop().run_in_executor(self.thread, runner.reset)
        return await self.Info(pb.InfoRequest(), context)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if self.info is None:
            raise NotReady("the model is still loading")
        info = pb.InfoResponse()
        info.CopyFrom(self.info)
        info.epoch = self.epoch
        return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50062", help="unix:PATH or a loopback HOST:PORT")
    add_allow_remote_argument(parser)
    add_executor_arguments(parser)


async def serve(args: argparse.Namespace) -> None:
    servicer = ExecutorServicer(ExecutorConfig.from_args(args))
    service = GrpcService(args.listen, [SERVICE_NAME])
    pb_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    await serve_until_signalled(service, warm_up=servicer.load)


def main(args: argparse.Namespace) -> None:
    check_sidecar_listen("executor", args.listen, args.allow_remote)
    run(serve(args), "executor")
