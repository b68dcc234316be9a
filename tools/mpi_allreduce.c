/* OpenMPI's MPI_Allreduce on floats, timed like allreduce_bench: the shared-memory baseline for the
 * in-process figures (and a TCP one with --mca btl tcp,self), measured in the same run. A check of our
 * figures with the tool users have, never a build dependency:
 *
 *   mpicc -O2 tools/mpi_allreduce.c -o /tmp/mpi_allreduce
 *   mpirun --allow-run-as-root -np 2 /tmp/mpi_allreduce 4096 67108864
 *
 * Prints: size_bytes median_us algbw_GBps busbw_GBps wrong (rank 0). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  enum { warmup = 5, iters = 20 };
  if (rank == 0) printf("# mpi size_bytes median_us algbw_GBps busbw_GBps wrong (%d ranks)\n", size);
  for (int a = 1; a < argc; ++a) {
    const size_t bytes = strtoull(argv[a], NULL, 10), n = bytes / sizeof(float);
    float* buf = malloc(n * sizeof(float) + 1);
    double times[iters];
    size_t wrong = 0;
    for (int it = 0; it < warmup + iters; ++it) {
      for (size_t i = 0; i < n; ++i) buf[i] = (float)(rank + 1) + (float)(i % 64);
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      const double t = MPI_Wtime() - t0;
      if (it >= warmup) times[it - warmup] = t;
      for (size_t i = 0; i < n; ++i)
        wrong += buf[i] != (float)(size * (size + 1) / 2) + (float)size * (float)(i % 64);
    }
    qsort(times, iters, sizeof times[0], cmp);
    const double med = times[iters / 2], algbw = (double)bytes / med / 1e9;
    if (rank == 0)
      printf("mpi %12zu %12.2f %10.3f %10.3f %8zu\n", bytes, med * 1e6, algbw, algbw * 2 * (size - 1) / size, wrong);
    free(buf);
  }
  MPI_Finalize();
  return 0;
}
