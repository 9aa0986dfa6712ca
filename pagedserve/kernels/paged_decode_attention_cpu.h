/* Decode attention over a paged cache on the CPU (paged_attention_cpu.c), as the layer ops call it
 * (cpu_layer_ops.c). */
#ifndef PAGEDSERVE_PAGED_DECODE_ATTENTION_CPU_H
#define PAGEDSERVE_PAGED_DECODE_ATTENTION_CPU_H

#include <stdint.h>

/* Work run for a sequence right before its attention, on the thread that attends for it (a decode layer's
   rotary embedding and cache write: decode_attention_layer_f32), so that what it writes is read on the same
   core. Where a sequence's KV heads are split over several tasks (fewer sequences than threads), every
   sequence's runs first, before any attention. */
typedef struct {
    void (*run)(const void *context, int64_t seq);
    const void *context;
} SequencePrologue;

/* paged_decode_attention_f32 with a prologue per sequence (or NULL) */
int paged_decode_attention_with_prologue_f32(const float *q, int64_t q_seq_stride, const void *k_cache,
                                             const void *v_cache, int64_t kv_bf16, int64_t num_blocks,
                                             int64_t block_size, const int32_t *block_tables, int64_t max_blocks,
                                             const int32_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
                                             int64_t num_kv_heads, int64_t head_dim, float scale, int64_t num_threads,
                                             const SequencePrologue *prologue);

#endif
