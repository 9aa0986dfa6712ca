/* Arithmetic shared by the CPU kernels (paged_decode_attention_cpu.c, cpu_layer_ops.c). */
#ifndef PAGEDSERVE_CPU_MATH_H
#define PAGEDSERVE_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a score minus its row's maximum), in arithmetic the compiler vectorizes (libm's expf is
 * a call per element without -ffast-math): 2^n * exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by
 * Cephes' degree-6 polynomial (within 1.5 ulp of exp on [-87, 0]). Below -87.3 (exp < 1.2e-38, nothing next to the maximum's 1) it
 * clamps, so 2^n stays a normal float. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = (x * 1.44269504089f + 12582912.f) - 12582912.f; /* round to nearest: 1.5 * 2^23 */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;       /* x - n ln 2, ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    /* 2^n from the bits, not by converting to an integer (undefined for NaN, which must stay NaN): n + 127
       (1..127) sits in the low mantissa bits of n + 127 + 1.5 * 2^23 */
    const float biased = n + 12583039.f;
    uint32_t bits;
    memcpy(&bits, &biased, sizeof bits);
    bits = (bits & 0xffu) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif
