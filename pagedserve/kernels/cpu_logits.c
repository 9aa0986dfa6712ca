/* A step's logits on the CPU in fp32: per row, the greedy choice and the normalizer of its logprobs, in one
 * read of the row from memory and a second from cache (a row of a 49152-token vocabulary is 192 KiB).
 *
 * Built with the other CPU kernels into one library (kernels/cpu_native.py). torch computes the same with a
 * `log_softmax` written over the whole [rows, vocab] (every logprob, though the step needs one or a few per
 * row) and a separate argmax. Here logprob(x) = (x - max) - log_sum, the terms of torch's own formula; only
 * the order of the sum and exp's polynomial differ (tests/kernels/test_logits_ops.py bounds them).
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

#define PARALLEL_MIN 32768 /* elements below which a thread team costs more than it saves */
#define CHUNK 256          /* the maximum is found chunk by chunk, the first index only in the chunk holding it */

/* logits [num_rows, vocab], rows `stride` floats apart. Per row: first[r], the first index of its maximum
 * (of its first NaN where it has one, as torch's argmax), row_max[r], that value, and log_sum[r],
 * log(sum(exp(x - row_max))) (NaN with a NaN in the row). */
void first_max_and_log_sum_f32(const float *logits, int64_t stride, int64_t num_rows, int64_t vocab,
                               int64_t *first, float *row_max, float *log_sum, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows * vocab >= PARALLEL_MIN)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *x = logits + r * stride;
        float top = x[0];
        int64_t best = 0, nan_at = -1;
        for (int64_t c = 0; c < vocab && nan_at < 0; c += CHUNK) {
            const int64_t n = vocab - c < CHUNK ? vocab - c : CHUNK;
            float m = x[c];
            int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
            for (int64_t i = 0; i < n; i++) {
                m = x[c + i] > m ? x[c + i] : m;
                nan |= x[c + i] != x[c + i];
            }
            if (nan) {
                for (nan_at = c; x[nan_at] == x[nan_at]; nan_at++) {}
            } else if (m > top) { /* strictly greater: the first chunk holding the maximum stays */
                top = m;
                best = c;
            }
        }
        if (nan_at >= 0) {
            first[r] = nan_at;
            row_max[r] = log_sum[r] = x[nan_at];
            continue;
        }
        while (x[best] != top) best++;
        /* summed chunk by chunk, the chunks' sums in double: one running fp32 sum per lane over a whole row
           drifts by ~1e-5 at 49152 terms, torch's log_softmax by ~1e-6 */
        double sum = 0.;
        for (int64_t c = 0; c < vocab; c += CHUNK) {
            const int64_t n = vocab - c < CHUNK ? vocab - c : CHUNK;
            float part = 0.f;
#pragma omp simd reduction(+ : part)
            for (int64_t i = 0; i < n; i++) part += exp_nonpositive(x[c + i] - top);
            sum += part;
        }
        first[r] = best;
        row_max[r] = top;
        log_sum[r] = (float)log(sum);
    }
}
