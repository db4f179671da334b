// The GDN mixer's causal depthwise conv on CPU (its sums; silu follows in XLA), an XLA FFI custom call:
//   gdnspec_causal_conv  out[B, T, C] = sum_j window[b, t + j, c] w_taps[j, c], j = 0..Kc-1, over the window
//                        [history[b] | x[b]] [Kc-1+T, C] of the row's Kc-1 earlier raw inputs history [B, Kc-1, C]
//                        (oldest first) and this step's x [B, T, C]; w_taps [Kc, C], tap by tap.
//
// XLA computes the conv as a dot batched over the channels: a fused multiply-and-reduce at one token, a batched
// dot with copies around it at more, whose order of summation follows the shape (one row of two tokens sums
// otherwise; README, "What a verify row adds at one stream, and the causal conv as a kernel"). Here the channels
// are the vector lanes and each sum is x_0 w_0, then one FMA per later tap, oldest first, on every lane (a last
// partial group of channels computes its other lanes on zeros): XLA's order at one token, and a channel's value is
// the same bits whatever T, B or the channels around it, so decoding, verifying and replay's rebuild (which
// convolves the key and value channels alone) agree. Reference: `causal_conv_reference` in cpu_conv.py; tests:
// tests/test_cpu_conv.py.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "cpu_pool.h"
#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using gdnspec::multiply_add;
using gdnspec::v8;

constexpr int64_t kMinParallelWork = 1 << 16;  // multiply-adds below which one thread does it all
constexpr int64_t kChannelsPerChunk = 64;

// Lanes c.. of a row of C floats: eight, or n < 8 followed by zeros.
inline v8 load(const float* row, int64_t c, int64_t n) {
  if (n == 8) return *(const v8*)(row + c);
  v8 lanes{};
  std::memcpy(&lanes, row + c, n * sizeof(float));
  return lanes;
}

ffi::Error CausalConv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> history, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> w_taps, ffi::ResultBuffer<ffi::F32> out) {
  const auto hd = history.dimensions(), xd = x.dimensions(), wd = w_taps.dimensions();
  if (hd.size() != 3 || xd.size() != 3 || wd.size() != 2)
    return ffi::Error::InvalidArgument("causal_conv takes history [B, Kc-1, C], x [B, T, C] and w_taps [Kc, C]");
  const int64_t B = xd[0], T = xd[1], C = xd[2], Kc = wd[0];
  if (Kc < 1 || hd[0] != B || hd[1] != Kc - 1 || hd[2] != C || wd[1] != C)
    return ffi::Error::InvalidArgument("causal_conv: history [B, Kc-1, C], x [B, T, C] and w_taps [Kc, C] disagree");
  const float *hp = history.typed_data(), *xp = x.typed_data(), *wp = w_taps.typed_data();
  float* op = out->typed_data();
  const int64_t blocks = (C + kChannelsPerChunk - 1) / kChannelsPerChunk;
  gdnspec::over_chunks(pool, B * blocks, B * T * C * Kc >= kMinParallelWork, [&](int64_t chunk) {
    const int64_t b = chunk / blocks, c0 = chunk % blocks * kChannelsPerChunk;
    const int64_t c1 = std::min(C, c0 + kChannelsPerChunk);
    auto row = [&](int64_t r) {  // row r of the window [Kc-1+T, C]
      return r < Kc - 1 ? hp + (b * (Kc - 1) + r) * C : xp + (b * T + r - (Kc - 1)) * C;
    };
    for (int64_t t = 0; t < T; ++t) {
      float* to = op + (b * T + t) * C;
      for (int64_t c = c0; c < c1; c += 8) {
        const int64_t n = std::min<int64_t>(8, c1 - c);
        v8 acc = load(row(t), c, n) * load(wp, c, n);
        for (int64_t j = 1; j < Kc; ++j) acc = multiply_add(acc, load(row(t + j), c, n), load(wp + j * C, c, n));
        if (n == 8)
          *(v8*)(to + c) = acc;
        else
          std::memcpy(to + c, &acc, n * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_causal_conv, CausalConv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // history
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_taps
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
