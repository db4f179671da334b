// Work split over XLA's intra-op thread pool, shared by the CPU kernels (cpu_matmul.cc, cpu_attention.cc).
//
// Chunks are claimed from a shared counter, so the caller finishes alone if the pool's threads are busy; the state
// is shared-owned because a scheduled task may start after the call has returned (it then finds no chunk).

#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace gdnspec {

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// run(c) for every chunk c in [0, n_chunks), on the pool's threads when `parallel` (the work pays for the hand-off)
// and there are at least two chunks; returns when all have run.
template <typename Run>
void over_chunks(xla::ffi::ThreadPool& pool, int64_t n_chunks, bool parallel, const Run& run) {
  const int64_t threads = pool.num_threads();
  if (!parallel || threads <= 1 || n_chunks < 2) {
    for (int64_t c = 0; c < n_chunks; ++c) run(c);
    return;
  }
  auto progress = std::make_shared<Progress>();
  auto work = [=]() {
    int64_t finished = 0;
    for (int64_t c; (c = progress->next.fetch_add(1)) < n_chunks; ++finished) run(c);
    progress->done.fetch_add(finished);
  };
  for (int64_t t = 1; t < std::min(threads, n_chunks); ++t) pool.Schedule(decltype(work)(work));
  work();
  for (int spins = 0; progress->done.load() < n_chunks; ++spins)
    if (spins > 64) sched_yield();
}

}  // namespace gdnspec
