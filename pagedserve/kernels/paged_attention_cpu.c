/* Attention over a paged KV cache on the CPU, in fp32 over a cache of fp32 or of bf16 (`kv_bf16`: half the bytes to
 * read; each key and value widened to fp32 as it is loaded, which is exact, so the result is the fp32 kernel's over
 * the widened cache, bit for bit). Decode first (one query token per sequence), then prefill (its own section at
 * the end).
 *
 * Built at first use on the machine that runs it (-O3 -march=native -fopenmp, kernels/cpu_native.py) and
 * called through ctypes with raw pointers. One OpenMP task per sequence (per sequence and KV head when
 * there are fewer sequences than threads), dealt round robin, so each thread knows its next task: while it
 * computes one, it prefetches the next one's key and value rows into L2, spread evenly over its work. Reading
 * the cache is most of the time (it is cold: every layer's cache is read once a step), and a task's compute
 * is the lead time that hides its latency. Within a task, per KV head and the (up to four) query heads that
 * share it: their scores over all positions (each key vector loaded once for all of them), a softmax per
 * head, then their values summed in registers (each value vector loaded once). A query head's arithmetic is
 * the same whichever heads share its pass, so its result does not depend on the grouping.
 * The torch path instead copies the keys into a padded batch and reads the values through embedding_bag.
 *
 * Memory safety is checked here, not trusted to the caller: a block id outside the cache or a length past
 * the block table returns an error code before anything is read through it (a prefetch is only a hint and
 * skips a bad id).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "paged_decode_attention_cpu.h"

int omp_get_num_threads(void); /* libgomp's; declared here so that the build needs no omp.h */

#define PREFETCH_AHEAD 6 /* positions, for a thread's first task (later ones were prefetched as a whole) */

/* A vector of the machine's width: 16 floats with AVX-512, else 8 (AVX2). Head dims that are a multiple of
   it, up to 256, are held in registers. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define MAX_VECTORS (256 / LANES)
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

/* Loads through a pointer of that type (aligned to a float: unaligned loads). Not memcpy into a local: with
   generic tuning GCC splits that into halves written to the stack and read back whole (a stalled store
   forward on every load; an x86-64-v3 build ran 8x slower). */
static inline vec load(const float *p) { return *(const vec *)p; }
static inline void store(float *p, vec v) { *(vec *)p = v; }

/* A cache's LANES elements from element `index`, as floats: fp32 as stored, or bf16 widened (a bf16 is the high
   half of the fp32 with the same value). `bf16` is a constant at every call, so each kernel is built twice. */
typedef uint16_t bf16_lanes __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
typedef uint32_t word_lanes __attribute__((vector_size(LANES * sizeof(uint32_t))));
static inline __attribute__((always_inline)) vec load_kv(const void *cache, int64_t index, const int bf16) {
    if (!bf16) return load((const float *)cache + index);
    const word_lanes words = __builtin_convertvector(*(const bf16_lanes *)((const uint16_t *)cache + index),
                                                     word_lanes) << 16;
    return (vec)words; /* the same bits, read as floats */
}
static inline __attribute__((always_inline)) float kv_at(const void *cache, int64_t index, const int bf16) {
    if (!bf16) return ((const float *)cache)[index];
    const uint32_t word = (uint32_t)((const uint16_t *)cache)[index] << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

/* The sum of a vector's lanes as a tree: v plus itself rotated by half, a quarter, ... (log2(LANES) adds
   deep). Summed lane by lane, in order, it was a chain of LANES dependent adds per score: the kernel's
   hottest instructions. */
#if defined(__clang__)
#define ROTATE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
typedef int32_t lane_index __attribute__((vector_size(LANES * sizeof(int32_t))));
#define ROTATE(v, ...) __builtin_shuffle(v, (lane_index){__VA_ARGS__})
#endif
static inline float sum_lanes(vec v) {
#if LANES == 16
    v += ROTATE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += ROTATE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += ROTATE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += ROTATE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    v += ROTATE(v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += ROTATE(v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += ROTATE(v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return v[0];
}

enum { OK = 0, BAD_BLOCK = 1, BAD_LENGTH = 2, NO_MEMORY = 3 };

/* `count` elements of `size` bytes from element `index` of a cache */
static inline void prefetch_row(const void *cache, int64_t index, int64_t count, int64_t size) {
    const char *row = (const char *)cache + index * size;
    for (int64_t byte = 0; byte < count * size; byte += 64)
        __builtin_prefetch(row + byte, 0, 1); /* into L2: L1 is too small to hold a task */
}

/* The next task's rows, prefetched a few at a time as this task's work proceeds. */
typedef struct {
    const int32_t *table;
    int64_t len, head_offset, work, done, fetched;
} Ahead;

static inline void prefetch_ahead(Ahead *ahead, const void *k_cache, const void *v_cache, int64_t num_blocks,
                                  int64_t block_size, int64_t row_len, int64_t width, int64_t size) {
    ahead->done++;
    while (ahead->fetched < ahead->len && ahead->fetched * ahead->work < ahead->done * ahead->len) {
        const int64_t t = ahead->fetched++, block = ahead->table[t / block_size];
        if (block < 0 || block >= num_blocks) continue; /* refused when that task runs */
        const int64_t row = (block * block_size + t % block_size) * row_len + ahead->head_offset;
        prefetch_row(k_cache, row, width, size);
        prefetch_row(v_cache, row, width, size);
    }
}

/* Everything the query heads of one KV head read: that KV head's rows, and what to prefetch meanwhile. */
typedef struct {
    const void *k_cache, *v_cache; /* fp32 or bf16 */
    const int64_t *rows;           /* each position's row offset (in elements), at the task's first KV head */
    int64_t len, head, width, num_blocks, block_size, row_len, head_dim, size; /* size: an element's bytes */
    int first;           /* the task's first pass: prefetch its own rows a few positions ahead */
    Ahead *ahead;
} HeadPass;

static inline void prefetch_step(const HeadPass *h, int64_t t) {
    if (h->first && t + PREFETCH_AHEAD < h->len) {
        prefetch_row(h->k_cache, h->rows[t + PREFETCH_AHEAD], h->width, h->size);
        prefetch_row(h->v_cache, h->rows[t + PREFETCH_AHEAD], h->width, h->size);
    }
    prefetch_ahead(h->ahead, h->k_cache, h->v_cache, h->num_blocks, h->block_size, h->row_len, h->width, h->size);
}

/* At most this many query heads share one pass over their KV head's rows (GQA): each key and value vector is
   loaded once for all of them, and their chains of multiply-adds run side by side. */
#define MAX_GROUP 4

/* p[g * len + t] = q_g . k[t] for the `G` query heads of one KV head, each head's query already scaled, in
   `qs` [G][head_dim]. `G` is a constant at each call (see scores_group), so the sums stay in registers. Each
   head's arithmetic is the one-head loop's: two chains (even and odd vectors), summed at the end. */
static inline __attribute__((always_inline)) void scores_heads(const HeadPass *h, const float *qs, float *p,
                                                               const int G, const int bf16) {
    const int64_t vectors = h->head_dim / LANES;
    for (int64_t t = 0; t < h->len; t++) {
        prefetch_step(h, t);
        const int64_t k = h->rows[t] + h->head;
        vec even[MAX_GROUP], odd[MAX_GROUP];
        for (int g = 0; g < G; g++) even[g] = odd[g] = (vec){0};
        int64_t c = 0;
        for (; c + 1 < vectors; c += 2) {
            const vec k0 = load_kv(h->k_cache, k + LANES * c, bf16);
            const vec k1 = load_kv(h->k_cache, k + LANES * (c + 1), bf16);
            for (int g = 0; g < G; g++) {
                even[g] += load(qs + g * h->head_dim + LANES * c) * k0;
                odd[g] += load(qs + g * h->head_dim + LANES * (c + 1)) * k1;
            }
        }
        if (c < vectors) {
            const vec k0 = load_kv(h->k_cache, k + LANES * c, bf16);
            for (int g = 0; g < G; g++) even[g] += load(qs + g * h->head_dim + LANES * c) * k0;
        }
        for (int g = 0; g < G; g++) p[g * h->len + t] = sum_lanes(even[g] + odd[g]);
    }
}

static inline __attribute__((always_inline)) void scores_group(const HeadPass *h, const float *qs, float *p, int G,
                                                               const int bf16) {
    switch (G) {
    case 1: scores_heads(h, qs, p, 1, bf16); break;
    case 2: scores_heads(h, qs, p, 2, bf16); break;
    case 3: scores_heads(h, qs, p, 3, bf16); break;
    default: scores_heads(h, qs, p, 4, bf16); break;
    }
}

static inline __attribute__((always_inline)) void scores_plain(const HeadPass *h, const float *q, float scale,
                                                               float *p, const int bf16) {
    for (int64_t t = 0; t < h->len; t++) {
        prefetch_step(h, t);
        const int64_t k = h->rows[t] + h->head;
        float dot = 0.f; /* simdlen: one vector length for both caches (GCC picked a longer one for bf16), so the
                            partial sums, hence the bits, are the same */
#pragma omp simd reduction(+ : dot) simdlen(LANES)
        for (int64_t d = 0; d < h->head_dim; d++) dot += q[d] * kv_at(h->k_cache, k + d, bf16);
        p[t] = dot * scale;
    }
}

/* out_g[c..c+n) = sum_t p_g[t] v[t][c..c+n) * inverse_g for the `G` query heads of one KV head, `n` vectors from
   vector c: `G` and `n` are constants at each call, so the loops unroll and the sums stay in registers (with a
   count known only at run time, GCC kept them in memory: a load, multiply-add and store per vector and position,
   each position waiting on the last's store). Each value vector is loaded once for all `G` heads. */
static inline __attribute__((always_inline)) void values_block(const HeadPass *h, const float *p, const float *inverse,
                                                               float *out, int64_t c, const int G, const int n,
                                                               const int bf16) {
    vec acc[MAX_GROUP][8];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < n; i++) acc[g][i] = (vec){0};
    for (int64_t t = 0; t < h->len; t++) {
        const int64_t v = h->rows[t] + h->head + LANES * c;
        for (int i = 0; i < n; i++) {
            const vec value = load_kv(h->v_cache, v + LANES * i, bf16);
            for (int g = 0; g < G; g++) acc[g][i] += p[g * h->len + t] * value;
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < n; i++) store(out + g * h->head_dim + LANES * (c + i), acc[g][i] * inverse[g]);
}

/* The values of `G` heads in blocks of as many vectors as leave the sums in registers (AVX2's 16: eight sums
   for one head, four for two or three heads, two for four), then one vector at a time. */
static inline __attribute__((always_inline)) void values_heads(const HeadPass *h, const float *p, const float *inverse,
                                                               float *out, const int G, const int bf16) {
    const int64_t vectors = h->head_dim / LANES;
    const int wide = G == 1 ? 8 : G == 4 ? 2 : 4;
    int64_t c = 0;
    for (; c + wide <= vectors; c += wide) values_block(h, p, inverse, out, c, G, wide, bf16);
    for (; c < vectors; c++) values_block(h, p, inverse, out, c, G, 1, bf16);
}

static inline __attribute__((always_inline)) void values_group(const HeadPass *h, const float *p, const float *inverse,
                                                               float *out, int G, const int bf16) {
    switch (G) {
    case 1: values_heads(h, p, inverse, out, 1, bf16); break;
    case 2: values_heads(h, p, inverse, out, 2, bf16); break;
    case 3: values_heads(h, p, inverse, out, 3, bf16); break;
    default: values_heads(h, p, inverse, out, 4, bf16); break;
    }
}

static inline __attribute__((always_inline)) void values_plain(const HeadPass *h, const float *p, float inverse,
                                                               float *out, const int bf16) {
    memset(out, 0, sizeof(float) * (size_t)h->head_dim);
    for (int64_t t = 0; t < h->len; t++) {
        const int64_t v = h->rows[t] + h->head;
        const float w = p[t];
#pragma omp simd
        for (int64_t d = 0; d < h->head_dim; d++) out[d] += w * kv_at(h->v_cache, v + d, bf16);
    }
    for (int64_t d = 0; d < h->head_dim; d++) out[d] *= inverse;
}

/* p = exp(p - max p) in place; returns 1 / their sum. The sum runs in vectors from p[0], then the tail: its order
   depends on len only, never on p's address (where a vectorized reduction may peel for alignment), so a prefill
   row's bits do not depend on where its scores lie. The maximum and each exp are exact whatever the order. */
static inline float softmax_in_place(float *p, int64_t len) {
    float top = p[0];
#pragma omp simd reduction(max : top)
    for (int64_t t = 1; t < len; t++) top = p[t] > top ? p[t] : top;
#pragma omp simd
    for (int64_t t = 0; t < len; t++) p[t] = exp_nonpositive(p[t] - top);
    vec sums = {0};
    int64_t t = 0;
    for (; t + LANES <= len; t += LANES) sums += load(p + t);
    float sum = sum_lanes(sums);
    for (; t < len; t++) sum += p[t];
    return 1.f / sum;
}

/* One pass over a KV head's rows for `G` of its query heads (`qs`, each head_dim apart): their scores (the
   queries first scaled into `scaled` where the head dim is held in registers), softmax and values into `out`. */
static inline __attribute__((always_inline)) void attend_pass(const HeadPass *h, const float *qs, float scale,
                                                              float *scaled, float *scores, float *out, int G,
                                                              int in_registers, const int bf16) {
    float inverse[MAX_GROUP];
    if (in_registers) {
        for (int g = 0; g < G; g++) /* the queries, scaled once */
            for (int64_t c = 0; c < h->head_dim; c += LANES)
                store(scaled + g * h->head_dim + c, load(qs + g * h->head_dim + c) * scale);
        scores_group(h, scaled, scores, G, bf16);
    } else {
        scores_plain(h, qs, scale, scores, bf16);
    }
    for (int g = 0; g < G; g++) inverse[g] = softmax_in_place(scores + g * h->len, h->len);
    if (in_registers)
        values_group(h, scores, inverse, out, G, bf16);
    else
        values_plain(h, scores, inverse[0], out, bf16);
}

int paged_decode_attention_with_prologue_f32(
    const float *q, int64_t q_seq_stride,       /* [num_seqs, num_heads, head_dim], each row's heads contiguous */
    const void *k_cache, const void *v_cache, /* [num_blocks, block_size, num_kv_heads, head_dim] contiguous */
    int64_t kv_bf16,                          /* the caches' elements: 0 fp32, 1 bf16 */
    int64_t num_blocks, int64_t block_size,
    const int32_t *block_tables, int64_t max_blocks, /* [num_seqs, max_blocks] contiguous */
    const int32_t *seq_lens,                         /* [num_seqs] */
    float *out,                                      /* [num_seqs, num_heads, head_dim] contiguous */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    int64_t num_threads, /* torch.get_num_threads() of the calling thread: what torch's own ops use there */
    const SequencePrologue *prologue) /* or NULL (paged_decode_attention_cpu.h) */
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
    if (prologue != NULL && tasks_per_seq > 1) { /* a sequence's tasks may run on different threads */
        for (int64_t s = 0; s < num_seqs; s++) prologue->run(prologue->context, s);
        prologue = NULL;
    }
    int status = OK;
#pragma omp parallel num_threads(team)
    {
        float *scores = malloc(sizeof(float) * (size_t)(MAX_GROUP * max_len)); /* a pass's query heads' */
        float scaled[MAX_GROUP * LANES * MAX_VECTORS]; /* their queries, times the scale */
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)max_len); /* each position's row offset in the cache */
        const int have_memory = scores && rows;
        if (!have_memory) {
#pragma omp atomic write
            status = NO_MEMORY;
        }
        const int64_t stride = omp_get_num_threads(); /* schedule(static, 1): this thread's next task */
        const int in_registers = head_dim % LANES == 0 && head_dim / LANES <= MAX_VECTORS;
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            const int64_t s = task / tasks_per_seq, h0 = task % tasks_per_seq * heads_per_task;
            const int64_t nq = heads_per_task * group, width = heads_per_task * head_dim; /* the task's heads */
            const int64_t len = seq_lens[s];
            float *o = out + (s * num_heads + h0 * group) * head_dim;
            if (prologue != NULL) prologue->run(prologue->context, s);
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
            /* one pass over the task's rows per KV head and group of up to MAX_GROUP query heads (per query head
               where the head dim is not held in registers): the prefetcher spreads the next task over them */
            const int64_t passes = in_registers ? heads_per_task * ((group + MAX_GROUP - 1) / MAX_GROUP) : nq;
            Ahead ahead = {block_tables, 0, 0, passes * len, 0, 0};
            if (task + stride < num_tasks) {
                const int64_t next = task + stride, s_next = next / tasks_per_seq;
                ahead.table = block_tables + s_next * max_blocks;
                ahead.len = seq_lens[s_next];
                ahead.head_offset = next % tasks_per_seq * heads_per_task * head_dim;
            }
            const float *qs = q + s * q_seq_stride + h0 * group * head_dim;
            for (int64_t hq = 0; hq < nq;) {
                const int64_t left_in_group = group - hq % group;
                const int G = in_registers ? (int)(left_in_group < MAX_GROUP ? left_in_group : MAX_GROUP) : 1;
                const HeadPass h = {k_cache, v_cache, rows, len, (hq / group) * head_dim, width, num_blocks,
                                    block_size, row_len, head_dim, kv_bf16 ? 2 : 4, hq == 0, &ahead};
                if (kv_bf16)
                    attend_pass(&h, qs + hq * head_dim, scale, scaled, scores, o + hq * head_dim, G, in_registers, 1);
                else
                    attend_pass(&h, qs + hq * head_dim, scale, scaled, scores, o + hq * head_dim, G, in_registers, 0);
                hq += G;
            }
        }
        free(scores);
        free(rows);
    }
    return status;
}

int paged_decode_attention_f32(const float *q, int64_t q_seq_stride, const void *k_cache, const void *v_cache,
                               int64_t kv_bf16, int64_t num_blocks, int64_t block_size, const int32_t *block_tables,
                               int64_t max_blocks, const int32_t *seq_lens, float *out, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                               int64_t num_threads) {
    return paged_decode_attention_with_prologue_f32(q, q_seq_stride, k_cache, v_cache, kv_bf16, num_blocks,
                                                    block_size, block_tables, max_blocks, seq_lens, out, num_seqs,
                                                    num_heads, num_kv_heads, head_dim, scale, num_threads, NULL);
}

/* ---- prefill ------------------------------------------------------------------------------------------------
 * Causal attention of prefill chunks over the paged cache (their own keys written to it first). Laid out for the
 * arithmetic, unlike decode, whose time is the reading: each (sequence, KV head)'s keys are first copied
 * transposed (kt[d][t]: a vector holds LANES positions' element d), so that a query row's scores for LANES keys
 * are one chain of multiply-adds over d, its query element broadcast; then softmax over the row's own keys, and
 * its values summed position by position in vectors of the head dim. A row's arithmetic depends only on its query
 * and the keys and values up to its position: its bits are the same whichever chunk, batch, tile or thread
 * computes it. Tasks: (sequence, KV head, PF_TOKENS tokens of its chunk) dealt dynamically (later rows see
 * more keys); within a task, tiles of PF_ROWS rows, a row being one token's query head. */
#define PF_TOKENS 16
#define PF_ROWS 4   /* rows a tile: with two key vectors at a time, 8 independent chains of multiply-adds */
#define PF_WIDTH (LANES == 16 ? 4 : 2) /* value vectors a row per pass: PF_ROWS x PF_WIDTH sums in registers */

typedef struct {
    const float *q; /* the row's query, already scaled */
    float *out;
    int64_t len;    /* keys it attends to: its position + 1 */
} PrefillRow;

/* scores[r][t] for t < the tile's longest len (rounded up to 2 * LANES: kt is padded with zeros that far) */
static inline __attribute__((always_inline)) void prefill_scores(const PrefillRow *rows, int n, const float *kt,
                                                                 int64_t stride, int64_t head_dim, float *scores,
                                                                 int64_t scores_stride, int64_t len_max) {
    for (int64_t t = 0; t < len_max; t += 2 * LANES) {
        vec a0[PF_ROWS], a1[PF_ROWS];
        for (int r = 0; r < PF_ROWS; r++) a0[r] = a1[r] = (vec){0};
        for (int64_t d = 0; d < head_dim; d++) {
            const vec k0 = load(kt + d * stride + t), k1 = load(kt + d * stride + t + LANES);
            for (int r = 0; r < PF_ROWS; r++) {
                if (r >= n) break;
                const float x = rows[r].q[d];
                a0[r] += x * k0;
                a1[r] += x * k1;
            }
        }
        for (int r = 0; r < n; r++) {
            store(scores + r * scores_stride + t, a0[r]);
            store(scores + r * scores_stride + t + LANES, a1[r]);
        }
    }
}

/* out_r = sum_t p_r[t] v[t] * inverse_r, t < len_r, in vectors of the head dim (a multiple of LANES) */
static inline __attribute__((always_inline)) void prefill_values(const PrefillRow *rows, int n, const float *scores,
                                                                 int64_t scores_stride, const float *inverse,
                                                                 const void *v_cache, const int64_t *vrows,
                                                                 int64_t head, int64_t head_dim, const int bf16) {
    int64_t len_min = rows[0].len;
    for (int r = 1; r < n; r++) len_min = rows[r].len < len_min ? rows[r].len : len_min;
    for (int64_t c = 0; c < head_dim; c += PF_WIDTH * LANES) {
        const int w = (int)((head_dim - c) / LANES < PF_WIDTH ? (head_dim - c) / LANES : PF_WIDTH);
        vec acc[PF_ROWS][PF_WIDTH];
        for (int r = 0; r < PF_ROWS; r++)
            for (int i = 0; i < PF_WIDTH; i++) acc[r][i] = (vec){0};
        for (int64_t t = 0; t < len_min; t++) {
            const int64_t v = vrows[t] + head + c;
            for (int i = 0; i < PF_WIDTH && i < w; i++) {
                const vec value = load_kv(v_cache, v + LANES * i, bf16);
                for (int r = 0; r < PF_ROWS && r < n; r++) acc[r][i] += scores[r * scores_stride + t] * value;
            }
        }
        for (int r = 0; r < PF_ROWS && r < n; r++) /* each row's own last keys */
            for (int64_t t = len_min; t < rows[r].len; t++) {
                const int64_t v = vrows[t] + head + c;
                for (int i = 0; i < PF_WIDTH && i < w; i++)
                    acc[r][i] += scores[r * scores_stride + t] * load_kv(v_cache, v + LANES * i, bf16);
            }
        for (int r = 0; r < PF_ROWS && r < n; r++)
            for (int i = 0; i < PF_WIDTH && i < w; i++) store(rows[r].out + c + LANES * i, acc[r][i] * inverse[r]);
    }
}

/* the same, one row and one element at a time: a head dim that is not a multiple of LANES */
static inline void prefill_values_plain(const PrefillRow *row, const float *p, float inverse, const void *v_cache,
                                        const int64_t *vrows, int64_t head, int64_t head_dim, const int bf16) {
    for (int64_t d = 0; d < head_dim; d++) {
        float sum = 0.f;
        for (int64_t t = 0; t < row->len; t++) sum += p[t] * kv_at(v_cache, vrows[t] + head + d, bf16);
        row->out[d] = sum * inverse;
    }
}

static void prefill_tile(const PrefillRow *rows, int n, const float *kt, int64_t stride, const void *v_cache,
                         const int64_t *vrows, int64_t head, int64_t head_dim, float *scores, const int bf16) {
    int64_t len_max = 0;
    for (int r = 0; r < n; r++) len_max = rows[r].len > len_max ? rows[r].len : len_max;
    prefill_scores(rows, n, kt, stride, head_dim, scores, stride, len_max);
    float inverse[PF_ROWS];
    for (int r = 0; r < n; r++) inverse[r] = softmax_in_place(scores + r * stride, rows[r].len);
    if (head_dim % LANES == 0)
        prefill_values(rows, n, scores, stride, inverse, v_cache, vrows, head, head_dim, bf16);
    else
        for (int r = 0; r < n; r++)
            prefill_values_plain(rows + r, scores + r * stride, inverse[r], v_cache, vrows, head, head_dim, bf16);
}

/* keys a row of kt holds: len rounded up to the two key vectors prefill_scores reads at a time */
static inline int64_t padded_len(int64_t len) { return (len + 2 * LANES - 1) / (2 * LANES) * (2 * LANES); }

/* the sequence whose tasks include task: the last s with task_at[s] <= task (task_at ascending, task_at[0] = 0) */
static inline int64_t task_sequence(const int64_t *task_at, int64_t num_seqs, int64_t task) {
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (task_at[mid] <= task) lo = mid; else hi = mid - 1;
    }
    return lo;
}

int paged_prefill_attention_f32(
    const float *q, int64_t q_token_stride,  /* [num_tokens, num_heads, head_dim], each row's heads contiguous */
    const void *k_cache, const void *v_cache, int64_t kv_bf16, int64_t num_blocks, int64_t block_size,
    const int32_t *block_tables, int64_t max_blocks, /* [num_seqs, max_blocks] contiguous */
    const int32_t *cu_seqlens_q,                     /* [num_seqs + 1]: sequence s's rows [cu[s], cu[s + 1]) */
    const int32_t *seq_lens,                         /* [num_seqs]: context after its chunk */
    float *out,                                      /* [num_tokens, num_heads, head_dim] contiguous */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t num_threads)
{
    const int64_t group = num_heads / num_kv_heads, row_len = num_kv_heads * head_dim;
    /* per sequence: where its transposed keys (kt_at), its positions' cache rows (rows_at) and its tasks (task_at)
     * start */
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)(3 * num_seqs + 1));
    if (!offsets) return NO_MEMORY;
    int64_t *kt_at = offsets, *rows_at = offsets + num_seqs, *task_at = offsets + 2 * num_seqs;
    int64_t num_tasks = 0, total_len = 0, kt_floats = 0, widest = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s], len = seq_lens[s];
        if (q_len < 0 || len < q_len || len > max_blocks * block_size) {
            free(offsets);
            return BAD_LENGTH;
        }
        kt_at[s] = kt_floats, rows_at[s] = total_len, task_at[s] = num_tasks;
        num_tasks += (q_len + PF_TOKENS - 1) / PF_TOKENS * num_kv_heads;
        total_len += len;
        kt_floats += padded_len(len) * head_dim * num_kv_heads;
        widest = padded_len(len) > widest ? padded_len(len) : widest;
    }
    if (num_tasks == 0) {
        free(offsets);
        return OK;
    }
    /* each sequence's transposed keys per KV head (kt; only its padding zeroed), each position's row in the cache */
    float *kt = malloc(sizeof(float) * (size_t)kt_floats);
    int64_t *vrows = malloc(sizeof(int64_t) * (size_t)total_len);
    if (!kt || !vrows) {
        free(kt), free(vrows), free(offsets);
        return NO_MEMORY;
    }
    int status = OK;
    const int team = (int)(num_threads < num_tasks ? num_threads : num_tasks);
#pragma omp parallel num_threads(team)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            const int64_t len = seq_lens[s], padded = padded_len(len);
            if (cu_seqlens_q[s + 1] == cu_seqlens_q[s]) continue;
            const int32_t *table = block_tables + s * max_blocks;
            int64_t *rows = vrows + rows_at[s];
            int bad = 0;
            for (int64_t t = 0; t < len; t++) {
                const int64_t block = table[t / block_size];
                bad |= block < 0 || block >= num_blocks;
                rows[t] = bad ? 0 : (block * block_size + t % block_size) * row_len;
            }
            if (bad) { /* its rows point at row 0 from the bad block on: in the cache, and the call fails */
#pragma omp atomic write
                status = BAD_BLOCK;
            }
            for (int64_t h = 0; h < num_kv_heads; h++) {
                float *kth = kt + kt_at[s] + h * head_dim * padded;
                for (int64_t t = 0; t < len; t++)
                    for (int64_t d = 0; d < head_dim; d++)
                        kth[d * padded + t] = kv_at(k_cache, rows[t] + h * head_dim + d, (int)kv_bf16);
                for (int64_t d = 0; d < head_dim; d++)
                    for (int64_t t = len; t < padded; t++) kth[d * padded + t] = 0.f;
            }
        }
        /* (the loop's barrier: every sequence's keys are in place) */
        float *scores = malloc(sizeof(float) * (size_t)(PF_ROWS * widest));
        float *scaled = malloc(sizeof(float) * (size_t)(PF_TOKENS * group * head_dim));
        if (!scores || !scaled) {
#pragma omp atomic write
            status = NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (!scores || !scaled) continue; /* (a sequence with a bad block reads row 0 and the call fails) */
            /* the task's sequence, then its KV head and block of tokens */
            const int64_t s = task_sequence(task_at, num_seqs, task), first = task - task_at[s];
            const int64_t h = first % num_kv_heads, token0 = first / num_kv_heads * PF_TOKENS;
            const int64_t q_start = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - q_start;
            const int64_t tokens = q_len - token0 < PF_TOKENS ? q_len - token0 : PF_TOKENS;
            const int64_t context = seq_lens[s] - q_len, padded = padded_len(seq_lens[s]);
            const float *kth = kt + kt_at[s] + h * head_dim * padded;
            PrefillRow tile[PF_ROWS];
            int n = 0;
            for (int64_t i = 0; i < tokens; i++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t token = q_start + token0 + i, head = h * group + g;
                    float *qs = scaled + (i * group + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) qs[d] = q[token * q_token_stride + head * head_dim + d] * scale;
                    tile[n++] = (PrefillRow){qs, out + (token * num_heads + head) * head_dim, context + token0 + i + 1};
                    if (n == PF_ROWS) {
                        prefill_tile(tile, n, kth, padded, v_cache, vrows + rows_at[s], h * head_dim, head_dim, scores,
                                     (int)kv_bf16);
                        n = 0;
                    }
                }
            if (n) prefill_tile(tile, n, kth, padded, v_cache, vrows + rows_at[s], h * head_dim, head_dim, scores,
                                (int)kv_bf16);
        }
        free(scores);
        free(scaled);
    }
    free(kt), free(vrows), free(offsets);
    return status;
}
