// Eight-float vectors and the arithmetic the CPU kernels (cpu_matmul.cc, cpu_attention.cc, cpu_gdn.cc, cpu_conv.cc)
// share.

#pragma once

#if defined(__FMA__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

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

#ifdef __AVX512F__
// Sixteen floats, where the CPU has AVX-512 (the gated delta rule's state rows): lane for lane the arithmetic of v8.
typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline v16 multiply_add(v16 acc, v16 x, v16 w) { return (v16)_mm512_fmadd_ps((__m512)x, (__m512)w, (__m512)acc); }
#endif

// The lanes added in order.
inline float lane_sum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

inline v8 splat(float x) { return v8{} + x; }

// Attention's keys and values are float32 or float16 (IEEE half, stored as uint16_t); each is widened to float32
// as it is loaded, exactly, so a float16 cache computes what a float32 cache holding the same values would.
inline v8 load8(const float* p) { return *(const v8*)p; }
inline float load1(const float* p) { return *p; }

inline float half_to_float(uint16_t h) {  // as cpu_matmul.cc's round_to_f16 converts the other way
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  _Float16 f;
  std::memcpy(&f, &h, sizeof f);
  return float(f);
#endif
}

inline float load1(const uint16_t* p) { return half_to_float(*p); }

inline v8 load8(const uint16_t* p) {
#ifdef __F16C__
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = half_to_float(p[i]);
  return out;
#endif
}

// sum a[d] b[d] over [0, D): eight lanes of FMAs, added lane by lane, then the tail in order.
template <typename KV>
inline float dot(const float* a, const KV* b, int64_t D) {
  const int64_t D8 = D & ~int64_t(7);
  v8 acc{};
  for (int64_t d = 0; d < D8; d += 8) acc = multiply_add(acc, *(const v8*)(a + d), load8(b + d));
  float s = lane_sum(acc);
  for (int64_t d = D8; d < D; ++d) s += a[d] * load1(b + d);
  return s;
}

// exp(x) for eight lanes: Cephes' expf (x = n ln 2 + r, a degree-7 polynomial in r, scaled by 2^n), within 2 ulp
// of expf; 0 below -87.33 (where expf turns subnormal) and for -inf; exp(0) is exactly 1. The same arithmetic on
// every lane and in every call, so a result does not depend on where it is computed (attention's weights, silu).
inline v8 exp8(v8 x) {
  const v8 log2e = splat(1.44269504088896341f), c1 = splat(0.693359375f), c2 = splat(-2.12194440e-4f);
  x = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
  v8 fx = x * log2e + splat(0.5f);
#ifdef __AVX2__
  fx = (v8)_mm256_floor_ps((__m256)fx);
#else
  for (int i = 0; i < 8; ++i) fx[i] = std::floor(fx[i]);
#endif
  v8 r = x - fx * c1;
  r = r - fx * c2;
  v8 y = splat(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = y * r + splat(c);
  y = y * (r * r) + r + splat(1.f);
  v8 scaled;
#ifdef __AVX2__
  const __m256i n = _mm256_cvttps_epi32((__m256)fx);
  scaled = y * (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
#else
  for (int i = 0; i < 8; ++i) scaled[i] = std::ldexp(y[i], int(fx[i]));
#endif
  return x < splat(-87.3365447504019f) ? splat(0.f) : scaled;
}

// silu(x) = x / (1 + exp(-x)) for eight lanes (exp8: for x below -88.4 the denominator is exp(88.4), so the
// result stays finite and tends to -0 as expf's would).
inline v8 silu8(v8 x) { return x / (splat(1.f) + exp8(-x)); }

}  // namespace gdnspec
