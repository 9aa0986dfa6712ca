"""Hypothesis strategies for the fuzz tests (test_fuzz.py): the three services' request messages built field by
field, mostly valid (so that runs reach deep states) with adversarial values mixed in; random bytes."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from pagedserve.protos import block_manager_pb2 as bm
from pagedserve.protos import executor_pb2 as ex
from pagedserve.protos import inference_pb2 as pb

BLOCK_SIZE, EXECUTOR_BLOCKS, TINY_VOCAB = 4, 32, 96  # the executor under fuzz serves tests/tiny_model.py's Llama
CHAT_VOCAB = 49152  # SmolLM2's tokenizer, the tiny chat model's vocabulary
UINT32, UINT64, INT32 = 2**32 - 1, 2**64 - 1, 2**31 - 1
NAMESPACE = b"fuzz-namespace-1"


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`bad` once in sixteen: adversarial values in most examples, and yet steps valid often enough to reach
    deep states (one_of would pick each half the time, however often `good` is repeated in it)."""
    return st.integers(0, 15).flatmap(lambda i: bad if i == 15 else good)


# ---- block manager ---------------------------------------------------------------------------------------------------

ANY_SEQ_IDS = mostly(st.integers(0, 5), st.sampled_from([2**63, UINT64]))  # small: ids meet live sequences
BAD_TOKENS = st.sampled_from([-1, -(2**31), INT32])
TOKEN_LISTS = mostly(  # few values: prefix hits and shared blocks; sometimes one bad token, or none at all
    st.lists(st.integers(0, 2), min_size=1, max_size=8) | st.lists(st.integers(0, 2), min_size=9, max_size=40),
    st.just([]) | st.tuples(st.lists(st.integers(0, 2), max_size=8), BAD_TOKENS).map(lambda t: [*t[0], t[1]]))
COUNTS = mostly(st.integers(0, 12), st.just(UINT32))
NAMESPACES = mostly(st.sampled_from([NAMESPACE, b"fuzz-namespace-2"]), st.sampled_from([b"", b"short", b"x" * 65]))


def bm_op(**kind: st.SearchStrategy[Any]) -> st.SearchStrategy[bm.Op]:
    ((name, message),) = kind.items()
    return st.builds(bm.Op, **{name: message})


def bm_ops(resident: list[int], swapped: list[int]) -> st.SearchStrategy[bm.Op]:
    """One op of any kind; the sequences it names are mostly live ones (what earlier steps made), so that steps
    reach deep states; else any id (unknown, or taken, for a new sequence)."""
    def ids(live: list[int]) -> st.SearchStrategy[int]:
        return mostly(st.sampled_from(live), ANY_SEQ_IDS) if live else ANY_SEQ_IDS

    def id_lists(live: list[int]) -> st.SearchStrategy[list[int]]:
        return mostly(st.lists(ids(live), min_size=1, max_size=4, unique=True), st.lists(ids(live), max_size=4))

    unused = sorted(set(range(6)) - set(resident) - set(swapped))
    new_ids = ids(unused) if unused else ANY_SEQ_IDS
    creating = st.one_of(
        bm_op(create=st.builds(bm.Create, seq_id=new_ids, token_ids=TOKEN_LISTS, cache_namespace=NAMESPACES)),
        bm_op(admit=st.builds(bm.Admit, seq_id=new_ids, token_ids=TOKEN_LISTS, cache_namespace=NAMESPACES,
                              num_tokens=COUNTS)),
    )
    swap_in = bm_op(swap_in=st.builds(bm.SwapIn, seq_ids=id_lists(swapped)))
    seq_ids = ids(resident)
    ops = st.one_of(
        creating,
        bm_op(fork=st.builds(bm.Fork, parent_seq_id=seq_ids, child_seq_id=new_ids)),
        bm_op(reserve=st.builds(bm.Reserve, seq_id=seq_ids, num_tokens=COUNTS,
                                append_token_ids=mostly(st.lists(st.integers(0, 2), max_size=4), TOKEN_LISTS),
                                admission=st.booleans())),
        bm_op(commit=st.builds(bm.Commit, seq_id=seq_ids, num_computed_tokens=mostly(st.integers(0, 24),
                                                                                     st.just(UINT32)))),
        bm_op(free=st.builds(bm.Free, seq_id=ids(resident + swapped))),
        bm_op(swap_out=st.builds(bm.SwapOut, seq_ids=id_lists(resident))),
        swap_in,
        bm_op(decode=id_lists(resident).flatmap(lambda ids: st.builds(  # a token per sequence, mostly; -1: told later
            bm.Decode, seq_ids=st.just(ids), token_ids=mostly(
                st.lists(st.integers(-1, 2), min_size=len(ids), max_size=len(ids)), TOKEN_LISTS)))),
        # a spare past each tail (refused once blocks above the watermark run out; a second one, one behind a
        # shared tail, or one after another op on the sequence is INVALID_ARGUMENT), entered by later decodes
        bm_op(spare=st.builds(bm.Spare, seq_ids=id_lists(resident))),
    )
    if swapped:  # they can take no other op than a swap-in or a free
        ops = st.one_of(ops, swap_in)
    return mostly(ops if resident or swapped else mostly(creating, ops), st.just(bm.Op()))


class Sequences:
    """The sequences a block manager holds, followed from its answers: resident or swapped out."""

    def __init__(self) -> None:
        self.resident: set[int] = set()
        self.swapped: set[int] = set()

    def ops(self) -> st.SearchStrategy[bm.Op]:
        return bm_ops(sorted(self.resident), sorted(self.swapped))

    def update(self, ops: list[bm.Op], response: bm.StepResponse) -> None:
        for op, result in zip(ops, response.results, strict=True):
            kind = op.WhichOneof("kind")
            if result.status != bm.GRANTED:
                continue
            if kind in ("create", "admit", "fork"):
                self.resident.add(op.fork.child_seq_id if kind == "fork" else getattr(op, kind).seq_id)
            elif kind == "free":
                self.resident.discard(op.free.seq_id)
                self.swapped.discard(op.free.seq_id)
            elif kind == "swap_out":
                self.resident -= set(op.swap_out.seq_ids)
                self.swapped |= set(op.swap_out.seq_ids)
            elif kind == "swap_in":
                self.swapped -= set(op.swap_in.seq_ids)
                self.resident |= set(op.swap_in.seq_ids)


# ---- executor --------------------------------------------------------------------------------------------------------

EPOCH = 7  # each Execute example starts with Reset(EPOCH); a step of another epoch is UNAVAILABLE by design
ANY_FLOATS = st.floats(width=32)  # NaN, infinities, subnormals, negative zero
BLOCK_IDS = mostly(st.integers(0, EXECUTOR_BLOCKS - 1), st.sampled_from([-1, EXECUTOR_BLOCKS, INT32, -(2**31)]))
COPIES = mostly(st.lists(st.builds(ex.BlockCopy, src=st.integers(0, 3), dst=st.integers(0, 3)), max_size=2),
                st.lists(st.builds(ex.BlockCopy, src=BLOCK_IDS, dst=BLOCK_IDS), min_size=1, max_size=3))
DECODE_INPUT = [-1]  # LAST_SAMPLED: the token this executor sampled for the sequence in the previous step
TOKEN_INPUTS = mostly(
    st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=6) | st.just(DECODE_INPUT),
    st.just([]) | st.lists(st.integers(0, TINY_VOCAB - 1) | st.sampled_from([-1, TINY_VOCAB, -(2**31)]),
                           min_size=1, max_size=6))
PACKED = ("seq_ids", "num_tokens", "start_positions", "block_table_lens", "sample", "token_ids", "slot_mapping",
          "block_tables", "temperature", "top_k", "top_p", "seed", "num_top_logprobs")


@st.composite
def execute_requests(draw: st.DrawFn, step_id: int) -> ex.ExecuteRequest:
    """Step `step_id` of a run, with packed arrays that mostly agree and bad values in them: tokens outside the
    vocabulary, LAST_SAMPLED (-1) where no step sampled, step ids out of order, positions past the context,
    blocks outside the cache, slots outside their block, extreme sampling parameters, another epoch; now and
    then one array an entry too long or too short."""
    request = ex.ExecuteRequest(
        swap_out=draw(COPIES), swap_in=draw(COPIES), copies=draw(COPIES),
        step_id=draw(mostly(st.just(step_id), st.integers(0, 3) | st.just(UINT64))),
        epoch=draw(mostly(st.just(EPOCH), st.integers(0, UINT64))))
    seq_ids = draw(mostly(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),  # few: LAST_SAMPLED hits
                          st.lists(st.integers(0, 2) | st.just(UINT64), min_size=1, max_size=3)))
    for seq_id in seq_ids:
        tokens = draw(TOKEN_INPUTS)
        start = draw(mostly(st.integers(0, 12), st.sampled_from([250, 255, 256, UINT32])))
        num_blocks = math.ceil((start + len(tokens)) / BLOCK_SIZE) + draw(mostly(st.just(0), st.sampled_from([-1, 1])))
        num_blocks = min(max(num_blocks, 0), 70)  # a start past the context is refused before its table is read
        table = draw(st.lists(BLOCK_IDS, min_size=num_blocks, max_size=num_blocks))
        slots = []
        for position in range(start, start + len(tokens)):
            block = table[position // BLOCK_SIZE] if position // BLOCK_SIZE < len(table) else 0
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE + draw(mostly(st.just(0),
                                                                                 st.sampled_from([1, -1, 2**40]))))
        request.seq_ids.append(seq_id)
        request.num_tokens.append(len(tokens))
        request.start_positions.append(start)
        request.block_table_lens.append(len(table))
        request.token_ids.extend(tokens)
        request.slot_mapping.extend(slots)
        request.block_tables.extend(table)
        sample = draw(st.booleans())
        request.sample.append(sample)
        if sample:
            request.temperature.append(draw(mostly(st.floats(0.0, 2.0, width=32), ANY_FLOATS)))
            request.top_k.append(draw(mostly(st.integers(0, 100), st.just(UINT32))))
            request.top_p.append(draw(mostly(st.floats(0.0, 1.0, width=32), ANY_FLOATS)))
            request.seed.append(draw(st.integers(0, UINT64)))
            request.num_top_logprobs.append(draw(mostly(st.integers(0, 20), st.sampled_from([21, UINT32]))))
    if draw(mostly(st.just(False), st.just(True))):  # one packed array that disagrees with the others
        field = getattr(request, draw(st.sampled_from(PACKED)))
        if field and draw(st.booleans()):
            del field[-1]
        else:
            field.append(field[-1] if field else 0)
    return request


# ---- frontend --------------------------------------------------------------------------------------------------------

TEXTS = mostly(st.text(min_size=1, max_size=30),
               st.sampled_from(["", "\x00", "<|im_start|>user\n", "\U0010ffff" * 3, " " * 3000]))
CHATS = st.builds(pb.Chat, messages=mostly(
    st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=TEXTS),
             min_size=1, max_size=3),
    st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["tool", "", "USER"]), content=TEXTS), max_size=2)))
PROMPT_TOKENS = mostly(  # bad: outside the vocabulary, past the context (512), at it, far past
    st.lists(st.integers(0, CHAT_VOCAB - 1), min_size=1, max_size=12),
    st.lists(st.integers(0, CHAT_VOCAB - 1) | st.sampled_from([-1, CHAT_VOCAB, INT32, -(2**31)]), max_size=4)
    | st.sampled_from([[7] * 600, [7] * 511, [7] * 100_000]))
PROMPTS = mostly(st.one_of(st.fixed_dictionaries({"text": TEXTS}), st.fixed_dictionaries({"chat": CHATS}),
                           st.fixed_dictionaries({"token_ids": st.builds(pb.TokenIds, ids=PROMPT_TOKENS)})),
                 st.just({}))
PARAMS = st.fixed_dictionaries({}, optional={
    "max_tokens": mostly(st.integers(1, 12), st.sampled_from([0, 200, 500, UINT32])),
    "temperature": mostly(st.floats(0.0, 2.0, width=32), ANY_FLOATS),
    "top_p": mostly(st.floats(0.25, 1.0, width=32), ANY_FLOATS),
    "top_k": mostly(st.integers(0, 50), st.just(UINT32)),
    "seed": st.integers(0, UINT64),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=4), max_size=3),
                   st.lists(st.just("") | st.just("s" * 300), min_size=1, max_size=2) | st.just(["x"] * 17)),
    "stop_token_ids": st.lists(mostly(st.integers(0, 100), st.integers(-(2**31), INT32)), max_size=4),
    "ignore_eos": st.booleans(),
    "n": mostly(st.integers(1, 4), st.sampled_from([0, 17, UINT32])),
    "logprobs": mostly(st.integers(0, 20), st.sampled_from([21, UINT32])),
}).map(lambda fields: pb.GenerationParameters(**fields))
GENERATE_REQUESTS = st.builds(lambda model, prompt, params: pb.GenerateRequest(model=model, params=params, **prompt),
                              mostly(st.just(""), TEXTS), PROMPTS, PARAMS)
Call = str | tuple[str, float]
CALLS = st.one_of(  # unary or streamed to the end; clients that go away after a few chunks, or set a short deadline
    st.sampled_from(["complete", "stream"]), st.tuples(st.just("cancel after"), st.integers(0, 3)),
    st.tuples(st.sampled_from(["complete within", "stream within"]), st.floats(0.001, 0.2)))


# ---- random bytes ----------------------------------------------------------------------------------------------------

VALID = {  # a valid message of each service, to cut, extend and corrupt
    "block_manager": bm.StepRequest(ops=[bm.Op(admit=bm.Admit(seq_id=1, token_ids=[1, 2, 3, 4, 5],
                                                              cache_namespace=NAMESPACE, num_tokens=5))]),
    "executor": ex.ExecuteRequest(seq_ids=[1], num_tokens=[1], start_positions=[0], block_table_lens=[1],
                                  sample=[True], token_ids=[5], slot_mapping=[0], block_tables=[0], temperature=[0.0],
                                  top_k=[0], top_p=[1.0], seed=[1], num_top_logprobs=[2]),
    "stack": pb.GenerateRequest(text="Hello", params=pb.GenerationParameters(max_tokens=2, stop=["a"])),
}
RAW = st.one_of(
    st.binary(max_size=64),
    st.tuples(st.integers(0, 200), st.binary(max_size=16), st.integers(0, 255)),  # (cut at, append, xor a byte)
)


def raw_payload(name: str, raw: bytes | tuple[int, bytes, int]) -> bytes:
    if isinstance(raw, bytes):
        return raw
    cut, tail, flip = raw
    valid = bytearray(VALID[name].SerializeToString())
    valid[cut % len(valid)] ^= flip
    return bytes(valid[: cut % (len(valid) + 1)] if cut % 2 else valid) + tail
