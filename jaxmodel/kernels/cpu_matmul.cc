// Matrix products on CPU, XLA FFI custom calls over weights in GGUF's [N, K] order:
//   gdnspec_rows_matmul     out[M, N] = x[M, K] @ w[N, K]^T, float32 weights (below);
//   gdnspec_q8_rows_matmul  the same with Q8_0 weights, as llama.cpp computes it, each group of four rows' blocks
//                           interleaved as llama.cpp repacks them (further below, "Q8_0").
// Both take live [M] (int32): rows where it is 0 are padding (a batch's empty rows, the tokens past a row's own in
// a padded step) and are not computed; their output is 0. A step padded to its shape bucket then costs its tokens.
//
// The weight is read in GGUF's order, [N, K] (each output's weights contiguous, llama.cpp's loop order): every
// weight row is loaded once and multiplied into all M rows of x (held in L1), so a product of a few rows costs
// about what one row costs, where XLA's CPU dot packs the whole weight for each product and a 4-row one costs
// 2-2.5x a one-row one (README, "Model step"). Output columns are split in chunks over XLA's intra-op thread pool.
//
// Every output element is summed in the same order whatever M and the chunking: eight strided partial sums over k
// (one per vector lane), added lane by lane, then the tail k >= K & ~7. So row m of a product does not depend on
// the other rows, and a verify step's logits equal a one-token step's bit for bit (and a prompt chunk's).
//
// References: `rows_matmul_reference` and `q8_rows_matmul_reference` in cpu_matmul.py; tests:
// tests/test_cpu_matmul.py and tests/test_cpu_q8_matmul.py.

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
using gdnspec::v8;

constexpr int kRowBlock = 4;                    // rows of x per pass over the weights
constexpr int64_t kChunk = 64;                  // output columns per task
constexpr int64_t kMinParallelBytes = 1 << 20;  // smaller weights stay on the calling thread

// out[m, n] for m < MR, n in [n0, n1), NR weight rows at a time: MR * NR independent accumulators keep the FMA
// units busy (one row of x alone would otherwise wait on one accumulator's latency).
template <int MR, int NR>
void row_block(const float* x, const float* w, float* const* out, int64_t K, int64_t n0, int64_t n1) {
  const int64_t K8 = K & ~int64_t(7);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const float* wn = w + n * K;
    v8 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = v8{};
    for (int64_t k = 0; k < K8; k += 8) {
      v8 b[NR];
      for (int r = 0; r < NR; ++r) {
        b[r] = *(const v8*)(wn + r * K + k);
        __asm__("" : "+x"(b[r]));  // keep each weight vector in a register: loaded once, not once per row of x
      }
      for (int m = 0; m < MR; ++m) {
        v8 xv = *(const v8*)(x + m * K + k);
        __asm__("" : "+x"(xv));  // one load of x per row, not one per weight row
        for (int r = 0; r < NR; ++r) acc[m][r] = multiply_add(acc[m][r], xv, b[r]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) {
        float s = lane_sum(acc[m][r]);
        for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * wn[r * K + k];
        out[m][n + r] = s;
      }
  }
  if constexpr (NR > 1) {
    if (n < n1) row_block<MR, 1>(x, w, out, K, n, n1);
  }
}

// All M rows of x (contiguous) for output columns [n0, n1), row m's outputs at out[m]. (Eight rows of x per pass
// measured slower than four: with K = 1024 they fill L1.)
void columns(const float* x, const float* w, float* const* out, int64_t M, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const float* xm = x + m0 * K;
    float* const* om = out + m0;
    switch (std::min<int64_t>(kRowBlock, M - m0)) {
      case 1: row_block<1, 8>(xm, w, om, K, n0, n1); break;
      case 2: row_block<2, 4>(xm, w, om, K, n0, n1); break;
      case 3: row_block<3, 4>(xm, w, om, K, n0, n1); break;
      default: row_block<4, 4>(xm, w, om, K, n0, n1); break;
    }
  }
}

// The live rows of a product (live[m] != 0), kept by the calling thread between calls (no allocation per call;
// pool tasks read them, and the call waits for its tasks before it returns).
struct LiveRows {
  std::vector<int64_t> index;  // the live rows, in order
  std::vector<float*> out;     // where each live row's outputs go

  // Fills index and out (rows of out_base N apart) and zeroes the outputs of the rows that are not live.
  void find(const int32_t* live, int64_t M, float* out_base, int64_t N) {
    index.clear();
    out.clear();
    for (int64_t m = 0; m < M; ++m) {
      if (live[m]) {
        index.push_back(m);
        out.push_back(out_base + m * N);
      } else {
        std::fill(out_base + m * N, out_base + (m + 1) * N, 0.f);
      }
    }
  }
  int64_t count() const { return int64_t(index.size()); }
};

// columns(n0, n1) over [0, N) in chunks of kChunk, on the pool's threads when size (bytes or products) is large
// enough to pay for the hand-off.
template <typename Columns>
void over_columns(ffi::ThreadPool& pool, int64_t N, int64_t size, int64_t min_parallel_size,
                  const Columns& columns) {
  const int64_t n_chunks = (N + kChunk - 1) / kChunk;
  gdnspec::over_chunks(pool, n_chunks, size >= min_parallel_size,
                       [&](int64_t c) { columns(c * kChunk, std::min(N, (c + 1) * kChunk)); });
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("rows_matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K) return ffi::Error::InvalidArgument("rows_matmul: x is [M, K] and w [N, K] with the same K");
  if (live.element_count() != M) return ffi::Error::InvalidArgument("rows_matmul: live is [M]");
  thread_local LiveRows rows;
  thread_local std::vector<float> gathered;  // the live rows of x, when some are not
  rows.find(live.typed_data(), M, out->typed_data(), N);
  const int64_t L = rows.count();
  if (L == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  if (L < M) {
    if (gathered.size() < size_t(L * K)) gathered.resize(L * K);
    for (int64_t i = 0; i < L; ++i) std::copy_n(xp + rows.index[i] * K, K, gathered.data() + i * K);
    xp = gathered.data();
  }
  const float* wp = w.typed_data();
  float* const* op = rows.out.data();
  over_columns(pool, N, N * K * int64_t(sizeof(float)), kMinParallelBytes,
               [=](int64_t n0, int64_t n1) { columns(xp, wp, op, L, K, n0, n1); });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------- Q8_0
//
// out[M, N] = x[M, K] @ dequant(wq[N, K], wd[N, K/32])^T the way llama.cpp's CPU backend computes a Q8_0 matmul:
// each row of x is quantized to Q8_0 (quantize_row_q8_0), and each output is ggml_vec_dot_q8_0_q8_0 on AVX2
// (with VNNI where the CPU has it): per block of 32, eight lanes of exact 4-product integer sums, scaled by
// d_w * d_x and accumulated with FMA across blocks, the lanes then summed as hsum_float_8 does. The weight is read
// as int8 (a quarter of float32's bytes), one group of four rows at a time from one contiguous stream (Q8Layout),
// and the products are 8-bit. A row's result depends on that row of x only, for every M.

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8MinParallelWork = 1 << 16;  // products (M * N * K) below which one thread does it all

inline float round_to_f16(float v) {
#ifdef __F16C__
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
  return (float)(_Float16)v;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GDNSPEC_VNNI 1
inline __m256i dot_bytes(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define GDNSPEC_VNNI 1
inline __m256i dot_bytes(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define GDNSPEC_VNNI 0
#endif

// With VNNI each weight block is read offset by 128 (w ^ 0x80 as unsigned bytes, 0..255), because the instruction
// multiplies unsigned bytes by signed ones: sum((w + 128) * x) - 128 * sum(x) = sum(w * x), exactly, so the lane
// sums are those of llama.cpp's AVX2 path and a block costs one integer instruction per row of x and weight row.
// The correction -128 * sum(x) depends on x alone: it is computed once per block of each row of x
// (`x_lane_offsets`) and starts the instruction's accumulator.
#if GDNSPEC_VNNI
void x_lane_offsets(const int8_t* q, int64_t blocks, int32_t* offsets) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(q + b * kQ8Block));
    const __m256i sums = dot_bytes(_mm256_setzero_si256(), _mm256_set1_epi8(char(0x80)), x);  // 128 * sum of 4
    _mm256_storeu_si256((__m256i*)(offsets + b * 8), _mm256_sub_epi32(_mm256_setzero_si256(), sums));
  }
}
#endif

// llama.cpp's quantize_row_q8_0 (its AVX2 path): d = amax / 127 stored as f16, q = x * (127 / amax) rounded to
// nearest, ties to even.
void quantize_rows_q8_0(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  for (int64_t b = 0; b < M * (K / kQ8Block); ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.f;
    for (int i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    d[b] = round_to_f16(amax / 127.f);
    const float inverse = amax != 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < kQ8Block; ++i)
      q[b * kQ8Block + i] = (int8_t)std::nearbyint(xb[i] * inverse);
  }
}

// hsum_float_8: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float lane_sum_q8(v8 v) {
  return ((v[4] + v[0]) + (v[6] + v[2])) + ((v[5] + v[1]) + (v[7] + v[3]));
}

#ifdef __AVX2__
// lane_sum_q8 of eight accumulators at once, the same additions of the same pairs: lane i = lane_sum_q8(a[i]).
// With K = 192 (the bundled model) a tile runs six blocks, and summing its sixteen outputs one by one cost about
// as much as the blocks.
inline __m256 lane_sums_q8(const v8* a) {
  __m256 h[4];  // h[i] = [a[2i].hi + a[2i].lo | a[2i+1].hi + a[2i+1].lo]: lanes (l0 + l4, l1 + l5, l2 + l6, l3 + l7)
  for (int i = 0; i < 4; ++i) {
    const __m256 x = (__m256)a[2 * i], y = (__m256)a[2 * i + 1];
    h[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x31), _mm256_permute2f128_ps(x, y, 0x20));
  }
  __m256 pq[2];  // per half: (P, Q, P, Q) of two accumulators, P = c0 + c2 and Q = c1 + c3
  for (int i = 0; i < 2; ++i)
    pq[i] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pq[0], pq[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pq[0], pq[1], _MM_SHUFFLE(3, 1, 3, 1)));  // a0 a2 a4 a6 | a1 a3 a5 a7
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The eight lane sums of one block: lane j = sum of w[4j + i] * x[4j + i], i < 4 (llama.cpp's
// mul_sum_i8_pairs_float, with |w| shared by the rows of x).
inline __m256 block_lanes(__m256i w_abs, __m256i w, __m256i x) {
  const __m256i products = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));  // 16 pair sums, no overflow
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
#endif

// Where the weight's blocks lie: rows in groups of kQ8RowGroup (the last group may hold fewer, g), each group's
// blocks interleaved row by row, block b of its g rows one after another (llama.cpp's repacked q8_0x4 order;
// `interleave_q8_rows` in cpu_matmul.py); the scales likewise. A tile of a group's rows then reads one contiguous
// stream, which the hardware prefetchers follow at about twice the rate of four rows K bytes apart (a one-row
// product of the 0.8B FFN's weights, one thread, from memory: 22.8 against 9.9 GB/s).
constexpr int64_t kQ8RowGroup = 4;

struct Q8Layout {
  int64_t K, N, nb;
  // Offsets of block b of row n in the quants (bytes) and in the scales.
  int64_t block(int64_t n, int64_t b) const {
    const int64_t first = n - n % kQ8RowGroup, g = std::min(kQ8RowGroup, N - first);
    return first * K + (b * g + n % kQ8RowGroup) * kQ8Block;
  }
  int64_t scale(int64_t n, int64_t b) const {
    const int64_t first = n - n % kQ8RowGroup, g = std::min(kQ8RowGroup, N - first);
    return first * nb + b * g + n % kQ8RowGroup;
  }
};

// xo: x_lane_offsets of the rows of x (VNNI only; else unused).
template <int MR, int NR>
void q8_row_block(const int8_t* xq, const float* xd, const int32_t* xo, const int8_t* wq, const float* wd,
                  float* const* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ8Block;
  const Q8Layout layout{K, N, nb};
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    v8 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = v8{};
    for (int64_t b = 0; b < nb; ++b) {
#if GDNSPEC_VNNI
      __m256i w[NR];
      for (int r = 0; r < NR; ++r) {
        w[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wq + layout.block(n + r, b))),
                                _mm256_set1_epi8(char(0x80)));
        __asm__("" : "+x"(w[r]));  // in a register for all MR rows of x, not reloaded for each
      }
      if constexpr (NR == 4) {
        // The scale of block b for each (m, r), d_w[r] * d_x[m] (exact in float32: both are f16 values): one
        // product for two rows of x and four weight rows (a whole group's scales lie together), spread over a
        // vector by shuffles, which run beside the products where a multiply per (m, r) would compete with them
        // (one row of x: 1.5x faster, timed alone).
        const __m256 dw = _mm256_broadcast_ps((const __m128*)(wd + layout.scale(n, b)));
        for (int m2 = 0; m2 < MR; m2 += 2) {
          const __m128 lo = _mm_broadcast_ss(xd + m2 * nb + b);
          const __m128 hi = m2 + 1 < MR ? _mm_broadcast_ss(xd + (m2 + 1) * nb + b) : lo;
          const __m256 scales = _mm256_mul_ps(dw, _mm256_set_m128(hi, lo));  // [d_w * d_x[m2] | d_w * d_x[m2 + 1]]
          for (int h = 0; h < 2 && m2 + h < MR; ++h) {
            const int m = m2 + h;
            const __m256 row = _mm256_permute2f128_ps(scales, scales, h ? 0x11 : 0x00);
            __m256i x = _mm256_loadu_si256((const __m256i*)(xq + m * K + b * kQ8Block));
            __asm__("" : "+x"(x));
            const __m256i offset = _mm256_loadu_si256((const __m256i*)(xo + (m * nb + b) * 8));
            acc[m][0] = multiply_add(acc[m][0], (v8)_mm256_permute_ps(row, 0x00),
                                     (v8)_mm256_cvtepi32_ps(dot_bytes(offset, w[0], x)));
            acc[m][1] = multiply_add(acc[m][1], (v8)_mm256_permute_ps(row, 0x55),
                                     (v8)_mm256_cvtepi32_ps(dot_bytes(offset, w[1], x)));
            acc[m][2] = multiply_add(acc[m][2], (v8)_mm256_permute_ps(row, 0xAA),
                                     (v8)_mm256_cvtepi32_ps(dot_bytes(offset, w[2], x)));
            acc[m][3] = multiply_add(acc[m][3], (v8)_mm256_permute_ps(row, 0xFF),
                                     (v8)_mm256_cvtepi32_ps(dot_bytes(offset, w[3], x)));
          }
        }
      } else {
        __m256 dw[NR];
        for (int r = 0; r < NR; ++r) dw[r] = _mm256_broadcast_ss(wd + layout.scale(n + r, b));
        for (int m = 0; m < MR; ++m) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + m * K + b * kQ8Block));
          const __m256i offset = _mm256_loadu_si256((const __m256i*)(xo + (m * nb + b) * 8));
          const __m256 dx = _mm256_broadcast_ss(xd + m * nb + b);
          for (int r = 0; r < NR; ++r)
            acc[m][r] = multiply_add(acc[m][r], (v8)_mm256_mul_ps(dw[r], dx),
                                     (v8)_mm256_cvtepi32_ps(dot_bytes(offset, w[r], x)));
        }
      }
#elif defined(__AVX2__)
      __m256i w[NR], w_abs[NR];
      for (int r = 0; r < NR; ++r) {
        w[r] = _mm256_loadu_si256((const __m256i*)(wq + layout.block(n + r, b)));
        w_abs[r] = _mm256_sign_epi8(w[r], w[r]);
      }
      __m256 dw[NR];
      for (int r = 0; r < NR; ++r) dw[r] = _mm256_broadcast_ss(wd + layout.scale(n + r, b));
      for (int m = 0; m < MR; ++m) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + m * K + b * kQ8Block));
        const __m256 dx = _mm256_broadcast_ss(xd + m * nb + b);
        for (int r = 0; r < NR; ++r)
          acc[m][r] = multiply_add(acc[m][r], (v8)_mm256_mul_ps(dw[r], dx), (v8)block_lanes(w_abs[r], w[r], x));
      }
#else
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = xq + m * K + b * kQ8Block;
        for (int r = 0; r < NR; ++r) {
          const int8_t* w = wq + layout.block(n + r, b);
          const float scale = wd[layout.scale(n + r, b)] * xd[m * nb + b];
          for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int i = 0; i < 4; ++i) s += int32_t(w[4 * j + i]) * int32_t(x[4 * j + i]);
            acc[m][r][j] = std::fma(scale, float(s), acc[m][r][j]);
          }
        }
      }
#endif
    }
#ifdef __AVX2__
    if constexpr (NR == 4) {
      for (int m = 0; m < MR; m += 2) {
        const v8 a[8] = {acc[m][0], acc[m][1], acc[m][2], acc[m][3],
                         m + 1 < MR ? acc[m + 1][0] : v8{}, m + 1 < MR ? acc[m + 1][1] : v8{},
                         m + 1 < MR ? acc[m + 1][2] : v8{}, m + 1 < MR ? acc[m + 1][3] : v8{}};
        const __m256 sums = lane_sums_q8(a);
        _mm_storeu_ps(out[m] + n, _mm256_castps256_ps128(sums));
        if (m + 1 < MR) _mm_storeu_ps(out[m + 1] + n, _mm256_extractf128_ps(sums, 1));
      }
      continue;
    }
#endif
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) out[m][n + r] = lane_sum_q8(acc[m][r]);
  }
  if constexpr (NR > 1) {
    if (n < n1) q8_row_block<MR, 1>(xq, xd, xo, wq, wd, out, K, N, n, n1);
  }
}

void q8_columns(const int8_t* xq, const float* xd, const int32_t* xo, const int8_t* wq, const float* wd,
                float* const* out, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ8Block;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int8_t* xm = xq + m0 * K;
    const float* dm = xd + m0 * nb;
    const int32_t* offsets = xo + m0 * nb * 8;
    float* const* om = out + m0;
    switch (std::min<int64_t>(kRowBlock, M - m0)) {
      case 1: q8_row_block<1, 4>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
      case 2: q8_row_block<2, 4>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
      case 3: q8_row_block<3, 4>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
      default: q8_row_block<4, 4>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
    }
  }
}

ffi::Error Q8RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wq,
                        ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xs = x.dimensions(), qs = wq.dimensions(), ds = wd.dimensions();
  if (xs.size() != 2 || qs.size() != 2 || ds.size() != 2)
    return ffi::Error::InvalidArgument("q8_rows_matmul: x, quants and scales must be 2-D");
  const int64_t M = xs[0], K = xs[1], N = qs[0];
  if (qs[1] != K || K % kQ8Block != 0 || ds[0] != N || ds[1] != K / kQ8Block)
    return ffi::Error::InvalidArgument(
        "q8_rows_matmul: x is [M, K], quants [N, K] and scales [N, K / 32], with K a multiple of 32");
  if (live.element_count() != M) return ffi::Error::InvalidArgument("q8_rows_matmul: live is [M]");
  // The live rows of x quantized, in buffers kept by the calling thread like the rows themselves (LiveRows).
  thread_local LiveRows rows;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int32_t> xo;  // x_lane_offsets (VNNI)
  rows.find(live.typed_data(), M, out->typed_data(), N);
  const int64_t L = rows.count(), nb = K / kQ8Block;
  if (L == 0) return ffi::Error::Success();
  if (xq.size() < size_t(L * K)) xq.resize(L * K);
  if (xd.size() < size_t(L * nb)) xd.resize(L * nb);
  for (int64_t i = 0; i < L; ++i)
    quantize_rows_q8_0(x.typed_data() + rows.index[i] * K, 1, K, xq.data() + i * K, xd.data() + i * nb);
#if GDNSPEC_VNNI
  if (xo.size() < size_t(L * nb * 8)) xo.resize(L * nb * 8);
  x_lane_offsets(xq.data(), L * nb, xo.data());
#endif
  const int32_t* xop = xo.data();
  const int8_t* xqp = xq.data();
  const float* xdp = xd.data();
  const int8_t* wqp = wq.typed_data();
  const float* wdp = wd.typed_data();
  float* const* op = rows.out.data();
  over_columns(pool, N, L * N * K, kQ8MinParallelWork,
               [=](int64_t n0, int64_t n1) { q8_columns(xqp, xdp, xop, wqp, wdp, op, L, K, N, n0, n1); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_rows_matmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_q8_rows_matmul, Q8RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Ret<ffi::Buffer<ffi::F32>>());
