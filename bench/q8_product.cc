// Times the Q8_0 product's column loop (q8_columns of the cpu_matmul.cc named by KERNEL, included) on one thread,
// each shape's weight cycled through as many random copies as fill the bundled model's 4.4 MB, as a forward leaves
// its weights in the caches. Prints one line per (N, K, M): ns per (block of 32, row of x). bench/q8_product.py
// builds and runs it.
#include KERNEL

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 0.3;  // per (shape, M)
  const int64_t shapes[][2] = {{1416, 192}, {512, 192}, {192, 512}, {4096, 192}, {3584, 1024}};  // N, K
  const int row_counts[] = {1, 2, 4, 16};
  constexpr int64_t kCacheBytes = 4400000;
  std::mt19937 rng(1);
  for (const auto& shape : shapes) {
    const int64_t N = shape[0], K = shape[1], nb = K / 32;
    const int copies = int(std::max<int64_t>(1, kCacheBytes / (N * K)));
    std::vector<std::vector<int8_t>> wq(copies, std::vector<int8_t>(N * K));
    std::vector<std::vector<float>> wd(copies, std::vector<float>(N * nb));
    for (auto& w : wq)
      for (auto& v : w) v = int8_t(int(rng() % 255) - 127);
    for (auto& w : wd)
      for (auto& v : w) v = 1e-3f * float(rng() % 100);
    for (const int M : row_counts) {
      std::vector<int8_t> xq(M * K);
      std::vector<float> xd(M * nb, 0.01f);
      std::vector<int32_t> xo(M * nb * 8);  // room for either revision's offsets
      for (auto& v : xq) v = int8_t(int(rng() % 255) - 127);
      std::vector<float> out_rows(M * N);
      std::vector<float*> out(M);
      for (int m = 0; m < M; ++m) out[m] = out_rows.data() + m * N;
      int64_t products = 0;
      const auto start = std::chrono::steady_clock::now();
      double elapsed = 0;
      while (elapsed < seconds) {
        for (int c = 0; c < copies; ++c)
          for (int64_t n0 = 0; n0 < N; n0 += 64)
            q8_columns(xq.data(), xd.data(), xo.data(), wq[c].data(), wd[c].data(), out.data(), M, K, N, n0,
                       std::min(N, n0 + 64));
        products += copies;
        elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      std::printf("%ld %ld %d %.4f\n", long(N), long(K), M, elapsed * 1e9 / (double(products) * N * nb * M));
    }
  }
}
