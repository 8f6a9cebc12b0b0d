/* One pass of a lean Adam/AdamW master with 8-bit state, on a CPU (fxamp/training/native.py builds and loads it).

   Per block of 256 elements: read the gradient (float32, or the bfloat16 one where it is, widened and multiplied
   by 1/scale here: the float32 multiply the engine's unscale does, so no float32 copy of it is written), decode
   both moments (table value times the block's absmax, as quant.dequantize),
   step Adam or AdamW as torch's fused CPU kernel does (float32 arithmetic, bias corrections given), re-code both
   moments with the new blocks' absmax (the code of quant.quantize: round(top + 1/2 + k log2(|x| / absmax)),
   clamped; log2 by a series here, so a value within ~1e-6 of a code boundary may take the other code), and write
   the bfloat16 weight: stochastically rounded, or rounded to nearest even with the rest kept in a bfloat16
   compensation term (Kahan). The rounding's 16 bits of noise for element i are a hash of (key, base + i)
   (murmur3's finalizer, twice): a pure function of the tensor's step key and the element's place, so a
   slice, a thread or a resumed run draws the same bits, and no random stream is read in order.

   Built with -ffp-contract=off and without -ffast-math: every operation is one IEEE float32 operation, so the
   bits do not depend on the vector width the compiler picks, nor on the CPU (-fno-trapping-math only lets the
   compiler turn the clamps into selects: no value changes). */

#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define BLOCK 256
/* blocks a thread takes at least (64K elements: below that a parallel region costs about what they take) */
#define MIN_BLOCKS_PER_THREAD 256

/* Adam's moments and the new value of element i from its weight w (decayed) and gradient g (with L2 decay) */
#define UPDATE(w_, g_) do { \
        const float wv = (w_), gv = (g_); \
        const float mi = bf16_state ? f32_of_bf16(m_bf16[j]) : m[i];  /* (8-bit state: decoded by decode_run) */ \
        const float vi = bf16_state ? f32_of_bf16(v_bf16[j]) : v[i]; \
        const float mn = mi + one_minus_beta1 * (gv - mi);   /* lerp(m, g, 1 - beta1), as torch's kernel */ \
        const float vn = vi * beta2 + one_minus_beta2 * gv * gv; \
        const float denom = sqrtf(vn) / bias_correction2_sqrt + eps; \
        m[i] = mn; v[i] = vn; w[i] = wv - step_size * mn / denom; \
    } while (0)

/* element j of the gradient, unscaled (x * 1.0f is x: with grad_mul 1 the float32 gradient is read as it is) */
#define GRAD(j_) ((grad_bf16 ? f32_of_bf16(((const uint16_t *)grad)[j_]) : ((const float *)grad)[j_]) * grad_mul)

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float f32_of_bf16(uint16_t h) { return f32_of_bits((uint32_t)h << 16); }

/* murmur3's 32-bit finalizer: every input bit moves every output bit */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x85EBCA6Bu; x ^= x >> 13; x *= 0xC2B2AE35u; x ^= x >> 16;
    return x;
}

/* float32 -> bfloat16, round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16) */
static inline uint16_t bf16_rne(float f) {
    uint32_t u = bits_of_f32(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* log2(x) for a normal x >= 2^-126 (callers raise smaller values to 2^-126: see the encode): the exponent
   counted from sqrt(1/2) (an integer subtraction folds the mantissa into [sqrt(1/2), sqrt(2))), plus
   2/ln2 * atanh of t = (f - 1) / (f + 1), |t| <= 0.1716, by its series to t^9 (the next term is under 2e-8) */
static inline float log2_pos(float x) {
    const uint32_t u = bits_of_f32(x);
    const int32_t e = (int32_t)(u - 0x3F3504F3u) >> 23;
    const float f = f32_of_bits(u - ((uint32_t)e << 23));
    const float t = (f - 1.0f) / (f + 1.0f);
    const float t2 = t * t;
    const float s = t * (2.0f + t2 * (0.666666667f + t2 * (0.4f + t2 * (0.285714286f + t2 * 0.222222222f))));
    return (float)e + s * 1.44269504f;
}

/* A 256-entry float32 table as four byte planes (plane p: byte p of every entry), for decode_run's lookup */
typedef struct { uint8_t plane[4][256]; } planes_t;

static void planes_of(const float *table, planes_t *out) {
    for (int c = 0; c < 256; c++) {
        const uint32_t u = bits_of_f32(table[c]);
        for (int p = 0; p < 4; p++) out->plane[p][c] = (uint8_t)(u >> (8 * p));
    }
}

/* out[i] = table[codes[i]] * scale for i < len (quant.dequantize: the same float32 multiply). The lookup reads
   the same entry on every path, so the bits do not depend on it. Gathers (or the scalar loads the compiler makes
   of them where it deems gathers slow, as on AMD's CPUs) took a quarter of the 8-bit step (0.6 of 2.4 ms per
   million elements, EPYC); with AVX-512 VBMI the table is looked up in registers, 64 codes at a time: each byte
   plane of the entries by two byte permutes (entries 0-127, 128-255) and a blend on the code's top bit, the
   planes then interleaved back into float32 (the codes permuted first so that the interleave, which works
   within 128-bit lanes, leaves the values in order). */
static inline __attribute__((always_inline)) void decode_run(const uint8_t *codes, const float *table,
                                                             const planes_t *planes, float scale, float *out,
                                                             int64_t len) {
    int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    /* position 16L + 4q + j of the permuted codes takes code 16q + 4L + j: after the two interleaves, lane L of
       the q-th result holds values 16q + 4L .. 16q + 4L + 3 */
    static const uint8_t order_bytes[64] = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
        52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
        44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i order = _mm512_loadu_si512(order_bytes);
    __m512i t[4][2][2];
    for (int p = 0; p < 4; p++)
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 2; k++) t[p][h][k] = _mm512_loadu_si512(planes->plane[p] + 128 * h + 64 * k);
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 64 <= len; i += 64) {
        const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
        const __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i b[4];
        for (int p = 0; p < 4; p++)
            b[p] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[p][0][0], idx, t[p][0][1]),
                                          _mm512_permutex2var_epi8(t[p][1][0], idx, t[p][1][1]));
        const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
        const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s));
        _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s));
        _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s));
        _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s));
    }
#else
    (void)planes;
#endif
    for (; i < len; i++) out[i] = table[codes[i]] * scale;
}

/* block b of the step, for 8-bit state (bf16_state 0: codes and absmax) or bfloat16 state (1: m_state and
   v_state hold bfloat16 values, no absmax); inlined into each exported function's loop with bf16_state a
   constant (in the OpenMP region's body, where a flag read at run time would keep the loops scalar) */
static inline __attribute__((always_inline)) void lean_block(
    const int bf16_state, const int grad_bf16, const int64_t b,
    int64_t n,
    uint16_t *low,            /* bfloat16 weights, in and out */
    uint16_t *term,           /* Kahan's bfloat16 term, in and out; NULL: stochastic rounding */
    const void *grad,         /* the gradient: float32, or bfloat16 (grad_bf16) */
    float grad_mul,           /* what the gradient is multiplied by: 1/scale, or 1 */
    void *m_state, float *m_absmax,
    void *v_state, float *v_absmax,
    uint64_t key, int64_t base,  /* stochastic rounding: the step's key, and the index of element 0 in its tensor */
    const float *table_signed, const float *table_unsigned,  /* quant.code_constants()' tables, by the code's byte */
    const planes_t *planes,   /* the two tables' byte planes (planes_of) */
    float beta2, float one_minus_beta1, float one_minus_beta2, float eps, float weight_decay, int decoupled,
    float decay, float step_size, float bias_correction2_sqrt,  /* coefficients computed in double by the caller,
                                                                   as torch's kernel computes them */
    float k_signed, float top_signed, float k_unsigned, float top_unsigned)
{
    int8_t *m_codes = (int8_t *)m_state;
    uint8_t *v_codes = (uint8_t *)v_state;
    uint16_t *m_bf16 = (uint16_t *)m_state, *v_bf16 = (uint16_t *)v_state;
    {
        float m[BLOCK], v[BLOCK], w[BLOCK];
        const int64_t start = b * BLOCK;
        const int64_t len = n - start < BLOCK ? n - start : BLOCK;
        if (!bf16_state) {  /* both moments decoded into m and v first, which the update reads and overwrites */
            decode_run((const uint8_t *)m_codes + start, table_signed, &planes[0], m_absmax[b], m, len);
            decode_run(v_codes + start, table_unsigned, &planes[1], v_absmax[b], v, len);
        }
        /* the update, one loop per weight-decay form (a branch inside would keep the loop from vectorizing) */
        if (weight_decay != 0.0f && decoupled) {
            for (int64_t i = 0; i < len; i++) {
                const int64_t j = start + i;
                float wi = f32_of_bf16(low[j]);
                if (term) wi = wi + f32_of_bf16(term[j]);
                UPDATE(wi * decay, GRAD(j));
            }
        } else if (weight_decay != 0.0f) {
            for (int64_t i = 0; i < len; i++) {
                const int64_t j = start + i;
                float wi = f32_of_bf16(low[j]);
                if (term) wi = wi + f32_of_bf16(term[j]);
                UPDATE(wi, GRAD(j) + wi * weight_decay);
            }
        } else {
            for (int64_t i = 0; i < len; i++) {
                const int64_t j = start + i;
                float wi = f32_of_bf16(low[j]);
                if (term) wi = wi + f32_of_bf16(term[j]);
                UPDATE(wi, GRAD(j));
            }
        }
        if (bf16_state) {  /* bfloat16 state: rounded to nearest even, as Tensor.to(torch.bfloat16) */
            for (int64_t i = 0; i < len; i++) {
                const int64_t j = start + i;
                m_bf16[j] = bf16_rne(m[i]);
                v_bf16[j] = bf16_rne(v[i]);
            }
        } else {
            /* the blocks' new absmax: the largest magnitude's bits (non-negative floats order as their bits; a NaN's
               bits are above infinity's, so a NaN wins, as in torch.amax) */
            uint32_t mbits = 0, vbits = 0;
            for (int64_t i = 0; i < len; i++) {
                uint32_t a = bits_of_f32(m[i]) & 0x7FFFFFFFu, c = bits_of_f32(v[i]) & 0x7FFFFFFFu;
                mbits = a > mbits ? a : mbits;
                vbits = c > vbits ? c : vbits;
            }
            const float mmax = f32_of_bits(mbits), vmax = f32_of_bits(vbits);
            m_absmax[b] = mmax;
            v_absmax[b] = vmax;
            /* an all-zero block: every element the lowest code (-inf, clamped), as quant.quantize codes it */
            const float mfloor = mmax > 1.17549435e-38f ? mmax : 1.17549435e-38f;
            const float vfloor = vmax > 1.17549435e-38f ? vmax : 1.17549435e-38f;
            const float bias_m = mmax > 0.0f ? top_signed + 0.5f - k_signed * log2_pos(mfloor) : -INFINITY;
            const float bias_v = vmax > 0.0f ? top_unsigned + 0.5f - k_unsigned * log2_pos(vfloor) : -INFINITY;
            for (int64_t i = 0; i < len; i++) {
                const int64_t j = start + i;
                float a = fabsf(m[i]);
                /* (a magnitude under 2^-126 counts as 2^-126: the same code as eager's unless the block's absmax is
                   under ~2^-100, a block of zeros in effect) */
                float q = bias_m + k_signed * log2_pos(a > 1.17549435e-38f ? a : 1.17549435e-38f);
                /* each clamp a statement of its own: the compiler makes each one max or min instruction (the
                   nested form took compares and blends); the same values, a NaN kept as in the nested form */
                q = q < 0.0f ? 0.0f : q;
                q = q > top_signed ? top_signed : q;
                int32_t c = (int32_t)q;
                m_codes[j] = (int8_t)(m[i] < 0.0f ? -c : c);
                float r = bias_v + k_unsigned * log2_pos(v[i] > 1.17549435e-38f ? v[i] : 1.17549435e-38f);
                r = r < 1.0f ? 1.0f : r;
                r = r > top_unsigned ? top_unsigned : r;
                v_codes[j] = (uint8_t)(int32_t)r;
            }
        }
        if (term) {
            for (int64_t i = 0; i < len; i++) {
                const int64_t j = start + i;
                uint16_t h = bf16_rne(w[i]);
                low[j] = h;
                term[j] = bf16_rne(w[i] - f32_of_bf16(h));
            }
        } else {
            const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
            const uint64_t first = (uint64_t)(base + start);
            if ((first >> 32) == ((first + (uint64_t)len - 1) >> 32)) {
                /* the block's places share their high 32 bits (all but one block in 2^24): the hash's input in
                   32-bit lanes (64-bit ones took twice the instructions), the same values */
                const uint32_t lo = (uint32_t)first, hi = k1 ^ (uint32_t)(first >> 32);
                for (int64_t i = 0; i < len; i++) {
                    const uint32_t noise = mix32(mix32((lo + (uint32_t)i) ^ k0) ^ hi) >> 16;
                    uint32_t u = bits_of_f32(w[i]);
                    uint16_t h = (uint16_t)((u + noise) >> 16);
                    low[start + i] = w[i] != w[i] ? (uint16_t)0x7FC0 : h;
                }
            } else {
                for (int64_t i = 0; i < len; i++) {
                    const int64_t j = start + i;
                    const uint64_t at = (uint64_t)(base + j);
                    const uint32_t noise = mix32(mix32((uint32_t)at ^ k0) ^ k1 ^ (uint32_t)(at >> 32)) >> 16;
                    uint32_t u = bits_of_f32(w[i]);
                    uint16_t h = (uint16_t)((u + noise) >> 16);
                    low[j] = w[i] != w[i] ? (uint16_t)0x7FC0 : h;
                }
            }
        }
    }
}

#define LEAN_ARGS int64_t n, uint16_t *low, uint16_t *term, const void *grad, float grad_mul, void *m_state, \
    float *m_absmax, void *v_state, float *v_absmax, uint64_t key, int64_t base, const float *table_signed, \
    const float *table_unsigned, float beta2, float one_minus_beta1, float one_minus_beta2, float eps, \
    float weight_decay, int decoupled, float decay, float step_size, float bias_correction2_sqrt, float k_signed, \
    float top_signed, float k_unsigned, float top_unsigned
#define LEAN_PASS n, low, term, grad, grad_mul, m_state, m_absmax, v_state, v_absmax, key, base, table_signed, \
    table_unsigned, planes, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decoupled, decay, step_size, \
    bias_correction2_sqrt, k_signed, top_signed, k_unsigned, top_unsigned

/* blocks are independent: split among the OpenMP threads torch itself uses (the same runtime, loaded by torch:
   its workers, already spinning after torch's last op, take the blocks at once); the bits do not depend on the
   split */
#ifdef _OPENMP
#define PARALLEL _Pragma("omp parallel for schedule(static) if ((n + BLOCK - 1) / BLOCK >= 2 * MIN_BLOCKS_PER_THREAD)")
#else
#define PARALLEL
#endif

/* every block of the tensor, the two flags literal constants in the OpenMP region's body (see lean_block) */
#define LEAN_LOOP(bf16_state_, grad_bf16_) do { \
        planes_t planes[2]; \
        if (!(bf16_state_)) { planes_of(table_signed, &planes[0]); planes_of(table_unsigned, &planes[1]); } \
        PARALLEL \
        for (int64_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++) lean_block(bf16_state_, grad_bf16_, b, LEAN_PASS); \
    } while (0)

/* grad_bf16: the gradient is bfloat16 */
void fxamp_lean_adam_int8(LEAN_ARGS, int grad_bf16) {
    if (grad_bf16) LEAN_LOOP(0, 1); else LEAN_LOOP(0, 0);
}

void fxamp_lean_adam_bf16(LEAN_ARGS, int grad_bf16) {
    if (grad_bf16) LEAN_LOOP(1, 1); else LEAN_LOOP(1, 0);
}

/* The stochastic rounding alone, for the eager lean step on a CPU (flat.py's round_stochastic_): float32 values in
   place to bfloat16 values (the low 16 bits dropped), with the noise above. Stretch s of x holds counts[s] elements
   of the master whose key is keys[s], the first its element firsts[s]; a NaN is written as 0x7FC00000. */
void fxamp_round_stochastic(int64_t nseg, float *x, const int64_t *counts, const uint64_t *keys,
                            const int64_t *firsts) {
    int64_t start = 0;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t n = counts[s], base = firsts[s];
        const uint32_t k0 = (uint32_t)keys[s], k1 = (uint32_t)(keys[s] >> 32);
        uint32_t *u = (uint32_t *)(x + start);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= 2 * BLOCK * MIN_BLOCKS_PER_THREAD)
#endif
        for (int64_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++) {
            const int64_t first = b * BLOCK, end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
            const uint64_t at0 = (uint64_t)(base + first);
            if ((at0 >> 32) == ((at0 + (uint64_t)(end - first) - 1) >> 32)) {
                /* the block's places share their high 32 bits: the hash in 32-bit lanes, as in lean_block */
                const uint32_t lo = (uint32_t)at0, hi = k1 ^ (uint32_t)(at0 >> 32);
                for (int64_t i = first; i < end; i++) {
                    const uint32_t noise = mix32(mix32((lo + (uint32_t)(i - first)) ^ k0) ^ hi) >> 16;
                    const uint32_t v = u[i];
                    u[i] = (v & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (v + noise) & 0xFFFF0000u;
                }
            } else {
                for (int64_t i = first; i < end; i++) {
                    const uint64_t at = (uint64_t)(base + i);
                    const uint32_t noise = mix32(mix32((uint32_t)at ^ k0) ^ k1 ^ (uint32_t)(at >> 32)) >> 16;
                    const uint32_t v = u[i];
                    u[i] = (v & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (v + noise) & 0xFFFF0000u;
                }
            }
        }
        start += n;
    }
}

/* The 8-bit state codes of quant.py for a run's masters (flat.py's decode and encode on a CPU), bitwise
   quant.dequantize and quant.quantize: the same float32 operations on the same values (the code's multiply-add
   one fused rounding, as torch.add(bias, q, alpha=k) on a CPU), the one transcendental, log2, left to torch
   between the two encoding passes (torch's log2 is not correctly rounded: only its own gives its bits). Master s
   has counts[s] elements at offsets[s] of the float32 buffers, its codes and block scales at codes[s] and
   absmax[s] (its own tensors: no copy in or out); its blocks' log2 at block_offsets[s] of the log2 buffer. */

#define TINY 1.17549435e-38f  /* torch.finfo(float32).tiny: an absmax is raised to it before its log2 */
#define SMALLEST 1.40129846e-45f  /* 2^-149: a magnitude is raised to it before its log2 */

/* float32 values of the codes: table[code byte] * the block's absmax (quant.dequantize) */
void fxamp_decode(int64_t k, const int64_t *counts, const int64_t *offsets, const uintptr_t *codes,
                  const uintptr_t *absmax, const float *table, float *out) {
    for (int64_t s = 0; s < k; s++) {
        const int64_t n = counts[s];
        const uint8_t *c = (const uint8_t *)codes[s];
        const float *a = (const float *)absmax[s];
        float *o = out + offsets[s];
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= 2 * BLOCK * MIN_BLOCKS_PER_THREAD)
#endif
        for (int64_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++) {
            const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
            const float scale = a[b];
            for (int64_t j = b * BLOCK; j < end; j++) o[j] = table[c[j]] * scale;
        }
    }
}

/* the first encoding pass, in place: each block's absmax (its largest magnitude; an unsigned state's largest value,
   as torch.amax: a NaN wins) written to absmax[s], then what torch's log2 takes: the magnitudes raised to 2^-149
   (over x's values: the decoded moment is not read again) and the absmax raised to the smallest normal (into blocks
   at block_offsets[s]); a signed state's signs (-1, 0, 1; 0 for a NaN, as torch.sign) into its codes meanwhile */
void fxamp_encode_magnitudes(int64_t k, const int64_t *counts, const int64_t *offsets, const int64_t *block_offsets,
                             float *x, const uintptr_t *absmax, const uintptr_t *codes, int is_signed, float *blocks) {
    for (int64_t s = 0; s < k; s++) {
        const int64_t n = counts[s];
        float *xs = x + offsets[s], *bs = blocks + block_offsets[s], *a = (float *)absmax[s];
        int8_t *signs = (int8_t *)codes[s];
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= 2 * BLOCK * MIN_BLOCKS_PER_THREAD)
#endif
        for (int64_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++) {
            const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
            float top = -INFINITY;
            int nan = 0;
            for (int64_t j = b * BLOCK; j < end; j++) {
                const float v = xs[j];
                const float q = is_signed ? fabsf(v) : v;
                if (is_signed) signs[j] = (int8_t)(v > 0.0f ? 1 : (v < 0.0f ? -1 : 0));
                nan |= q != q;
                top = q > top ? q : top;
                xs[j] = q < SMALLEST ? SMALLEST : q;  /* (a NaN stays NaN, as clamp_min) */
            }
            top = nan ? NAN : top;
            a[b] = top;
            bs[b] = top < TINY ? TINY : top;
        }
    }
}

/* the second pass, from torch's log2 of the first's x and blocks: code = round(top + 1/2 + k (log2 |x| - log2
   absmax)) clamped, as quant._code_ computes it: bias = log2(absmax) * -k + (top + 1/2) (-inf for an all-zero
   block), then one fused multiply-add; a signed code times the sign the first pass kept (0 for a zero), truncated
   to an integer */
void fxamp_encode_codes(int64_t k, const int64_t *counts, const int64_t *offsets, const int64_t *block_offsets,
                        const float *x, const float *blocks, const uintptr_t *absmax, const uintptr_t *codes,
                        int is_signed, float kk, float top) {
    const float neg_k = -kk, half = top + 0.5f, low = is_signed ? 0.0f : 1.0f;
    for (int64_t s = 0; s < k; s++) {
        const int64_t n = counts[s];
        const float *ls = x + offsets[s], *bs = blocks + block_offsets[s], *a = (const float *)absmax[s];
        int8_t *signed_codes = (int8_t *)codes[s];
        uint8_t *unsigned_codes = (uint8_t *)codes[s];
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= 2 * BLOCK * MIN_BLOCKS_PER_THREAD)
#endif
        for (int64_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++) {
            const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
            const float bias = a[b] == 0.0f ? -INFINITY : bs[b] * neg_k + half;
            for (int64_t j = b * BLOCK; j < end; j++) {
                float q = fmaf(ls[j], kk, bias);
                q = q < low ? low : (q > top ? top : q);
                if (is_signed) signed_codes[j] = (int8_t)(int32_t)(q * (float)signed_codes[j]);
                else unsigned_codes[j] = (uint8_t)(int32_t)q;
            }
        }
    }
}

/* Whether k tensors of float32 (bits 32), or bfloat16 or float16 (bits 16), hold only finite values: the largest
   magnitude's bits (sign masked off) below those of an infinity ("inf": the smallest non-finite magnitude; a NaN's
   are above it): the overflow check of a step's large gradients (executors.FoundInf.check_), one call over every
   tensor, reading only (a max reduction, which the compiler vectorizes) */
int fxamp_all_finite(int64_t k, const int64_t *counts, const uintptr_t *data, int bits, uint32_t inf) {
    for (int64_t s = 0; s < k; s++) {
        const int64_t n = counts[s];
        if (bits == 32) {
            const uint32_t *u = (const uint32_t *)data[s];
            uint32_t top = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(max:top) if (n >= 2 * BLOCK * MIN_BLOCKS_PER_THREAD)
#endif
            for (int64_t i = 0; i < n; i++) {
                const uint32_t v = u[i] & 0x7FFFFFFFu;
                top = v > top ? v : top;
            }
            if (top >= inf) return 0;
        } else {
            const uint16_t *u = (const uint16_t *)data[s];
            uint16_t top = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(max:top) if (n >= 2 * BLOCK * MIN_BLOCKS_PER_THREAD)
#endif
            for (int64_t i = 0; i < n; i++) {
                const uint16_t v = u[i] & 0x7FFFu;
                top = v > top ? v : top;
            }
            if (top >= inf) return 0;
        }
    }
    return 1;
}
