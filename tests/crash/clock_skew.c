/* LD_PRELOAD shim for tests/crash/test_clock_skew.py: shift this process's wall clock
 * (CLOCK_REALTIME: time.time(), datetime.now(), gettimeofday, time) by CLOCK_SKEW_SECONDS
 * and leave the monotonic clocks alone, so sleeps and timed waits keep working.
 *
 * Why not libfaketime: with libfaketime 0.9.10 (Debian 12) and Python 3.11, faking the
 * monotonic clock makes threading.Event().wait(0.2) block for the whole offset (Python
 * waits with sem_clockwait(CLOCK_MONOTONIC), which libfaketime does not translate), and
 * FAKETIME_DONT_FAKE_MONOTONIC=1 makes time.sleep() fail with EINVAL (its
 * clock_nanosleep(TIMER_ABSTIME) wrapper shifts a real deadline). A Celery worker needs
 * both. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long skew(void) {
    static int ready;
    static long seconds;
    if (!ready) {
        const char *value = getenv("CLOCK_SKEW_SECONDS");
        seconds = value ? atol(value) : 0;
        ready = 1;
    }
    return seconds;
}

int clock_gettime(clockid_t clock, struct timespec *tp) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clock, tp);
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
