// Dot products of ggml block-quantized weight rows (the file's bytes, GGUF's order) with quantized activations, for
// the CPU block product (cpu_matmul.cc, "Block formats"). Each format is llama.cpp's: its block layout, the
// activation type its CPU backend quantizes x to (Q8_0 for the 32-weight blocks, Q8_K for the 256-weight super-blocks),
// and its vec_dot arithmetic (exact integer products per block or sub-block, scaled into float lanes, the lanes added
// at the end), extended to MR rows of x: a weight block is loaded and unpacked once and multiplied into every row.
// A row's sum depends on that row of x and the weight row only, in one order whatever MR, so a verify step's products
// equal a one-token step's bit for bit.
//
// Two forms. The 256-bit one (AVX2, F16C, FMA) is llama.cpp's AVX2 arithmetic: `maddubs` pair sums, scaled by
// `madd`, eight int32 lanes per block. The 512-bit one (AVX-512 BW, VL and VNNI; Q4_0, Q5_0, Q4_K, Q5_K, Q6_K)
// sums four byte products per int32 lane with `dpbusd` (or scales pair sums with `dpwssd`, Q6_K), over activations
// laid out for it (ActQ8_KS, ActQ8_0x2), sixteen lanes per block; same integers, the float lanes added in another
// order than llama.cpp's. Without AVX2 GDNSPEC_BLOCKS is 0 and the model dequantizes with jnp
// (jaxmodel/quant_blocks.py).
//
// Shapes: a weight row of K inputs is K / kBlock blocks of kBytes; an activation row is K / sizeof(Act::qs) `Act`
// records (rounded up). Every format's `dot<MR>(w, x, nb, out)`: w one weight row (nb blocks), x[m] row m's
// activation records, out[m] its sum. Reference: `block_rows_matmul_reference` in cpu_matmul.py; tests:
// tests/test_cpu_block_matmul.py (which also runs the 256-bit form on a CPU that has the 512-bit one).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GDNSPEC_BLOCKS 1
#include <immintrin.h>
#else
#define GDNSPEC_BLOCKS 0
#endif

// The 512-bit forms, where the CPU has AVX-512 BW, VL and VNNI (GDNSPEC_BLOCKS_AVX2_ONLY: the 256-bit ones).
#if GDNSPEC_BLOCKS && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && !defined(GDNSPEC_BLOCKS_AVX2_ONLY)
#define GDNSPEC_BLOCKS512 1
#else
#define GDNSPEC_BLOCKS512 0
#endif

namespace gdnspec::blocks {

// A vector's worth of constants, computed at compile time.
template <typename T, int N>
struct alignas(64) Lanes {
  T v[N];
};

// ggml's type numbers (GGMLQuantizationType).
enum Type : int32_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_XS = 23 };

// Weight rows interleaved by the Q4_0 product over row groups (`interleave_block_rows` in cpu_matmul.py).
constexpr int64_t kRowGroup = 8;

// Activations, as llama.cpp quantizes them: Q8_0 (32 int8 and an f16 scale, here held as the float it rounds to)
// and Q8_K (256 int8, a float scale, and the sums of each 16 quants).
struct ActQ8_0 {
  float d;
  int8_t qs[32];
};
struct alignas(64) ActQ8_K {  // qs first, so that the 512-bit products load whole cache lines
  int8_t qs[256];
  float d;
  int16_t bsums[16];
};

// Q8_K as the 512-bit Q4_K / Q5_K product reads it: a super-block's quants in the order it unpacks its weights
// (`sub_block_order`), so that int32 lane l of its four `dpbusd` sums sub-block `lane_sub_block(l)` alone, and
// d times the sum of each sub-block's 32 quants in those lanes (the first of each pair; 0 in the second).
struct alignas(64) ActQ8_KS {
  int8_t qs[256];
  float scaled_sums[16];
  float d;
};

// Q8_K as the Q4_K product over row groups reads it: the quants in order, d, and the sums of each 32 quants.
struct alignas(64) ActQ8_KG {
  int8_t qs[256];
  float d;
  int16_t sub_sums[8];
};

// Q8_0 and -8 times the sum of its quants: what the Q4_0 product over rows in groups of eight reads (its weights
// are the nibbles, q + 8, as unsigned bytes; the offset starts each block's integer sums).
struct ActQ8_0Sum {
  float d;
  int32_t offset;
  int8_t qs[32];
};

// Q8_0 as the 512-bit Q4_0 / Q5_0 products read it, two blocks to a record (a row of an odd number of blocks ends in
// a record whose second block is zeros): the quants, -kOffset sum(q) of block b in int32 lane 8b (0 in the others;
// the weights' offset, their stored values being q + kOffset) and block b's d in lanes 8b-8b+7.
template <int kOffset>
struct alignas(64) ActQ8_0x2 {
  int8_t qs[64];
  int32_t offset[16];
  float d[16];
};

// Vector v (0-3) of a super-block, byte p (0-63): weight 8v + p % 8 of sub-block 2 (p % 32 / 8) + p / 32.
constexpr int sub_block_order(int v, int p) { return 32 * (2 * (p % 32 / 8) + p / 32) + 8 * v + p % 8; }
constexpr int lane_sub_block(int l) { return 2 * (l % 8 / 2) + l / 8; }

#if GDNSPEC_BLOCKS

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum8(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline float hsum4(__m128 r) {
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// Sum of products of unsigned bytes u and signed bytes s, pairs added into 16 bits and then into eight int32 lanes.
inline __m256i dot_us8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The same for signed x and y (|x| carried as unsigned, its sign moved onto y).
inline __m256i dot_s8(__m256i x, __m256i y) { return dot_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x)); }

// 32 weights of 4 bits (16 bytes: low nibbles are weights 0-15, high nibbles 16-31) as bytes.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128((const __m128i*)p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
}

// 32 bits as 32 bytes, 0xFF where the bit is set.
inline __m256i bits32(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)), shuffle);
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

// ---------------------------------------------------------------------------------------------- 32-weight blocks
// w = d * q with q signed (Q8_0: int8; Q4_0: nibble - 8; Q5_0: 5 bits - 16), against Q8_0 activations:
// acc += (d_w * d_x) * sum(q * x_q) in eight lanes.

template <typename Unpack>
struct Block32 {
  using Act = ActQ8_0;
  static constexpr int64_t kBytes = Unpack::kBytes, kBlock = 32;
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = w + b * Unpack::kBytes;
      const float dw = half(block);
      const __m256i q = Unpack::quants(block);
      const __m256i q_abs = _mm256_sign_epi8(q, q);
      for (int m = 0; m < MR; ++m) {
        const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x[m][b].qs), q);
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[m][b].d), _mm256_cvtepi32_ps(dot_us8(q_abs, y)), acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]);
  }
};

struct UnpackQ8_0 {  // f16 d, 32 int8
  static constexpr int64_t kBytes = 34;
  static __m256i quants(const uint8_t* b) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
};
struct UnpackQ4_0 {  // f16 d, 16 bytes of nibbles
  static constexpr int64_t kBytes = 18;
  static __m256i quants(const uint8_t* b) { return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)); }
};
struct UnpackQ5_0 {  // f16 d, 4 bytes of fifth bits, 16 bytes of nibbles: q = nibble | bit << 4, less 16
  static constexpr int64_t kBytes = 22;
  static __m256i quants(const uint8_t* b) {
    // (nibble | 0xF0) where the bit is clear: nibble - 16 as a signed byte.
    return _mm256_or_si256(nibbles32(b + 6), _mm256_andnot_si256(bits32(b + 2), _mm256_set1_epi8(char(0xF0))));
  }
};

#if GDNSPEC_BLOCKS512
// Q4_0 / Q5_0, two blocks per 512-bit vector: the two blocks' bytes in one load (nothing read past the row),
// their nibbles spread by one byte permutation into weights 0-31 of each (the fifth bits added from a 64-bit mask),
// as unsigned q + kOffset; `dpbusd` from ActQ8_0x2's offsets sums sum(q x_q) in eight int32 lanes per block; the
// lanes scaled by d_w d_x in float.
template <typename Unpack>
struct Block32x2 {
  static constexpr int kOffset = Unpack::kOffset;
  static constexpr int64_t kBytes = Unpack::kBytes, kBlock = 32;
  using Act = ActQ8_0x2<kOffset>;
  // Bytes 0-15 and 16-31 of the vector from the first block's nibbles, 32-63 from the second's (the high nibbles,
  // weights 16-31, are shifted down in the second quarter of each); the two blocks' scales, eight lanes each.
  static constexpr Lanes<uint8_t, 64> kSpread = [] {
    Lanes<uint8_t, 64> t{};
    for (int p = 0; p < 64; ++p) t.v[p] = uint8_t((p / 32) * kBytes + Unpack::kQuants + p % 16);
    return t;
  }();
  static constexpr Lanes<uint16_t, 32> kScaleWords = [] {
    Lanes<uint16_t, 32> t{};
    for (int l = 0; l < 16; ++l) t.v[l] = uint16_t((l / 8) * kBytes / 2);
    return t;
  }();
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i spread_v = _mm512_load_si512((const __m512i*)kSpread.v);
    const __m512i scale_v = _mm512_load_si512((const __m512i*)kScaleWords.v);
    const __m512i nibble_shift = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                                   0x0004000400040004, 0x0004000400040004);
    const __m512i low4 = _mm512_set1_epi8(0xF);
    for (int64_t b = 0; b < nb; b += 2) {
      const uint8_t* blocks = w + b * kBytes;
      const bool pair = b + 1 < nb;
      // 64 bytes from the record where the row holds them, else the row's last 64 with the permutations' indices
      // moved along (a row of fewer bytes: the record's own, masked). Masked loads are not prefetched: a product
      // of them ran at a third of the rate from memory, and masking a row's last records cost it 18%.
      const int64_t left = (nb - b) * kBytes;
      __m512i raw, spread = spread_v, scale = scale_v;
      if (left >= 64) {
        raw = _mm512_loadu_si512((const void*)blocks);
      } else if (nb * kBytes >= 64) {
        raw = _mm512_loadu_si512((const void*)(blocks + left - 64));
        spread = _mm512_add_epi8(spread, _mm512_set1_epi8(char(64 - left)));
        scale = _mm512_add_epi16(scale, _mm512_set1_epi16(short((64 - left) / 2)));  // kBytes is even
      } else {
        raw = _mm512_maskz_loadu_epi8((1ull << ((pair ? 2 : 1) * kBytes)) - 1, blocks);
      }
      __m512i q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(spread, raw), nibble_shift), low4);
      if constexpr (Unpack::kFifthBits) {
        uint32_t h0, h1 = 0;
        std::memcpy(&h0, blocks + 2, 4);
        if (pair) std::memcpy(&h1, blocks + kBytes + 2, 4);
        q = _mm512_mask_add_epi8(q, _cvtu64_mask64(h0 | uint64_t(h1) << 32), q, _mm512_set1_epi8(16));
      }
      // A record of one block: its second half's scale 0 (its quants, and x's, are then read from elsewhere or 0).
      const __m512 dw = _mm512_maskz_mov_ps(pair ? 0xFFFF : 0x00FF,
                                            _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(scale, raw))));
      const int64_t r = b / 2;
      for (int m = 0; m < MR; ++m) {
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_load_si512((const __m512i*)x[m][r].offset), q,
                                                _mm512_load_si512((const __m512i*)x[m][r].qs));
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_load_ps(x[m][r].d)), _mm512_cvtepi32_ps(sum), acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
};

struct PairsQ4_0 {  // f16 d, 16 bytes of nibbles: q = nibble - 8
  static constexpr int64_t kBytes = 18, kQuants = 2;
  static constexpr int kOffset = 8;
  static constexpr bool kFifthBits = false;
};
struct PairsQ5_0 {  // f16 d, 4 bytes of fifth bits, 16 bytes of nibbles: q = (nibble | bit << 4) - 16
  static constexpr int64_t kBytes = 22, kQuants = 6;
  static constexpr int kOffset = 16;
  static constexpr bool kFifthBits = true;
};

using Q4_0 = Block32x2<PairsQ4_0>;
using Q5_0 = Block32x2<PairsQ5_0>;
#else
using Q4_0 = Block32<UnpackQ4_0>;
using Q5_0 = Block32<UnpackQ5_0>;
#endif
using Q8_0 = Block32<UnpackQ8_0>;

// ---------------------------------------------------------------------------------------------- K-quants

// Picks int16 scale i of 16 (bytes 2i, 2i+1), broadcast.
inline __m256i scale_k4(__m256i scales, int i) {
  return _mm256_shuffle_epi8(scales, _mm256_set1_epi16(short((2 * i) | ((2 * i + 1) << 8))));
}

// The eight 6-bit scales and eight 6-bit mins of a Q4_K / Q5_K super-block (12 bytes) as 16 int16: scales, mins.
inline __m256i scales_and_mins(const uint8_t* packed) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_low = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_low;
  u[0] &= kmask1;
  return _mm256_cvtepu8_epi16(_mm_set_epi32(int(u[3]), int(u[2]), int(u[1]), int(u[0])));
}

// The same 16 values as bytes, from vector operations on the 12 bytes (read as 16: a block goes on past them).
inline __m128i scale_min_bytes(const uint8_t* packed) {
  const __m128i q = _mm_loadu_si128((const __m128i*)packed);
  // sc_0-3 = q_0-3 & 63; sc_4-7 = q_8-11 & 15 | q_0-3 >> 6 << 4; m_0-3 = q_4-7 & 63; m_4-7 = q_8-11 >> 4 | q_4-7 >> 6 << 4
  const __m128i low = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i low_bits = _mm_blend_epi32(
      _mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
      _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15)), 0b1000);
  const __m128i high = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  return _mm_or_si128(low_bits, _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(0x30)));
}

// acc_m + (-d_x dmin) * sum_j m_j sum(x_q over sub-block j), in four lanes: the mins' part of a Q4_K / Q5_K super-block.
inline __m128 mins_term(__m128i mins, const ActQ8_K& x, float dmin, __m128 acc_m) {
  const __m256i bsums = _mm256_loadu_si256((const __m256i*)x.bsums);
  const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
  return _mm_fmadd_ps(_mm_set1_ps(-x.d * dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, pairs)), acc_m);
}

#if GDNSPEC_BLOCKS512
// int16 a in lanes 0-15 and b in lanes 16-31; bytes a in 0-31 and b in 32-63.
inline __m512i halves16(short a, short b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(a)), _mm256_set1_epi16(b), 1);
}
// Byte p: the bit of qh that holds the fifth bit of the weight at p in ActQ8_KS's order (bit s for sub-block s).
inline constexpr Lanes<uint8_t, 64> kFifthBitSelect = [] {
  Lanes<uint8_t, 64> t{};
  for (int p = 0; p < 64; ++p) t.v[p] = uint8_t(1 << (2 * (p % 32 / 8) + p / 32));
  return t;
}();
#endif

// Q4_K / Q5_K: 256 weights in eight sub-blocks of 32, w = d * sc_j * q - dmin * m_j (q unsigned 4 or 5 bits):
// acc += (d_x d) * sum_j sc_j sum(q x_q) in eight lanes, acc_m += (-d_x dmin) * sum_j m_j sum(x_q) in four.
template <bool kFifthBit>
struct QK45 {
  static constexpr int64_t kBlock = 256;
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144;  // f16 d, f16 dmin, 12 scale bytes, [32 qh], 128 qs
#if GDNSPEC_BLOCKS512
  // Per super-block, four vectors of 64 weights, each eight of every sub-block (ActQ8_KS's order): quadword v of
  // each 32-byte run of nibbles picked into both halves of a register (vpermt2q), the second half's high nibbles;
  // `dpbusd` sums four products per int32 lane, a lane one sub-block's; then per lane, in float,
  // (d d_x sc_j) sum(q x_q) - dmin m_j (d_x sum(x_q)).
  using Act = ActQ8_KS;
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0xF);
    const __m512i nibble_shift = halves16(0, 4);
    const __m512i lane_scale = _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 1, 1, 3, 3, 5, 5, 7, 7);
    const __m512i lane_min = _mm512_add_epi32(lane_scale, _mm512_set1_epi32(8));
    const __m512i fifth = _mm512_load_si512((const __m512i*)kFifthBitSelect.v);
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* block = w + i * kBytes;
      const __m512i sm = _mm512_cvtepu8_epi32(scale_min_bytes(block + 4));  // sc_0..7, m_0..7
      const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(half(block)),
                                       _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(lane_scale, sm)));
      const __m512 dmin = _mm512_mul_ps(_mm512_set1_ps(-half(block + 2)),
                                        _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(lane_min, sm)));
      const uint8_t* qs = block + (kFifthBit ? 48 : 16);
      const __m512i nibbles_a = _mm512_loadu_si512((const void*)qs), nibbles_b = _mm512_loadu_si512((const void*)(qs + 64));
      __m512i sumi[MR];
      for (int m = 0; m < MR; ++m) sumi[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i pick = _mm512_setr_epi64(v, 4 + v, 8 + v, 12 + v, v, 4 + v, 8 + v, 12 + v);
        __m512i q = _mm512_and_si512(
            _mm512_srlv_epi16(_mm512_permutex2var_epi64(nibbles_a, pick, nibbles_b), nibble_shift), low4);
        if constexpr (kFifthBit) {
          int64_t high;
          std::memcpy(&high, block + 16 + 8 * v, 8);
          const __mmask64 set = _mm512_test_epi8_mask(_mm512_set1_epi64(high), fifth);
          q = _mm512_mask_add_epi8(q, set, q, _mm512_set1_epi8(16));
        }
        for (int m = 0; m < MR; ++m)
          sumi[m] = _mm512_dpbusd_epi32(sumi[m], q, _mm512_load_si512((const __m512i*)(x[m][i].qs + 64 * v)));
      }
      for (int m = 0; m < MR; ++m) {
        acc[m] = _mm512_fmadd_ps(dmin, _mm512_load_ps(x[m][i].scaled_sums), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dsc, _mm512_set1_ps(x[m][i].d)), _mm512_cvtepi32_ps(sumi[m]), acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
#else
  using Act = ActQ8_K;
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    __m256 acc[MR];
    __m128 acc_m[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), acc_m[m] = _mm_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0xF);
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* block = w + i * kBytes;
      const float d = half(block), dmin = half(block + 2);
      const __m256i sm = scales_and_mins(block + 4);
      const __m128i mins = _mm256_extracti128_si256(sm, 1);
      const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
      const uint8_t* qs = block + (kFifthBit ? 48 : 16);
      const __m256i high_bits = kFifthBit ? _mm256_loadu_si256((const __m256i*)(block + 16)) : _mm256_setzero_si256();
      __m256i sumi[MR];
      for (int m = 0; m < MR; ++m) {
        acc_m[m] = mins_term(mins, x[m][i], dmin, acc_m[m]);
        sumi[m] = _mm256_setzero_si256();
      }
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        __m256i q_low = _mm256_and_si256(bits, low4);
        __m256i q_high = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
        if constexpr (kFifthBit) {
          const __m256i one = _mm256_set1_epi8(1);
          q_low = _mm256_add_epi8(q_low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high_bits, 2 * j), one), 4));
          q_high = _mm256_add_epi8(
              q_high, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high_bits, 2 * j + 1), one), 4));
        }
        const __m256i scale_low = scale_k4(scales, 2 * j), scale_high = scale_k4(scales, 2 * j + 1);
        for (int m = 0; m < MR; ++m) {
          const int8_t* q8 = x[m][i].qs + 64 * j;
          const __m256i p_low = _mm256_madd_epi16(
              scale_low, _mm256_maddubs_epi16(q_low, _mm256_loadu_si256((const __m256i*)q8)));
          const __m256i p_high = _mm256_madd_epi16(
              scale_high, _mm256_maddubs_epi16(q_high, _mm256_loadu_si256((const __m256i*)(q8 + 32))));
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p_low, p_high));
        }
      }
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m][i].d * d), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
    }
    for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]) + hsum4(acc_m[m]);
  }
#endif
};

using Q4_K = QK45<false>;
using Q5_K = QK45<true>;

#if GDNSPEC_BLOCKS512
// int16 lanes 8k-8k+7 = s + k (k = 0-3): the scales of four 16-weight sub-blocks over 64 weights' pair sums.
inline __m512i quarters16(short s) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(short(s + 1)), _mm_set1_epi16(s))),
      _mm256_set_m128i(_mm_set1_epi16(short(s + 3)), _mm_set1_epi16(short(s + 2))), 1);
}
#endif

// Q6_K: 256 weights in sixteen sub-blocks of 16, w = d * sc_j * (q - 32), q 6 bits (128 bytes of low nibbles, 64 of
// high bit pairs), sc_j int8: acc += (d_x d) * (sum_j sc_j sum(q x_q) - 32 sum_j sc_j sum(x_q)).
struct Q6_K {
  using Act = ActQ8_K;
  static constexpr int64_t kBytes = 210, kBlock = 256;  // 128 ql, 64 qh, 16 int8 scales, f16 d
#if GDNSPEC_BLOCKS512
  // 64 weights at a time: 64 bytes of ql give weights 128j + 0-63 (low nibbles) and 64-127 (high); their high bit
  // pairs come from the 32 bytes of qh j shifted per half; four sub-blocks' scales spread over the pair sums.
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(48);
    const __m512i up_low = halves16(4, 2), down_high = halves16(0, 2);
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* block = w + i * kBytes;
      const float d = half(block + 208);
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 192)));
      const __m512i scales = _mm512_castsi256_si512(scales16);
      __m512i sumi[MR];
      for (int m = 0; m < MR; ++m)
        sumi[m] = _mm512_zextsi256_si512(_mm256_sub_epi32(
            _mm256_setzero_si256(),
            _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)x[m][i].bsums), scales16), 5)));
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m512i ql = _mm512_loadu_si512((const void*)(block + 64 * j));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(block + 128 + 32 * j)));
        const __m512i q_low =
            _mm512_or_si512(_mm512_and_si512(ql, m15), _mm512_and_si512(_mm512_sllv_epi16(qh, up_low), m48));
        const __m512i q_high = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m15),
                                               _mm512_and_si512(_mm512_srlv_epi16(qh, down_high), m48));
        const __m512i scale_low = _mm512_permutexvar_epi16(quarters16(8 * j), scales);
        const __m512i scale_high = _mm512_permutexvar_epi16(quarters16(8 * j + 4), scales);
        for (int m = 0; m < MR; ++m) {
          const int8_t* q8 = x[m][i].qs + 128 * j;
          sumi[m] = _mm512_dpwssd_epi32(sumi[m], scale_low,
                                        _mm512_maddubs_epi16(q_low, _mm512_load_si512((const __m512i*)q8)));
          sumi[m] = _mm512_dpwssd_epi32(sumi[m], scale_high,
                                        _mm512_maddubs_epi16(q_high, _mm512_load_si512((const __m512i*)(q8 + 64))));
        }
      }
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][i].d * d), _mm512_cvtepi32_ps(sumi[m]), acc[m]);
    }
    for (int m = 0; m < MR; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
#else
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* block = w + i * kBytes;
      const float d = half(block + 208);
      const __m128i scales = _mm_loadu_si128((const __m128i*)(block + 192));
      const __m256i scales16 = _mm256_cvtepi8_epi16(scales);
      __m256i sumi[MR];
      for (int m = 0; m < MR; ++m)
        sumi[m] = _mm256_sub_epi32(
            _mm256_setzero_si256(),
            _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)x[m][i].bsums), scales16), 5));
      for (int j = 0; j < 2; ++j) {
        const uint8_t* ql = block + 64 * j;
        const __m256i bits1 = _mm256_loadu_si256((const __m256i*)ql);
        const __m256i bits2 = _mm256_loadu_si256((const __m256i*)(ql + 32));
        const __m256i high = _mm256_loadu_si256((const __m256i*)(block + 128 + 32 * j));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(bits1, m15), _mm256_slli_epi16(_mm256_and_si256(high, m3), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(bits2, m15),
                               _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(12)), 2));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15),
                               _mm256_and_si256(high, _mm256_set1_epi8(48)));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15),
                               _mm256_srli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(char(0xC0))), 2));
        __m256i sc[4];
        for (int k = 0; k < 4; ++k) {
          const int s = 8 * j + 2 * k;  // sub-blocks s (weights 0-15 of the 32) and s + 1
          sc[k] = _mm256_cvtepi8_epi16(
              _mm_shuffle_epi8(scales, _mm_set_epi64x(0x0101010101010101LL * (s + 1), 0x0101010101010101LL * s)));
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* q8 = x[m][i].qs + 128 * j;
          __m256i s = sumi[m];
          for (int k = 0; k < 4; ++k)
            s = _mm256_add_epi32(
                s, _mm256_madd_epi16(sc[k], _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i*)(q8 + 32 * k)))));
          sumi[m] = s;
        }
      }
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m][i].d * d), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
    }
    for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]);
  }
#endif
};

// IQ4_XS: 256 weights in eight sub-blocks of 32, w = d * (ls_j - 32) * kvalues[nibble], ls_j 6 bits (4 low bits in
// scales_l, 2 high in scales_h): acc += (d_x d) * sum_j (ls_j - 32) sum(kvalues[q] x_q).
struct IQ4_XS {
  using Act = ActQ8_K;
  static constexpr int64_t kBytes = 136, kBlock = 256;  // f16 d, uint16 scales_h, 4 bytes scales_l, 128 qs
  template <int MR>
  static void dot(const uint8_t* w, const Act* const* x, int64_t nb, float* out) {
    const __m128i values128 = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const __m256i values = _mm256_broadcastsi128_si256(values128);
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* block = w + i * kBytes;
      const float d = half(block);
      uint16_t scales_h;
      std::memcpy(&scales_h, block + 2, 2);
      const uint8_t* scales_l = block + 4;
      const uint8_t* qs = block + 8;
      __m256i sumi[MR];
      for (int m = 0; m < MR; ++m) sumi[m] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const int ls = ((scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((scales_h >> (2 * j)) & 3) << 4);
        const __m256i scale = _mm256_set1_epi16(short(ls - 32));
        const __m256i q = _mm256_shuffle_epi8(values, nibbles32(qs + 16 * j));
        const __m256i q_abs = _mm256_sign_epi8(q, q);
        for (int m = 0; m < MR; ++m) {
          const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x[m][i].qs + 32 * j)), q);
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q_abs, y), scale));
        }
      }
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m][i].d * d), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
    }
    for (int m = 0; m < MR; ++m) out[m] = hsum8(acc[m]);
  }
};

#endif  // GDNSPEC_BLOCKS

#if GDNSPEC_BLOCKS512
// One super-block of quantize_row_q8_K in 16-float vectors: the same operations on each element, so the same bytes.
inline void quantize_block_q8_K(const float* x, ActQ8_K* y) {
  __m512 vmax = _mm512_setzero_ps();
  for (int j = 0; j < 16; ++j) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * j)));
  const float amax = _mm512_reduce_max_ps(vmax);
  if (amax == 0.f) {
    std::memset(y, 0, sizeof *y);
    return;
  }
  float max = amax;
  for (int j = 0; j < 16; ++j) {  // the first element of largest magnitude, as the scalar loop's strict >
    const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
    if (at) {
      max = x[16 * j + __builtin_ctz(at)];
      break;
    }
  }
  const float iscale = -127.f / max;
  for (int j = 0; j < 16; ++j) {
    const __m512 shifted =
        _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(iscale), _mm512_loadu_ps(x + 16 * j)), _mm512_set1_ps(12582912.f));
    const __m512i v = _mm512_min_epi32(
        _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(shifted), _mm512_set1_epi32(0x007fffff)),
                         _mm512_set1_epi32(0x00400000)),
        _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i*)(y->qs + 16 * j), _mm512_cvtepi32_epi8(v));
    y->bsums[j] = int16_t(_mm512_reduce_add_epi32(v));
  }
  y->d = 1.f / iscale;
}
#endif

// llama.cpp's quantize_row_q8_K (its reference, which its x86 build uses): per 256, the element of largest magnitude
// maps to -127 (d = max / -127, the sign kept), q = nearest(x / d) capped at 127 (round half to even, as llama.cpp's
// nearest_int), and the sums of each 16 quants.
inline void quantize_row_q8_K(const float* x, int64_t K, ActQ8_K* y) {
#if GDNSPEC_BLOCKS512
  for (int64_t i = 0; i < K / 256; ++i) quantize_block_q8_K(x + 256 * i, y + i);
#else
  for (int64_t i = 0; i < K / 256; ++i, x += 256) {
    float max = 0.f, amax = 0.f;
    for (int j = 0; j < 256; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) amax = ax, max = x[j];
    }
    if (amax == 0.f) {
      y[i].d = 0.f;
      std::memset(y[i].qs, 0, sizeof y[i].qs);
      std::memset(y[i].bsums, 0, sizeof y[i].bsums);
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < 256; ++j) {
      const float shifted = iscale * x[j] + 12582912.f;  // nearest_int: the integer in the mantissa
      int32_t bits;
      std::memcpy(&bits, &shifted, 4);
      const int v = (bits & 0x007fffff) - 0x00400000;
      y[i].qs[j] = int8_t(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; ++j) {
      int sum = 0;
      for (int k = 0; k < 16; ++k) sum += y[i].qs[16 * j + k];
      y[i].bsums[j] = int16_t(sum);
    }
    y[i].d = 1.f / iscale;
  }
#endif
}

// quantize_row_q8_K, each super-block's quants in ActQ8_KS's order with its sub-blocks' sums.
inline void quantize_row_q8_KS(const float* x, int64_t K, ActQ8_KS* y) {
  ActQ8_K natural;
  for (int64_t i = 0; i < K / 256; ++i) {
    quantize_row_q8_K(x + 256 * i, 256, &natural);
    for (int v = 0; v < 4; ++v)  // quadwords: sub_block_order is 8 consecutive quants at every 8th byte
      for (int p = 0; p < 64; p += 8) std::memcpy(y[i].qs + 64 * v + p, natural.qs + sub_block_order(v, p), 8);
    for (int l = 0; l < 16; ++l) {
      const int j = lane_sub_block(l);
      y[i].scaled_sums[l] = l % 2 ? 0.f : natural.d * float(natural.bsums[2 * j] + natural.bsums[2 * j + 1]);
    }
    y[i].d = natural.d;
  }
}

}  // namespace gdnspec::blocks
