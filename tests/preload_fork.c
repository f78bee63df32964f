/* fork while other threads allocate, for test_malloc_preload.sh (run under LD_PRELOAD of
 * libspindle-malloc.so). Three threads malloc and free in a tight loop - small blocks of many
 * sizes (their caches keep taking spans from and giving spans to the central heap, under its
 * lock) and large ones (the large heap's lock) - while the main thread forks FORKS times. Each
 * child allocates small and large blocks itself, checks them and exits. Without the library's
 * fork handlers a child often inherits a lock that a churning thread held at the fork and
 * waits for it forever: each child has an alarm, so a hang shows as a child killed by SIGALRM.
 * Prints "forks N failed F" and exits 0 only when all FORKS children exited 0; it stops at the
 * first child that did not (printing how it ended), so a broken build costs one alarm.
 * Built without libspindle: the allocator under test is whatever serves malloc. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { THREADS = 3, FORKS = 200, SLOTS = 256, CHILD_SECONDS = 10 };

static atomic_int stop;

/* Sizes for slot i of round r: mostly small blocks of many classes, every 16th a large one. */
static size_t size_for(unsigned i, unsigned r) {
    if ((i + r) % 16 == 0) return 64 * 1024 + (i * 4096) % (512 * 1024);
    return 8 + (i * 37 + r * 11) % 4000;
}

static void *churn(void *arg) {
    void *slot[SLOTS] = {0};
    unsigned r = (unsigned)(size_t)arg;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        for (unsigned i = 0; i < SLOTS; i++) {
            free(slot[i]);
            slot[i] = malloc(size_for(i, r));
            if (slot[i]) memset(slot[i], (int)i, 8);
        }
        r++;
    }
    for (unsigned i = 0; i < SLOTS; i++) free(slot[i]);
    return NULL;
}

/* The child: blocks of the same mix as the threads', written and checked, then freed. */
static int child(unsigned seed) {
    alarm(CHILD_SECONDS); /* a child stuck on an inherited lock dies of SIGALRM */
    void *slot[SLOTS];
    int bad = 0;
    for (unsigned round = 0; round < 4; round++) {
        for (unsigned i = 0; i < SLOTS; i++) {
            size_t n = size_for(i, seed + round);
            slot[i] = malloc(n);
            if (!slot[i]) return 2;
            memset(slot[i], (int)(i ^ round), n);
        }
        for (unsigned i = 0; i < SLOTS; i++) {
            unsigned char *p = slot[i];
            size_t n = size_for(i, seed + round);
            if (p[0] != (unsigned char)(i ^ round) || p[n - 1] != (unsigned char)(i ^ round))
                bad = 1;
            free(p);
        }
    }
    return bad ? 3 : 0;
}

int main(void) {
    pthread_t t[THREADS];
    for (size_t i = 0; i < THREADS; i++)
        if (pthread_create(&t[i], NULL, churn, (void *)(i * 1000))) {
            puts("pthread_create failed");
            return 1;
        }
    int failed = 0, forks = 0;
    while (forks < FORKS && !failed) {
        pid_t pid = fork();
        if (pid < 0) {
            puts("fork failed");
            failed++;
            break;
        }
        if (pid == 0) _exit(child((unsigned)forks));
        forks++;
        int status;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status)) {
            /* Stop at the first: a hung child costs CHILD_SECONDS each. */
            printf("child %d: %s %d\n", forks, WIFSIGNALED(status) ? "signal" : "exit",
                   WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
            failed++;
        }
    }
    atomic_store(&stop, 1);
    for (size_t i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    printf("forks %d failed %d\n", forks, failed);
    return failed != 0;
}
