// Few-row matrix product on CPU, an XLA FFI custom call: out[M, N] = x[M, K] @ w[N, K]^T.
//
// The weight is read in GGUF's order, [N, K] (each output's weights contiguous, llama.cpp's loop order): every
// weight row is loaded once and multiplied into all M rows of x (held in L1), so a product of a few rows costs
// about what one row costs, where XLA's CPU dot packs the whole weight for each product and a 4-row one costs
// 2-2.5x a one-row one (README, "Model step"). Output columns are split in chunks over XLA's intra-op thread pool.
//
// Every output element is summed in the same order whatever M and the chunking: eight strided partial sums over k
// (one per vector lane), added lane by lane, then the tail k >= K & ~7. So row m of a product does not depend on
// the other rows, and a verify step's logits equal a one-token step's bit for bit.
//
// Reference: `rows_matmul_reference` in cpu_matmul.py (x @ w.T); tests: tests/test_cpu_matmul.py.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <sched.h>
#ifdef __FMA__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // unaligned loads of 8 floats

constexpr int kRowBlock = 4;                    // rows of x per pass over the weights
constexpr int64_t kChunk = 64;                  // output columns per task
constexpr int64_t kMinParallelBytes = 1 << 20;  // smaller weights stay on the calling thread

// acc + x * w, fused where the CPU has FMA. Spelled out (the library builds with -ffp-contract=off) so that the
// compiler cannot fuse in one instantiation of row_block and not in another: rows must sum alike for every M.
inline v8 multiply_add(v8 acc, v8 x, v8 w) {
#ifdef __FMA__
  return (v8)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

inline float lane_sum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// out[m, n] for m < MR, n in [n0, n1), NR weight rows at a time: MR * NR independent accumulators keep the FMA
// units busy (one row of x alone would otherwise wait on one accumulator's latency).
template <int MR, int NR>
void row_block(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
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
        const v8 xv = *(const v8*)(x + m * K + k);
        for (int r = 0; r < NR; ++r) acc[m][r] = multiply_add(acc[m][r], xv, b[r]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) {
        float s = lane_sum(acc[m][r]);
        for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * wn[r * K + k];
        out[m * N + n + r] = s;
      }
  }
  if constexpr (NR > 1) {
    if (n < n1) row_block<MR, 1>(x, w, out, K, N, n, n1);
  }
}

// All M rows for output columns [n0, n1).
void columns(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const float* xm = x + m0 * K;
    float* om = out + m0 * N;
    switch (std::min<int64_t>(kRowBlock, M - m0)) {
      case 1: row_block<1, 8>(xm, w, om, K, N, n0, n1); break;
      case 2: row_block<2, 4>(xm, w, om, K, N, n0, n1); break;
      case 3: row_block<3, 2>(xm, w, om, K, N, n0, n1); break;
      default: row_block<4, 2>(xm, w, om, K, N, n0, n1); break;
    }
  }
}

// Chunks are claimed from a shared counter, so the caller finishes alone if the pool's threads are busy; the
// state is shared-owned because a scheduled task may start after the call has returned (it then finds no chunk).
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("rows_matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K) return ffi::Error::InvalidArgument("rows_matmul: x is [M, K] and w [N, K] with the same K");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  const int64_t n_chunks = (N + kChunk - 1) / kChunk;
  const int64_t threads = pool.num_threads();
  if (threads <= 1 || n_chunks < 2 || N * K * int64_t(sizeof(float)) < kMinParallelBytes) {
    columns(xp, wp, op, M, K, N, 0, N);
    return ffi::Error::Success();
  }
  auto progress = std::make_shared<Progress>();
  auto work = [=]() {
    int64_t finished = 0;
    for (int64_t c; (c = progress->next.fetch_add(1)) < n_chunks; ++finished)
      columns(xp, wp, op, M, K, N, c * kChunk, std::min(N, (c + 1) * kChunk));
    progress->done.fetch_add(finished);
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(work)(work));
  work();
  for (int spins = 0; progress->done.load() < n_chunks; ++spins)
    if (spins > 64) sched_yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_rows_matmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
