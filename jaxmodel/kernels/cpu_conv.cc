// The GDN mixer's causal depthwise conv on CPU (its sums; silu follows in XLA), an XLA FFI custom call:
//   gdnspec_causal_conv  out[B, T, C] = sum_j window[b, t + j, c] w_taps[j, c], j = 0..Kc-1, over the window
//                        [history[b] | x[b]] [Kc-1+T, C] of the row's Kc-1 earlier raw inputs history [B, Kc-1, C]
//                        (oldest first) and this step's x [B, T, C]; w_taps [Kc, C], tap by tap; a row's tokens
//                        from n_tokens[b] on are padding, which costs nothing and comes out 0.
//   gdnspec_causal_conv_planes  the same sums with the conv state in planes [N, C, Kc-1] (the GDN mixer's): row b's
//                        history read from planes[read_plane[b]] (clamped into the pool), w [C, Kc] as the weights
//                        hold it, and the state after token t (the window's rows t+1 .. t+Kc-1) written to
//                        planes[write_planes[b, t]] in place (outside [0, N): nowhere), every read before any write;
//                        in place of XLA's gather, transposes, concatenation and scatter around the conv.
//
// XLA computes the conv as a dot batched over the channels: a fused multiply-and-reduce at one token, a batched
// dot with copies around it at more, whose order of summation follows the shape (one row of two tokens sums
// otherwise; docs/performance.md, "What a verify row adds at one stream, and the causal conv as a kernel"). Here the
// channels are the vector lanes and each sum is x_0 w_0, then one FMA per later tap, oldest first, on every lane (a
// last partial group of channels computes its other lanes on zeros): XLA's order at one token, and a channel's value is
// the same bits whatever T, B or the channels around it, so decoding, verifying and replay's rebuild (which
// convolves the key and value channels alone) agree. Reference: `causal_conv_reference` in cpu_conv.py; tests:
// tests/test_cpu_conv.py.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_pool.h"
#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using gdnspec::load8;
using gdnspec::multiply_add;
using gdnspec::v8;

constexpr int64_t kMinParallelWork = 1 << 16;  // multiply-adds below which one thread does it all
constexpr int64_t kChannelsPerChunk = 64;

// Window row r of a row's task, [C] floats: its history for r < Kc-1, then its tokens.
struct Window {
  const float *history, *x;
  int64_t Kc, C;
  const float* row(int64_t r) const { return r < Kc - 1 ? history + r * C : x + (r - (Kc - 1)) * C; }
};

// out[c0, c0 + 8 G) of token t: G vectors of channels side by side, so that their chains of FMAs overlap.
template <int G>
inline void conv_vectors(const Window& window, const float* w_taps, int64_t t, int64_t c0, float* out) {
  v8 acc[G];
  const float* first = window.row(t);
  for (int g = 0; g < G; ++g) acc[g] = load8(first + c0 + 8 * g) * load8(w_taps + c0 + 8 * g);
  for (int64_t j = 1; j < window.Kc; ++j) {
    const float *xj = window.row(t + j), *wj = w_taps + j * window.C;
    for (int g = 0; g < G; ++g) acc[g] = multiply_add(acc[g], load8(xj + c0 + 8 * g), load8(wj + c0 + 8 * g));
  }
  for (int g = 0; g < G; ++g) std::memcpy(out + c0 + 8 * g, &acc[g], sizeof(v8));
}

// The same for n < 8 channels: the other lanes compute on zeros.
inline void conv_partial(const Window& window, const float* w_taps, int64_t t, int64_t c, int64_t n, float* out) {
  auto lanes = [n](const float* p) {
    v8 v{};
    std::memcpy(&v, p, n * sizeof(float));
    return v;
  };
  v8 acc = lanes(window.row(t) + c) * lanes(w_taps + c);
  for (int64_t j = 1; j < window.Kc; ++j)
    acc = multiply_add(acc, lanes(window.row(t + j) + c), lanes(w_taps + j * window.C + c));
  std::memcpy(out + c, &acc, n * sizeof(float));
}

// The sums of every row's live tokens, over a history [B, Kc-1, C] and taps [Kc, C] (padding tokens: 0).
void convolve(ffi::ThreadPool& pool, const float* hp, const float* xp, const float* wp, const int32_t* lengths,
              int64_t B, int64_t T, int64_t C, int64_t Kc, float* op) {
  const int64_t blocks = (C + kChannelsPerChunk - 1) / kChannelsPerChunk;
  gdnspec::over_chunks(pool, B * blocks, B * T * C * Kc >= kMinParallelWork, [&](int64_t chunk) {
    const int64_t b = chunk / blocks, c0 = chunk % blocks * kChannelsPerChunk;
    const int64_t c1 = std::min(C, c0 + kChannelsPerChunk);
    const int64_t n = std::min<int64_t>(std::max<int32_t>(lengths[b], 0), T);
    const Window window{hp + b * (Kc - 1) * C, xp + b * T * C, Kc, C};
    for (int64_t t = 0; t < n; ++t) {
      float* to = op + (b * T + t) * C;
      int64_t c = c0;
      if (c1 - c0 == kChannelsPerChunk) {
        conv_vectors<kChannelsPerChunk / 8>(window, wp, t, c, to);
        c = c1;
      }
      for (; c + 8 <= c1; c += 8) conv_vectors<1>(window, wp, t, c, to);
      if (c < c1) conv_partial(window, wp, t, c, c1 - c, to);
    }
    for (int64_t t = n; t < T; ++t) std::memset(op + (b * T + t) * C + c0, 0, (c1 - c0) * sizeof(float));
  });
}

ffi::Error CausalConv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> history, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> w_taps, ffi::Buffer<ffi::S32> n_tokens, ffi::ResultBuffer<ffi::F32> out) {
  const auto hd = history.dimensions(), xd = x.dimensions(), wd = w_taps.dimensions();
  if (hd.size() != 3 || xd.size() != 3 || wd.size() != 2)
    return ffi::Error::InvalidArgument("causal_conv takes history [B, Kc-1, C], x [B, T, C] and w_taps [Kc, C]");
  const int64_t B = xd[0], T = xd[1], C = xd[2], Kc = wd[0];
  if (Kc < 1 || hd[0] != B || hd[1] != Kc - 1 || hd[2] != C || wd[1] != C || n_tokens.element_count() != B)
    return ffi::Error::InvalidArgument(
        "causal_conv: history [B, Kc-1, C], x [B, T, C], w_taps [Kc, C] and n_tokens [B] disagree");
  convolve(pool, history.typed_data(), x.typed_data(), w_taps.typed_data(), n_tokens.typed_data(), B, T, C, Kc,
           out->typed_data());
  return ffi::Error::Success();
}

// a [rows, cols] -> [cols, rows]; K a compile-time cols (the model's Kc-1 = 3, Kc = 4) where it is one, so the
// inner loop unrolls.
template <int K>
inline void transpose_rows(const float* a, int64_t rows, int64_t cols, float* to) {
  const int64_t k = K > 0 ? K : cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) to[j * rows + r] = a[r * k + j];
}

inline void transpose(const float* a, int64_t rows, int64_t cols, float* to) {
  if (cols == 3) return transpose_rows<3>(a, rows, cols, to);
  if (cols == 4) return transpose_rows<4>(a, rows, cols, to);
  transpose_rows<0>(a, rows, cols, to);
}

// to[c, j] = window row r0 + j at channel c, for j < Kc-1: a conv state stored [C, Kc-1].
template <int K>
inline void interleave_rows(const Window& window, int64_t r0, float* to) {
  const int64_t k = K > 0 ? K : window.Kc - 1, C = window.C;
  if constexpr (K == 3) {  // unrolled, so that the compiler stores whole vectors
    const float *a = window.row(r0), *b = window.row(r0 + 1), *d = window.row(r0 + 2);
    for (int64_t c = 0; c < C; ++c) {
      to[3 * c] = a[c];
      to[3 * c + 1] = b[c];
      to[3 * c + 2] = d[c];
    }
  } else {
    for (int64_t j = 0; j < k; ++j) {
      const float* row = window.row(r0 + j);
      for (int64_t c = 0; c < C; ++c) to[c * k + j] = row[c];
    }
  }
}

inline void interleave(const Window& window, int64_t r0, float* to) {
  if (window.Kc == 4) return interleave_rows<3>(window, r0, to);
  interleave_rows<0>(window, r0, to);
}

ffi::Error CausalConvPlanes(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> planes, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> n_tokens, ffi::Buffer<ffi::S32> read_plane,
                            ffi::Buffer<ffi::S32> write_planes, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> planes_out) {
  const auto pd = planes.dimensions(), xd = x.dimensions(), wd = w.dimensions();
  if (pd.size() != 3 || xd.size() != 3 || wd.size() != 2)
    return ffi::Error::InvalidArgument("causal_conv_planes takes planes [N, C, Kc-1], x [B, T, C] and w [C, Kc]");
  const int64_t N = pd[0], B = xd[0], T = xd[1], C = xd[2], Kc = wd[1];
  if (N < 1 || Kc < 1 || pd[1] != C || pd[2] != Kc - 1 || wd[0] != C || n_tokens.element_count() != B ||
      read_plane.element_count() != B || write_planes.element_count() != B * T)
    return ffi::Error::InvalidArgument(
        "causal_conv_planes: planes [N, C, Kc-1], x [B, T, C], w [C, Kc], n_tokens and read_plane [B] and "
        "write_planes [B, T] disagree");
  const int64_t plane_size = C * (Kc - 1);
  // Every row's history is read before any plane is written: a row may write the plane another one reads. As
  // XLA's gather and dropping scatter: a read plane outside the pool is clamped into it, a write outside dropped.
  thread_local std::vector<float> history, taps;  // [B, Kc-1, C], [Kc, C]
  history.resize(B * plane_size);
  taps.resize(Kc * C);
  transpose(w.typed_data(), C, Kc, taps.data());
  const float* source = planes.typed_data();
  const int32_t* reads = read_plane.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = std::clamp<int64_t>(reads[b], 0, N - 1);
    transpose(source + p * plane_size, C, Kc - 1, history.data() + b * plane_size);
  }
  float* target = planes_out->typed_data();
  if (target != source)  // not aliased: the result starts as the operand
    std::memcpy(target, source, planes.size_bytes());
  const float *hp = history.data(), *xp = x.typed_data();
  convolve(pool, hp, xp, taps.data(), n_tokens.typed_data(), B, T, C, Kc, out->typed_data());
  // The state after token t: the window's rows t+1 .. t+Kc-1, stored [C, Kc-1].
  const int32_t* writes = write_planes.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    const Window window{hp + b * plane_size, xp + b * T * C, Kc, C};
    for (int64_t t = 0; t < T; ++t) {
      const int64_t q = writes[b * T + t];
      if (q < 0 || q >= N) continue;
      interleave(window, t + 1, target + q * plane_size);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_causal_conv, CausalConv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // history
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_taps
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n_tokens
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_causal_conv_planes, CausalConvPlanes,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // planes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n_tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // read_plane
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_planes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>());  // planes, updated in place
