"""The model runner: the KV tensors (device blocks and the CPU swap pool) and one step over them.

A step applies swap-outs, then swap-ins, then copy-on-write copies, then the forward pass, then
sampling. That order is the block manager's contract: a block freed by a swap-out may be handed to
another sequence in the same step, so its contents must leave before anything writes into it.

With a per-sequence layout (`virtual`, `static`: virtual_kv.py) there are no blocks to move: the step first
releases the sequences the block manager freed, and attention is dense over each sequence's region.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from itertools import chain, compress, repeat

import torch

from ...kernels import KernelBackend, swap_blocks
from ...kernels.linear_ops import linear_packed
from ..common.errors import InvalidRequest
from .attention import build_attention_metadata, int_tensor
from .dense_attention import DenseLayer, build_dense_metadata
from .model.config import ModelConfig
from .model.llama import KVCache, LlamaForCausalLM, Metadata
from .sampling import sample
from .step_types import (
    LAST_SAMPLED,
    MAX_TOP_LOGPROBS,
    HeldInputs,
    LastSampled,
    SampledToken,
    SequenceInput,
    StepInput,
)
from .virtual_kv import SequenceKV


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        backend: KernelBackend,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int,
        max_model_len: int,
        sequence_kv: SequenceKV | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`sequence_kv`: a per-sequence layout (engine_config.build_sequence_kv) instead of the paged pool.
        `kv_dtype`: the cache's, where narrower than the model's (engine_config.kv_cache_dtype)."""
        if num_blocks <= 0:
            raise ValueError(f"the KV budget holds {num_blocks} blocks of {block_size} tokens: too small")
        if sequence_kv is not None and num_cpu_blocks:
            raise ValueError("a per-sequence KV layout has no CPU swap pool: preempt by recompute")
        param = model.norm.weight  # never released (release_plain_weights): the model's device and dtype
        self.model, self.config, self.backend = model, config, backend
        self.device, self.dtype = param.device, param.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.block_size, self.num_blocks, self.num_cpu_blocks = block_size, num_blocks, num_cpu_blocks
        self.max_model_len = max_model_len
        self.sequence_kv = sequence_kv
        shape = (num_blocks if sequence_kv is None else 0, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(config.num_layers)
        ]
        self._layer_caches: list[KVCache] = (
            list(self.kv_caches) if sequence_kv is None else [DenseLayer(i) for i in range(config.num_layers)]
        )
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = self.device.type == "cuda"
        self.cpu_caches = [
            (torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin),
             torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin))
            for _ in range(config.num_layers)
        ]
        # Overlapped steps: the tokens the last step sampled, the next step's inputs where it says LAST_SAMPLED.
        self.last_sampled = LastSampled()
        # Each sequence's block table whose ids were checked, by object: tables are replaced, never changed in
        # place (the scheduler's, and those a server holds), so a step checks only the tables that changed. Kept
        # by the rules of the tables a server holds: recorded per valid step, forgotten at a release or reset.
        self._checked_tables = HeldInputs()
        # The torch path plans the decodes' cache reads once per step (block_size, num_kv_heads, num_heads).
        self._gather_geometry = (block_size, config.num_kv_heads, config.num_heads) if backend.name == "torch" else None
        self._logits = torch.empty(0, config.vocab_size, device=self.device)
        self._decode_tables: tuple[int, torch.Tensor] | None = None  # a decode-only step's id, its padded tables

    def reset(self) -> None:
        """Forgets every step and sequence (the frontend starts over; its block manager is empty too)."""
        self.last_sampled.clear()
        self._checked_tables.clear()
        self._decode_tables = None
        if self.sequence_kv is not None:
            self.sequence_kv.reset()

    def validate(self, step: StepInput) -> bool:
        """Raises InvalidRequest naming the field; nothing has changed when it does. Every step's sequences are
        checked as columns (C loops over the step); only one that fails there is walked sequence by sequence,
        for the error that names the field. True when the step is the last one's batch again (`same_batch`)."""
        seqs = step.sequences
        repeated = self._repeats_batch(step)
        if not repeated:
            if seqs and not self._columns_valid(seqs, step.step_id):
                self._check_each(seqs, step.step_id)
            checked = self._checked_tables.tables
            new_tables = list(map(operator.is_not, map(checked.get, map(_SEQ_ID, seqs)), map(_TABLE, seqs)))
            for i in compress(range(len(seqs)), new_tables):  # O(table) per sequence: only a new table
                _check_ids(seqs[i].block_table, self.num_blocks, f"sequences[{i}].block_table")
        if self.sequence_kv is not None:
            moves = next((name for name in ("swap_out", "swap_in", "copies") if getattr(step, name)), None)
            if moves is not None:
                raise InvalidRequest(f"{moves}: a per-sequence KV layout shares no blocks and has no swap pool")
            self.sequence_kv.check(seqs, step.released_seq_ids)
        for name, pairs, src_limit, dst_limit in (
            ("swap_out", step.swap_out, self.num_blocks, self.num_cpu_blocks),
            ("swap_in", step.swap_in, self.num_cpu_blocks, self.num_blocks),
            ("copies", step.copies, self.num_blocks, self.num_blocks),
        ):
            for j, (src, dst) in enumerate(pairs):
                if not (0 <= src < src_limit and 0 <= dst < dst_limit):
                    raise InvalidRequest(f"{name}[{j}]: block ({src} -> {dst}) outside the cache")
        if repeated:  # the step is valid: its tables are checked
            self._checked_tables.commit_repeated(step)
        else:
            self._checked_tables.commit(step, samplings_sent=False)
        return repeated

    def _repeats_batch(self, step: StepInput) -> bool:
        """Whether a `same_batch` step is the batch of the last step validated here again, one position on: the
        same sequences with the same table objects, hence the sampling parameters that step checked (held with
        them), and slots by the slot rule (the server derived them). Then only what the step adds is checked:
        each position within the context and its table, the tokens it asks for. Else it is checked as any."""
        batch = self._checked_tables.batch
        if not step.same_batch or batch is None or step.step_id != batch[0] + 1:
            return False
        seq_ids, token_lists, starts, tables, _, _ = zip(*step.sequences, strict=True)
        checked, bs = self._checked_tables.tables, self.block_size
        return (seq_ids == batch[1] and starts == batch[2] and all(map(operator.is_, map(checked.get, seq_ids), tables))
                and max(starts) < self.max_model_len
                and all(map(operator.lt, starts, map(operator.mul, map(len, tables), repeat(bs))))
                and token_lists.count([LAST_SAMPLED]) == len(token_lists)
                and self.last_sampled.allows(step.step_id, seq_ids, token_lists))

    def _columns_valid(self, seqs: Sequence[SequenceInput], step_id: int) -> bool:
        """Whether every rule of `_check_each` but the block ids holds, tested over the step's columns: True only
        when `_check_each` would pass."""
        seq_ids, token_lists, starts, tables, slot_lists, samplings = zip(*seqs, strict=True)
        num_tokens = list(map(len, token_lists))
        if len(set(seq_ids)) != len(seq_ids) or min(num_tokens) < 1 or list(map(len, slot_lists)) != num_tokens:
            return False
        ends = list(map(operator.add, starts, num_tokens))
        bs = self.block_size
        if max(ends) > self.max_model_len or not all(map(operator.le, ends, map(operator.mul, map(len, tables),
                                                                                   repeat(bs)))):
            return False
        tokens = list(chain.from_iterable(token_lists))
        if max(tokens) >= self.config.vocab_size:
            return False
        if min(tokens) < 0 and (min(tokens) < LAST_SAMPLED  # only LAST_SAMPLED, where the last step sampled
                                or not self.last_sampled.allows(step_id, seq_ids, token_lists)):
            return False
        if max(num_tokens) == 1:  # each token's slot is in its block: table[pos // bs] * bs + pos % bs
            positions: Iterable[int] = starts
            token_tables: Iterable[Sequence[int]] = tables
        else:
            positions = chain.from_iterable(map(range, starts, ends))
            token_tables = chain.from_iterable(map(repeat, tables, num_tokens))
        positions = list(positions)
        blocks = map(operator.getitem, token_tables, map(operator.floordiv, positions, repeat(bs)))
        in_block = map(operator.add, map(operator.mul, blocks, repeat(bs)), map(operator.mod, positions, repeat(bs)))
        if not all(map(operator.eq, in_block, chain.from_iterable(slot_lists))):
            return False
        sampled = list(filter(None, samplings))
        if sampled:  # `0.0 <= x` is False for NaN, as the per-sequence check's comparisons are
            temperature, top_k, top_p, _, num_top_logprobs = zip(*sampled, strict=True)
            return (all(map((0.0).__le__, temperature)) and min(top_k) >= 0 and all(map((0.0).__le__, top_p))
                    and all(map((1.0).__ge__, top_p)) and max(num_top_logprobs) <= MAX_TOP_LOGPROBS)
        return True

    def _check_each(self, seqs: Sequence[SequenceInput], step_id: int) -> None:
        """The step's rules sequence by sequence, in order: raises InvalidRequest for the first one broken."""
        vocab, bs, checked = self.config.vocab_size, self.block_size, self._checked_tables.tables
        seen = set()
        for i, seq in enumerate(seqs):
            at = f"sequences[{i}]"
            if seq.seq_id in seen:
                raise InvalidRequest(f"{at}.seq_id: sequence {seq.seq_id} appears twice in the step")
            seen.add(seq.seq_id)
            if not seq.token_ids:
                raise InvalidRequest(f"{at}.token_ids: must not be empty")
            known_tokens = seq.token_ids
            if LAST_SAMPLED in seq.token_ids:
                self.last_sampled.check(step_id, seq.seq_id, seq.token_ids, f"{at}.token_ids")
                known_tokens = []
            bad = next((t for t in known_tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"{at}.token_ids: token id {bad} outside the vocabulary [0, {vocab})")
            end = seq.start_position + len(seq.token_ids)
            if end > self.max_model_len:
                raise InvalidRequest(
                    f"{at}.start_position: positions up to {end} exceed the context of {self.max_model_len}"
                )
            if len(seq.slot_mapping) != len(seq.token_ids):
                raise InvalidRequest(
                    f"{at}.slot_mapping: {len(seq.slot_mapping)} slots for {len(seq.token_ids)} tokens"
                )
            if len(seq.block_table) * bs < end:
                raise InvalidRequest(f"{at}.block_table: {len(seq.block_table)} blocks cannot hold {end} tokens")
            if checked.get(seq.seq_id) is not seq.block_table:  # O(table) per sequence: only a new table
                _check_ids(seq.block_table, self.num_blocks, f"{at}.block_table")
            for offset, slot in enumerate(seq.slot_mapping):
                pos = seq.start_position + offset
                if slot != seq.block_table[pos // bs] * bs + pos % bs:
                    raise InvalidRequest(f"{at}.slot_mapping: slot {slot} of position {pos} is not in its block")
            if seq.sampling is not None:
                s = seq.sampling
                if not (s.temperature >= 0 and 0 <= s.top_p <= 1 and s.top_k >= 0):
                    raise InvalidRequest(f"{at}.sampling: temperature >= 0, 0 <= top_p <= 1, top_k >= 0 required")
                if s.num_top_logprobs > MAX_TOP_LOGPROBS:
                    raise InvalidRequest(f"{at}.sampling.num_top_logprobs: at most {MAX_TOP_LOGPROBS}")

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[SampledToken]:
        repeated = self.validate(step)
        last_sampled = self.last_sampled.start(step.step_id)
        if self.sequence_kv is not None:
            self.sequence_kv.release(step.released_seq_ids)
        self._move_blocks(step)
        if not step.sequences:
            return []
        seqs = _prefills_first(step.sequences)
        input_ids, positions, meta = self._build_batch(seqs, last_sampled, step.step_id, repeated)
        hidden = self.model(input_ids, positions, meta, self._layer_caches)  # [num_tokens, hidden]
        seq_ids, token_lists, starts, _, _, samplings = zip(*seqs, strict=True)
        num_tokens = list(map(len, token_lists))
        next_positions = list(map(operator.add, starts, num_tokens))  # of each sequence's next token
        wanted = list(compress(range(len(seqs)), samplings))  # a SamplingParams is a non-empty tuple
        if not wanted:
            return []
        if len(wanted) < len(seqs):  # prefill chunks that sample nothing
            ends = list(itertools.accumulate(num_tokens))
            hidden = hidden[torch.tensor([ends[i] - 1 for i in wanted], device=self.device)]
            seq_ids, samplings = tuple(seq_ids[i] for i in wanted), tuple(samplings[i] for i in wanted)
            next_positions = [next_positions[i] for i in wanted]
        elif len(seqs) < hidden.shape[0]:  # every sequence samples, some after a chunk: its last row
            hidden = hidden[torch.tensor([end - 1 for end in itertools.accumulate(num_tokens)], device=self.device)]
        logits = self.model.compute_logits(hidden, out=self._logits_buffer(len(wanted)))  # [n, vocab]
        sampled = sample(logits, list(samplings), next_positions, list(seq_ids),
                         first_max_and_log_sum=self.backend.first_max_and_log_sum)
        self.last_sampled.record(sampled)
        if seqs is step.sequences:  # in the step's order already (no chunk moved ahead)
            return sampled
        by_id = {t.seq_id: t for t in sampled}
        return [by_id[s.seq_id] for s in step.sequences if s.sampling is not None]

    def _build_batch(
        self, seqs: Sequence[SequenceInput], last_sampled: dict[int, int], step_id: int = 0, repeated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Metadata]:
        """The flat token batch of `seqs` (prefill chunks first): input ids and positions [num_tokens] int64,
        and the attention metadata, each tensor made from one Python list. `repeated`: the batch of step
        `step_id - 1` again (validate), whose decode tables tensor is reused if that step was all decodes."""
        seq_ids, token_lists, starts, tables, slot_lists, _ = zip(*seqs, strict=True)
        num_tokens = list(map(len, token_lists))
        if max(num_tokens) == 1:  # decodes only, by columns
            input_ids = list(map(_FIRST, token_lists))
            if LAST_SAMPLED in input_ids:
                input_ids = [last_sampled[seq_id] if token == LAST_SAMPLED else token
                             for seq_id, token in zip(seq_ids, input_ids, strict=True)]
            positions = list(starts)
            slots = list(map(_FIRST, slot_lists))
        else:
            input_ids, positions, slots = [], [], []
            for seq_id, tokens, start, slot_list in zip(seq_ids, token_lists, starts, slot_lists, strict=True):
                if len(tokens) == 1:  # a decode: its token may be the one the last step sampled
                    input_ids.append(tokens[0] if tokens[0] != LAST_SAMPLED else last_sampled[seq_id])
                    positions.append(start)
                else:
                    input_ids.extend(tokens)
                    positions.extend(range(start, start + len(tokens)))
                slots.extend(slot_list)
        ids_and_positions = int_tensor(input_ids + positions, torch.int64, self.device).view(2, -1)
        if self.sequence_kv is not None:
            regions = [self.sequence_kv.region_for(s) for s in seqs]
            dense = build_dense_metadata(regions, list(starts), num_tokens, self.device)
            return ids_and_positions[0], ids_and_positions[1], dense
        held = self._decode_tables
        meta = build_attention_metadata(
            num_tokens,
            list(map(operator.add, starts, num_tokens)),
            tables,
            slots,
            self.device,
            gather_geometry=self._gather_geometry,
            decode_block_tables=held[1] if repeated and held is not None and held[0] == step_id - 1 else None,
        )
        # the same tables in the same order next step (same_batch) need not be padded and copied again
        self._decode_tables = (step_id, meta.decode_block_tables) if max(num_tokens) == 1 else None
        return ids_and_positions[0], ids_and_positions[1], meta

    def _logits_buffer(self, num_rows: int) -> torch.Tensor | None:
        """[num_rows, vocab] fp32 scratch reused across steps: a fresh 12 MiB tensor per step (64 rows of
        SmolLM2's vocabulary) costs the CPU a page fault per 4 KiB, ~5 ms. None unless the model is fp32, or
        when the backend's matmul writes a tensor of its own (the packed one: the allocator reuses it)."""
        if self.dtype != torch.float32 or self.backend.linear is linear_packed:
            return None
        if self._logits.shape[0] < num_rows:
            self._logits = torch.empty(num_rows, self.config.vocab_size, device=self.device)
        return self._logits[:num_rows]

    def _move_blocks(self, step: StepInput) -> None:
        if step.swap_out:
            mapping = torch.tensor(step.swap_out, dtype=torch.int64)
            for (k, v), (k_cpu, v_cpu) in zip(self.kv_caches, self.cpu_caches, strict=True):
                swap_blocks(k, k_cpu, mapping)
                swap_blocks(v, v_cpu, mapping)
        if step.swap_in:
            mapping = torch.tensor(step.swap_in, dtype=torch.int64)
            for (k, v), (k_cpu, v_cpu) in zip(self.kv_caches, self.cpu_caches, strict=True):
                swap_blocks(k_cpu, k, mapping)
                swap_blocks(v_cpu, v, mapping)
        if step.copies:
            mapping = torch.tensor(step.copies, dtype=torch.int64, device=self.device)
            self.backend.copy_blocks([c for kv in self.kv_caches for c in kv], mapping)


_SEQ_ID = operator.itemgetter(0)  # a SequenceInput's
_TABLE = operator.itemgetter(3)
_TOKENS = operator.itemgetter(1)
_FIRST = operator.itemgetter(0)  # of a one-token list


def _prefills_first(sequences: Sequence[SequenceInput]) -> Sequence[SequenceInput]:
    """Multi-token chunks first, then single tokens (the layout AttentionMetadata expects), each in step order;
    the step's own sequences when there is no chunk to move."""
    if max(map(len, map(_TOKENS, sequences))) == 1:
        return sequences
    return sorted(sequences, key=lambda s: len(s.token_ids) == 1)


def _check_ids(values: Sequence[int], limit: int, where: str) -> None:
    bad = next((v for v in values if not 0 <= v < limit), None)
    if bad is not None:
        raise InvalidRequest(f"{where}: {bad} outside [0, {limit})")
