"""The KV client on its own, over the real block-manager core in process (services/frontend/kv_client.py): what
each call sends, in which order, and how the answers keep the frontend's mirror equal to the block manager."""

from __future__ import annotations

from pagedserve.services.block_manager.contract import AdmitOp, AdvanceOp, DecodeOp, ReserveOp, SpareOp
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.frontend.kv_client import KVClient, PlannedStep
from pagedserve.services.frontend.ports import LocalBlockManager
from pagedserve.services.frontend.request import GenerationParams, Request, SeqStatus, Sequence

BLOCK_SIZE = 4
NAMESPACE = b"test-namespace"


def new_sequence(seq_id: int, num_tokens: int) -> Sequence:
    prompt = list(range(100 * seq_id, 100 * seq_id + num_tokens))  # no prefix hits between sequences
    request = Request(f"r{seq_id}", prompt, GenerationParams(max_tokens=50), NAMESPACE, seed=0)
    return Sequence(seq_id, request, 0, list(request.prompt_token_ids))


def admitted(kv: KVClient, seqs: list[Sequence]) -> None:
    """Admits the sequences, each computing its whole prompt, as the scheduler would (rows included)."""
    kv.begin()
    for seq in seqs:
        kv.admit(seq, seq.token_ids, NAMESPACE, len(seq.token_ids), kv.blocks_needed(seq, len(seq.token_ids)))
    planned = kv.send([], num_running=0)
    assert planned is not None
    for (op, route_seqs), outcome in kv.answered(planned):
        assert outcome.granted
        (seq,) = kv.take_outcome(op, route_seqs, outcome)
        seq.status, seq.num_computed = SeqStatus.RUNNING, len(seq.token_ids)  # step_rows.add_tokens' part


def op_types(planned: PlannedStep | None) -> list[str]:
    assert planned is not None
    return [type(op).__name__ for op, _ in planned.routes]


def test_a_decode_into_its_own_block_sends_nothing_until_a_spare_is_due() -> None:
    manager = BlockManager(16, BLOCK_SIZE)
    kv = KVClient(LocalBlockManager(manager), BLOCK_SIZE, spare_lookahead=2)
    seq = new_sequence(1, 5)  # two blocks, three free slots after the prompt
    admitted(kv, [seq])
    assert seq.tail_private and seq.num_known_to_manager == 5 and len(seq.block_table) == 2
    kv.begin()
    assert kv.place_decode(seq)  # room 3 > lookahead 2: no spare yet, and the prompt's commit rides later
    planned = kv.send([seq], num_running=1)
    assert op_types(planned) == ["AdvanceOp"] and planned is not None and planned.deferred  # the prompt's commit
    assert kv.answered(planned) == []
    seq.num_computed, seq.num_local_slots = 6, 1  # the decode placed (step_rows.add_decodes' part)
    kv.settle()
    kv.begin()
    assert kv.place_decode(seq)  # room 2: a spare is wanted, not due yet, and nothing else to send
    assert op_types(kv.send([seq], num_running=1)) == []
    seq.num_computed, seq.num_local_slots = 7, 2
    kv.begin()
    assert kv.place_decode(seq)  # its last free slot: the spare is due
    planned = kv.send([seq], num_running=1)
    assert op_types(planned) == ["AdvanceOp", "SpareOp"] and planned is not None and planned.deferred
    advance = planned.routes[0][0]
    assert isinstance(advance, AdvanceOp) and list(advance.seq_ids) == [1] and list(advance.num_slots) == [2]
    assert kv.answered(planned) == [] and kv.has_deferred_answer  # applied at the next plan
    version = kv.table_version
    kv.settle()
    assert not kv.has_deferred_answer and kv.table_version == version + 1
    assert seq.block_table == [b.block_id for b in manager.seqs[1].block_table] and len(seq.block_table) == 3
    manager.check_integrity()


def test_ops_go_in_the_order_the_block_manager_needs() -> None:
    """Reserves of running sequences, then their one Decode, then what is admitted; the Advance heads it all."""
    manager = BlockManager(32, BLOCK_SIZE)
    kv = KVClient(LocalBlockManager(manager), BLOCK_SIZE, local_decodes=False)
    decoding, chunked, waiting = new_sequence(1, 4), new_sequence(2, 3), new_sequence(3, 6)
    admitted(kv, [decoding, chunked])
    decoding.token_ids.append(7)  # sampled: its next token needs a new block
    chunked.token_ids += [8, 9]  # a chunk of two more
    kv.begin()
    assert not kv.place_decode(decoding) and kv.decode(decoding)
    kv.reserve(chunked, 2)
    kv.admit(waiting, waiting.token_ids, NAMESPACE, 6, kv.blocks_needed(waiting, 6))
    planned = kv.send([], num_running=2)
    assert op_types(planned) == ["AdvanceOp", "ReserveOp", "DecodeOp", "AdmitOp"] and planned is not None
    assert not planned.deferred  # these ops shape the step's rows: their answer is waited for
    answered = kv.answered(planned)
    for (op, seqs), outcome in answered:
        granted = kv.take_outcome(op, seqs, outcome)
        assert granted == seqs and outcome.granted
        if isinstance(op, DecodeOp | ReserveOp | AdmitOp):
            assert len(outcome.slot_mapping) == {DecodeOp: 1, ReserveOp: 2, AdmitOp: 6}[type(op)]
    assert decoding.num_known_to_manager == 5 and chunked.num_known_to_manager == 5
    for seq in (decoding, chunked, waiting):
        assert seq.block_table == [b.block_id for b in manager.seqs[seq.seq_id].block_table]


def test_frees_go_with_the_next_call_and_the_executor_hears_of_them_once() -> None:
    manager = BlockManager(16, BLOCK_SIZE)
    kv = KVClient(LocalBlockManager(manager), BLOCK_SIZE)
    seqs = [new_sequence(1, 5), new_sequence(2, 3)]
    admitted(kv, seqs)
    kv.free_later(seqs[0])
    assert kv.has_ops_due and not kv.has_released
    kv.flush()
    assert not kv.has_ops_due and kv.has_released and kv.stats.num_sequences == 1
    assert kv.take_released() == [1] and not kv.has_released
    kv.free_later(seqs[1])
    kv.begin()
    planned = kv.send([], num_running=0)
    assert op_types(planned) == ["AdvanceOp", "FreeOp"] and planned is not None and planned.deferred
    assert kv.take_released() == [2]
    assert kv.answered(planned) == []
    kv.settle()
    assert kv.stats.num_used_blocks == 0
    manager.check_integrity()


def test_restart_drops_what_was_not_sent() -> None:
    manager = BlockManager(16, BLOCK_SIZE)
    kv = KVClient(LocalBlockManager(manager), BLOCK_SIZE)
    seq = new_sequence(1, 5)
    admitted(kv, [seq])
    kv.free_later(seq)
    kv.restart()
    kv.forget(seq)
    assert not kv.has_ops_due and not kv.has_released and not kv.has_deferred_answer
    assert (seq.block_table, seq.num_known_to_manager, seq.num_committed, seq.tail_private) == ([], 0, 0, False)
    kv.reset()
    assert kv.stats.num_sequences == 0


def test_spares_are_taken_only_while_a_block_per_running_sequence_stays_free() -> None:
    manager = BlockManager(5, BLOCK_SIZE, watermark=0.0)
    kv = KVClient(LocalBlockManager(manager), BLOCK_SIZE, spare_lookahead=3)
    seqs = [new_sequence(1, 7), new_sequence(2, 7)]  # two blocks each: one block left free
    admitted(kv, seqs)
    kv.begin()
    assert all(kv.place_decode(s) for s in seqs)
    planned = kv.send(list(seqs), num_running=2)
    assert SpareOp.__name__ not in op_types(planned)  # one free block for two running sequences: no spare
