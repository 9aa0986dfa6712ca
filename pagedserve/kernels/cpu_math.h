/* Arithmetic shared by the CPU kernels (paged_attention_cpu.c, cpu_layer_ops.c, cpu_logits.c). */
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

/* g * sigmoid(g) * up. Sigmoid from exp(-|g|) <= 1, so exp never overflows: 1 / (1 + e) for g >= 0, e / (1 + e)
 * below; 0 where exp_nonpositive clamps (g < -87.3: exp(g) < 1.2e-38), so a huge negative gate gives 0. */
static inline float silu_times(float g, float up) {
    const float e = exp_nonpositive(g < 0.f ? g : -g);
    const float sigmoid = g < -87.3f ? 0.f : (g < 0.f ? e : 1.f) / (1.f + e);
    return g * sigmoid * up;
}

/* x rounded to the nearest bf16, ties to even, as torch rounds (c10's round_to_nearest_even): any NaN becomes
 * the quiet NaN 0x7fc0. Without a branch, so that the row loop vectorizes. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

/* a bf16's value as a float: its bits are the float's high half (exact) */
static inline float from_bf16(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#endif
