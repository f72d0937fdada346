/* What the exact attention's files share (attn16.c and its loops, one file per instruction set:
 * attn16_avx2.h, attn16_avx512.h, attn16_keytiles.h, attn16_words.h): the threads' threshold, the
 * query rows' rounding and the softmax's exponential.
 *
 * A query row (one token, one head: D grid integers in float64) is rounded to a block float before
 * its scores: q = q' 2^s with s = max(0, e - QB), where 2^(e-1) <= max |q| < 2^e, and q' =
 * rint(q 2^-s), so |q'| <= 2^QB. QB = 16 - ceil(log2 D) (10 for D = 64) keeps a score's integer sum
 * below 2^31 whatever the order: |q'| |k| D <= 2^QB (2^15 - 1) D < 2^31 with k the cache's int16
 * (|k| <= 32767). So sum q'_d k_d is exact in int32 (pairs of int16 products summed by one
 * instruction), and q' k 2^(s + shift_k) is the same double as the float64 product sums of the
 * rounded q: the C loops here, the float64 loops of attn16.c and torch's float64 matmul give the same
 * bits. The rounding is a function of the row alone (the same at any width, batch or cache size);
 * what it costs in quality is measured as a weight format's is (10 bits kept the mean KL to fp32
 * within noise on real text). `kernels.attn16.round_q` is its torch twin. */
#ifndef SELFSPEC_ATTN16_H
#define SELFSPEC_ATTN16_H
#include "common.h"

#define D_MAX 256
#define QCHUNK 4
/* multiply-adds below which a step runs on one thread. Inside a forward the team is awake (its
 * threads spin between the matmuls), so a step's region costs far less than a sleeping team's: a
 * one-token round of one row over a short context stays on one thread, four rows of it share out
 * (attn16_set_par_min moves it) */
static int64_t par_min = 131072;
#define PAR_MIN par_min

static inline int q_bits(int64_t D) {
    int b = 0;
    while (((int64_t)1 << b) < D) b++;
    return 16 - b;
}

/* q [D] float64 grid integers -> qi [D] = rint(q 2^-s); returns s */
static inline int q_round(const double *q, int64_t D, int qb, int16_t *qi) {
    double top = 0.0;
    #pragma omp simd reduction(max:top)  /* a maximum: the same in any order */
    for (int64_t d = 0; d < D; d++) top = fabs(q[d]) > top ? fabs(q[d]) : top;
    int e = 0;
    frexp(top, &e);
    int s = e - qb > 0 ? e - qb : 0;
    double f = pow2(-s);
    for (int64_t d = 0; d < D; d++) qi[d] = (int16_t)nearbyint(q[d] * f);
    return s;
}

/* P = rint(e^x) for x <= 20 ln 2, 0 where x < -1 (e^-1 < 0.5; also -inf, a masked key), as
 * `attn16.exp_round`: k = rint(x / ln 2), r = (x - k ln2_hi) - k ln2_lo, e^r = 1 + r (1 + r q(r))
 * by Horner's rule (Taylor, degree 7, |r| <= 0.35: truncation 5e-9) with q's five steps in float32
 * and the last two in float64 (q's float32 rounding then moves e^r by r^2 2^-24 at most), times 2^k
 * (exact, built from its bits), then rint: within 0.5 + 2^-26 e^x of e^x, at about half the
 * vector operations of a float64 polynomial of degree 13 (a long context's softmax is many
 * exponentials). Branch-free, so that the loops over keys vectorize. */
#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10
#define INV_LN2 1.44269504088896338700e+00
#define F2 ((float)(1.0 / 2))
#define F3 ((float)(1.0 / 6))
#define F4 ((float)(1.0 / 24))
#define F5 ((float)(1.0 / 120))
#define F6 ((float)(1.0 / 720))
#define F7 ((float)(1.0 / 5040))
static inline double exp_round1(double x) {
    double xc = x >= -1.0 ? x : -1.0;
    double k = nearbyint(xc * INV_LN2);
    double r = (xc - k * LN2_HI) - k * LN2_LO;
    float rf = (float)r, q = F7;
    q = q * rf + F6; q = q * rf + F5; q = q * rf + F4; q = q * rf + F3; q = q * rf + F2;
    double p = (double)q * r + 1.0;
    p = p * r + 1.0;
    /* 2^k from its bits; k (an integer, |k| < 2^51) read off the low bits of k + 1.5 * 2^52, not
     * converted: AVX2 has no vector double -> int64 conversion, and this loop must vectorize */
    double kk = k + 6755399441055744.0, two_k;
    int64_t ki;
    memcpy(&ki, &kk, 8);
    ki = (ki - 0x4338000000000000LL + 1023) << 52;
    memcpy(&two_k, &ki, 8);
    double e = nearbyint(p * two_k);
    return x >= -1.0 ? e : 0.0;
}

/* The one-byte cache (kb == 1): K as int8 mantissas with an integer scale per token and key head
 * (int32: k = m c), V as int8 mantissas with a shift (v = m 2^shift). The loops widen them to int16
 * in registers as they load them; `widen8` makes a widened copy where no loop reads them. */

/* n rows of int8 src [n, D] -> int16 dst [n, D] */
static inline void widen8(const int8_t *src, int64_t n, int64_t D, int16_t *dst) {
    for (int64_t i = 0; i < n * D; i++) dst[i] = src[i];
}
#endif
