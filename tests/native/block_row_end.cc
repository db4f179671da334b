// Every block format's dot product reads nothing past its weight row: each row of 1-9 blocks is placed to end
// exactly at a page that is followed by an inaccessible one, so a read past it faults (tests/test_cpu_block_matmul.py
// builds and runs this with the library's flags).

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

#include "cpu_blocks.h"

using namespace gdnspec::blocks;

template <typename Format>
void rows_at_a_page_end(uint8_t* page_end) {
  for (int64_t nb = 1; nb <= 9; ++nb) {
    const int64_t bytes = nb * Format::kBytes;
    uint8_t* w = page_end - bytes;
    for (int64_t i = 0; i < bytes; ++i) w[i] = uint8_t(i * 37 % 251);
    constexpr int64_t per = sizeof(Format::Act::qs);
    std::vector<typename Format::Act> x((nb * Format::kBlock + per - 1) / per);  // zeros: any values do
    const typename Format::Act* rows[4] = {x.data(), x.data(), x.data(), x.data()};
    float out[4];
    Format::template dot<1>(w, rows, nb, out);
    Format::template dot<4>(w, rows, nb, out);
    volatile float sink = out[0] + out[3];
    (void)sink;
  }
}

int main() {
#if GDNSPEC_BLOCKS
  const long page = sysconf(_SC_PAGESIZE), size = 4 * page;
  auto* mem = static_cast<uint8_t*>(mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                                         -1, 0));
  if (mem == MAP_FAILED || mprotect(mem + size, page, PROT_NONE) != 0) return 2;
  uint8_t* end = mem + size;
  rows_at_a_page_end<Q4_0>(end);
  rows_at_a_page_end<Q5_0>(end);
  rows_at_a_page_end<Q8_0>(end);
  rows_at_a_page_end<Q4_K>(end);
  rows_at_a_page_end<Q5_K>(end);
  rows_at_a_page_end<Q6_K>(end);
  rows_at_a_page_end<IQ4_XS>(end);
  std::printf("ok %d\n", GDNSPEC_BLOCKS512 ? 512 : 256);
#else
  std::printf("ok 0\n");
#endif
  return 0;
}
