// The token-serial gated delta rule over snapshot planes on CPU, an XLA FFI custom call:
//   gdnspec_gdn_recurrent  o[B, T, Hv, Dv] and the state pool [N, Hv, Dk, Dv] (updated in place: the pool operand
//                          is aliased to the result) from q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv],
//                          read_plane [B], write_planes [B, T] (-1: none) and n_tokens [B].
//
// One task per (row b, value head h) runs the row's n_tokens tokens through the head's state, from the row's read
// plane: each token's state goes into its write plane write_planes[b, t] where that is a plane, else into a buffer
// held in cache (64 KB at Dk = Dv = 128), and the next token reads it from there. Per token, two passes over the
// state:
//   S *= exp(g);  recalled = S^T k;  delta = beta (v - recalled);  S += k delta^T;  o = S^T q / sqrt(Dk)
// where XLA's loop read and wrote the whole state several times per token, and gathered and scattered it around the
// loop. Every element is computed in one fixed order whatever T, B or the thread, so a token's state and output are
// the same bits in a decoding step, a verify step and replay's rebuild (which runs this kernel too). Tokens from
// n_tokens on are padding: their output is 0 and they write nothing.
//
// Value head h reads key head h % Hk (GGUF's tiled order). Reference: `reference_pool_update` in reference.py; tests:
// tests/test_cpu_gdn.py.

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

using gdnspec::multiply_add;
using gdnspec::splat;
using gdnspec::v8;

constexpr int64_t kMinParallelWork = 1 << 16;  // state elements touched below which one thread does it all

struct Shape {
  int64_t B, T, Hk, Hv, Dk, Dv, N;
};

// One token on state S [Dk, Dv]: S *= exp(g); recalled = S^T k; delta = beta (v - recalled); S += k delta^T;
// o = S^T q / sqrt(Dk). Each sum over k runs in order, one FMA per k, vectorized over v.
void advance(float* S, const float* q, const float* k, const float* v, float g, float beta, float* o,
             float* delta, int64_t Dk, int64_t Dv) {
  const int64_t V8 = Dv & ~int64_t(7);
  const float decay = std::exp(g), scale = 1.f / std::sqrt(float(Dk));
  const v8 d = splat(decay);
  std::fill(delta, delta + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i) {  // S *= decay; recalled += S[i] k[i]
    float* row = S + i * Dv;
    const v8 ki = splat(k[i]);
    int64_t j = 0;
    for (; j < V8; j += 8) {
      const v8 s = *(v8*)(row + j) * d;
      *(v8*)(row + j) = s;
      *(v8*)(delta + j) = multiply_add(*(v8*)(delta + j), s, ki);
    }
    for (; j < Dv; ++j) delta[j] = std::fma(row[j] *= decay, k[i], delta[j]);
  }
  for (int64_t j = 0; j < Dv; ++j) delta[j] = beta * (v[j] - delta[j]);
  std::fill(o, o + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i) {  // S += k[i] delta; o += S[i] q[i]
    float* row = S + i * Dv;
    const v8 ki = splat(k[i]), qi = splat(q[i]);
    int64_t j = 0;
    for (; j < V8; j += 8) {
      const v8 s = multiply_add(*(v8*)(row + j), ki, *(v8*)(delta + j));
      *(v8*)(row + j) = s;
      *(v8*)(o + j) = multiply_add(*(v8*)(o + j), s, qi);
    }
    for (; j < Dv; ++j) {
      row[j] = std::fma(k[i], delta[j], row[j]);
      o[j] = std::fma(row[j], q[i], o[j]);
    }
  }
  for (int64_t j = 0; j < Dv; ++j) o[j] *= scale;
}

// `advance` for Dv = NV vectors V (v8, or v16 with AVX-512), the same arithmetic in the same order (each element its
// own lane's chain of FMAs, so the vector width changes no bit), with delta and o held in registers (through memory
// each FMA of their chains waited on the store before it: the compiler cannot keep them in registers where they
// might alias the state), from the state at `from` into S (the same or another place: each element is read before
// it is written).
// Unaligned loads and stores of V: a template argument loses the typedefs' aligned(4), so V's own alignment (its
// size) must not be assumed of a state row.
template <typename V>
V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename V, int NV>
void advance_fixed(const float* from, float* S, const float* q, const float* k, const float* v, float g, float beta,
                   float* o, int64_t Dk) {
  constexpr int64_t L = sizeof(V) / sizeof(float), Dv = L * NV;
  const float decay = std::exp(g), scale = 1.f / std::sqrt(float(Dk));
  const V d = V{} + decay;
  V acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = V{};
  for (int64_t i = 0; i < Dk; ++i) {  // S *= decay; recalled += S[i] k[i]
    const float* previous = from + i * Dv;
    float* row = S + i * Dv;
    const V ki = V{} + k[i];
    for (int j = 0; j < NV; ++j) {
      const V s = load<V>(previous + L * j) * d;
      store(row + L * j, s);
      acc[j] = multiply_add(acc[j], s, ki);
    }
  }
  V delta[NV];
  for (int j = 0; j < NV; ++j) delta[j] = (V{} + beta) * (load<V>(v + L * j) - acc[j]);
  for (int j = 0; j < NV; ++j) acc[j] = V{};
  for (int64_t i = 0; i < Dk; ++i) {  // S += k[i] delta; o += S[i] q[i]
    float* row = S + i * Dv;
    const V ki = V{} + k[i], qi = V{} + q[i];
    for (int j = 0; j < NV; ++j) {
      const V s = multiply_add(load<V>(row + L * j), ki, delta[j]);
      store(row + L * j, s);
      acc[j] = multiply_add(acc[j], s, qi);
    }
  }
  for (int j = 0; j < NV; ++j) store(o + L * j, acc[j] * (V{} + scale));
}

#ifdef __AVX512F__
using StateRow = gdnspec::v16;
#else
using StateRow = v8;
#endif
constexpr int kRowLanes = sizeof(StateRow) / sizeof(float);

// initial: the head's state before the row's first token (its read plane, or a copy of it). Each token's state goes
// straight into its write plane where it has one (else into a buffer) and the next token reads it there, so a
// decoding step reads the read plane and writes the write plane with no copy between (copies in and out took half
// the time of a head of the bundled model's, Dk = Dv = 32).
void row_head(const Shape& s, int64_t b, int64_t h, const float* q, const float* k, const float* v, const float* g,
              const float* beta, const float* initial, const int32_t* write_planes, const int32_t* n_tokens,
              float* pool, float* out) {
  const int64_t state_size = s.Dk * s.Dv, kh = h % s.Hk;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(n_tokens[b], 0), s.T);
  auto plane = [&](int64_t p) { return pool + (p * s.Hv + h) * state_size; };
  thread_local std::vector<float> buffer, delta;  // [Dk, Dv], [Dv]
  if (buffer.size() < size_t(state_size)) buffer.resize(state_size);
  if (delta.size() < size_t(s.Dv)) delta.resize(s.Dv);
  const float* state = initial;
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t bt = b * s.T + t;
    float* o = out + (bt * s.Hv + h) * s.Dv;
    if (t >= n) {
      std::fill(o, o + s.Dv, 0.f);
      continue;
    }
    const int32_t target = write_planes[bt];
    float* next = target >= 0 && target < s.N ? plane(target) : buffer.data();
    const float *qt = q + (bt * s.Hk + kh) * s.Dk, *kt = k + (bt * s.Hk + kh) * s.Dk, *vt = v + (bt * s.Hv + h) * s.Dv;
    const float gt = g[bt * s.Hv + h], beta_t = beta[bt * s.Hv + h];
    switch (s.Dv) {
      case 32: advance_fixed<StateRow, 32 / kRowLanes>(state, next, qt, kt, vt, gt, beta_t, o, s.Dk); break;
      case 64: advance_fixed<StateRow, 64 / kRowLanes>(state, next, qt, kt, vt, gt, beta_t, o, s.Dk); break;
      case 128: advance_fixed<StateRow, 128 / kRowLanes>(state, next, qt, kt, vt, gt, beta_t, o, s.Dk); break;
      default:
        if (next != state) std::memmove(next, state, state_size * sizeof(float));
        advance(next, qt, kt, vt, gt, beta_t, o, delta.data(), s.Dk, s.Dv);
    }
    state = next;
  }
}

ffi::Error GdnRecurrent(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                        ffi::Buffer<ffi::F32> ssm_pool, ffi::Buffer<ffi::S32> read_plane,
                        ffi::Buffer<ffi::S32> write_planes, ffi::Buffer<ffi::S32> n_tokens,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> pool_out) {
  const auto qs = q.dimensions(), vs = v.dimensions(), ps = ssm_pool.dimensions();
  if (qs.size() != 4 || vs.size() != 4 || ps.size() != 4)
    return ffi::Error::InvalidArgument("gdn_recurrent: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], pool [N, Hv, Dk, Dv]");
  const Shape s{qs[0], qs[1], qs[2], vs[2], qs[3], vs[3], ps[0]};
  const auto ks = k.dimensions(), gs = g.dimensions(), bs = beta.dimensions(), ws = write_planes.dimensions();
  const bool same_k = ks.size() == 4 && std::equal(ks.begin(), ks.end(), qs.begin());
  const bool gates = gs.size() == 3 && gs[0] == s.B && gs[1] == s.T && gs[2] == s.Hv && bs.size() == 3 &&
                     std::equal(bs.begin(), bs.end(), gs.begin());
  if (!same_k || !gates || vs[0] != s.B || vs[1] != s.T || s.Hk == 0 || s.Hv % s.Hk != 0 || ps[1] != s.Hv ||
      ps[2] != s.Dk || ps[3] != s.Dv || read_plane.element_count() != s.B || n_tokens.element_count() != s.B ||
      ws.size() != 2 || ws[0] != s.B || ws[1] != s.T)
    return ffi::Error::InvalidArgument("gdn_recurrent: shapes disagree (Hv a multiple of Hk; B, T, heads and sizes "
                                       "the same throughout)");
  // As XLA's gather and dropping scatter: a read plane outside the pool is clamped into it, a write outside is
  // dropped (-1 names none).
  std::vector<int32_t> reads(read_plane.typed_data(), read_plane.typed_data() + s.B);
  for (int32_t& r : reads) r = std::clamp<int32_t>(r, 0, int32_t(s.N - 1));
  const int32_t* writes = write_planes.typed_data();
  float* planes = pool_out->typed_data();
  if (planes != ssm_pool.typed_data())  // not aliased: the result starts as the operand
    std::memcpy(planes, ssm_pool.typed_data(), ssm_pool.size_bytes());
  int64_t work = 0;
  const int32_t* lengths = n_tokens.typed_data();
  for (int64_t b = 0; b < s.B; ++b) work += std::max<int32_t>(lengths[b], 0) * s.Hv * s.Dk * s.Dv;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *gp = g.typed_data(),
              *bp = beta.typed_data();
  float* op = out->typed_data();
  // Every row reads its state before any row writes (as XLA's gather before its scatter): where a row writes a
  // plane another row reads, the read states are copied first; otherwise each task reads its plane itself.
  const int64_t state_size = s.Dk * s.Dv;
  bool shared = false;
  for (int64_t b = 0; b < s.B && !shared; ++b)
    for (int64_t c = 0; c < s.B * s.T && !shared; ++c) shared = c / s.T != b && writes[c] == reads[b];
  std::vector<float> initial(shared ? s.B * s.Hv * state_size : 0);
  for (int64_t b = 0; shared && b < s.B; ++b)
    std::memcpy(initial.data() + b * s.Hv * state_size, planes + reads[b] * s.Hv * state_size,
                s.Hv * state_size * sizeof(float));
  gdnspec::over_chunks(pool, s.B * s.Hv, work >= kMinParallelWork, [&](int64_t c) {
    const int64_t b = c / s.Hv, h = c % s.Hv;
    const float* start = shared ? initial.data() + c * state_size : planes + (reads[b] * s.Hv + h) * state_size;
    row_head(s, b, h, qp, kp, vp, gp, bp, start, writes, lengths, planes, op);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(gdnspec_gdn_recurrent, GdnRecurrent,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ssm_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // read_plane
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_planes
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n_tokens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>());  // the pool
