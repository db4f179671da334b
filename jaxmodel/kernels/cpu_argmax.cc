// gdnspec_argmax_rows  token[...] = the index of the largest value of each row of x[..., V] float32 (any leading
// dimensions), as jnp.argmax picks it: the first of equal maxima, and the first NaN where a row has one.
//
// XLA's CPU backend computes an argmax as a reduction over (value, index) pairs, one element at a time: 20 us for
// a row of 4096 logits, about as long as the output head's product that made them (docs/performance.md, "What an
// iteration costs"). Here eight lanes each keep their first maximum, which a strict comparison does, and the lanes are
// then merged by value and, among equal values, by the smaller index; NaN is looked for only in a row that has one.
// Reference: jnp.argmax; tests: tests/test_cpu_argmax.py.

#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

int32_t first_nan(const float* x, int64_t V) {
  for (int64_t v = 0; v < V; ++v)
    if (std::isnan(x[v])) return int32_t(v);
  return -1;
}

int32_t argmax_row(const float* x, int64_t V) {
  int64_t v = 0;
  float best = x[0];
  int64_t best_index = 0;
  bool any_nan = false;
#ifdef __AVX2__
  if (V >= 8) {
    __m256 lane_best = _mm256_loadu_ps(x);
    __m256i lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i index = lane_index;
    __m256 unordered = _mm256_cmp_ps(lane_best, lane_best, _CMP_UNORD_Q);
    const __m256i eight = _mm256_set1_epi32(8);
    for (v = 8; v + 8 <= V; v += 8) {
      const __m256 value = _mm256_loadu_ps(x + v);
      index = _mm256_add_epi32(index, eight);
      const __m256 greater = _mm256_cmp_ps(value, lane_best, _CMP_GT_OQ);
      lane_best = _mm256_blendv_ps(lane_best, value, greater);
      lane_index = _mm256_blendv_epi8(lane_index, index, _mm256_castps_si256(greater));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    }
    any_nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, lane_best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), lane_index);
    best = values[0];
    best_index = indices[0];
    for (int lane = 1; lane < 8; ++lane)
      if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
        best = values[lane];
        best_index = indices[lane];
      }
  }
#endif
  for (; v < V; ++v) {
    any_nan |= std::isnan(x[v]);
    if (x[v] > best) {
      best = x[v];
      best_index = v;
    }
  }
  if (any_nan) return first_nan(x, V);
  return int32_t(best_index);
}

ffi::Error ArgmaxRows(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> token) {
  const auto xd = x.dimensions();
  if (xd.size() < 1 || xd.back() < 1) return ffi::Error::InvalidArgument("argmax_rows: x must be [..., V], V >= 1");
  if (xd.back() > INT32_MAX) return ffi::Error::InvalidArgument("argmax_rows: V must fit int32");
  const int64_t V = xd.back(), M = int64_t(x.element_count()) / V;
  if (int64_t(token->element_count()) != M) return ffi::Error::InvalidArgument("argmax_rows: token must be [...]");
  const float* xp = x.typed_data();
  int32_t* out = token->typed_data();
  for (int64_t m = 0; m < M; ++m) out[m] = argmax_row(xp + m * V, V);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_argmax_rows, ArgmaxRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
