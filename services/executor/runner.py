"""The model runner: the KV tensors (device blocks and the CPU swap pool) and one step over them.

A step applies swap-outs, then swap-ins, then copy-on-write copies, then the forward pass, then
sampling. That order is the block manager's contract: a block freed by a swap-out may be handed to
another sequence in the same step, so its contents must leave before anything writes into it.

With a per-sequence layout (`virtual`, `static`: virtual_kv.py) there are no blocks to move: the step first
releases the sequences the block manager freed, and attention is dense over each sequence's region.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ...kernels import KernelBackend, swap_blocks
from ...kernels.linear_ops import linear_packed
from ..common.errors import InvalidRequest
from .attention import build_attention_metadata
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
    ) -> None:
        """`sequence_kv`: a per-sequence layout (engine_config.build_sequence_kv) instead of the paged pool."""
        if num_blocks <= 0:
            raise ValueError(f"the KV budget holds {num_blocks} blocks of {block_size} tokens: too small")
        if sequence_kv is not None and num_cpu_blocks:
            raise ValueError("a per-sequence KV layout has no CPU swap pool: preempt by recompute")
        param = next(model.parameters())
        self.model, self.config, self.backend = model, config, backend
        self.device, self.dtype = param.device, param.dtype
        self.block_size, self.num_blocks, self.num_cpu_blocks = block_size, num_blocks, num_cpu_blocks
        self.max_model_len = max_model_len
        self.sequence_kv = sequence_kv
        shape = (num_blocks if sequence_kv is None else 0, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(config.num_layers)
        ]
        self._layer_caches: list[KVCache] = (
            list(self.kv_caches) if sequence_kv is None else [DenseLayer(i) for i in range(config.num_layers)]
        )
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = self.device.type == "cuda"
        self.cpu_caches = [
            (torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin),
             torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin))
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

    def reset(self) -> None:
        """Forgets every step and sequence (the frontend starts over; its block manager is empty too)."""
        self.last_sampled.clear()
        self._checked_tables.clear()
        if self.sequence_kv is not None:
            self.sequence_kv.reset()

    def validate(self, step: StepInput) -> None:
        """Raises InvalidRequest naming the field; nothing has changed when it does."""
        vocab, bs, checked = self.config.vocab_size, self.block_size, self._checked_tables.tables
        seen = set()
        for i, seq in enumerate(step.sequences):
            at = f"sequences[{i}]"
            if seq.seq_id in seen:
                raise InvalidRequest(f"{at}.seq_id: sequence {seq.seq_id} appears twice in the step")
            seen.add(seq.seq_id)
            if not seq.token_ids:
                raise InvalidRequest(f"{at}.token_ids: must not be empty")
            known_tokens = seq.token_ids
            if LAST_SAMPLED in seq.token_ids:
                self.last_sampled.check(step.step_id, seq.seq_id, seq.token_ids, f"{at}.token_ids")
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
        if self.sequence_kv is not None:
            moves = next((name for name in ("swap_out", "swap_in", "copies") if getattr(step, name)), None)
            if moves is not None:
                raise InvalidRequest(f"{moves}: a per-sequence KV layout shares no blocks and has no swap pool")
            self.sequence_kv.check(step.sequences, step.released_seq_ids)
        for name, pairs, src_limit, dst_limit in (
            ("swap_out", step.swap_out, self.num_blocks, self.num_cpu_blocks),
            ("swap_in", step.swap_in, self.num_cpu_blocks, self.num_blocks),
            ("copies", step.copies, self.num_blocks, self.num_blocks),
        ):
            for j, (src, dst) in enumerate(pairs):
                if not (0 <= src < src_limit and 0 <= dst < dst_limit):
                    raise InvalidRequest(f"{name}[{j}]: block ({src} -> {dst}) outside the cache")
        self._checked_tables.commit(step, samplings_sent=False)  # the step is valid: its tables are checked

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[SampledToken]:
        self.validate(step)
        last_sampled = self.last_sampled.start(step.step_id)
        if self.sequence_kv is not None:
            self.sequence_kv.release(step.released_seq_ids)
        self._move_blocks(step)
        if not step.sequences:
            return []
        seqs = _prefills_first(step.sequences)
        input_ids, positions, meta = self._build_batch(seqs, last_sampled)
        hidden = self.model(input_ids, positions, meta, self._layer_caches)  # [num_tokens, hidden]
        wanted = [i for i, s in enumerate(seqs) if s.sampling is not None]
        if not wanted:
            return []
        if len(wanted) < hidden.shape[0]:  # some rows are not last tokens, or not sampled: keep the others
            ends = list(itertools.accumulate(len(s.token_ids) for s in seqs))
            hidden = hidden[torch.tensor([ends[i] - 1 for i in wanted], device=self.device)]
        logits = self.model.compute_logits(hidden, out=self._logits_buffer(len(wanted)))  # [n, vocab]
        sampled = sample(
            logits,
            [seqs[i].sampling for i in wanted],  # type: ignore[misc]
            [seqs[i].start_position + len(seqs[i].token_ids) for i in wanted],
            [seqs[i].seq_id for i in wanted],
            first_max_and_log_sum=self.backend.first_max_and_log_sum,
        )
        by_id = {t.seq_id: t for t in sampled}
        self.last_sampled.record(sampled)
        return [by_id[s.seq_id] for s in step.sequences if s.sampling is not None]

    def _build_batch(
        self, seqs: Sequence[SequenceInput], last_sampled: dict[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, Metadata]:
        """The flat token batch of `seqs` (prefill chunks first): input ids and positions [num_tokens] int64,
        and the attention metadata, each tensor made from one Python list."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in seqs:
            start, num_tokens = seq.start_position, len(seq.token_ids)
            if num_tokens == 1:  # a decode: no ranges to build
                token = seq.token_ids[0]
                input_ids.append(token if token != LAST_SAMPLED else last_sampled[seq.seq_id])
                positions.append(start)
                slots.append(seq.slot_mapping[0])
            else:
                input_ids.extend(seq.token_ids)
                positions.extend(range(start, start + num_tokens))
                slots.extend(seq.slot_mapping)
        ids_and_positions = torch.tensor([input_ids, positions], device=self.device)  # [2, num_tokens] int64
        if self.sequence_kv is not None:
            regions = [self.sequence_kv.region_for(s) for s in seqs]
            dense = build_dense_metadata(regions, [s.start_position for s in seqs], [len(s.token_ids) for s in seqs],
                                         self.device)
            return ids_and_positions[0], ids_and_positions[1], dense
        meta = build_attention_metadata(
            [len(s.token_ids) for s in seqs],
            [s.start_position + len(s.token_ids) for s in seqs],
            [list(s.block_table) for s in seqs],
            slots,
            self.device,
            gather_geometry=self._gather_geometry,
        )
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


def _prefills_first(sequences: Sequence[SequenceInput]) -> list[SequenceInput]:
    """Multi-token chunks first, then single tokens (the layout AttentionMetadata expects), each in step order."""
    if all(len(s.token_ids) == 1 for s in sequences):
        return list(sequences)
    return sorted(sequences, key=lambda s: len(s.token_ids) == 1)


def _check_ids(values: Sequence[int], limit: int, where: str) -> None:
    bad = next((v for v in values if not 0 <= v < limit), None)
    if bad is not None:
        raise InvalidRequest(f"{where}: {bad} outside [0, {limit})")
