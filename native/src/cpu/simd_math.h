/*
 * simd_math.h — vector exp and silu over the primitives of simd_avx2.h / simd_avx512.h
 * (whichever the including file chose), shared by the exact and the fast tables.
 */
#ifndef COLIBRI_CPU_SIMD_MATH_H
#define COLIBRI_CPU_SIMD_MATH_H

#ifndef AI
#define AI static inline __attribute__((always_inline))
#endif

/* exp(x), Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-5 polynomial; inputs are
 * clamped to [-87.3, 88.7] (below: ~1e-38, which underflows to 0 in softmax sums). */
AI vf vexp(vf x) {
    x = vmin(x, vset1(88.7f));
    x = vmax(x, vset1(-87.3f));
    vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), x);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vmul(p, vpow2i(n));
}

AI vf vsilu(vf g) { return vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))); }

#endif
