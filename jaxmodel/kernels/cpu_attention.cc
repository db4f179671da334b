// Causal attention over the paged KV cache on CPU for steps of any length, an XLA FFI custom call:
//   gdnspec_paged_attention  out[B, T, H, D] from q[B, T, H, D], k/v pages [N, S, Hkv, D], page_table[B, P] and
//                            qpos[B, T] (a token's position, -1 for padding: its output is 0); float32 pages
//   gdnspec_paged_attention_f16  the same over float16 pages
//
// One task per (row b, KV head h) walks the row's own pages up to its last live position, so a row costs its own
// context whatever the width of the page table, and a padding row costs nothing. The T x G queries of the task
// (G = H / Hkv query heads share a KV head) walk the keys in groups of up to four, each key's and value's vectors
// loaded once for the group: a decoding step's G heads share them, and so do a verify step's or a prompt chunk's
// tokens (at a long context the keys come from L3 or memory, not from cache).
//
// Every query's result is computed in one fixed order, whatever its group: its score with key j is D products in
// eight strided lanes (one per vector lane), added lane by lane, then the tail; the softmax takes the scores'
// maximum, then exp(score - max) for eight keys at a time (`exp8`), summed in eight lanes over the keys in order and
// then lane by lane; the output adds p_j * v_j over j in order and divides by the sum. Nothing depends on T or on
// the other queries, so a token's attention is the same bits in a decoding step and in a verify step (XLA's dot
// picks its summation order by the number of query rows; docs/performance.md, "A token's logits do not depend on its
// step's length").
//
// Reference: `paged_attention_reference` in paged_attention.py; tests: tests/test_cpu_attention.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_pool.h"
#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using gdnspec::dot;
using gdnspec::exp8;
using gdnspec::lane_sum;
using gdnspec::load1;
using gdnspec::load8;
using gdnspec::multiply_add;
using gdnspec::splat;
using gdnspec::v8;

constexpr int64_t kMinParallelWork = 1 << 15;  // multiply-adds below which one thread does it all

// x in every lane. splat adds x to 0.f, an addition the compiler must keep (it turns -0 into +0), in the innermost
// loops here; a weight is never -0, and a scale is positive.
inline v8 broadcast(float x) { return v8{x, x, x, x, x, x, x, x}; }

// acc[0, D) += p * v[0, D)
template <typename KV>
inline void add_scaled(float* acc, float p, const KV* v, int64_t D) {
  const int64_t D8 = D & ~int64_t(7);
  const v8 pv = splat(p);
  for (int64_t d = 0; d < D8; d += 8) *(v8*)(acc + d) = multiply_add(*(v8*)(acc + d), pv, load8(v + d));
  for (int64_t d = D8; d < D; ++d) acc[d] = std::fma(p, load1(v + d), acc[d]);
}

// Lane k: lane_sum(acc[k]), for eight vectors at once, lane by lane in lane_sum's order, after a transpose (one
// vector's sum took seven dependent scalar additions).
inline v8 lane_sums8(const v8* acc) {
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
  return total;
#else
  v8 total;
  for (int k = 0; k < 8; ++k) total[k] = lane_sum(acc[k]);
  return total;
#endif
}

// Keys per call of scores_block for Q queries: 8 pairs of query and key for one query, 16 (two transposes whose
// additions interleave) for more.
template <int Q>
constexpr int kKeysPerBlock = Q == 1 ? 8 : 16 / Q;

// The scores of Q queries with kKeysPerBlock<Q> keys, written to rows[q][j + k], each exactly as `dot` computes it,
// then scaled: independent chains of FMAs, each key's vector loaded once for the Q queries.
template <int Q, typename KV>
inline void scores_block(const float* const* queries, const KV* const* keys, int64_t D, float scale,
                         float* const* rows, int64_t j) {
  constexpr int KB = kKeysPerBlock<Q>, NP = Q * KB;
  const int64_t D8 = D & ~int64_t(7);
  v8 acc[NP] = {};
  for (int64_t d = 0; d < D8; d += 8) {
    v8 x[Q];
    for (int q = 0; q < Q; ++q) x[q] = *(const v8*)(queries[q] + d);
    for (int k = 0; k < KB; ++k) {
      const v8 w = load8(keys[k] + d);
      for (int q = 0; q < Q; ++q) acc[q * KB + k] = multiply_add(acc[q * KB + k], x[q], w);
    }
  }
  v8 sums[NP / 8];
  for (int k = 0; k < NP; k += 8) sums[k / 8] = lane_sums8(acc + k);
  if (D8 == D) {  // pairs q * KB + k: whole vectors of one query's scores (KB 8), or halves (KB 4)
    for (int k = 0; k < NP / 8; ++k) sums[k] = sums[k] * broadcast(scale);
    for (int q = 0; q < Q; ++q) {
      if constexpr (KB == 8) {
        *(v8*)(rows[q] + j) = sums[q];
      } else {
        for (int k = 0; k < KB; ++k) rows[q][j + k] = sums[(q * KB + k) / 8][(q * KB + k) % 8];
      }
    }
    return;
  }
  for (int q = 0; q < Q; ++q)
    for (int k = 0; k < KB; ++k) {
      float s = sums[(q * KB + k) / 8][(q * KB + k) % 8];
      for (int64_t d = D8; d < D; ++d) s += queries[q][d] * load1(keys[k] + d);
      rows[q][j + k] = s * scale;
    }
}

// Scores of query `query` with keys [j0, j1), into row[j0, j1).
template <typename KV>
inline void scores_alone(const float* query, const KV* const* keys, int64_t D, float scale, float* row,
                         int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) scores_block<1>(&query, keys + j, D, scale, &row, j);
  for (; j < j1; ++j) row[j] = dot(query, keys[j], D) * scale;
}

// row[0, seen) <- exp(row[j] - max over the row), returning their sum: eight lanes summed across the keys in order,
// then the lanes in order (lane_sum). row has room for seen rounded up to 8; the rest is set to -inf (weight 0).
inline float softmax_weights(float* row, int64_t seen) {
  const int64_t n8 = (seen + 7) & ~int64_t(7);
  for (int64_t j = seen; j < n8; ++j) row[j] = -INFINITY;
  v8 top8 = splat(-INFINITY);
  for (int64_t j = 0; j < n8; j += 8) {
    const v8 x = *(const v8*)(row + j);
    top8 = x > top8 ? x : top8;
  }
  float top = -INFINITY;
  for (int i = 0; i < 8; ++i) top = std::max(top, top8[i]);
  if (top == -INFINITY) return 0.f;
  top8 = splat(top);
  v8 total = splat(0.f);
  for (int64_t j = 0; j < n8; j += 8) {
    const v8 e = exp8(*(const v8*)(row + j) - top8);
    *(v8*)(row + j) = e;
    total = total + e;
  }
  return lane_sum(total);
}

// acc[q][u] += sum over j in [j0, j1), in order, of p[q][j] * values[j][d0 + 8u, d0 + 8u + 8): each value vector
// loaded once for the Q queries.
template <int Q, int U, typename KV>
inline void weighted_block(const float* const* p, const KV* const* values, int64_t j0, int64_t j1, int64_t d0,
                           v8 (*acc)[U]) {
  for (int64_t j = j0; j < j1; ++j) {
    v8 w[U];
    for (int u = 0; u < U; ++u) w[u] = load8(values[j] + d0 + 8 * u);
    for (int q = 0; q < Q; ++q) {
      const v8 pv = broadcast(p[q][j]);
      for (int u = 0; u < U; ++u) acc[q][u] = multiply_add(acc[q][u], pv, w[u]);
    }
  }
}

// acc[q] += sum over keys j in [j0, j1) that query q sees (j < seen[q]), in order, of p[q][j] * values[j]: those all
// Q see ([j0, min(j1, common))) together, then each query's own. acc[q] holds D floats; D a multiple of 8U.
template <int Q, int U, typename KV>
void weighted_values(const float* const* p, const KV* const* values, const int64_t* seen, int64_t common,
                     int64_t j0, int64_t j1, int64_t D, float* const* acc) {
  const int64_t shared = std::min(j1, common);
  for (int64_t d0 = 0; d0 < D; d0 += 8 * U) {
    v8 tile[Q][U];
    for (int q = 0; q < Q; ++q)
      for (int u = 0; u < U; ++u) tile[q][u] = *(const v8*)(acc[q] + d0 + 8 * u);
    weighted_block<Q, U>(p, values, j0, shared, d0, tile);
    for (int q = 0; q < Q; ++q) weighted_block<1, U>(p + q, values, std::max(j0, shared), std::min(j1, seen[q]), d0,
                                                     tile + q);  // fmt: skip
    for (int q = 0; q < Q; ++q)
      for (int u = 0; u < U; ++u) *(v8*)(acc[q] + d0 + 8 * u) = tile[q][u];
  }
}

// weighted_values with the widest U (at most 8 / Q vectors per query, 8 accumulators) that divides D / 8.
template <int Q, typename KV, int U = 8 / Q>
void weighted_values_for(const float* const* p, const KV* const* values, const int64_t* seen, int64_t common,
                         int64_t j0, int64_t j1, int64_t D, float* const* acc) {
  if constexpr (U > 1) {
    if ((D / 8) % U != 0) return weighted_values_for<Q, KV, U / 2>(p, values, seen, common, j0, j1, D, acc);
  }
  weighted_values<Q, U>(p, values, seen, common, j0, j1, D, acc);
}

struct Shape {
  int64_t B, T, H, D, N, S, Hkv, P;
};

// Up to kTile live queries of one task and what they need: their rows of scores (then weights) and of sums.
constexpr int kTile = 16;

struct Group {  // Q consecutive queries of a tile
  int first, Q;
  int64_t common;  // keys [0, common) are seen by all Q
};

// Scores of group g's queries with keys [j0, j1), those all see in blocks of kKeysPerBlock<Q>.
template <int Q, typename KV>
void group_scores(const Group& g, const float* const* queries, const int64_t* seen, const KV* const* keys,
                  int64_t D, float scale, float* const* rows, int64_t j0, int64_t j1) {
  constexpr int KB = kKeysPerBlock<Q>;
  const int64_t shared = std::min(j1, g.common);
  int64_t j = j0;
  for (; j + KB <= shared; j += KB) scores_block<Q>(queries + g.first, keys + j, D, scale, rows + g.first, j);
  for (int q = g.first; q < g.first + Q; ++q)
    scores_alone(queries[q], keys, D, scale, rows[q], j, std::min(j1, seen[q]));
}

// The tile's queries walk the keys in blocks of about 32 KB, every group of the tile taking each block in turn while
// it is in cache: first the scores, then (after each query's softmax) the weighted values. A query's results do not
// depend on its group, its tile or the blocks (each score is computed alone, each output sums over keys in order).
template <typename KV>
void attend_tile(const Shape& s, int n, const float* const* queries, const int64_t* seen, const KV* const* keys,
                 const KV* const* values, float* const* rows, float* const* acc, float* const* out) {
  const int64_t D = s.D;
  const float scale = 1.f / std::sqrt(float(D));
  Group groups[kTile];
  int n_groups = 0;
  int64_t n_keys = 0;
  for (int first = 0; first < n;) {
    const int Q = n - first >= 4 ? 4 : n - first >= 2 ? 2 : 1;
    int64_t common = seen[first];
    for (int q = first; q < first + Q; ++q) common = std::min(common, seen[q]), n_keys = std::max(n_keys, seen[q]);
    groups[n_groups++] = {first, Q, common};
    first += Q;
  }
  const int64_t block = std::max<int64_t>(8, (32768 / (4 * D)) & ~int64_t(7));
  for (int64_t j0 = 0; j0 < n_keys; j0 += block)
    for (int k = 0; k < n_groups; ++k) {
      const Group& g = groups[k];
      const int64_t j1 = std::min(j0 + block, n_keys);
      if (g.Q == 4) group_scores<4>(g, queries, seen, keys, D, scale, rows, j0, j1);
      else if (g.Q == 2) group_scores<2>(g, queries, seen, keys, D, scale, rows, j0, j1);
      else group_scores<1>(g, queries, seen, keys, D, scale, rows, j0, j1);
    }
  float total[kTile];
  for (int q = 0; q < n; ++q) {
    total[q] = softmax_weights(rows[q], seen[q]);
    std::fill(acc[q], acc[q] + D, 0.f);
  }
  if (D % 8 == 0) {
    for (int64_t j0 = 0; j0 < n_keys; j0 += block)
      for (int k = 0; k < n_groups; ++k) {
        const Group& g = groups[k];
        const float* const* p = rows + g.first;
        const int64_t j1 = std::min(j0 + block, n_keys);
        if (g.Q == 4) weighted_values_for<4>(p, values, seen + g.first, g.common, j0, j1, D, acc + g.first);
        else if (g.Q == 2) weighted_values_for<2>(p, values, seen + g.first, g.common, j0, j1, D, acc + g.first);
        else weighted_values_for<1>(p, values, seen + g.first, g.common, j0, j1, D, acc + g.first);
      }
  } else {
    for (int q = 0; q < n; ++q)
      for (int64_t j = 0; j < seen[q]; ++j) add_scaled(acc[q], rows[q][j], values[j], D);
  }
  for (int q = 0; q < n; ++q)
    for (int64_t d = 0; d < D; ++d) out[q][d] = total[q] > 0.f ? acc[q][d] / total[q] : 0.f;
}

// The T x G queries of row b that read KV head h (G = H / Hkv query heads share a KV head), in tiles of live
// queries; a padding query's output is 0.
template <typename KV>
void attend_row_head(const Shape& s, int64_t b, int64_t h, const float* q, const KV* k_pages,
                     const KV* v_pages, const int32_t* table, const int32_t* qpos, float* out) {
  const int64_t G = s.H / s.Hkv, M = s.T * G, D = s.D;
  auto query = [&](int64_t i) { return q + ((b * s.T + i / G) * s.H + h * G + i % G) * D; };
  auto output = [&](int64_t i) { return out + ((b * s.T + i / G) * s.H + h * G + i % G) * D; };

  int64_t n_keys = 0;
  for (int64_t t = 0; t < s.T; ++t) n_keys = std::max<int64_t>(n_keys, qpos[b * s.T + t] + 1);
  const int64_t stride = (n_keys + 7) & ~int64_t(7);
  // Tiles of four queries where the row's keys and values stay in the core's cache (L2) from one tile to the next,
  // kTile where they do not: in cache, a wider tile only moves its scores out of L1.
  const int tile = int(std::min<int64_t>(M, n_keys * D * 2 * int64_t(sizeof(KV)) > (1 << 20) ? kTile : 4));
  thread_local std::vector<float> scores, sums;         // [tile, stride], [tile, D]
  thread_local std::vector<const KV*> keys, values;  // [n_keys]: where key j's and value j's rows lie
  if (scores.size() < size_t(tile * stride)) scores.resize(tile * stride);
  if (sums.size() < size_t(tile * D)) sums.resize(tile * D);
  if (keys.size() < size_t(n_keys)) keys.resize(n_keys), values.resize(n_keys);
  for (int64_t page = 0, j = 0; j < n_keys; ++page) {  // page by page: j / S per key was an eighth of the time
    const int64_t row0 = (int64_t(table[b * s.P + page]) * s.S * s.Hkv + h) * D, step = s.Hkv * D;
    for (int64_t slot = 0; slot < s.S && j < n_keys; ++slot, ++j)
      keys[j] = k_pages + row0 + slot * step, values[j] = v_pages + row0 + slot * step;
  }

  float* rows[kTile];
  float* acc[kTile];
  for (int k = 0; k < tile; ++k) rows[k] = scores.data() + k * stride, acc[k] = sums.data() + k * D;
  const float* queries[kTile];
  float* outs[kTile];
  int64_t seen[kTile];
  int n = 0;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t position = qpos[b * s.T + i / G];
    if (position < 0) {
      std::fill(output(i), output(i) + D, 0.f);
      continue;
    }
    queries[n] = query(i), outs[n] = output(i), seen[n] = position + 1;
    if (++n == tile) attend_tile(s, n, queries, seen, keys.data(), values.data(), rows, acc, outs), n = 0;
  }
  if (n > 0) attend_tile(s, n, queries, seen, keys.data(), values.data(), rows, acc, outs);
}

template <ffi::DataType PageType, typename KV>
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<PageType> k_pages,
                          ffi::Buffer<PageType> v_pages, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> qpos,
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
  const KV* kp = reinterpret_cast<const KV*>(k_pages.untyped_data());
  const KV* vp = reinterpret_cast<const KV*>(v_pages.untyped_data());
  float* op = out->typed_data();
  gdnspec::over_chunks(pool, s.B * s.Hkv, work >= kMinParallelWork, [&](int64_t c) {
    attend_row_head(s, c / s.Hkv, c % s.Hkv, qp, kp, vp, table, positions, op);
  });
  return ffi::Error::Success();
}

// q, the K and V pages (float32 or float16), the page table, the positions; out.
template <ffi::DataType PageType>
auto paged_attention_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<PageType>>()
      .template Arg<ffi::Buffer<PageType>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_paged_attention, (PagedAttention<ffi::F32, float>),
                              paged_attention_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_paged_attention_f16, (PagedAttention<ffi::F16, uint16_t>),
                              paged_attention_binding<ffi::F16>());
