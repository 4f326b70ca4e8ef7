/* LD_PRELOAD shim: make sched_getaffinity report FLAX_RINGATTN_FAKE_CPUS CPUs (default 32).
 *
 * Pallas TPU interpret mode runs each simulated device's kernel on a thread of
 * JAX's CPU client, which blocks in the interpreter's callbacks; XLA sizes its
 * CPU thread pools from sched_getaffinity, so with few real cores the pools run
 * out and a multi-device kernel deadlocks.  Reporting more CPUs makes XLA start
 * more (mostly idle) threads; they still share the real cores.  Only the size
 * of the reported set changes: errors of the real call (bad pid, ...) are kept.
 * get_nprocs/sysconf are left alone: they do not size XLA's pools.
 * Built and loaded by flax_ringattn/_src/testing/interpret.py.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef int (*getaffinity_fn)(pid_t, size_t, cpu_set_t *);

int sched_getaffinity(pid_t pid, size_t cpusetsize, cpu_set_t *mask) {
  static getaffinity_fn real = NULL;
  if (real == NULL) real = (getaffinity_fn)dlsym(RTLD_NEXT, "sched_getaffinity");
  if (real == NULL) {
    errno = ENOSYS;
    return -1;
  }
  int rc = real(pid, cpusetsize, mask);
  const char *env = getenv("FLAX_RINGATTN_FAKE_CPUS");
  long n = env ? strtol(env, NULL, 10) : 32;
  if (rc != 0 || n <= 0) return rc;
  if ((size_t)n > cpusetsize * 8) n = (long)(cpusetsize * 8);
  memset(mask, 0, cpusetsize);
  for (long i = 0; i < n; ++i) CPU_SET_S((size_t)i, cpusetsize, mask);
  return 0;
}
