/* OpenMPI's MPI_Allreduce on floats, timed like allreduce_bench: the shared-memory baseline for the
 * in-process figures (and a TCP one with --mca btl tcp,self), measured in the same run. A check of our
 * figures with the tool users have, never a build dependency:
 *
 *   mpicc -O2 tools/mpi_allreduce.c -o /tmp/mpi_allreduce
 *   mpirun --allow-run-as-root -np 2 /tmp/mpi_allreduce 4096 67108864
 *
 * As nccl-tests and allreduce_bench time: 5 checked all-reduces, a barrier, 20 back to back, the
 * slowest rank's time / 20. Prints: size_bytes time_us algbw_GBps busbw_GBps wrong (rank 0). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  enum { warmup = 5, iters = 20 };
  if (rank == 0) printf("# mpi size_bytes time_us algbw_GBps busbw_GBps wrong (%d ranks)\n", size);
  for (int a = 1; a < argc; ++a) {
    const size_t bytes = strtoull(argv[a], NULL, 10), n = bytes / sizeof(float);
    float* buf = malloc(n * sizeof(float) + 1);
    unsigned long wrong = 0, all_wrong = 0;
    for (int it = 0; it < warmup; ++it) {
      for (size_t i = 0; i < n; ++i) buf[i] = (float)(rank + 1) + (float)(i % 64);
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      for (size_t i = 0; i < n; ++i)
        wrong += buf[i] != (float)(size * (size + 1) / 2) + (float)size * (float)(i % 64);
    }
    memset(buf, 0, n * sizeof(float));
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int it = 0; it < iters; ++it) MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t = (MPI_Wtime() - t0) / iters, slowest = 0;
    for (size_t i = 0; i < n; ++i) wrong += buf[i] != 0.0f;
    MPI_Reduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&wrong, &all_wrong, 1, MPI_UNSIGNED_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    const double algbw = (double)bytes / slowest / 1e9;
    if (rank == 0)
      printf("mpi %12zu %12.2f %10.3f %10.3f %8lu\n", bytes, slowest * 1e6, algbw, algbw * 2 * (size - 1) / size, all_wrong);
    free(buf);
  }
  MPI_Finalize();
  return 0;
}
