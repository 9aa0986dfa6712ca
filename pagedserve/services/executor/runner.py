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
from collections.abc import Sequence
from itertools import compress

import torch

from ...kernels import KernelBackend, swap_blocks
from ...kernels.linear_ops import linear_packed
from .attention import build_attention_metadata, int_tensor
from .dense_attention import DenseLayer, build_dense_metadata
from .model import cpu_decode
from .model.config import ModelConfig
from .model.llama import KVCache, LlamaForCausalLM, Metadata
from .sampling import sample
from .step_checks import StepChecks
from .step_types import LAST_SAMPLED, LastSampled, SampledToken, SequenceInput, StepInput
from .virtual_kv import SequenceKV


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def model_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, meta: Metadata,
                  kv_caches: list[KVCache]) -> torch.Tensor:
    """The model over a batch, [num_tokens, hidden] after the final norm: through its layers, or for a step of
    decodes only on the cpu backend, that backend's decode forward (cpu_decode.py: the same kernels, the glue once
    per step). Chosen here: the model knows no backend's fast path."""
    x, rope = model.embed(input_ids, positions)
    if cpu_decode.applies(model.backend, meta, kv_caches, x):
        return cpu_decode.decode_forward(model, x, rope, meta, kv_caches)  # type: ignore[arg-type]
    return model.forward_layers(x, rope, meta, kv_caches)


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
        self.checks = StepChecks(config.vocab_size, max_model_len, block_size, num_blocks, num_cpu_blocks,
                                 self.last_sampled, sequence_kv)
        # The torch path plans the decodes' cache reads once per step (block_size, num_kv_heads, num_heads).
        self._gather_geometry = (block_size, config.num_kv_heads, config.num_heads) if backend.name == "torch" else None
        self._logits = torch.empty(0, config.vocab_size, device=self.device)
        self._decode_tables: tuple[int, torch.Tensor] | None = None  # a decode-only step's id, its padded tables

    def reset(self) -> None:
        """Forgets every step and sequence (the frontend starts over; its block manager is empty too)."""
        self.last_sampled.clear()
        self.checks.reset()
        self._decode_tables = None
        if self.sequence_kv is not None:
            self.sequence_kv.reset()

    def execute(self, step: StepInput) -> list[SampledToken]:
        """Checks the step (InvalidRequest naming the field, the cache untouched), then runs it: what the boundary
        calls, the executor's server and the in-process port, for a step built elsewhere."""
        return self._run(step, self.checks.validate(step))

    def run(self, step: StepInput) -> list[SampledToken]:
        """Runs a step its caller built to the rules (warm-up, profiling, benchmarks), unchecked: a `same_batch` one
        must be the last step's batch again, one position on."""
        return self._run(step, step.same_batch)

    @torch.inference_mode()
    def _run(self, step: StepInput, repeated: bool) -> list[SampledToken]:
        """Block moves, the forward pass, sampling; `repeated`: the sequences are the last step's batch again."""
        last_sampled = self.last_sampled.start(step.step_id)
        if self.sequence_kv is not None:
            self.sequence_kv.release(step.released_seq_ids)
        self._move_blocks(step)
        if not step.sequences:
            return []
        seqs = _prefills_first(step.sequences)
        input_ids, positions, meta = self._build_batch(seqs, last_sampled, step.step_id, repeated)
        hidden = model_forward(self.model, input_ids, positions, meta, self._layer_caches)  # [num_tokens, hidden]
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


_TOKENS = operator.itemgetter(1)
_FIRST = operator.itemgetter(0)  # of a one-token list


def _prefills_first(sequences: Sequence[SequenceInput]) -> Sequence[SequenceInput]:
    """Multi-token chunks first, then single tokens (the layout AttentionMetadata expects), each in step order;
    the step's own sequences when there is no chunk to move."""
    if max(map(len, map(_TOKENS, sequences))) == 1:
        return sequences
    return sorted(sequences, key=lambda s: len(s.token_ids) == 1)
