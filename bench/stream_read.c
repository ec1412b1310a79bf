// The memory read ceiling of this machine: two threads summing 1 GiB with 256-bit loads,
// three times (BENCHMARKS.md "CPU: own Q4_K / Q6_K kernels"). A decode step streams its
// weights once, so this bounds decode speed: bytes of weights per token / this rate.
//   gcc -O2 -mavx2 -fopenmp bench/stream_read.c -o /tmp/stream_read && /tmp/stream_read
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
  size_t n = (size_t)1 << 30;
  char *a = aligned_alloc(64, n);
  memset(a, 1, n);
  for (int round = 0; round < 3; round++) {
    double t = omp_get_wtime();
    long total = 0;
#pragma omp parallel for reduction(+ : total) num_threads(2)
    for (size_t i = 0; i < n; i += 256) {
      __m256i s = _mm256_setzero_si256();
      for (int j = 0; j < 256; j += 32)
        s = _mm256_add_epi8(s, _mm256_load_si256((const __m256i *)(a + i + j)));
      total += _mm256_extract_epi8(s, 0);
    }
    t = omp_get_wtime() - t;
    printf("%.1f GB/s (checksum %ld)\n", n / t / 1e9, total);
  }
  free(a);
  return 0;
}
