// LD_PRELOAD experiment behind docs/benchmarks.md ("What it buys back"): serves RAND_bytes from a
// per-thread buffer refilled by the real RAND_bytes 512 bytes at a time — what a buffered
// detail::new_fence() would do — to measure what idem's one RAND_bytes call per claim costs.
// Evidence only: not fork-safe, not built by CMake, never for production.
//   gcc -O2 -shared -fPIC -o /tmp/rand_buffer_shim.so bench/experiments/rand_buffer_shim.c -ldl
//   LD_PRELOAD=/tmp/rand_buffer_shim.so idem-bench --db ... --threads 16 --cases replay --only idem
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

typedef int (*rand_fn)(unsigned char*, int);
static __thread unsigned char buf[512];
static __thread int left = 0;

int RAND_bytes(unsigned char* out, int n) {
    static rand_fn real = 0;
    if (!real) real = (rand_fn)dlsym(RTLD_NEXT, "RAND_bytes");
    if (n > (int)sizeof buf) return real(out, n);
    if (left < n) {
        if (real(buf, sizeof buf) != 1) return 0;
        left = sizeof buf;
    }
    memcpy(out, buf + sizeof buf - left, (size_t)n);
    left -= n;
    return 1;
}
