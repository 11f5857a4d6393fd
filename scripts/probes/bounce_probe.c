// Bounce probe: how fast this host moves a warm file into device memory through small pinned
// buffers, with no loader around it. Each of T threads claims 8 MiB (or 8 buffers') ranges of the
// file in turn, reads each buffer's worth with pread into one of its 4 pinned buffers (cuMemHostAlloc),
// and queues the upload on its own stream, waiting for a buffer's previous upload before reusing it.
// Sweeps T in {4, 8, 12, 16} and buffer sizes {256 KiB, 1, 4, 16 MiB}; one JSON line per run (a first,
// untimed run per configuration). Used for docs/benchmarks/bounce-probe-2026-11-26.jsonl:
//   gcc -O2 -pthread -I/usr/local/cuda/include scripts/probes/bounce_probe.c -o bounce -lcuda
//   ./bounce /var/tmp/bounce.bin 3      # an 8 GiB file of random bytes, read once before (warm)
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char *s; cuGetErrorString(r, &s); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
static CUcontext ctx; static CUdeviceptr dst; static int fd; static size_t file_bytes, chunk; static int nbuf;
static volatile size_t next_off; static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; static size_t claim_bytes;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { void **bufs; CUevent *ev; CUstream st; } tstate;
static void *work(void *p) {
  tstate *s = p; CK(cuCtxSetCurrent(ctx)); int i = 0; int used[64] = {0};
  for (;;) {
    pthread_mutex_lock(&mu); size_t off = next_off; next_off += claim_bytes; pthread_mutex_unlock(&mu);
    if (off >= file_bytes) break;
    size_t end = off + claim_bytes; if (end > file_bytes) end = file_bytes;
    for (size_t o = off; o < end; o += chunk) {
      size_t n = end - o < chunk ? end - o : chunk;
      if (used[i]) CK(cuEventSynchronize(s->ev[i]));
      size_t got = 0; while (got < n) { ssize_t r = pread(fd, (char *)s->bufs[i] + got, n - got, o + got); if (r <= 0) { perror("pread"); exit(1); } got += r; }
      CK(cuMemcpyHtoDAsync(dst + o, s->bufs[i], n, s->st)); CK(cuEventRecord(s->ev[i], s->st)); used[i] = 1;
      i = (i + 1) % nbuf;
    }
  }
  CK(cuStreamSynchronize(s->st)); return 0;
}
int main(int argc, char **argv) {
  const char *path = argv[1]; int runs = atoi(argv[2]);
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  fd = open(path, O_RDONLY); file_bytes = lseek(fd, 0, SEEK_END); CK(cuMemAlloc(&dst, file_bytes));
  int threads_list[] = {4, 8, 12, 16}; size_t chunk_list[] = {256 << 10, 1 << 20, 4 << 20, 16 << 20}; int buf_list[] = {4};
  for (int ti = 0; ti < 4; ti++) for (int ci = 0; ci < 4; ci++) for (int bi = 0; bi < 1; bi++) {
    int T = threads_list[ti]; chunk = chunk_list[ci]; nbuf = buf_list[bi]; claim_bytes = chunk * 8 > (8 << 20) ? chunk * 8 : (8 << 20);
    tstate st[64];
    for (int t = 0; t < T; t++) { st[t].bufs = malloc(sizeof(void *) * nbuf); st[t].ev = malloc(sizeof(CUevent) * nbuf); CK(cuStreamCreate(&st[t].st, CU_STREAM_NON_BLOCKING));
      for (int b = 0; b < nbuf; b++) { CK(cuMemHostAlloc(&st[t].bufs[b], chunk, 0)); memset(st[t].bufs[b], 1, chunk); CK(cuEventCreate(&st[t].ev[b], CU_EVENT_DISABLE_TIMING)); } }
    for (int r = 0; r < runs + 1; r++) {
      next_off = 0; struct rusage u0, u1; getrusage(RUSAGE_SELF, &u0); double t0 = now(); pthread_t th[64];
      for (int t = 0; t < T; t++) pthread_create(&th[t], 0, work, &st[t]);
      for (int t = 0; t < T; t++) pthread_join(th[t], 0);
      double dt = now() - t0; getrusage(RUSAGE_SELF, &u1);
      double cpu = (u1.ru_utime.tv_sec - u0.ru_utime.tv_sec) + (u1.ru_utime.tv_usec - u0.ru_utime.tv_usec) * 1e-6 + (u1.ru_stime.tv_sec - u0.ru_stime.tv_sec) + (u1.ru_stime.tv_usec - u0.ru_stime.tv_usec) * 1e-6;
      if (r > 0) printf("{\"probe\":\"bounce\",\"threads\":%d,\"chunk_kib\":%zu,\"buffers\":%d,\"run\":%d,\"gb_per_s\":%.2f,\"cores\":%.2f}\n", T, chunk >> 10, nbuf, r, file_bytes / dt / 1e9, cpu / dt);
      fflush(stdout);
    }
    for (int t = 0; t < T; t++) { for (int b = 0; b < nbuf; b++) { cuMemFreeHost(st[t].bufs[b]); cuEventDestroy(st[t].ev[b]); } cuStreamDestroy(st[t].st); }
  }
  return 0;
}
