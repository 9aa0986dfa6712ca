/* An fp32 linear layer's matmul, y[rows, n] = x[rows, k] @ w[n, k]^T (+ bias), over the weight packed once into
 * column panels: panel p holds columns p*NB .. p*NB+NB-1 (zero past n) as [k][NB], so a panel is one sequential
 * stream. Each output is one chain of fused multiply-adds over k = 0 .. k-1 in order, then the bias: its bits do not
 * depend on the number of rows, how they are tiled, or the thread count (the same token gets the same logits
 * alone or in any batch, and on any of these code paths that has FMA).
 *
 * Why not oneDNN's: at a decode step's few rows the matmul only streams the weights, and oneDNN's fp32 kernels read
 * them at ~55 % of the machine's streaming rate, these at ~80 %: each thread streams its panels with a software
 * prefetch a few KiB ahead, and a tile of up to MR rows is multiplied against a panel with MR x NB sums in registers
 * (docs/kernels.md); meanwhile each tile prefetches its share of the thread's next panels into L2 (look_ahead), so
 * that the weights stream while the multiply-adds run. From PAIR_ROWS rows (a prefill) the matmul is bound by the
 * arithmetic instead, and with AVX-512 a tile of MR2 rows takes two panels at once: half the broadcasts of x a
 * multiply-add, ~15 % less time at 512 rows.
 *
 * gemm_silu_mul_f32 is an MLP's gate/up matmul with SiLU(gate) * up as its epilogue: its weight is packed with each
 * panel's first HALF columns gate's and the other HALF the same outputs' up (linear_ops.py interleaves the rows), so a
 * tile's sums hold both and it writes HALF activations a panel, in cpu_math.h's arithmetic (silu_and_mul_f32's):
 * the gate/up output is never written and read back. */

#include <stdint.h>
#include <string.h>

#include "cpu_math.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
typedef __m512 vec;
#define VW 16 /* floats a register */
#define MR 12 /* 24 sums + 2 weights + 1 broadcast of the 32 zmm registers */
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define VW 8
#define MR 6 /* 12 sums + 2 weights + 1 broadcast of the 16 ymm registers */
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#else
#define MR 4
#endif
#ifdef VW
#define NB (2 * VW) /* a panel's columns: two registers */
#else
#define NB 16
#endif
#define PREFETCH_ROWS 48 /* of a panel (NB floats each) ahead of the one being read: 6 KiB with AVX-512 */

#define HALF (NB / 2) /* a gated panel's gate (then up) columns */

/* The 64-byte lines a tile prefetches into L2 (one every `every` of its k steps), of the panels its thread takes
 * next. Where a panel has several tiles, the first would otherwise read it from memory while the others only
 * compute: spread over all of a panel's tiles, the next panels arrive at the rate they are needed, the weight stream
 * overlapping the multiply-adds. A panel's only tile (a decode of up to MR rows) fetches the start of the next panel
 * a whole panel ahead, further than its own PREFETCH_ROWS stream reaches. */
typedef struct {
    const char *at;
    int64_t lines, every;
} ahead_t;

/* tile t's share of `count` panels from `first` (none past the last panel), at most a line a k step */
static inline ahead_t look_ahead(const float *packed, int64_t k, int64_t first, int64_t count, int64_t panels,
                                 int64_t tiles, int64_t t) {
    ahead_t none = {NULL, 0, 1};
    int64_t left = panels - first < count ? panels - first : count;
    if (left <= 0) return none;
    int64_t total = left * k * NB * (int64_t)sizeof(float) / 64, share = (total + tiles - 1) / tiles;
    if (share > k) share = k;
    int64_t start = t * share;
    if (start >= total) return none;
    int64_t lines = total - start < share ? total - start : share;
    ahead_t ahead = {(const char *)(packed + first * k * NB) + 64 * start, lines, k / share};
    return ahead;
}

#ifdef VW
/* at k step i: the next of ahead's lines, if one is due (`line` and `due`: the tile's count and next step) */
static inline __attribute__((always_inline)) void fetch_ahead(const ahead_t ahead, int64_t i, int64_t *line,
                                                              int64_t *due) {
    if (i == *due && *line < ahead.lines) {
        _mm_prefetch(ahead.at + 64 * (*line)++, _MM_HINT_T1);
        *due += ahead.every;
    }
}
#endif

int64_t gemm_panel_columns(void) { return NB; }

/* w [n, k] (rows `w_stride` apart) into ceil(n / NB) panels of [k][NB] at `packed`. */
void gemm_pack_f32(const float *w, int64_t w_stride, int64_t n, int64_t k, float *packed, int64_t threads) {
    int64_t panels = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *panel = packed + p * k * NB;
        for (int64_t j = 0; j < NB; j++) {
            int64_t column = p * NB + j;
            for (int64_t i = 0; i < k; i++) panel[i * NB + j] = column < n ? w[column * w_stride + i] : 0.0f;
        }
    }
}

/* one row of a tile's sums for a panel into y: `cols` outputs (+ bias), or gated, HALF silu(gate) * up */
static inline __attribute__((always_inline)) void finish(const float *sums, float *y, const float *bias, int64_t cols,
                                                         const int gated) {
    if (gated) {
#pragma omp simd
        for (int j = 0; j < HALF; j++) y[j] = silu_times(sums[j], sums[HALF + j]);
    } else if (bias != NULL)
        for (int64_t j = 0; j < cols; j++) y[j] = sums[j] + bias[j];
    else
        memcpy(y, sums, (size_t)cols * sizeof(float));
}

/* `rows` (a constant once inlined: the sums stay in registers) rows of x against one panel. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const float *panel,
                                                       int64_t k, float *y, int64_t y_stride, const float *bias,
                                                       int64_t cols, const int rows, const int gated,
                                                       const ahead_t ahead) {
    float sums[MR][NB];
#ifdef VW
    vec lo[MR], hi[MR];
    int64_t line = 0, due = 0; /* fetch_ahead's */
    for (int m = 0; m < rows; m++) lo[m] = hi[m] = vzero();
    for (int64_t i = 0; i < k; i++) {
        const float *w = panel + i * NB;
        for (int j = 0; j < NB; j += 16) /* each 64-byte line of the panel's row ahead */
            _mm_prefetch((const char *)(w + PREFETCH_ROWS * NB + j), _MM_HINT_T0);
        fetch_ahead(ahead, i, &line, &due);
        vec w_lo = vload(w), w_hi = vload(w + VW);
        for (int m = 0; m < rows; m++) {
            vec xv = vset1(x[m * x_stride + i]);
            lo[m] = vfma(xv, w_lo, lo[m]);
            hi[m] = vfma(xv, w_hi, hi[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        vstore(sums[m], lo[m]);
        vstore(sums[m] + VW, hi[m]);
    }
#else
    (void)ahead;
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NB; j++) sums[m][j] = 0.0f;
    for (int64_t i = 0; i < k; i++)
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < NB; j++) sums[m][j] += x[m * x_stride + i] * panel[i * NB + j];
#endif
    for (int m = 0; m < rows; m++) finish(sums[m], y + m * y_stride, bias, cols, gated);
}

#if defined(__AVX512F__)
#define PAIR_ROWS 64
#define PAIR_MAX_K 4096 /* two panels of at most 1 MiB, which a tile's successors find in L2 */
#define MR2 6 /* 24 sums + 4 weights + 1 broadcast */

/* `rows` (at most MR2) rows of x against panels `pa` and `pa`'s next, whose first `cols_b` columns are real. */
static inline __attribute__((always_inline)) void tile2(const float *x, int64_t x_stride, const float *pa,
                                                        int64_t k, float *y, int64_t y_stride, const float *bias,
                                                        int64_t cols_b, const int rows, const int gated,
                                                        const ahead_t ahead) {
    float sums[MR2][2 * NB];
    const float *pb = pa + k * NB;
    vec a_lo[MR2], a_hi[MR2], b_lo[MR2], b_hi[MR2];
    int64_t line = 0, due = 0; /* fetch_ahead's */
    for (int m = 0; m < rows; m++) a_lo[m] = a_hi[m] = b_lo[m] = b_hi[m] = vzero();
    for (int64_t i = 0; i < k; i++) {
        const float *wa = pa + i * NB, *wb = pb + i * NB;
        for (int j = 0; j < NB; j += 16) {
            _mm_prefetch((const char *)(wa + PREFETCH_ROWS * NB + j), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + PREFETCH_ROWS * NB + j), _MM_HINT_T0);
        }
        fetch_ahead(ahead, i, &line, &due);
        vec wa_lo = vload(wa), wa_hi = vload(wa + VW), wb_lo = vload(wb), wb_hi = vload(wb + VW);
        for (int m = 0; m < rows; m++) {
            vec xv = vset1(x[m * x_stride + i]);
            a_lo[m] = vfma(xv, wa_lo, a_lo[m]);
            a_hi[m] = vfma(xv, wa_hi, a_hi[m]);
            b_lo[m] = vfma(xv, wb_lo, b_lo[m]);
            b_hi[m] = vfma(xv, wb_hi, b_hi[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        vstore(sums[m], a_lo[m]);
        vstore(sums[m] + VW, a_hi[m]);
        vstore(sums[m] + NB, b_lo[m]);
        vstore(sums[m] + NB + VW, b_hi[m]);
    }
    for (int m = 0; m < rows; m++) {
        if (gated) { /* panel b's activations follow a's */
            finish(sums[m], y + m * y_stride, NULL, HALF, 1);
            finish(sums[m] + NB, y + m * y_stride + HALF, NULL, HALF, 1);
        } else {
            finish(sums[m], y + m * y_stride, bias, NB + cols_b, 0);
        }
    }
}
#endif

/* y [rows, n] (contiguous) = x [rows, k] (rows `x_stride` apart) @ the packed weight^T (+ bias [n], or NULL); gated
 * (n a multiple of NB), y [rows, n / 2] = silu(gate) * up of the panels' halves. */
static inline __attribute__((always_inline)) void gemm(const float *x, int64_t x_stride, int64_t rows, int64_t k,
                                                       const float *packed, int64_t n, const float *bias, float *y,
                                                       int64_t threads, const int gated) {
    const int64_t panels = (n + NB - 1) / NB, y_cols = gated ? n / 2 : n;
    int64_t paired = 0; /* panels taken two at a time */
#ifdef PAIR_ROWS
    if (rows >= PAIR_ROWS && k <= PAIR_MAX_K) {
        int64_t tiles = (rows + MR2 - 1) / MR2;
        paired = panels / 2 * 2;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
        for (int64_t p = 0; p < paired; p += 2)
            for (int64_t t = 0; t < tiles; t++) {
                int64_t m0 = t * MR2, c0 = p * NB, left = rows - m0;
                int64_t cols_b = n - c0 - NB < NB ? n - c0 - NB : NB;
                const float *xs = x + m0 * x_stride, *pa = packed + p * k * NB, *b = bias ? bias + c0 : NULL;
                float *ys = y + m0 * y_cols + (gated ? c0 / 2 : c0);
                const ahead_t ahead = look_ahead(packed, k, p + 2, 2, panels, tiles, t);
                switch (left < MR2 ? left : MR2) {
#define TILE(r) \
    case r: tile2(xs, x_stride, pa, k, ys, y_cols, b, cols_b, r, gated, ahead); break;
                    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
                }
            }
        if (paired == panels) return;
    }
#endif
    int64_t tiles = (rows + MR - 1) / MR;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t p = paired; p < panels; p++)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t m0 = t * MR, c0 = p * NB;
            int64_t left = rows - m0, cols = n - c0 < NB ? n - c0 : NB;
            const float *xs = x + m0 * x_stride, *panel = packed + p * k * NB, *b = bias ? bias + c0 : NULL;
            float *ys = y + m0 * y_cols + (gated ? c0 / 2 : c0);
            const ahead_t ahead = look_ahead(packed, k, p + 1, 1, panels, tiles, t);
            switch (left < MR ? left : MR) {
#define TILE(r) \
    case r: tile(xs, x_stride, panel, k, ys, y_cols, b, cols, r, gated, ahead); break;
                TILE(1) TILE(2) TILE(3) TILE(4)
#if MR > 4
                TILE(5) TILE(6)
#endif
#if MR > 6
                TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif
#undef TILE
            }
        }
}

void gemm_f32(const float *x, int64_t x_stride, int64_t rows, int64_t k, const float *packed, int64_t n,
              const float *bias, float *y, int64_t threads) {
    gemm(x, x_stride, rows, k, packed, n, bias, y, threads, 0);
}

/* y [rows, n / 2] = silu(x @ gate^T) * (x @ up^T), the weight [n, k] packed gated (n a multiple of NB) */
void gemm_silu_mul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t k, const float *packed, int64_t n,
                       float *y, int64_t threads) {
    gemm(x, x_stride, rows, k, packed, n, NULL, y, threads, 1);
}
