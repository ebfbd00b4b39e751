/* LD_PRELOAD shim for tests/crash/test_clock_skew.py: shift this process's wall clock
 * (CLOCK_REALTIME: time.time(), datetime.now(), gettimeofday, time) by CLOCK_SKEW_SECONDS
 * (or by the number in the file CLOCK_SKEW_FILE, which may change while it runs) and
 * leave the monotonic clocks alone, so sleeps and timed waits keep working.
 *
 * Why not libfaketime: with libfaketime 0.9.10 (Debian 12) and Python 3.11, faking the
 * monotonic clock makes threading.Event().wait(0.2) block for the whole offset (Python
 * waits with sem_clockwait(CLOCK_MONOTONIC), which libfaketime does not translate), and
 * FAKETIME_DONT_FAKE_MONOTONIC=1 makes time.sleep() fail with EINVAL (its
 * clock_nanosleep(TIMER_ABSTIME) wrapper shifts a real deadline). A Celery worker needs
 * both. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int real_clock_gettime(clockid_t clock, struct timespec *tp) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    return real(clock, tp);
}

/* The skew in seconds: CLOCK_SKEW_SECONDS, or, with CLOCK_SKEW_FILE set, the number that
 * file holds, read again at most every 100 ms of monotonic time: a test steps the
 * process's clock while it runs by writing the file (tests/crash/test_beat_slots.py). */
static long skew(void) {
    static int ready;
    static long seconds;
    static const char *file;
    static long checked_ms = -1000000;
    if (!ready) {
        const char *value = getenv("CLOCK_SKEW_SECONDS");
        seconds = value ? atol(value) : 0;
        file = getenv("CLOCK_SKEW_FILE");
        ready = 1;
    }
    if (file) {
        struct timespec mono;
        if (real_clock_gettime(CLOCK_MONOTONIC_COARSE, &mono) == 0) {
            long ms = (long)mono.tv_sec * 1000 + mono.tv_nsec / 1000000;
            if (ms - checked_ms >= 100) {
                checked_ms = ms;
                /* open/read, not stdio: no allocation inside a clock call */
                int fd = open(file, O_RDONLY | O_CLOEXEC);
                if (fd >= 0) {
                    char buf[32];
                    ssize_t n = read(fd, buf, sizeof buf - 1);
                    close(fd);
                    if (n > 0) {
                        buf[n] = 0;
                        seconds = strtol(buf, NULL, 10);
                    }
                }
            }
        }
    }
    return seconds;
}

int clock_gettime(clockid_t clock, struct timespec *tp) {
    int rc = real_clock_gettime(clock, tp);
    if (rc == 0 && tp && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE))
        tp->tv_sec += skew();
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    static int (*real)(struct timeval *restrict, void *restrict);
    if (!real)
        real = (int (*)(struct timeval *restrict, void *restrict))dlsym(RTLD_NEXT,
                                                                        "gettimeofday");
    int rc = real(tv, tz);
    if (rc == 0 && tv) tv->tv_sec += skew();
    return rc;
}

time_t time(time_t *out) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    if (out) *out = now.tv_sec;
    return now.tv_sec;
}
