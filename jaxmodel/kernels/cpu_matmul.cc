// Matrix products on CPU, XLA FFI custom calls over weights in GGUF's [N, K] order:
//   gdnspec_rows_matmul     out[M, N] = x[M, K] @ w[N, K]^T, float32 weights (below);
//   gdnspec_q8_rows_matmul  the same with Q8_0 weights, with llama.cpp's Q8_0 arithmetic (x quantized to 8 bits,
//                           exact integer products per block), eight rows' quants interleaved four bytes at a time
//                           (further below, "Q8_0");
//   gdnspec_q8_rows_matmul_prologue  the Q8_0 product of x after a prologue each row of x goes through before it is
//                           quantized: an RMS norm, SwiGLU's gate, or the GDN output's gated norm (at the end,
//                           "Prologues").
// Both take live [M] (int32): rows where it is 0 are padding (a batch's empty rows, the tokens past a row's own in
// a padded step) and are not computed; their output is 0. A step padded to its shape bucket then costs its tokens.
//
// The weight is read in GGUF's order, [N, K] (each output's weights contiguous, llama.cpp's loop order): every
// weight row is loaded once and multiplied into all M rows of x (held in L1), so a product of a few rows costs
// about what one row costs, where XLA's CPU dot packs the whole weight for each product and a 4-row one costs
// 2-2.5x a one-row one (docs/performance.md, "Model step"). Output columns are split in chunks over XLA's intra-op
// thread pool.
//
// Every output element is summed in the same order whatever M and the chunking (float32: eight strided partial sums
// over k, one per vector lane, added lane by lane, then the tail k >= K & ~7; Q8_0: block after block). So row m of
// a product does not depend on the other rows, and a verify step's logits equal a one-token step's bit for bit (and
// a prompt chunk's).
//
// References: `rows_matmul_reference` and `q8_rows_matmul_reference` in cpu_matmul.py; tests:
// tests/test_cpu_matmul.py and tests/test_cpu_q8_matmul.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_blocks.h"
#include "cpu_pool.h"
#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using gdnspec::lane_sum;
using gdnspec::multiply_add;
using gdnspec::silu8;
using gdnspec::splat;
using gdnspec::v8;

constexpr int kRowBlock = 4;                    // rows of x per pass over the weights
constexpr int64_t kChunksPerThread = 2;         // tasks per thread of a product
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

// columns(n0, n1) over [0, N) in chunks, on the pool's threads when size (bytes or products) is large enough to pay
// for the hand-off. Chunks are whole groups of `group` columns (8: the Q8_0 layout's row groups; 16: Q4_K's), so
// only the last chunk may end in a group of fewer; kChunksPerThread per thread
// as near equal as the groups allow: each thread then reads long runs of consecutive weight rows, which the
// hardware prefetcher follows (chunks of 64 columns taken in turn by two threads read a weight from memory at half
// the rate), and a thread that starts late takes fewer chunks.
template <typename Columns>
void over_columns(ffi::ThreadPool& pool, int64_t N, int64_t size, int64_t min_parallel_size,
                  const Columns& columns, int64_t group = 8) {
  const bool parallel = size >= min_parallel_size;
  const int64_t threads = parallel ? std::max<int64_t>(pool.num_threads(), 1) : 1;
  const int64_t groups = (N + group - 1) / group;
  const int64_t n_target = std::min(groups, threads * kChunksPerThread);
  const int64_t chunk = group * ((groups + n_target - 1) / n_target);
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  gdnspec::over_chunks(pool, n_chunks, parallel,
                       [&](int64_t c) { columns(c * chunk, std::min(N, (c + 1) * chunk)); });
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
// out[M, N] = x[M, K] @ dequant(wq[N, K], wd[N, K/32])^T with llama.cpp's Q8_0 arithmetic: each row of x quantized
// to Q8_0 (quantize_row_q8_0), and per block of 32 one exact integer dot product of the two blocks' quants. Each
// output then sums its blocks in order, one FMA each:
//   acc = fma(d_w[n, b] * d_x[m, b], float(dot_b), acc)
// (the scale product of two f16 values is exact in float32, and so is the integer, |dot_b| < 2^19), whatever the
// instructions, M and the chunking: a row's result depends on that row of x only. This is the order of llama.cpp's
// repacked Q8_0 GEMMs (a block's products summed as one integer, then scaled), not of its x86 vec_dot, which keeps
// eight partial sums per block; the two differ in the last bits of a float32 sum.
//
// The weight is read as int8, a group of eight rows at a time from one contiguous stream (Q8Layout): block b of a
// group is eight vectors of 32 bytes, vector q holding bytes 4q..4q+3 of each of the eight rows. One integer
// product instruction (VNNI's vpdpbusd, or AVX2's maddubs and madd) of such a vector with four bytes of x broadcast
// adds to eight lanes, one per weight row, so after eight of them each lane holds its row's whole block product:
// one conversion and one FMA then serve eight outputs, where keeping eight partial sums per output took one each.

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8RowGroup = 8;   // weight rows interleaved together, one per vector lane
constexpr int64_t kQ8Quad = 4;       // bytes of a row side by side in a vector (one lane's products)
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
#if defined(__AVX2__) && defined(__FMA__)
#define GDNSPEC_Q8_VECTOR 1
#else
#define GDNSPEC_Q8_VECTOR 0
#endif

// llama.cpp's quantize_row_q8_0 (its AVX2 path): d = amax / 127 stored as f16, q = x * (127 / amax) rounded to
// nearest, ties to even. The vector form computes the same values (a maximum is exact in any order, the product is
// one rounding either way, and the rounding instruction is nearbyint's); at 16 rows the scalar loop took a third of
// a small product's time.
void quantize_rows_q8_0(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  for (int64_t b = 0; b < M * (K / kQ8Block); ++b) {
    const float* xb = x + b * kQ8Block;
#if GDNSPEC_Q8_VECTOR
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax8);  // a NaN is skipped, as by std::max
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    d[b] = round_to_f16(amax / 127.f);
    const __m256 inverse = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i)
      n[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // Narrowed to bytes by saturating packs (|n| <= 127), which interleave 128-bit lanes; the permutation restores
    // the order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i*)(q + b * kQ8Block),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.f;
    for (int i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    d[b] = round_to_f16(amax / 127.f);
    const float inverse = amax != 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < kQ8Block; ++i)
      q[b * kQ8Block + i] = (int8_t)std::nearbyint(xb[i] * inverse);
#endif
  }
}

// With VNNI each weight vector is read offset by 128 (w ^ 0x80 as unsigned bytes, 0..255), because the instruction
// multiplies unsigned bytes by signed ones: sum((w + 128) * x) - 128 * sum(x) = sum(w * x), exactly. The
// correction depends on x alone: -128 * sum(x) of each block of each row of x, computed once per product, starts
// the block's integer accumulators. (The 512-bit Q4_0 / Q5_0 products' weights are offset by 8 or 16: `offset`.)
void x_block_offsets(const int8_t* q, int64_t blocks, int32_t* offsets, int32_t offset = 128) {
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int i = 0; i < kQ8Block; ++i) sum += q[b * kQ8Block + i];
    offsets[b] = -offset * sum;
  }
}

// Where the weight's bytes lie: rows in groups of kQ8RowGroup (the last group may hold fewer, g); within a group,
// block after block, and within a block, quad q (bytes 4q..4q+3 of each row) of the group's g rows one after
// another (`interleave_q8_rows` in cpu_matmul.py). A group's scales: block after block, g each.
struct Q8Layout {
  int64_t K, N, nb;
  int64_t group_first(int64_t n) const { return n - n % kQ8RowGroup; }
  int64_t group_rows(int64_t n) const { return std::min(kQ8RowGroup, N - group_first(n)); }
  // Byte k of row n.
  int64_t byte(int64_t n, int64_t k) const {
    const int64_t first = group_first(n), g = group_rows(n), b = k / kQ8Block, q = k % kQ8Block / kQ8Quad;
    return first * K + ((b * (kQ8Block / kQ8Quad) + q) * g + n - first) * kQ8Quad + k % kQ8Quad;
  }
  // The scale of block b of row n.
  int64_t scale(int64_t n, int64_t b) const {
    const int64_t first = group_first(n);
    return first * nb + b * group_rows(n) + n - first;
  }
};

// Outputs [n0, n1) of MR rows of x, one row and output at a time, in the kernel's order: any rows of any group (a
// last group of fewer than eight rows; every row where the CPU has no AVX2).
template <int MR>
void q8_outputs_one_by_one(const int8_t* xq, const float* xd, const int8_t* wq, const float* wd, float* const* out,
                           int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ8Block;
  const Q8Layout layout{K, N, nb};
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < MR; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * kQ8Block; k < (b + 1) * kQ8Block; ++k)
          dot += int32_t(wq[layout.byte(n, k)]) * int32_t(xq[m * K + k]);
        acc = std::fma(wd[layout.scale(n, b)] * xd[m * nb + b], float(dot), acc);
      }
      out[m][n] = acc;
    }
}

#if GDNSPEC_Q8_VECTOR
// Outputs [n, n + 8 NG) of MR rows of x: NG whole groups. MR * NG integer accumulators, each a chain of eight
// products per block, keep the integer units busy; the weight vectors are loaded once for all MR rows of x.
// xo: x_block_offsets of the rows of x (VNNI only; else unused).
template <int MR, int NG>
void q8_groups(const int8_t* xq, const float* xd, const int32_t* xo, const int8_t* wq, const float* wd,
               float* const* out, int64_t K, int64_t n) {
  const int64_t nb = K / kQ8Block;
  const int8_t* wn = wq + n * K;    // group j at wn + j * 8K, block b of it at + 256 b
  const float* dn = wd + n * nb;    // group j at dn + j * 8 nb, block b of it at + 8 b
  __m256 acc[MR][NG];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NG; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i dot[MR][NG];  // lane r: the integer product of block b, weight row 8j + r and row m of x
    for (int m = 0; m < MR; ++m) {
#if GDNSPEC_VNNI
      const __m256i start = _mm256_set1_epi32(xo[m * nb + b]);
#else
      const __m256i start = _mm256_setzero_si256();
#endif
      for (int j = 0; j < NG; ++j) dot[m][j] = start;
    }
    for (int q = 0; q < kQ8Block / kQ8Quad; ++q) {
      __m256i w[NG];
#if !GDNSPEC_VNNI
      __m256i w_abs[NG];
#endif
      for (int j = 0; j < NG; ++j) {
        w[j] = _mm256_loadu_si256((const __m256i*)(wn + j * kQ8RowGroup * K + b * kQ8RowGroup * kQ8Block + q * 32));
#if GDNSPEC_VNNI
        w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8(char(0x80)));
#else
        w_abs[j] = _mm256_sign_epi8(w[j], w[j]);
#endif
      }
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * K + b * kQ8Block + q * kQ8Quad, sizeof quad);
        const __m256i x = _mm256_set1_epi32(quad);
        for (int j = 0; j < NG; ++j) {
#if GDNSPEC_VNNI
          dot[m][j] = dot_bytes(dot[m][j], w[j], x);
#else
          const __m256i pairs = _mm256_maddubs_epi16(w_abs[j], _mm256_sign_epi8(x, w[j]));  // no overflow
          dot[m][j] = _mm256_add_epi32(dot[m][j], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
        }
      }
    }
    __m256 dw[NG];
    for (int j = 0; j < NG; ++j) dw[j] = _mm256_loadu_ps(dn + j * kQ8RowGroup * nb + b * kQ8RowGroup);
    for (int m = 0; m < MR; ++m) {
      const __m256 dx = _mm256_broadcast_ss(xd + m * nb + b);
      for (int j = 0; j < NG; ++j)
        acc[m][j] = _mm256_fmadd_ps(_mm256_mul_ps(dw[j], dx), _mm256_cvtepi32_ps(dot[m][j]), acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NG; ++j) _mm256_storeu_ps(out[m] + n + j * kQ8RowGroup, acc[m][j]);
}
#endif

// Outputs [n0, n1) of MR rows of x (n0 at a group's start): whole groups by q8_groups, NG at a time then one, and
// a last group of fewer rows one output at a time.
template <int MR, int NG>
void q8_row_block(const int8_t* xq, const float* xd, const int32_t* xo, const int8_t* wq, const float* wd,
                  float* const* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
#if GDNSPEC_Q8_VECTOR
  const int64_t whole = n0 + (n1 - n0) / kQ8RowGroup * kQ8RowGroup;
  for (; n + NG * kQ8RowGroup <= whole; n += NG * kQ8RowGroup) q8_groups<MR, NG>(xq, xd, xo, wq, wd, out, K, n);
  for (; n < whole; n += kQ8RowGroup) q8_groups<MR, 1>(xq, xd, xo, wq, wd, out, K, n);
#endif
  q8_outputs_one_by_one<MR>(xq, xd, wq, wd, out, K, N, n, n1);
}

void q8_columns(const int8_t* xq, const float* xd, const int32_t* xo, const int8_t* wq, const float* wd,
                float* const* out, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ8Block;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int8_t* xm = xq + m0 * K;
    const float* dm = xd + m0 * nb;
    const int32_t* offsets = xo + m0 * nb;
    float* const* om = out + m0;
    switch (std::min<int64_t>(kRowBlock, M - m0)) {
      case 1: q8_row_block<1, 4>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
      case 2: q8_row_block<2, 2>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
      case 3: q8_row_block<3, 2>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
      default: q8_row_block<4, 2>(xm, dm, offsets, wq, wd, om, K, N, n0, n1); break;
    }
  }
}

constexpr int64_t kMinParallelInput = 1 << 15;  // x's elements times cost_per_element below which one thread
                                                // prepares the input (quantizing alone costs 1, a silu about 8)

// The product of the live rows of x, each row's input written by input(m, buffer) (a pointer to K floats: x's row
// itself, or `buffer` after a prologue); rows are prepared and quantized on the pool's threads where
// L * K * cost_per_element reaches kMinParallelInput.
template <typename Input>
ffi::Error q8_product(ffi::ThreadPool& pool, const int32_t* live, int64_t M, int64_t K, const int8_t* wqp,
                      const float* wdp, int64_t N, float* out, int64_t cost_per_element, const Input& input) {
  // The live rows of x quantized, in buffers kept by the calling thread like the rows themselves (LiveRows).
  thread_local LiveRows rows;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int32_t> xo;  // x_block_offsets (VNNI)
  rows.find(live, M, out, N);
  const int64_t L = rows.count(), nb = K / kQ8Block;
  if (L == 0) return ffi::Error::Success();
  if (xq.size() < size_t(L * K)) xq.resize(L * K);
  if (xd.size() < size_t(L * nb)) xd.resize(L * nb);
  {
    const int64_t* index = rows.index.data();
    int8_t* q = xq.data();
    float* d = xd.data();
    gdnspec::over_chunks(pool, L, L * K * cost_per_element >= kMinParallelInput, [=, &input](int64_t i) {
      thread_local std::vector<float> buffer;  // this thread's prologue output
      if (buffer.size() < size_t(K)) buffer.resize(K);
      quantize_rows_q8_0(input(index[i], buffer.data()), 1, K, q + i * K, d + i * nb);
    });
  }
#if GDNSPEC_VNNI
  if (xo.size() < size_t(L * nb)) xo.resize(L * nb);
  x_block_offsets(xq.data(), L * nb, xo.data());
#endif
  const int32_t* xop = xo.data();
  const int8_t* xqp = xq.data();
  const float* xdp = xd.data();
  float* const* op = rows.out.data();
  over_columns(pool, N, L * N * K, kQ8MinParallelWork,
               [=](int64_t n0, int64_t n1) { q8_columns(xqp, xdp, xop, wqp, wdp, op, L, K, N, n0, n1); });
  return ffi::Error::Success();
}

ffi::Error q8_shapes(const char* name, ffi::Span<const int64_t> qs, ffi::Span<const int64_t> ds, int64_t K) {
  if (qs.size() != 2 || ds.size() != 2 || qs[1] != K || K % kQ8Block != 0 || ds[0] != qs[0] ||
      ds[1] != K / kQ8Block)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": quants are [N, K] and scales [N, K / 32], with K a multiple of 32 (x's "
                                       "K, or half of it for swiglu)");
  return ffi::Error::Success();
}

ffi::Error Q8RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wq,
                        ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xs = x.dimensions();
  if (xs.size() != 2) return ffi::Error::InvalidArgument("q8_rows_matmul: x must be [M, K]");
  const int64_t M = xs[0], K = xs[1];
  if (auto error = q8_shapes("q8_rows_matmul", wq.dimensions(), wd.dimensions(), K); error.failure()) return error;
  if (live.element_count() != M) return ffi::Error::InvalidArgument("q8_rows_matmul: live is [M]");
  const float* xp = x.typed_data();
  return q8_product(pool, live.typed_data(), M, K, wq.typed_data(), wd.typed_data(), wq.dimensions()[0],
                    out->typed_data(), 1, [=](int64_t m, float*) { return xp + m * K; });
}

// ---------------------------------------------------------------------------------------------- Prologues
//
// What a product's input still needs, done to each live row of x just before it is quantized, so that a norm or a
// gate costs no XLA operations of its own (at the bundled model's sizes each was two or three operations costing
// more to launch than to run):
//   kRmsNorm       x [M, K], weight [K]:              y = x / sqrt(mean(x^2) + eps) * weight
//   kSwiglu        x [M, 2K] (gate | up):             y = silu(gate) * up
//   kGatedRmsNorm  x [M, K], weight [G], gate [M, K]: per group of G columns,
//                                                     y = x / sqrt(mean(x^2) + eps) * weight * silu(gate)
// A row's y depends on that row alone, computed in one fixed order (the sum of squares in eight lanes over the
// columns in order, the lanes added in order, then the tail; silu by exp8 in every lane and tail), so a token's
// product is the same bits in any step and batch. Their jnp form (`prologue_reference` in cpu_matmul.py) computes
// the same values to within rounding.

enum Prologue : int32_t { kRmsNorm = 1, kSwiglu = 2, kGatedRmsNorm = 3 };

// 1 / sqrt(mean(x[0, n)^2) + eps).
float inverse_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(gdnspec::dot(x, x, n) / float(n) + eps);
}

// y[0, n) = x * scale * weight (* silu(gate) where gate is given).
void scaled_row(const float* x, float scale, const float* weight, const float* gate, int64_t n, float* y) {
  const int64_t n8 = n & ~int64_t(7);
  const v8 s = splat(scale);
  for (int64_t k = 0; k < n8; k += 8) {
    v8 v = *(const v8*)(x + k) * s * *(const v8*)(weight + k);
    if (gate) v = v * silu8(*(const v8*)(gate + k));
    *(v8*)(y + k) = v;
  }
  for (int64_t k = n8; k < n; ++k) {
    float v = x[k] * scale * weight[k];
    if (gate) v = v * silu8(splat(gate[k]))[0];
    y[k] = v;
  }
}

// Checks a prologue's operands and runs product(cost_per_element, input) with the function that writes a live
// row's input (`q8_product`'s and `block_product`'s `input`). x is [M, K], or [M, 2K] for swiglu.
template <typename Product>
ffi::Error with_prologue(const char* name, int32_t prologue, const float* xp, int64_t M, int64_t x_cols, int64_t K,
                         const float* wp, int64_t G, const float* zp, int64_t gate_count, float eps,
                         const Product& product) {
  switch (prologue) {
    case kRmsNorm:
      if (G != K) return ffi::Error::InvalidArgument(std::string(name) + ": rms_norm's weight is [K]");
      return product(2, [=](int64_t m, float* y) {
        const float* row = xp + m * K;
        scaled_row(row, inverse_rms(row, K, eps), wp, nullptr, K, y);
        return (const float*)y;
      });
    case kSwiglu:
      if (x_cols != 2 * K) return ffi::Error::InvalidArgument(std::string(name) + ": swiglu's x is [M, 2K]");
      return product(8, [=](int64_t m, float* y) {
        const float *g = xp + m * 2 * K, *u = g + K;
        const int64_t K8 = K & ~int64_t(7);
        for (int64_t k = 0; k < K8; k += 8) *(v8*)(y + k) = silu8(*(const v8*)(g + k)) * *(const v8*)(u + k);
        for (int64_t k = K8; k < K; ++k) y[k] = silu8(splat(g[k]))[0] * u[k];
        return (const float*)y;
      });
    case kGatedRmsNorm:
      if (G < 1 || K % G != 0 || gate_count != M * K)
        return ffi::Error::InvalidArgument(std::string(name) +
                                           ": the gated norm's weight is [G] with K a multiple of G, its gate [M, K]");
      return product(8, [=](int64_t m, float* y) {
        for (int64_t g0 = m * K; g0 < (m + 1) * K; g0 += G)
          scaled_row(xp + g0, inverse_rms(xp + g0, G, eps), wp, zp + g0, G, y + g0 - m * K);
        return (const float*)y;
      });
    default:
      return ffi::Error::InvalidArgument(std::string(name) + ": unknown prologue " + std::to_string(prologue));
  }
}

ffi::Error Q8RowsMatmulPrologue(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wq,
                                ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> weight,
                                ffi::Buffer<ffi::F32> gate, ffi::ResultBuffer<ffi::F32> out, int32_t prologue,
                                float eps) {
  const auto xs = x.dimensions();
  if (xs.size() != 2) return ffi::Error::InvalidArgument("q8_rows_matmul_prologue: x must be 2-D");
  const int64_t M = xs[0], K = prologue == kSwiglu ? xs[1] / 2 : xs[1];
  if (auto error = q8_shapes("q8_rows_matmul_prologue", wq.dimensions(), wd.dimensions(), K); error.failure())
    return error;
  if (live.element_count() != M) return ffi::Error::InvalidArgument("q8_rows_matmul_prologue: live is [M]");
  const int8_t* wqp = wq.typed_data();
  const float* wdp = wd.typed_data();
  const int64_t N = wq.dimensions()[0];
  float* op = out->typed_data();
  const int32_t* lp = live.typed_data();
  return with_prologue("q8_rows_matmul_prologue", prologue, x.typed_data(), M, xs[1], K, weight.typed_data(),
                       weight.element_count(), gate.typed_data(), gate.element_count(), eps,
                       [&](int64_t cost, const auto& input) {
                         return q8_product(pool, lp, M, K, wqp, wdp, N, op, cost, input);
                       });
}

// ---------------------------------------------------------------------------------------------- Block formats
//
// out[M, N] = x[M, K] @ dequant(w[N, K / block * bytes])^T for weights kept as their file's ggml blocks (Q4_0, Q5_0,
// Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; cpu_blocks.h), one weight row after another as the file holds them: each live row
// of x quantized as llama.cpp quantizes it for that type (Q8_0 or Q8_K, into the format's activation records), then
// per weight row its blocks multiplied into up to four rows of x at a time, the row's bytes staying in L1 for the
// next four. A row's result depends on that row of x only.

namespace blk = gdnspec::blocks;

#if GDNSPEC_BLOCKS
template <typename Format>
constexpr int64_t block_of() { return Format::kBlock; }

// Activation records of a row of K inputs (a record holds one block, or two for the 512-bit 32-weight products).
template <typename Format>
constexpr int64_t records_of(int64_t K) {
  constexpr int64_t per = sizeof(Format::Act::qs);
  return (K + per - 1) / per;
}

inline void quantize_act(const float* x, int64_t K, blk::ActQ8_K* y) { blk::quantize_row_q8_K(x, K, y); }
inline void quantize_act(const float* x, int64_t K, blk::ActQ8_KS* y) { blk::quantize_row_q8_KS(x, K, y); }
inline void quantize_act(const float* x, int64_t K, blk::ActQ8_0* y) {
  for (int64_t b = 0; b < K / 32; ++b) quantize_rows_q8_0(x + 32 * b, 1, 32, y[b].qs, &y[b].d);
}
#if GDNSPEC_BLOCKS512
template <int kOffset>
void quantize_act(const float* x, int64_t K, blk::ActQ8_0x2<kOffset>* y) {
  std::memset(y, 0, (K + 63) / 64 * sizeof *y);
  for (int64_t b = 0; b < K / 32; ++b) {
    auto& record = y[b / 2];
    const int half = int(b % 2);
    float d;
    quantize_rows_q8_0(x + 32 * b, 1, 32, record.qs + 32 * half, &d);
    x_block_offsets(record.qs + 32 * half, 1, &record.offset[8 * half], kOffset);
    for (int l = 0; l < 8; ++l) record.d[8 * half + l] = d;
  }
}
#endif

template <typename Format>
void block_columns(const uint8_t* w, const typename Format::Act* x, float* const* out, int64_t L, int64_t nb,
                   int64_t n0, int64_t n1) {
  using Act = typename Format::Act;
  const int64_t records = records_of<Format>(nb * Format::kBlock);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * nb * Format::kBytes;
    for (int64_t m0 = 0; m0 < L; m0 += kRowBlock) {
      const Act* rows[kRowBlock];
      float sums[kRowBlock];
      const int mr = int(std::min<int64_t>(kRowBlock, L - m0));
      for (int r = 0; r < mr; ++r) rows[r] = x + (m0 + r) * records;
      switch (mr) {
        case 1: Format::template dot<1>(wn, rows, nb, sums); break;
        case 2: Format::template dot<2>(wn, rows, nb, sums); break;
        case 3: Format::template dot<3>(wn, rows, nb, sums); break;
        default: Format::template dot<4>(wn, rows, nb, sums); break;
      }
      for (int r = 0; r < mr; ++r) out[m0 + r][n] = sums[r];
    }
  }
}

// ---------------------------------------------------------------------------------------------- Q4_0 row groups
//
// Q4_0 weights as `interleave_block_rows` (cpu_matmul.py) stores them at load: rows in groups of eight (the last may
// hold fewer, g), each group block after block, a block being 18 g bytes: the g rows' f16 scales, then for
// q = 0..3 bytes 4q..4q+3 of each row's 16 bytes of nibbles in turn. One 32-byte load of quad q holds, in its low
// nibbles, weights 4q..4q+3 of each of eight rows and, in its high nibbles, weights 16+4q..16+4q+3: as in the Q8_0
// layout, one integer product of such a vector with four bytes of x broadcast adds to eight lanes, one per weight
// row, so a block's whole product ends in one lane, then one conversion and one FMA serve eight outputs. The
// per-row form of Q4_0 (cpu_blocks.h) keeps eight or sixteen lanes per output and converts and scales them all for
// every row of x, which bounds a 4-token verify by instructions rather than by memory.
//
// Each output: acc = fma(d_w * d_x, float(dot_b), acc) block after block, dot_b = sum(nibble * x_q) - 8 sum(x_q)
// exact, whatever M, the tile and the instructions (VNNI's `vpdpbusd`, or `maddubs` and `madd`).

// Asks for the cache lines of [p, p + bytes) ahead of their use. The row-group products read a group's block of a
// few KB at a time and then compute on it for longer than the per-row forms do, so the hardware prefetcher alone
// left their loads and arithmetic apart (docs/performance.md, "K-quant weights stay in their blocks", 6). A hint:
// an address past the weight's end does not fault.
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char*)(p + line), _MM_HINT_T0);
}

// The rows of x four at a time (then what is left) for a format over row groups: run(mr, rows, out) with mr the
// number of rows as a std::integral_constant (a template argument: decltype(mr)::value), rows[r] row m0 + r's nb
// activation records and out its outputs, for m0 = 0, 4, ...
template <typename Act, typename Run>
void rows_of_x_by_four(const Act* x, float* const* out, int64_t L, int64_t nb, const Run& run) {
  for (int64_t m0 = 0; m0 < L; m0 += kRowBlock) {
    const Act* rows[kRowBlock];
    const int mr = int(std::min<int64_t>(kRowBlock, L - m0));
    for (int r = 0; r < mr; ++r) rows[r] = x + (m0 + r) * nb;
    switch (mr) {
      case 1: run(std::integral_constant<int, 1>{}, rows, out + m0); break;
      case 2: run(std::integral_constant<int, 2>{}, rows, out + m0); break;
      case 3: run(std::integral_constant<int, 3>{}, rows, out + m0); break;
      default: run(std::integral_constant<int, 4>{}, rows, out + m0); break;
    }
  }
}

// Outputs [n0, n1) group by group: whole(n) for each whole group of G rows from n, part(n, g) for a last group of
// g < G rows (only the last chunk of `over_columns` ends in one).
template <int64_t G, typename Whole, typename Part>
void by_groups(int64_t n0, int64_t n1, const Whole& whole, const Part& part) {
  for (int64_t n = n0; n < n1; n += G) {
    if (n + G <= n1)
      whole(n);
    else
      part(n, n1 - n);
  }
}

struct Q4_0Rows {
  using Act = blk::ActQ8_0Sum;
  static constexpr int64_t kBytes = 18, kBlock = 32, kGroup = blk::kRowGroup;
  static void columns(const uint8_t* w, const Act* x, float* const* out, int64_t L, int64_t nb, int64_t n0,
                      int64_t n1);
};

inline void quantize_act(const float* x, int64_t K, blk::ActQ8_0Sum* y) {
  for (int64_t b = 0; b < K / 32; ++b) {
    quantize_rows_q8_0(x + 32 * b, 1, 32, y[b].qs, &y[b].d);
    x_block_offsets(y[b].qs, 1, &y[b].offset, 8);
  }
}

// acc + the sums of four products of unsigned bytes u (0-15 here) and signed bytes s, per int32 lane.
inline __m256i dot_nibbles(__m256i acc, __m256i u, __m256i s) {
#if GDNSPEC_VNNI && !defined(GDNSPEC_BLOCKS_AVX2_ONLY)
  return dot_bytes(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Outputs [n, n + 8) of MR rows of x (x[m]: row m's records): one whole group, the weight loaded and unpacked once
// for the MR rows. (Two or four groups side by side, as the Q8_0 product takes them, read from memory at half the
// rate: docs/performance.md, "K-quant weights stay in their blocks", 5.)
template <int MR>
void q4_0_group(const uint8_t* w, const blk::ActQ8_0Sum* const* x, float* const* out, int64_t nb, int64_t n) {
  constexpr int64_t kGroupBlock = blk::kRowGroup * Q4_0Rows::kBytes, kAhead = 8 * kGroupBlock;
  const __m256i low4 = _mm256_set1_epi8(0xF);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* group = w + n * nb * Q4_0Rows::kBytes + b * kGroupBlock;
    prefetch(group + kAhead, kGroupBlock);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)group));
    // Lane r: block b's integer product of weight row n + r and row m of x, its first and last 16 weights'
    // products in two chains.
    __m256i dot[MR], dot_high[MR];
    for (int m = 0; m < MR; ++m) {
      dot[m] = _mm256_set1_epi32(x[m][b].offset);
      dot_high[m] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256i bytes = _mm256_loadu_si256((const __m256i*)(group + 16 + 32 * q));
      const __m256i low = _mm256_and_si256(bytes, low4), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      for (int m = 0; m < MR; ++m) {
        int32_t first, second;
        std::memcpy(&first, x[m][b].qs + 4 * q, 4);
        std::memcpy(&second, x[m][b].qs + 16 + 4 * q, 4);
        dot[m] = dot_nibbles(dot[m], low, _mm256_set1_epi32(first));
        dot_high[m] = dot_nibbles(dot_high[m], high, _mm256_set1_epi32(second));
      }
    }
    for (int m = 0; m < MR; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x[m][b].d)),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(dot[m], dot_high[m])), acc[m]);
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out[m] + n, acc[m]);
}

// Outputs [first, first + g) of MR rows of x, one at a time in the kernel's order: a last group of g < 8 rows.
template <int MR>
void q4_0_outputs_one_by_one(const uint8_t* w, const blk::ActQ8_0Sum* const* x, float* const* out, int64_t nb,
                             int64_t first, int64_t g) {
  for (int64_t r = 0; r < g; ++r)
    for (int m = 0; m < MR; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w + first * nb * Q4_0Rows::kBytes + b * g * Q4_0Rows::kBytes;
        int32_t dot = x[m][b].offset;
        for (int k = 0; k < 32; ++k) {
          const uint8_t byte = block[2 * g + (k % 16 / 4) * 4 * g + 4 * r + k % 4];
          dot += int32_t(k < 16 ? byte & 0xF : byte >> 4) * int32_t(x[m][b].qs[k]);
        }
        acc = std::fma(blk::half(block + 2 * r) * x[m][b].d, float(dot), acc);
      }
      out[m][first + r] = acc;
    }
}

// As block_columns, for Q4_0 in row groups: [n0, n1) starts at a group's start (over_columns' chunks are whole
// groups), and only the last chunk ends in a group of fewer rows.
void Q4_0Rows::columns(const uint8_t* w, const blk::ActQ8_0Sum* x, float* const* out, int64_t L, int64_t nb,
                       int64_t n0, int64_t n1) {
  rows_of_x_by_four(x, out, L, nb, [&](auto mr, const blk::ActQ8_0Sum* const* rows, float* const* om) {
    constexpr int MR = decltype(mr)::value;
    by_groups<kGroup>(n0, n1, [&](int64_t n) { q4_0_group<MR>(w, rows, om, nb, n); },
                      [&](int64_t n, int64_t g) { q4_0_outputs_one_by_one<MR>(w, rows, om, nb, n, g); });
  });
}

#if GDNSPEC_BLOCKS512
// ---------------------------------------------------------------------------------------------- Q4_K row groups
//
// Q4_K weights as `interleave_block_rows` stores them at load: rows in groups of sixteen (the last may hold fewer,
// g), each group super-block after super-block, a super-block being 144 g bytes: the g rows' f16 d, their f16
// dmin, scale byte i of each row for i = 0..11, then the nibbles four bytes of each row at a time (Q5_K: 176 g
// bytes, the fifth bits' 32 bytes four at a time before the nibbles; bit 2c of qh unit q is the fifth bit of the
// low nibbles of unit 8c + q, bit 2c + 1 of its high nibbles, as in ggml's dequantize_row_q5_K). One 64-byte
// load of unit 8c + q holds, in its low nibbles, weights 64c+4q..64c+4q+3 (sub-block 2c) of each of sixteen rows
// and in its high nibbles weights 64c+32+4q.. (sub-block 2c+1), so `vpdpbusd` with four bytes of x broadcast adds
// into one int32 lane per weight row, a sub-block's sum after eight; the sixteen rows' scales and mins are
// unpacked once for all rows of x (the per-row form unpacks them, and converts and scales its lanes, per row and
// super-block, which bounds a 4-token verify by instructions). Per output and super-block, in float:
//   t = sum over c of (d sc_2c) lo_c + (d sc_2c+1) hi_c, then t += (-dmin) sum_j m_j sum_j(x_q) (`vpdpwssd` over
//   pairs of sub-blocks), then acc = fma(d_x, t, acc)
// in that order whatever M, so a row's result depends on its x alone.

// t + coefficient * sum_i pairs[i] . (sums[2i], sums[2i+1]), sixteen weight rows in the lanes (pairs[i]: int16
// pairs, one per int32 lane): the part of a group's super-block sum that depends on x's sums of its sub-blocks
// (Q4_K / Q5_K: the mins; Q6_K: the offset of its 6-bit weights).
template <int kPairs>
inline __m512 plus_pair_sums(__m512 t, __m512 coefficient, const __m512i* pairs, const int16_t* sums) {
  __m512i dot = _mm512_setzero_si512();
  for (int i = 0; i < kPairs; ++i) {
    int32_t pair;
    std::memcpy(&pair, sums + 2 * i, 4);
    dot = _mm512_dpwssd_epi32(dot, pairs[i], _mm512_set1_epi32(pair));
  }
  return _mm512_fmadd_ps(coefficient, _mm512_cvtepi32_ps(dot), t);
}

template <bool kFifthBit>
struct QK45Rows {
  using Act = blk::ActQ8_KG;
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144, kBlock = 256, kGroup = 16;
  static constexpr int64_t kQuants = kFifthBit ? 48 : 16;  // where the nibbles start, per row of the group
  static void columns(const uint8_t* w, const Act* x, float* const* out, int64_t L, int64_t nb, int64_t n0,
                      int64_t n1);
};
using Q4_KRows = QK45Rows<false>;
using Q5_KRows = QK45Rows<true>;

inline void quantize_act(const float* x, int64_t K, blk::ActQ8_KG* y) {
  blk::ActQ8_K natural;
  for (int64_t i = 0; i < K / 256; ++i) {
    blk::quantize_row_q8_K(x + 256 * i, 256, &natural);
    std::memcpy(y[i].qs, natural.qs, sizeof natural.qs);
    y[i].d = natural.d;
    for (int j = 0; j < 8; ++j) y[i].sub_sums[j] = int16_t(natural.bsums[2 * j] + natural.bsums[2 * j + 1]);
  }
}

// ggml's get_scale_min_k4 for sixteen rows at once: sub-block j's six-bit scale and min of each row, as bytes,
// from the rows' scale bytes s[i] (byte i of each row).
inline void scales_mins16(const __m128i* s, int j, __m128i& scale, __m128i& min) {
  const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(0x30);
  if (j < 4) {
    scale = _mm_and_si128(s[j], m63);
    min = _mm_and_si128(s[j + 4], m63);
  } else {
    scale = _mm_or_si128(_mm_and_si128(s[j + 4], m15), _mm_and_si128(_mm_srli_epi16(s[j - 4], 2), m48));
    min = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 4], 4), m15), _mm_and_si128(_mm_srli_epi16(s[j], 2), m48));
  }
}

// Outputs [n, n + 16) of MR rows of x: one whole group.
template <bool kFifthBit, int MR>
void qk45_group(const uint8_t* w, const blk::ActQ8_KG* const* x, float* const* out, int64_t nb, int64_t n) {
  using Rows = QK45Rows<kFifthBit>;
  constexpr int64_t G = Rows::kGroup, kGroupBlock = G * Rows::kBytes, kPrefetchAhead = 2 * kGroupBlock;
  const __m512i low4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1);
  const uint8_t* group = w + n * nb * Rows::kBytes;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kGroupBlock;
    prefetch(block + kPrefetchAhead, kGroupBlock);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block));
    const __m512 neg_dmin = _mm512_xor_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 2 * G))),
                                          _mm512_set1_ps(-0.f));
    __m128i s[12], mins[8];
    for (int i = 0; i < 12; ++i) s[i] = _mm_loadu_si128((const __m128i*)(block + 4 * G + G * i));
    __m512 scale[8];
    for (int j = 0; j < 8; ++j) {
      __m128i sc;
      scales_mins16(s, j, sc, mins[j]);
      scale[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    }
    __m512i min_pairs[4];  // int32 lane r: the int16 pair (m_2i, m_2i+1) of row r
    for (int i = 0; i < 4; ++i)
      min_pairs[i] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(mins[2 * i], mins[2 * i + 1]),
                                                           _mm_unpacklo_epi8(mins[2 * i], mins[2 * i + 1])));
    const uint8_t *qh = block + 16 * G, *qs = block + Rows::kQuants * G;
    __m512 t[MR];
    for (int m = 0; m < MR; ++m) t[m] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      __m512i low_sum[MR], high_sum[MR];
      for (int m = 0; m < MR; ++m) low_sum[m] = high_sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const __m512i v = _mm512_loadu_si512((const void*)(qs + (8 * c + q) * 4 * G));
        __m512i low = _mm512_and_si512(v, low4), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (kFifthBit) {
          const __m512i bits = _mm512_loadu_si512((const void*)(qh + q * 4 * G));
          low = _mm512_or_si512(low, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(bits, 2 * c), one), 4));
          high = _mm512_or_si512(high,
                                 _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(bits, 2 * c + 1), one), 4));
        }
        for (int m = 0; m < MR; ++m) {
          int32_t first, second;
          std::memcpy(&first, x[m][b].qs + 64 * c + 4 * q, 4);
          std::memcpy(&second, x[m][b].qs + 64 * c + 32 + 4 * q, 4);
          low_sum[m] = _mm512_dpbusd_epi32(low_sum[m], low, _mm512_set1_epi32(first));
          high_sum[m] = _mm512_dpbusd_epi32(high_sum[m], high, _mm512_set1_epi32(second));
        }
      }
      for (int m = 0; m < MR; ++m) {
        t[m] = _mm512_fmadd_ps(scale[2 * c], _mm512_cvtepi32_ps(low_sum[m]), t[m]);
        t[m] = _mm512_fmadd_ps(scale[2 * c + 1], _mm512_cvtepi32_ps(high_sum[m]), t[m]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      t[m] = plus_pair_sums<4>(t[m], neg_dmin, min_pairs, x[m][b].sub_sums);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][b].d), t[m], acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out[m] + n, acc[m]);
}

// Outputs [first, first + g) of MR rows of x, one at a time in the kernel's order: a last group of g < 16 rows.
template <bool kFifthBit, int MR>
void qk45_outputs_one_by_one(const uint8_t* w, const blk::ActQ8_KG* const* x, float* const* out, int64_t nb,
                             int64_t first, int64_t g) {
  using Rows = QK45Rows<kFifthBit>;
  constexpr int64_t B = Rows::kBytes;
  for (int64_t r = 0; r < g; ++r)
    for (int m = 0; m < MR; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w + first * nb * B + b * g * B;
        const float d = blk::half(block + 2 * r), neg_dmin = -blk::half(block + 2 * g + 2 * r);
        uint8_t s[12];
        for (int i = 0; i < 12; ++i) s[i] = block[4 * g + g * i + r];
        int32_t scale[8], min[8];
        for (int j = 0; j < 8; ++j) {
          scale[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
          min[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        const blk::ActQ8_KG& xb = x[m][b];
        float t = 0.f;
        for (int c = 0; c < 4; ++c) {
          int32_t low = 0, high = 0;
          for (int q = 0; q < 8; ++q)
            for (int k = 0; k < 4; ++k) {
              const uint8_t byte = block[Rows::kQuants * g + (8 * c + q) * 4 * g + 4 * r + k];
              const int bits = kFifthBit ? block[16 * g + q * 4 * g + 4 * r + k] : 0;
              low += int32_t((byte & 0xF) | (bits >> (2 * c) & 1) << 4) * xb.qs[64 * c + 4 * q + k];
              high += int32_t((byte >> 4) | (bits >> (2 * c + 1) & 1) << 4) * xb.qs[64 * c + 32 + 4 * q + k];
            }
          t = std::fma(d * float(scale[2 * c]), float(low), t);
          t = std::fma(d * float(scale[2 * c + 1]), float(high), t);
        }
        int32_t min_dot = 0;
        for (int j = 0; j < 8; ++j) min_dot += min[j] * xb.sub_sums[j];
        t = std::fma(neg_dmin, float(min_dot), t);
        acc = std::fma(xb.d, t, acc);
      }
      out[m][first + r] = acc;
    }
}

template <bool kFifthBit>
void QK45Rows<kFifthBit>::columns(const uint8_t* w, const blk::ActQ8_KG* x, float* const* out, int64_t L,
                                  int64_t nb, int64_t n0, int64_t n1) {
  rows_of_x_by_four(x, out, L, nb, [&](auto mr, const blk::ActQ8_KG* const* rows, float* const* om) {
    constexpr int MR = decltype(mr)::value;
    by_groups<kGroup>(n0, n1, [&](int64_t n) { qk45_group<kFifthBit, MR>(w, rows, om, nb, n); },
                      [&](int64_t n, int64_t g) { qk45_outputs_one_by_one<kFifthBit, MR>(w, rows, om, nb, n, g); });
  });
}

// ---------------------------------------------------------------------------------------------- Q6_K row groups
//
// Q6_K weights in groups of sixteen rows (`interleave_block_rows`): per super-block, 210 g bytes: the rows' `ql`
// four bytes of each row at a time, their `qh` likewise, scale byte i of each row for i = 0..15, their f16 d. For
// half h and unit u, the 64-byte vectors of ql units 16h + u and 16h + 8 + u and qh unit 8h + u give four 6-bit
// weights of each of sixteen rows in four places of the super-block (128h + 32k + 4u, k = 0..3: ggml's
// dequantize_row_q6_K), stored unsigned (q + 32): `vpdpbusd` sums each 16-weight sub-block into one int32 lane per
// weight row. Per output and super-block, in float:
//   t = sum over sub-blocks j of (d sc_j) sum_j, then t += (-32 d) sum_j sc_j sum_j(x_q) (`vpdpwssd` over pairs
//   of sub-blocks), then acc = fma(d_x, t, acc)
// in that order whatever M.

struct Q6_KRows {
  using Act = blk::ActQ8_K;
  static constexpr int64_t kBytes = 210, kBlock = 256, kGroup = 16;
  static void columns(const uint8_t* w, const Act* x, float* const* out, int64_t L, int64_t nb, int64_t n0,
                      int64_t n1);
};

// Outputs [n, n + 16) of MR rows of x: one whole group.
template <int MR>
void q6_k_group(const uint8_t* w, const blk::ActQ8_K* const* x, float* const* out, int64_t nb, int64_t n) {
  constexpr int64_t G = Q6_KRows::kGroup, kGroupBlock = G * Q6_KRows::kBytes;
  const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(48);
  const uint8_t* group = w + n * nb * Q6_KRows::kBytes;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kGroupBlock;
    prefetch(block + 2 * kGroupBlock, kGroupBlock);
    const uint8_t *ql = block, *qh = block + 128 * G, *scales = block + 192 * G;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 208 * G)));
    __m512 scale[16];
    for (int j = 0; j < 16; ++j)
      scale[j] = _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(scales + G * j)))));
    __m512i scale_pairs[8];  // int32 lane r: the int16 pair (sc_2i, sc_2i+1) of row r
    for (int i = 0; i < 8; ++i) {
      const __m128i a = _mm_loadu_si128((const __m128i*)(scales + G * 2 * i));
      const __m128i c = _mm_loadu_si128((const __m128i*)(scales + G * (2 * i + 1)));
      scale_pairs[i] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, c), _mm_unpacklo_epi8(a, c)));
    }
    __m512 t[MR];
    for (int m = 0; m < MR; ++m) t[m] = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h)
      for (int quarter = 0; quarter < 2; ++quarter) {  // units u = 4 quarter + 0..3: sub-blocks 8h + quarter + 2k
        __m512i sum[MR][4];
        for (int m = 0; m < MR; ++m)
          for (int k = 0; k < 4; ++k) sum[m][k] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const int u = 4 * quarter + v;
          const __m512i low = _mm512_loadu_si512((const void*)(ql + (16 * h + u) * 4 * G));
          const __m512i high = _mm512_loadu_si512((const void*)(ql + (16 * h + 8 + u) * 4 * G));
          const __m512i bits = _mm512_loadu_si512((const void*)(qh + (8 * h + u) * 4 * G));
          __m512i q[4];
          q[0] = _mm512_or_si512(_mm512_and_si512(low, m15), _mm512_and_si512(_mm512_slli_epi16(bits, 4), m48));
          q[1] = _mm512_or_si512(_mm512_and_si512(high, m15), _mm512_and_si512(_mm512_slli_epi16(bits, 2), m48));
          q[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), m15), _mm512_and_si512(bits, m48));
          q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(high, 4), m15),
                                 _mm512_and_si512(_mm512_srli_epi16(bits, 2), m48));
          for (int m = 0; m < MR; ++m)
            for (int k = 0; k < 4; ++k) {
              int32_t quad;
              std::memcpy(&quad, x[m][b].qs + 128 * h + 32 * k + 4 * u, 4);
              sum[m][k] = _mm512_dpbusd_epi32(sum[m][k], q[k], _mm512_set1_epi32(quad));
            }
        }
        for (int m = 0; m < MR; ++m)
          for (int k = 0; k < 4; ++k)
            t[m] = _mm512_fmadd_ps(scale[8 * h + 2 * k + quarter], _mm512_cvtepi32_ps(sum[m][k]), t[m]);
      }
    const __m512 offset = _mm512_mul_ps(d, _mm512_set1_ps(-32.f));
    for (int m = 0; m < MR; ++m) {
      t[m] = plus_pair_sums<8>(t[m], offset, scale_pairs, x[m][b].bsums);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][b].d), t[m], acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out[m] + n, acc[m]);
}

// Outputs [first, first + g) of MR rows of x, one at a time in the kernel's order: a last group of g < 16 rows.
template <int MR>
void q6_k_outputs_one_by_one(const uint8_t* w, const blk::ActQ8_K* const* x, float* const* out, int64_t nb,
                             int64_t first, int64_t g) {
  constexpr int64_t B = Q6_KRows::kBytes;
  for (int64_t r = 0; r < g; ++r)
    for (int m = 0; m < MR; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w + first * nb * B + b * g * B;
        const uint8_t *ql = block, *qh = block + 128 * g, *scales = block + 192 * g;
        const float d = blk::half(block + 208 * g + 2 * r);
        const blk::ActQ8_K& xb = x[m][b];
        float t = 0.f;
        for (int h = 0; h < 2; ++h)
          for (int quarter = 0; quarter < 2; ++quarter) {
            int32_t sum[4] = {0, 0, 0, 0};
            for (int v = 0; v < 4; ++v) {
              const int u = 4 * quarter + v;
              for (int i = 0; i < 4; ++i) {
                const int low = ql[(16 * h + u) * 4 * g + 4 * r + i], high = ql[(16 * h + 8 + u) * 4 * g + 4 * r + i];
                const int bits = qh[(8 * h + u) * 4 * g + 4 * r + i];
                const int q[4] = {(low & 15) | ((bits & 3) << 4), (high & 15) | ((bits >> 2 & 3) << 4),
                                  (low >> 4) | ((bits >> 4 & 3) << 4), (high >> 4) | ((bits >> 6 & 3) << 4)};
                for (int k = 0; k < 4; ++k) sum[k] += q[k] * xb.qs[128 * h + 32 * k + 4 * u + i];
              }
            }
            for (int k = 0; k < 4; ++k) {
              const int j = 8 * h + 2 * k + quarter;
              t = std::fma(d * float(int8_t(scales[g * j + r])), float(sum[k]), t);
            }
          }
        int32_t scaled_sums = 0;
        for (int j = 0; j < 16; ++j) scaled_sums += int32_t(int8_t(scales[g * j + r])) * xb.bsums[j];
        t = std::fma(d * -32.f, float(scaled_sums), t);
        acc = std::fma(xb.d, t, acc);
      }
      out[m][first + r] = acc;
    }
}

void Q6_KRows::columns(const uint8_t* w, const blk::ActQ8_K* x, float* const* out, int64_t L, int64_t nb,
                       int64_t n0, int64_t n1) {
  rows_of_x_by_four(x, out, L, nb, [&](auto mr, const blk::ActQ8_K* const* rows, float* const* om) {
    constexpr int MR = decltype(mr)::value;
    by_groups<kGroup>(n0, n1, [&](int64_t n) { q6_k_group<MR>(w, rows, om, nb, n); },
                      [&](int64_t n, int64_t g) { q6_k_outputs_one_by_one<MR>(w, rows, om, nb, n, g); });
  });
}
#endif

// Rows per group of a format's layout (kGroup; 1: the file's order).
template <typename F, typename = void>
struct RowGroup {
  static constexpr int64_t rows = 1;
};
template <typename F>
struct RowGroup<F, std::void_t<decltype(F::kGroup)>> {
  static constexpr int64_t rows = F::kGroup;
};

// As q8_product, for a block format.
template <typename Format, typename Input>
ffi::Error block_product(ffi::ThreadPool& pool, const int32_t* live, int64_t M, int64_t K, const uint8_t* w,
                         int64_t N, float* out, int64_t cost_per_element, const Input& input) {
  using Act = typename Format::Act;
  thread_local LiveRows rows;
  thread_local std::vector<Act> xa;
  rows.find(live, M, out, N);
  const int64_t L = rows.count(), nb = K / block_of<Format>(), records = records_of<Format>(K);
  if (L == 0) return ffi::Error::Success();
  if (xa.size() < size_t(L * records)) xa.resize(L * records);
  {
    const int64_t* index = rows.index.data();
    Act* a = xa.data();
    gdnspec::over_chunks(pool, L, L * K * cost_per_element >= kMinParallelInput, [=, &input](int64_t i) {
      thread_local std::vector<float> buffer;
      if (buffer.size() < size_t(K)) buffer.resize(K);
      quantize_act(input(index[i], buffer.data()), K, a + i * records);
    });
  }
  const Act* ap = xa.data();
  float* const* op = rows.out.data();
  constexpr int64_t group = RowGroup<Format>::rows;
  over_columns(
      pool, N, L * N * K, kQ8MinParallelWork,
      [=](int64_t n0, int64_t n1) {
        if constexpr (group > 1)
          Format::columns(w, ap, op, L, nb, n0, n1);
        else
          block_columns<Format>(w, ap, op, L, nb, n0, n1);
      },
      std::max<int64_t>(group, 8));
  return ffi::Error::Success();
}
#endif

template <typename T>
struct Tag {
  using type = T;
};

// run(Tag<Format>{}) for ggml type `type` with its rows in groups of `row_group` (1: the file's order); an error
// naming them where this build has no product for them.
template <typename Run>
ffi::Error with_format(const char* name, int32_t type, int32_t row_group, const Run& run) {
#if GDNSPEC_BLOCKS
  if (row_group != 1) {
    if (row_group == Q4_0Rows::kGroup && type == blk::kQ4_0) return run(Tag<Q4_0Rows>{});
#if GDNSPEC_BLOCKS512
    if (row_group == Q4_KRows::kGroup && type == blk::kQ4_K) return run(Tag<Q4_KRows>{});
    if (row_group == Q5_KRows::kGroup && type == blk::kQ5_K) return run(Tag<Q5_KRows>{});
    if (row_group == Q6_KRows::kGroup && type == blk::kQ6_K) return run(Tag<Q6_KRows>{});
#endif
    return ffi::Error::InvalidArgument(std::string(name) + ": no product for ggml type " + std::to_string(type) +
                                       " in row groups of " + std::to_string(row_group));
  }
  switch (type) {
    case blk::kQ4_0: return run(Tag<blk::Q4_0>{});
    case blk::kQ5_0: return run(Tag<blk::Q5_0>{});
    case blk::kQ8_0: return run(Tag<blk::Q8_0>{});
    case blk::kQ4_K: return run(Tag<blk::Q4_K>{});
    case blk::kQ5_K: return run(Tag<blk::Q5_K>{});
    case blk::kQ6_K: return run(Tag<blk::Q6_K>{});
    case blk::kIQ4_XS: return run(Tag<blk::IQ4_XS>{});
  }
  return ffi::Error::InvalidArgument(std::string(name) + ": no product for ggml type " + std::to_string(type));
#else
  return ffi::Error::InvalidArgument(std::string(name) + ": built without AVX2, F16C and FMA");
#endif
}

template <typename Format>
ffi::Error block_shapes(const char* name, ffi::Span<const int64_t> ws, int64_t K) {
#if GDNSPEC_BLOCKS
  const int64_t block = block_of<Format>();
  if (ws.size() == 2 && K % block == 0 && ws[1] == K / block * Format::kBytes) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + ": w is [N, K / " + std::to_string(block) + " * " +
                                     std::to_string(Format::kBytes) + "] bytes with K (x's, or half of it for "
                                     "swiglu) a multiple of " + std::to_string(block) + "; K is " + std::to_string(K));
#else
  return ffi::Error::Success();
#endif
}

ffi::Error BlockRowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out, int32_t type,
                           int32_t row_group) {
  const auto xs = x.dimensions();
  if (xs.size() != 2) return ffi::Error::InvalidArgument("block_rows_matmul: x must be [M, K]");
  const int64_t M = xs[0], K = xs[1];
  if (live.element_count() != M) return ffi::Error::InvalidArgument("block_rows_matmul: live is [M]");
  const float* xp = x.typed_data();
  return with_format("block_rows_matmul", type, row_group, [&](auto tag) {
    using Format = typename decltype(tag)::type;
    if (auto error = block_shapes<Format>("block_rows_matmul", w.dimensions(), K); error.failure()) return error;
#if GDNSPEC_BLOCKS
    return block_product<Format>(pool, live.typed_data(), M, K, w.typed_data(), w.dimensions()[0],
                                 out->typed_data(), 1, [=](int64_t m, float*) { return xp + m * K; });
#else
    return ffi::Error::Success();
#endif
  });
}

ffi::Error BlockRowsMatmulPrologue(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                                   ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> weight,
                                   ffi::Buffer<ffi::F32> gate, ffi::ResultBuffer<ffi::F32> out, int32_t type,
                                   int32_t row_group, int32_t prologue, float eps) {
  const auto xs = x.dimensions();
  if (xs.size() != 2) return ffi::Error::InvalidArgument("block_rows_matmul_prologue: x must be 2-D");
  const int64_t M = xs[0], K = prologue == kSwiglu ? xs[1] / 2 : xs[1];
  if (live.element_count() != M) return ffi::Error::InvalidArgument("block_rows_matmul_prologue: live is [M]");
  return with_format("block_rows_matmul_prologue", type, row_group, [&](auto tag) {
    using Format = typename decltype(tag)::type;
    if (auto error = block_shapes<Format>("block_rows_matmul_prologue", w.dimensions(), K); error.failure())
      return error;
    return with_prologue("block_rows_matmul_prologue", prologue, x.typed_data(), M, xs[1], K, weight.typed_data(),
                         weight.element_count(), gate.typed_data(), gate.element_count(), eps,
                         [&](int64_t cost, const auto& input) {
#if GDNSPEC_BLOCKS
                           return block_product<Format>(pool, live.typed_data(), M, K, w.typed_data(),
                                                        w.dimensions()[0], out->typed_data(), cost, input);
#else
                           return ffi::Error::Success();
#endif
                         });
  });
}

// x, quants, scales and live: what both Q8_0 targets take first.
auto q8_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S8>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>();  // live
}

// x, the blocks and live: what both block targets take first.
auto block_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::S32>>();  // live
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_rows_matmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_q8_rows_matmul, Q8RowsMatmul, q8_binding().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_q8_rows_matmul_prologue, Q8RowsMatmulPrologue,
                              q8_binding()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight (rms_norm, gated_rms_norm)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate (gated_rms_norm)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_block_rows_matmul, BlockRowsMatmul,
                              block_binding().Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("type").Attr<int32_t>(
                                  "row_group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_block_rows_matmul_prologue, BlockRowsMatmulPrologue,
                              block_binding()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight (rms_norm, gated_rms_norm)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate (gated_rms_norm)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("type")
                                  .Attr<int32_t>("row_group")
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps"));

// The block products this build has: 512 (the 512-bit forms, AVX-512 BW, VL and VNNI), 256 (AVX2, F16C and FMA),
// or 0 (none).
extern "C" int gdnspec_block_kernels() { return GDNSPEC_BLOCKS512 ? 512 : GDNSPEC_BLOCKS ? 256 : 0; }
