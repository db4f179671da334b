// Causal attention over the paged KV cache on CPU for steps of any length, an XLA FFI custom call:
//   gdnspec_paged_attention  out[B, T, H, D] from q[B, T, H, D], k/v pages [N, S, Hkv, D], page_table[B, P] and
//                            qpos[B, T] (a token's position, -1 for padding: its output is 0).
//
// One task per (row b, KV head h) walks the row's own pages up to its last live position, so a row costs its own
// context whatever the width of the page table, and a padding row costs nothing. The T x G queries of the task
// (G = H / Hkv query heads share a KV head) each walk the keys they may see, eight at a time, which stay in cache
// from one query to the next.
//
// Every query is computed alone, in one fixed order: its score with key j is D products in eight strided lanes
// (one per vector lane), added lane by lane, then the tail; the softmax takes the scores' maximum, then
// exp(score - max) summed over j in order; the output adds p_j * v_j over j in order and divides by the sum. Nothing
// depends on T or on the other queries, so a token's attention is the same bits in a decoding step and in a verify
// step (XLA's dot picks its summation order by the number of query rows; README, "A token's logits do not depend on
// its step's length").
//
// Reference: `paged_attention_reference` in paged_attention.py; tests: tests/test_cpu_attention.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_pool.h"
#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using gdnspec::lane_sum;
using gdnspec::multiply_add;
using gdnspec::splat;
using gdnspec::v8;

constexpr int64_t kMinParallelWork = 1 << 15;  // multiply-adds below which one thread does it all

inline float dot(const float* a, const float* b, int64_t D) {
  const int64_t D8 = D & ~int64_t(7);
  v8 acc{};
  for (int64_t d = 0; d < D8; d += 8) acc = multiply_add(acc, *(const v8*)(a + d), *(const v8*)(b + d));
  float s = lane_sum(acc);
  for (int64_t d = D8; d < D; ++d) s += a[d] * b[d];
  return s;
}

// acc[0, D) += p * v[0, D)
inline void add_scaled(float* acc, float p, const float* v, int64_t D) {
  const int64_t D8 = D & ~int64_t(7);
  const v8 pv = splat(p);
  for (int64_t d = 0; d < D8; d += 8) *(v8*)(acc + d) = multiply_add(*(v8*)(acc + d), pv, *(const v8*)(v + d));
  for (int64_t d = D8; d < D; ++d) acc[d] = std::fma(p, v[d], acc[d]);
}

// The scores of eight keys with one query, each exactly as `dot` computes it, then scaled: eight independent chains
// of FMAs (one key at a time waited on each FMA's latency), and the eight lane sums at once, lane by lane in the same
// order, after a transpose (one key's took seven dependent scalar additions).
inline void dot8(const float* a, const float* const* keys, int64_t D, float scale, float* out) {
  const int64_t D8 = D & ~int64_t(7);
  v8 acc[8] = {};
  for (int64_t d = 0; d < D8; d += 8) {
    const v8 x = *(const v8*)(a + d);
    for (int k = 0; k < 8; ++k) acc[k] = multiply_add(acc[k], x, *(const v8*)(keys[k] + d));
  }
  float sums[8];
#ifdef __AVX__
  __m256 r[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) r[k] = (__m256)acc[k];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  v8 total = splat(0.f);  // lane k: 0 + lane 0 of acc[k] + lane 1 + ... + lane 7, as lane_sum adds them
  for (int m = 0; m < 4; ++m) total = total + (v8)_mm256_permute2f128_ps(u[m], u[m + 4], 0x20);
  for (int m = 0; m < 4; ++m) total = total + (v8)_mm256_permute2f128_ps(u[m], u[m + 4], 0x31);
  for (int k = 0; k < 8; ++k) sums[k] = total[k];
#else
  for (int k = 0; k < 8; ++k) sums[k] = lane_sum(acc[k]);
#endif
  for (int k = 0; k < 8; ++k) {
    float s = sums[k];
    for (int64_t d = D8; d < D; ++d) s += a[d] * keys[k][d];
    out[k] = s * scale;
  }
}

// acc[0, 8U) = sum over j < n, in order, of p[j] * values[j][d0, d0 + 8U): add_scaled's arithmetic with the sums in
// registers (through memory each FMA waited on the store before it).
template <int U>
void weighted_sum(const float* p, const float* const* values, int64_t n, int64_t d0, float* out) {
  v8 acc[U] = {};
  for (int64_t j = 0; j < n; ++j) {
    const v8 pv = splat(p[j]);
    for (int u = 0; u < U; ++u) acc[u] = multiply_add(acc[u], pv, *(const v8*)(values[j] + d0 + 8 * u));
  }
  for (int u = 0; u < U; ++u) *(v8*)(out + 8 * u) = acc[u];
}

struct Shape {
  int64_t B, T, H, D, N, S, Hkv, P;
};

// The T x G queries of row b that read KV head h, one after another: scores over the keys it may see, the softmax,
// the weighted values (each query's sums over keys in key order, so the loop order changes no result).
void attend_row_head(const Shape& s, int64_t b, int64_t h, const float* q, const float* k_pages,
                     const float* v_pages, const int32_t* table, const int32_t* qpos, float* out) {
  const int64_t G = s.H / s.Hkv, M = s.T * G, D = s.D;
  const float scale = 1.f / std::sqrt(float(D));
  auto query = [&](int64_t i) { return q + ((b * s.T + i / G) * s.H + h * G + i % G) * D; };
  auto output = [&](int64_t i) { return out + ((b * s.T + i / G) * s.H + h * G + i % G) * D; };
  auto position = [&](int64_t i) { return qpos[b * s.T + i / G]; };
  auto key_row = [&](const float* pages, int64_t j) {
    return pages + ((int64_t(table[b * s.P + j / s.S]) * s.S + j % s.S) * s.Hkv + h) * D;
  };

  int64_t n_keys = 0;
  for (int64_t t = 0; t < s.T; ++t) n_keys = std::max<int64_t>(n_keys, qpos[b * s.T + t] + 1);
  thread_local std::vector<float> scores, acc;        // [n_keys], [D]
  thread_local std::vector<const float*> keys, values;  // [n_keys]: where key j's and value j's rows lie
  if (scores.size() < size_t(n_keys)) scores.resize(n_keys);
  if (acc.size() < size_t(D)) acc.resize(D);
  if (keys.size() < size_t(n_keys)) keys.resize(n_keys), values.resize(n_keys);
  for (int64_t j = 0; j < n_keys; ++j) keys[j] = key_row(k_pages, j), values[j] = key_row(v_pages, j);

  for (int64_t i = 0; i < M; ++i) {
    const int64_t seen = std::max<int64_t>(position(i) + 1, 0);  // 0 for padding
    const float* qi = query(i);
    float* row = scores.data();
    int64_t j = 0;
    for (; j + 8 <= seen; j += 8) dot8(qi, keys.data() + j, D, scale, row + j);
    for (; j < seen; ++j) row[j] = dot(qi, keys[j], D) * scale;
    float top = -INFINITY;
    for (j = 0; j < seen; ++j) top = std::max(top, row[j]);
    float total = 0.f;
    for (j = 0; j < seen; ++j) total += (row[j] = std::exp(row[j] - top));
    int64_t d = 0;
    if (D % 8 == 0) {
      for (; d + 64 <= D; d += 64) weighted_sum<8>(row, values.data(), seen, d, acc.data() + d);
      for (; d + 32 <= D; d += 32) weighted_sum<4>(row, values.data(), seen, d, acc.data() + d);
      for (; d < D; d += 8) weighted_sum<1>(row, values.data(), seen, d, acc.data() + d);
    } else {
      std::fill(acc.begin(), acc.begin() + D, 0.f);
      for (j = 0; j < seen; ++j) add_scaled(acc.data(), row[j], values[j], D);
    }
    float* o = output(i);
    for (d = 0; d < D; ++d) o[d] = total > 0.f ? acc[d] / total : 0.f;
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                          ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> qpos,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qs = q.dimensions(), ks = k_pages.dimensions(), ts = page_table.dimensions(), ps = qpos.dimensions();
  const auto vs = v_pages.dimensions();
  if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4 || !std::equal(ks.begin(), ks.end(), vs.begin()) ||
      ts.size() != 2 || ps.size() != 2)
    return ffi::Error::InvalidArgument(
        "paged_attention: q [B, T, H, D], k_pages and v_pages [N, S, Hkv, D], page_table [B, P], qpos [B, T]");
  const Shape s{qs[0], qs[1], qs[2], qs[3], ks[0], ks[1], ks[2], ts[1]};
  if (ks[3] != s.D || s.Hkv == 0 || s.H % s.Hkv != 0 || ts[0] != s.B || ps[0] != s.B || ps[1] != s.T)
    return ffi::Error::InvalidArgument(
        "paged_attention: shapes disagree (H a multiple of Hkv, the same D, B and T throughout)");
  const int32_t* table = page_table.typed_data();
  const int32_t* positions = qpos.typed_data();
  int64_t work = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    int64_t n_keys = 0;
    for (int64_t t = 0; t < s.T; ++t) n_keys = std::max<int64_t>(n_keys, positions[b * s.T + t] + 1);
    if (n_keys > s.P * s.S) return ffi::Error::InvalidArgument("paged_attention: a position is past the page table");
    for (int64_t p = 0; p < (n_keys + s.S - 1) / s.S; ++p)
      if (table[b * s.P + p] < 0 || table[b * s.P + p] >= s.N)
        return ffi::Error::InvalidArgument("paged_attention: a live page-table entry is outside the pool");
    work += n_keys * s.T * s.H * s.D * 2;
  }
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  float* op = out->typed_data();
  gdnspec::over_chunks(pool, s.B * s.Hkv, work >= kMinParallelWork, [&](int64_t c) {
    attend_row_head(s, c / s.Hkv, c % s.Hkv, qp, kp, vp, table, positions, op);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
