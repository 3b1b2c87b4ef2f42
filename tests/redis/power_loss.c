/* tests/redis/power_loss.c — an LD_PRELOAD shim that makes kill -9 of redis-server lose what a
 * power loss would (not part of idem; tests/support/redis_server.hpp preloads it with power_loss).
 *
 * kill -9 alone loses nothing Redis wrote: write() put the bytes in the kernel's page cache, which
 * outlives the process, so appendfsync everysec looks as safe as always. A machine crash loses
 * what was written but not yet fsync'ed. This shim emulates that for the AOF: for every fd opened
 * on a path containing "appendonlydir/" (Redis 7's multi-part AOF: base, incr and manifest files),
 * write()/writev() only append the bytes to a buffer in the process's memory and report them
 * written; fsync()/fdatasync() pass the buffer to the kernel, then sync for real. So the bytes reach
 * the file exactly when Redis asked for them to be durable, and a SIGKILL drops the rest with the
 * process's memory. With appendfsync always Redis fsyncs before it answers (nothing acknowledged is
 * lost); with everysec it fsyncs once a second from a background thread (up to a second of
 * acknowledged writes is lost).
 *
 * Conservative where Redis might rely on the file: close() and ftruncate() of a tracked fd pass its
 * buffer on first (the file then holds what Redis wrote, as a page cache would show it; Redis
 * closes an AOF only after fsync, or at a rewrite whose new files it fsyncs). Reads of a tracked
 * file while it has a buffer would miss the buffered bytes: Redis reads its AOF only at start-up.
 * Metadata (open, rename, unlink) goes to the kernel at once; pwrite() is not intercepted (Redis
 * does not use it for the AOF). Files written through stdio (the base file of a rewrite) are not
 * intercepted: Redis fsyncs them before it renames them in. A forked child (rewrite, RDB) forgets
 * the parent's buffers (pthread_atfork): only the parent passes them on.
 *
 * IDEM_POWER_LOSS_HOLD (a path): while that file exists, fsyncs pass nothing on (see held()).
 *
 * Thread-safe: Redis's main thread writes while its bio thread fsyncs and closes. One mutex guards
 * the table; a second orders the flushes (a flush takes the buffer under the first, then writes it
 * under the second only, so the main thread's write() never waits for a disk).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FDS 4096

struct pending {
    int tracked;
    char* data;
    size_t len, cap;
};

static struct pending table[MAX_FDS];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t flush_lock = PTHREAD_MUTEX_INITIALIZER;

static int (*real_open64)(const char*, int, ...);
static int (*real_openat64)(int, const char*, int, ...);
static ssize_t (*real_write)(int, const void*, size_t);
static ssize_t (*real_writev)(int, const struct iovec*, int);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_close)(int);
static int (*real_ftruncate64)(int, off_t);

static void resolve(void);

/* fork(): the child (a rewrite or RDB child) gets the buffers' memory but must never pass the
 * parent's bytes on (they would land twice): it forgets every tracked fd. The locks are held across
 * the fork so the child's copies are not left locked by a thread that does not exist there. */
static void before_fork(void) {
    pthread_mutex_lock(&flush_lock);
    pthread_mutex_lock(&table_lock);
}
static void after_fork_parent(void) {
    pthread_mutex_unlock(&table_lock);
    pthread_mutex_unlock(&flush_lock);
}
static void after_fork_child(void) {
    for (int fd = 0; fd < MAX_FDS; ++fd) {
        table[fd].tracked = 0;
        table[fd].data = NULL; /* the parent's: not freed here */
        table[fd].len = table[fd].cap = 0;
    }
    pthread_mutex_init(&table_lock, NULL);
    pthread_mutex_init(&flush_lock, NULL);
}

__attribute__((constructor)) static void init(void) {
    resolve();
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    /* Proof of presence for the test harness (RedisServer checks it after every start). */
    const char* loaded = getenv("IDEM_POWER_LOSS_LOADED");
    if (loaded != NULL && *loaded != '\0') {
        const int fd = real_open64(loaded, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) real_close(fd);
    }
}

static void resolve(void) {
    if (real_write) return;
    real_open64 = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, "open64");
    real_openat64 = (int (*)(int, const char*, int, ...))dlsym(RTLD_NEXT, "openat64");
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    real_close = (int (*)(int))dlsym(RTLD_NEXT, "close");
    real_ftruncate64 = (int (*)(int, off_t))dlsym(RTLD_NEXT, "ftruncate64");
    real_writev = (ssize_t(*)(int, const struct iovec*, int))dlsym(RTLD_NEXT, "writev");
    real_write = (ssize_t(*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write"); /* last: the "resolved" mark */
}

static int is_aof(const char* path) { return path != NULL && strstr(path, "appendonlydir/") != NULL; }

static int track(int fd, const char* path, int flags) {
    if (fd >= 0 && fd < MAX_FDS && (flags & O_ACCMODE) != O_RDONLY && is_aof(path)) {
        pthread_mutex_lock(&table_lock);
        table[fd].len = 0;
        __atomic_store_n(&table[fd].tracked, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&table_lock);
    }
    return fd;
}

static int tracked(int fd) { return fd >= 0 && fd < MAX_FDS && __atomic_load_n(&table[fd].tracked, __ATOMIC_ACQUIRE); }

/* Appends to fd's buffer; 0, or -1 with errno (ENOMEM). */
static int buffer(int fd, const void* data, size_t len) {
    int rc = 0;
    pthread_mutex_lock(&table_lock);
    struct pending* p = &table[fd];
    if (p->len + len > p->cap) {
        size_t cap = p->cap ? p->cap : 65536;
        while (cap < p->len + len) cap *= 2;
        char* grown = realloc(p->data, cap);
        if (grown == NULL) {
            rc = -1;
            errno = ENOMEM;
        } else {
            p->data = grown;
            p->cap = cap;
        }
    }
    if (rc == 0) {
        memcpy(p->data + p->len, data, len);
        p->len += len;
    }
    pthread_mutex_unlock(&table_lock);
    return rc;
}

/* Passes fd's buffer to the kernel; 0, or -1 with errno (what write() said). */
static int flush(int fd) {
    int rc = 0;
    pthread_mutex_lock(&flush_lock);
    pthread_mutex_lock(&table_lock);
    struct pending* p = &table[fd];
    char* data = p->data;
    size_t len = p->len;
    p->data = NULL;
    p->len = p->cap = 0;
    pthread_mutex_unlock(&table_lock);
    for (size_t done = 0; done < len;) {
        ssize_t n = real_write(fd, data + done, len - done);
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = -1;
            break;
        }
        done += (size_t)n;
    }
    free(data);
    pthread_mutex_unlock(&flush_lock);
    return rc;
}

/* The mode argument after `flags`: passed only with O_CREAT or O_TMPFILE. */
#define MODE_ARG(flags, mode)                  \
    do {                                       \
        if ((flags) & (O_CREAT | O_TMPFILE)) { \
            va_list ap;                        \
            va_start(ap, flags);               \
            (mode) = (mode_t)va_arg(ap, int);  \
            va_end(ap);                        \
        }                                      \
    } while (0)

int open64(const char* path, int flags, ...) {
    resolve();
    mode_t mode = 0;
    MODE_ARG(flags, mode);
    return track(real_open64(path, flags, mode), path, flags);
}

/* On 64-bit Linux open and open64 (openat, ftruncate) are one function: same entry point. */
int open(const char* path, int flags, ...) __attribute__((alias("open64")));

int openat64(int dirfd, const char* path, int flags, ...) {
    resolve();
    mode_t mode = 0;
    MODE_ARG(flags, mode);
    return track(real_openat64(dirfd, path, flags, mode), path, flags);
}

int openat(int dirfd, const char* path, int flags, ...) __attribute__((alias("openat64")));

ssize_t write(int fd, const void* data, size_t len) {
    resolve();
    if (!tracked(fd)) return real_write(fd, data, len);
    return buffer(fd, data, len) == 0 ? (ssize_t)len : -1;
}

ssize_t writev(int fd, const struct iovec* iov, int count) {
    resolve();
    if (!tracked(fd)) return real_writev(fd, iov, count);
    size_t total = 0;
    for (int i = 0; i < count; ++i) {
        if (buffer(fd, iov[i].iov_base, iov[i].iov_len) != 0) return -1;
        total += iov[i].iov_len;
    }
    return (ssize_t)total;
}

/* While the file named by IDEM_POWER_LOSS_HOLD exists, an fsync of a tracked fd passes nothing on
 * (and reports success): the machine is about to die before its next fsync reaches the disk. A test
 * creates the file to place its kill -9 inside that window for certain, instead of racing a
 * background fsync that comes once a second; appendfsync always is never held (Redis fsyncs before
 * it answers, so holding it would fake a loss that cannot happen). */
static int held(void) {
    const char* path = getenv("IDEM_POWER_LOSS_HOLD");
    return path != NULL && *path != '\0' && access(path, F_OK) == 0;
}

int fsync(int fd) {
    resolve();
    if (tracked(fd)) {
        if (held()) return 0;
        if (flush(fd) != 0) return -1;
    }
    return real_fsync(fd);
}

int fdatasync(int fd) {
    resolve();
    if (tracked(fd)) {
        if (held()) return 0;
        if (flush(fd) != 0) return -1;
    }
    return real_fdatasync(fd);
}

int ftruncate64(int fd, off_t length) {
    resolve();
    if (tracked(fd) && flush(fd) != 0) return -1;
    return real_ftruncate64(fd, length);
}

int ftruncate(int fd, off_t length) __attribute__((alias("ftruncate64")));

int close(int fd) {
    resolve();
    if (tracked(fd)) {
        flush(fd); /* as the page cache would keep them; an error here is close()'s to ignore */
        pthread_mutex_lock(&table_lock);
        __atomic_store_n(&table[fd].tracked, 0, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&table_lock);
    }
    return real_close(fd);
}
