// Eight-float vectors and the arithmetic the CPU kernels (cpu_matmul.cc, cpu_attention.cc, cpu_gdn.cc) share.

#pragma once

#if defined(__FMA__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gdnspec {

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // unaligned loads of 8 floats

// acc + x * w, fused where the CPU has FMA. Spelled out (the library builds with -ffp-contract=off) so that the
// compiler cannot fuse in one instantiation of a loop and not in another: a result must sum alike wherever it is
// computed.
inline v8 multiply_add(v8 acc, v8 x, v8 w) {
#ifdef __FMA__
  return (v8)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

// The lanes added in order.
inline float lane_sum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

inline v8 splat(float x) { return v8{} + x; }

}  // namespace gdnspec
