/* A pin racing a free of the same handle, round after round on two threads: either the pin
 * comes first (the free is refused with SP_ERR_PINNED until the unpin) or the free does (the
 * pin gives NULL). A pin that lands on a freed block would make its unpin find the handle
 * stale. Pin and unpin take the heap lock for this (alloc/handle.c). */
#include <pthread.h>
#include <stdatomic.h>

#include "sp_handle.h"
#include "test_support.h"

static sp_handle_heap *heap;
static _Atomic uint32_t raced; /* the handle id of this round */
static _Atomic int64_t phase;  /* round r: the pinner may go; -r: it is done */
static atomic_int stale_unpins, pins_taken;
static int rounds;

static void *pinner(void *arg) {
    (void)arg;
    for (int r = 1; r <= rounds; r++) {
        while (atomic_load(&phase) != r) {
        }
        sp_handle x = {atomic_load(&raced)};
        if (sp_handle_pin(heap, x)) {
            atomic_fetch_add(&pins_taken, 1);
            if (sp_handle_unpin(heap, x) != SP_OK) atomic_fetch_add(&stale_unpins, 1);
        }
        atomic_store(&phase, -r);
    }
    return NULL;
}

int main(void) {
    rounds = (int)ts_scaled(100000, 10);
    heap = sp_handle_heap_create(NULL, NULL);
    ts_log_capture(); /* a refused free is reported (SP_ERR_PINNED): counted, not fatal */
    pthread_t t;
    pthread_create(&t, NULL, pinner, NULL);
    int freed = 0, refused = 0, other = 0;
    for (int r = 1; r <= rounds; r++) {
        sp_handle x = sp_handle_alloc(heap, 64, 0);
        atomic_store(&raced, x.id);
        atomic_store(&phase, r);
        for (volatile int k = 0; k < r % 64; k++) {
        }
        sp_result res;
        while ((res = sp_handle_free(heap, x)) == SP_ERR_PINNED) refused++;
        if (res == SP_OK)
            freed++;
        else
            other++;
        while (atomic_load(&phase) != -r) {
        }
    }
    pthread_join(t, NULL);
    ts_log_release();
    sp_handle_heap_status st;
    sp_handle_heap_status_get(heap, &st);
    is_int(freed, rounds, "every free went through in the end (%d refused while pinned)", refused);
    is_int(other, 0, "no free failed otherwise");
    is_int(atomic_load(&stale_unpins), 0,
           "no pin landed on a freed block (%d pins taken, every unpin found its handle)",
           atomic_load(&pins_taken));
    ok(st.live_handles == 0 && sp_handle_heap_check(heap) == SP_OK, "heap empty and consistent");
    sp_handle_heap_destroy(heap);
    return done();
}
