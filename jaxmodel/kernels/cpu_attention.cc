// Causal attention over the paged KV cache on CPU for steps of any length, an XLA FFI custom call:
//   gdnspec_paged_attention  out[B, T, H, D] from q[B, T, H, D], k/v pages [N, S, Hkv, D], page_table[B, P] and
//                            qpos[B, T] (a token's position, -1 for padding: its output is 0).
//
// One task per (row b, KV head h) walks the row's own pages up to its last live position, so a row costs its own
// context whatever the width of the page table, and a padding row costs nothing. Each key is loaded once for the
// T x G queries of the task (G = H / Hkv query heads share a KV head) and dotted with those that may see it.
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

struct Shape {
  int64_t B, T, H, D, N, S, Hkv, P;
};

// The T x G queries of row b that read KV head h.
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
  thread_local std::vector<float> scores, acc;  // [M, n_keys], [M, D]
  if (scores.size() < size_t(M * n_keys)) scores.resize(M * n_keys);
  if (acc.size() < size_t(M * D)) acc.resize(M * D);
  std::fill(acc.begin(), acc.begin() + M * D, 0.f);

  for (int64_t j = 0; j < n_keys; ++j) {
    const float* key = key_row(k_pages, j);
    for (int64_t i = 0; i < M; ++i)
      if (j <= position(i)) scores[i * n_keys + j] = dot(query(i), key, D) * scale;
  }
  thread_local std::vector<float> totals;  // [M]
  if (totals.size() < size_t(M)) totals.resize(M);
  for (int64_t i = 0; i < M; ++i) {
    const int64_t seen = position(i) + 1;  // 0 for padding
    float* row = scores.data() + i * n_keys;
    float top = -INFINITY;
    for (int64_t j = 0; j < seen; ++j) top = std::max(top, row[j]);
    float total = 0.f;
    for (int64_t j = 0; j < seen; ++j) total += (row[j] = std::exp(row[j] - top));
    totals[i] = total;
  }
  for (int64_t j = 0; j < n_keys; ++j) {
    const float* value = key_row(v_pages, j);
    for (int64_t i = 0; i < M; ++i)
      if (j <= position(i)) add_scaled(acc.data() + i * D, scores[i * n_keys + j], value, D);
  }
  for (int64_t i = 0; i < M; ++i) {
    float* o = output(i);
    const float total = totals[i];
    for (int64_t d = 0; d < D; ++d) o[d] = total > 0.f ? acc[i * D + d] / total : 0.f;
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
