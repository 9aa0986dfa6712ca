/* A decoder layer's per-token ops on the CPU in fp32, each in one pass: RMSNorm (alone, or with the residual
 * add before it), the rotary embedding, SiLU(gate) * up, and the write of a step's keys and values into the
 * paged cache.
 *
 * Built with the decode attention kernel into one library (kernels/cpu_native.py). torch runs each of these
 * as several ops (RMSNorm: pow, mean, add, rsqrt and two multiplies; the rotary embedding: four multiplies,
 * a subtraction and an addition; the cache write: an index_copy_ per cache), each a pass over memory with
 * its own allocation and thread team. The results differ from torch's in the last bits only (the order of
 * a sum, fused multiply-adds, exp's polynomial): tests/kernels/test_cpu_layer_ops.py bounds them. The cache
 * write copies bits into an fp32 cache, or rounds them as torch does into a bf16 one, and checks every slot
 * before it writes any. A bf16 model's versions (the second half of this file) load and store bf16 and compute in
 * fp32 between.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"
#include "paged_decode_attention_cpu.h"

/* elements below which a thread team costs more than it saves (torch's own grain size) */
#define PARALLEL_MIN 32768

enum { OK = 0, BAD_SLOT = 1 };

/* o = weight * row / sqrt(mean(row^2) + eps): one token's norm, shared by the two norms below, so that they
 * sum in the same order */
static inline void normalize_row(const float *row, const float *weight, float *o, int64_t hidden, float eps) {
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; i++) squares += row[i] * row[i];
    const float inverse_rms = 1.f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (row[i] * inverse_rms);
}

/* out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps); x rows `x_stride` floats apart, out contiguous */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t num_tokens,
                  int64_t hidden, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * hidden >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) normalize_row(x + t * x_stride, weight, out + t * hidden, hidden, eps);
}

/* The residual add fused into the next norm: x[t] += delta[t] in place (x is the model's residual stream,
 * contiguous), then out[t] = rms_norm(x[t]) as rms_norm_f32 computes it, so the result is the add followed by
 * rms_norm_f32 bit for bit. One call instead of two: each call after a layer's GEMM finds its data and code
 * out of cache (docs/performance.md). */
void add_rms_norm_f32(float *x, const float *delta, int64_t delta_stride, const float *weight, float *out,
                      int64_t num_tokens, int64_t hidden, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * hidden >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *row = x + t * hidden;
        const float *d = delta + t * delta_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) row[i] += d[i];
        normalize_row(row, weight, out + t * hidden, hidden, eps);
    }
}

/* The "rotate_half" rotation of one token's heads: dimension i pairs with i + head_dim / 2. x [num_heads, head_dim]
 * (a row of the fused QKV output), cos, sin [head_dim / 2], out [num_heads, head_dim]. */
static inline void rotary_token(const float *x, const float *c, const float *s, float *out, int64_t num_heads,
                                int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        const float *x1 = x + h * head_dim, *x2 = x1 + half;
        float *o1 = out + h * head_dim, *o2 = o1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            o1[i] = x1[i] * c[i] - x2[i] * s[i];
            o2[i] = x2[i] * c[i] + x1[i] * s[i];
        }
    }
}

/* rotary_token for every token: x [num_tokens, num_heads, head_dim] with tokens `x_stride` floats apart (heads
 * contiguous: a view of the fused QKV output); cos, sin [num_tokens, head_dim / 2] contiguous; out [num_tokens,
 * num_heads, head_dim]. */
void rotary_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
                int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * num_heads * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++)
        rotary_token(x + t * x_stride, cos + t * half, sin + t * half, out + t * num_heads * head_dim, num_heads,
                     head_dim);
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, intermediate + i]: the gate's columns first, then up's, rows
 * `gate_up_stride` floats apart; out [num_tokens, intermediate] contiguous. */
void silu_and_mul_f32(const float *gate_up, int64_t gate_up_stride, float *out, int64_t num_tokens,
                      int64_t intermediate, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * intermediate >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *gate = gate_up + t * gate_up_stride, *up = gate + intermediate;
        float *o = out + t * intermediate;
#pragma omp simd
        for (int64_t i = 0; i < intermediate; i++) o[i] = silu_times(gate[i], up[i]);
    }
}

static inline void round_row(uint16_t *out, const float *in, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(in[i]);
}

/* k_cache/v_cache row `slot` (`row` elements: fp32, or bf16 where `kv_bf16`) = one token's key and value; a
 * negative slot is padding and skipped. */
static inline void write_slot(const float *key, const float *value, void *k_cache, void *v_cache, int64_t kv_bf16,
                              int64_t slot, int64_t row) {
    if (slot < 0) return;
    if (kv_bf16) {
        round_row((uint16_t *)k_cache + slot * row, key, row);
        round_row((uint16_t *)v_cache + slot * row, value, row);
    } else {
        memcpy((float *)k_cache + slot * row, key, sizeof(float) * (size_t)row);
        memcpy((float *)v_cache + slot * row, value, sizeof(float) * (size_t)row);
    }
}

static inline int slots_fit(const int64_t *slots, int64_t num_tokens, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return 0;
    return 1;
}

/* k_cache/v_cache row slots[t] (num_kv_heads * head_dim elements: fp32, or bf16 where `kv_bf16`) = key/value
 * token t; rows of key and value `key_stride` / `value_stride` floats apart; a negative slot is padding and
 * skipped. Every slot is checked against the cache before anything is written. */
int cache_write_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                    void *k_cache, void *v_cache, int64_t kv_bf16, const int64_t *slots, int64_t num_tokens,
                    int64_t row, int64_t num_slots) {
    if (!slots_fit(slots, num_tokens, num_slots)) return BAD_SLOT;
    for (int64_t t = 0; t < num_tokens; t++)
        write_slot(key + t * key_stride, value + t * value_stride, k_cache, v_cache, kv_bf16, slots[t], row);
    return OK;
}

/* What a decode layer does for one sequence before its attention: the rotary embedding of its q and k heads into
 * qk, then its key (rotated) and value into the cache. */
typedef struct {
    const void *qkv; /* fp32, or bf16 (decode_attention_layer_bf16) */
    const float *cos, *sin;
    float *qk;
    void *k_cache, *v_cache;
    const int64_t *slots;
    int64_t qkv_stride, kv_bf16, num_heads, num_kv_heads, head_dim;
} LayerInputs;

static void rotate_and_write(const void *context, int64_t seq) {
    const LayerInputs *in = context;
    const int64_t heads = in->num_heads + in->num_kv_heads, half = in->head_dim / 2;
    const float *x = (const float *)in->qkv + seq * in->qkv_stride;
    float *rotated = in->qk + seq * heads * in->head_dim;
    rotary_token(x, in->cos + seq * half, in->sin + seq * half, rotated, heads, in->head_dim);
    write_slot(rotated + in->num_heads * in->head_dim, x + heads * in->head_dim, in->k_cache, in->v_cache,
               in->kv_bf16, in->slots[seq], in->num_kv_heads * in->head_dim);
}

/* A decode layer's attention after its QKV matmul, in one call and one thread team: for each sequence, on the
 * thread that then attends for it, the rotary embedding of its q and k (qkv's rows, q heads then k heads then v
 * heads, `qkv_stride` floats apart) into qk [num_seqs, num_heads + num_kv_heads, head_dim] and its key and value
 * into the cache (fp32, or bf16 where `kv_bf16`); then decode attention into out [num_seqs, num_heads, head_dim].
 * The arithmetic is rotary_f32's, cache_write_f32's and paged_decode_attention_f32's, so the result is theirs bit
 * for bit; each sequence's rows stay in its thread's cache, and a call after a GEMM pays for one team, not two
 * and a serial write. Returns 0, BAD_SLOT_CODE for a slot past the cache (nothing written), or the attention
 * kernel's error code. */
#define BAD_SLOT_CODE 4
int decode_attention_layer_f32(const float *qkv, int64_t qkv_stride, const float *cos, const float *sin, float *qk,
                               void *k_cache, void *v_cache, int64_t kv_bf16, int64_t num_blocks, int64_t block_size,
                               const int64_t *slots, const int32_t *block_tables, int64_t max_blocks,
                               const int32_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, float scale, int64_t num_threads) {
    if (!slots_fit(slots, num_seqs, num_blocks * block_size)) return BAD_SLOT_CODE;
    const LayerInputs inputs = {qkv, cos, sin, qk, k_cache, v_cache, slots, qkv_stride, kv_bf16, num_heads,
                                num_kv_heads, head_dim};
    const SequencePrologue prologue = {rotate_and_write, &inputs};
    return paged_decode_attention_with_prologue_f32(qk, (num_heads + num_kv_heads) * head_dim, k_cache, v_cache,
                                                    kv_bf16, num_blocks, block_size, block_tables, max_blocks,
                                                    seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, scale,
                                                    num_threads, &prologue);
}

/* ---- A bf16 model's ops: bf16 loaded (widened exactly), the arithmetic above in fp32, each result rounded once
 * into bf16 as torch rounds. The residual stream, the GEMMs' inputs and outputs and the cache are bf16; the
 * sums of squares, the rotated queries and the attention stay fp32. */

/* normalize_row over a bf16 row and weight, into bf16 */
static inline void normalize_row_bf16(const uint16_t *row, const uint16_t *weight, uint16_t *o, int64_t hidden,
                                      float eps) {
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; i++) squares += from_bf16(row[i]) * from_bf16(row[i]);
    const float inverse_rms = 1.f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) o[i] = to_bf16(from_bf16(weight[i]) * (from_bf16(row[i]) * inverse_rms));
}

/* rms_norm_f32 for bf16 x, weight and out */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, uint16_t *out, int64_t num_tokens,
                   int64_t hidden, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * hidden >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++)
        normalize_row_bf16(x + t * x_stride, weight, out + t * hidden, hidden, eps);
}

/* add_rms_norm_f32 for bf16: x[t] = bf16(x[t] + delta[t]) in place (the sum rounded, as a bf16 model's residual
 * add is), then out[t] = rms_norm_bf16 of that rounded row */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, int64_t delta_stride, const uint16_t *weight,
                       uint16_t *out, int64_t num_tokens, int64_t hidden, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * hidden >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) {
        uint16_t *row = x + t * hidden;
        const uint16_t *d = delta + t * delta_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) row[i] = to_bf16(from_bf16(row[i]) + from_bf16(d[i]));
        normalize_row_bf16(row, weight, out + t * hidden, hidden, eps);
    }
}

/* silu_and_mul_f32 for bf16 gate_up and out */
void silu_and_mul_bf16(const uint16_t *gate_up, int64_t gate_up_stride, uint16_t *out, int64_t num_tokens,
                       int64_t intermediate, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * intermediate >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) {
        const uint16_t *gate = gate_up + t * gate_up_stride, *up = gate + intermediate;
        uint16_t *o = out + t * intermediate;
#pragma omp simd
        for (int64_t i = 0; i < intermediate; i++) o[i] = to_bf16(silu_times(from_bf16(gate[i]), from_bf16(up[i])));
    }
}

/* rotary_token over a bf16 row (the fused QKV output's), into fp32 */
static inline void rotary_token_bf16(const uint16_t *x, const float *c, const float *s, float *out, int64_t num_heads,
                                     int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        const uint16_t *x1 = x + h * head_dim, *x2 = x1 + half;
        float *o1 = out + h * head_dim, *o2 = o1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            o1[i] = from_bf16(x1[i]) * c[i] - from_bf16(x2[i]) * s[i];
            o2[i] = from_bf16(x2[i]) * c[i] + from_bf16(x1[i]) * s[i];
        }
    }
}

/* rotate_and_write for a bf16 qkv and a bf16 cache: the rotated key rounded into the cache, the value copied */
static void rotate_and_write_bf16(const void *context, int64_t seq) {
    const LayerInputs *in = context;
    const int64_t heads = in->num_heads + in->num_kv_heads, half = in->head_dim / 2, row = in->num_kv_heads * in->head_dim;
    const uint16_t *x = (const uint16_t *)in->qkv + seq * in->qkv_stride;
    float *rotated = in->qk + seq * heads * in->head_dim;
    rotary_token_bf16(x, in->cos + seq * half, in->sin + seq * half, rotated, heads, in->head_dim);
    const int64_t slot = in->slots[seq];
    if (slot < 0) return;
    round_row((uint16_t *)in->k_cache + slot * row, rotated + in->num_heads * in->head_dim, row);
    memcpy((uint16_t *)in->v_cache + slot * row, x + heads * in->head_dim, sizeof(uint16_t) * (size_t)row);
}

/* decode_attention_layer_f32 for a bf16 model: qkv bf16 (rows `qkv_stride` elements apart), the caches bf16; the
 * rotated q and k in fp32 (qk, as there), the attention in fp32 into `attended` [num_seqs, num_heads * head_dim],
 * then rounded into out (bf16, the same shape): the o_proj GEMM's input. Returns decode_attention_layer_f32's
 * codes. */
int decode_attention_layer_bf16(const uint16_t *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                                float *qk, void *k_cache, void *v_cache, int64_t num_blocks, int64_t block_size,
                                const int64_t *slots, const int32_t *block_tables, int64_t max_blocks,
                                const int32_t *seq_lens, float *attended, uint16_t *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                int64_t num_threads) {
    if (!slots_fit(slots, num_seqs, num_blocks * block_size)) return BAD_SLOT_CODE;
    const LayerInputs inputs = {qkv, cos, sin, qk, k_cache, v_cache, slots, qkv_stride,
                                1, num_heads, num_kv_heads, head_dim};
    const SequencePrologue prologue = {rotate_and_write_bf16, &inputs};
    const int status = paged_decode_attention_with_prologue_f32(
        qk, (num_heads + num_kv_heads) * head_dim, k_cache, v_cache, 1, num_blocks, block_size, block_tables,
        max_blocks, seq_lens, attended, num_seqs, num_heads, num_kv_heads, head_dim, scale, num_threads, &prologue);
    if (status != OK) return status;
    const int64_t width = num_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_seqs * width >= PARALLEL_MIN)
    for (int64_t s = 0; s < num_seqs; s++) round_row(out + s * width, attended + s * width, width);
    return OK;
}
