/* Decode attention over a paged fp32 KV cache on the CPU: one query token per sequence.
 *
 * Built at first use on the machine that runs it (-O3 -march=native -fopenmp, kernels/cpu_native.py) and
 * called through ctypes with raw pointers. One OpenMP task per sequence (per sequence and KV head when
 * there are fewer sequences than threads): it reads each of its positions' key rows (every KV head of a
 * position is one contiguous row of the cache) once, with the rows a few positions ahead prefetched (keys
 * and values both, so the value pass finds them in the cache), then a softmax per query head, then each
 * value row once. The torch path gathers the keys into a padded copy
 * and sums the values through embedding_bag: two passes over memory per tensor, and this is one.
 *
 * Memory safety is checked here, not trusted to the caller: a block id outside the cache or a length past
 * the block table returns an error code before anything is read through it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define PREFETCH_AHEAD 6 /* positions; 2-8 measured within noise of each other, 0 is ~2x slower */

enum { OK = 0, BAD_BLOCK = 1, BAD_LENGTH = 2, NO_MEMORY = 3 };

static inline void prefetch_row(const float *row, int64_t num_floats) {
    for (int64_t byte = 0; byte < num_floats * (int64_t)sizeof(float); byte += 64)
        __builtin_prefetch((const char *)row + byte);
}

int paged_decode_attention_f32(
    const float *q, int64_t q_seq_stride,       /* [num_seqs, num_heads, head_dim], each row's heads contiguous */
    const float *k_cache, const float *v_cache, /* [num_blocks, block_size, num_kv_heads, head_dim] contiguous */
    int64_t num_blocks, int64_t block_size,
    const int32_t *block_tables, int64_t max_blocks, /* [num_seqs, max_blocks] contiguous */
    const int32_t *seq_lens,                         /* [num_seqs] */
    float *out,                                      /* [num_seqs, num_heads, head_dim] contiguous */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    int64_t num_threads) /* torch.get_num_threads() of the calling thread: what torch's own ops use there */
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_len = num_kv_heads * head_dim; /* one position: every KV head */
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (seq_lens[s] < 0 || seq_lens[s] > max_blocks * block_size) return BAD_LENGTH;
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    }
    /* One task per sequence, all its KV heads (a position's keys are one row); with fewer sequences than
       threads, one per (sequence, KV head), so that a lone long sequence still uses every thread. */
    const int64_t heads_per_task = num_seqs >= num_threads ? num_kv_heads : 1;
    const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
    const int64_t num_tasks = num_seqs * tasks_per_seq;
    const int team = (int)(num_threads < num_tasks ? num_threads : num_tasks > 0 ? num_tasks : 1);
    int status = OK;
#pragma omp parallel num_threads(team)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len)); /* [query heads, len] */
        float *queries = malloc(sizeof(float) * (size_t)(num_heads * head_dim));
        float *acc = malloc(sizeof(float) * (size_t)(num_heads * head_dim));
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)max_len); /* each position's row offset in the cache */
        const int have_memory = scores && queries && acc && rows;
        if (!have_memory) {
#pragma omp atomic write
            status = NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            const int64_t s = task / tasks_per_seq, h0 = task % tasks_per_seq * heads_per_task;
            const int64_t h1 = h0 + heads_per_task, nq = heads_per_task * group; /* query heads of the task */
            const int64_t len = seq_lens[s];
            float *o = out + (s * num_heads + h0 * group) * head_dim;
            if (!have_memory || len == 0) { /* attention over nothing is 0 */
                memset(o, 0, sizeof(float) * (size_t)(nq * head_dim));
                continue;
            }
            const int32_t *table = block_tables + s * max_blocks;
            int bad = 0;
            for (int64_t t = 0, b = 0; t < len; b++) {
                const int64_t block = table[b];
                bad |= block < 0 || block >= num_blocks;
                for (int64_t offset = 0; offset < block_size && t < len; offset++, t++)
                    rows[t] = (block * block_size + offset) * row_len + h0 * head_dim;
            }
            if (bad) {
#pragma omp atomic write
                status = BAD_BLOCK;
                continue;
            }
            const float *qs = q + s * q_seq_stride + h0 * group * head_dim;
            for (int64_t i = 0; i < nq * head_dim; i++) queries[i] = qs[i] * scale;

            for (int64_t t = 0; t < len; t++) {
                if (t + PREFETCH_AHEAD < len) {
                    prefetch_row(k_cache + rows[t + PREFETCH_AHEAD], heads_per_task * head_dim);
                    prefetch_row(v_cache + rows[t + PREFETCH_AHEAD], heads_per_task * head_dim);
                }
                const float *k = k_cache + rows[t];
                for (int64_t h = h0, hq = 0; h < h1; h++) {
                    const float *kh = k + (h - h0) * head_dim;
                    for (int64_t g = 0; g < group; g++, hq++) {
                        const float *qh = queries + hq * head_dim;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                        scores[hq * len + t] = dot;
                    }
                }
            }
            for (int64_t hq = 0; hq < nq; hq++) {
                float *p = scores + hq * len, top = p[0], sum = 0.f;
#pragma omp simd reduction(max : top)
                for (int64_t t = 1; t < len; t++) top = p[t] > top ? p[t] : top;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) {
                    p[t] = exp_nonpositive(p[t] - top);
                    sum += p[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; t++) p[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(nq * head_dim));
            for (int64_t t = 0; t < len; t++) {
                const float *v = v_cache + rows[t];
                for (int64_t h = h0, hq = 0; h < h1; h++) {
                    const float *vh = v + (h - h0) * head_dim;
                    for (int64_t g = 0; g < group; g++, hq++) {
                        const float p = scores[hq * len + t];
                        float *a = acc + hq * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
                    }
                }
            }
            memcpy(o, acc, sizeof(float) * (size_t)(nq * head_dim));
        }
        free(scores);
        free(queries);
        free(acc);
        free(rows);
    }
    return status;
}
