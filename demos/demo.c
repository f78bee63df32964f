/* spindle-demo: the flagship demo. A small "game" on the whole runtime: sp_init, then frames
 * until the time is up, then sp_shutdown.
 *
 * The world is a set of entities living in the handle heap (variable-size payloads, 16 B to
 * 4 KiB, with a size mix that drifts over time). Every frame:
 *   - the main thread spawns and despawns entities (holes for the compactor);
 *   - an update job runs a parallel_for over the entities: each piece pins its entities,
 *     checks their payload, moves them, and writes a render record for each into memory it
 *     allocates from this frame's arena (lock-free bump allocation on the worker running it);
 *   - each piece also sends "events" (thread-cache blocks) to a mailbox that the next frame's
 *     pieces free, usually on another worker (remote frees);
 *   - a render job (after the update, through a counter) walks last frame's and this frame's
 *     render records - last frame's arena data is still valid - and checks each against a
 *     hash of its entity id and position, and that they cover every entity of their frame;
 *   - sp_frame_end waits for the jobs, flips the arena, tidies the caches and compacts the
 *     handle heap within the between-frames budget.
 * Prints a line of figures a second and a summary; exits non-zero if any payload, render
 * record or event was damaged, if anything leaked (handles, thread-cache blocks), if a runtime
 * call failed, a piece found no arena memory, a spawn found the handle heap full, or the
 * output could not be written.
 *
 *   spindle-demo [SECONDS] [ENTITIES]     defaults: 2 seconds, 20000 entities
 * Bad arguments (not a number, out of range, trailing characters, more than two) print the
 * usage and exit 2; -h or --help print it and exit 0.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spindle.h"

#define MAX_ENTITIES 200000
#define GRAIN 256
#define MAILBOXES (MAX_ENTITIES / GRAIN + 1) /* one per GRAIN entities */
/* Calls of update_range a frame: each covers at most GRAIN entities, and parallel_for splits
 * no piece below GRAIN / 2, so fewer than 4 per GRAIN entities (checked: an overflow counts as
 * damage). */
#define MAX_PIECES (4 * MAILBOXES + 64)

typedef struct entity {
    uint32_t id;
    uint32_t len; /* payload bytes */
    float pos[2], vel[2];
    uint8_t payload[]; /* byte i = id + i */
} entity;

typedef struct render_rec {
    uint32_t id;
    float pos[2];
    uint32_t check; /* render_check(id, pos) */
} render_rec;

/* The render records of one update_range call: entities [begin, end), in arena memory. */
typedef struct render_piece {
    uint32_t begin, end;
    const render_rec *recs;
} render_piece;

typedef struct event {
    struct event *next;
    uint32_t id, check;
} event;

typedef struct world {
    sp_handle_heap *heap;
    sp_handle ents[MAX_ENTITIES];
    uint32_t count;
    uint32_t next_id;
    uint64_t frame;
    uint64_t rng;
    render_piece pieces[2][MAX_PIECES]; /* this frame's and last frame's records */
    atomic_uint piece_count[2];
    uint32_t render_count[2]; /* entities updated in that frame */
    event *mail[MAILBOXES];   /* events sent last frame, freed by this frame's piece */
    atomic_uint_fast64_t damaged, events_checked, render_checked, arena_refused;
    uint64_t failed_spawns; /* handle heap full (main thread only) */
    sp_counter *updated;
} world;

static world W;

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Nonzero for a zeroed record too: a cleared or reused buffer fails the check. */
static uint32_t render_check(uint32_t id, const float pos[2]) {
    return (id * 0x9e3779b1u) ^ (float_bits(pos[0]) * 0x85ebca77u) ^
           (float_bits(pos[1]) * 0xc2b2ae3du) ^ 0x27d4eb2fu;
}

/* Size mix drifting with time: mostly small early, larger later, and back. */
static uint32_t payload_size(uint64_t frame, uint64_t r) {
    uint32_t phase = (uint32_t)(frame / 120 % 4); /* 0..3, two seconds each at 60 fps */
    uint32_t max = 64u << (phase * 2);            /* 64 B .. 4 KiB */
    return 16 + (uint32_t)(r % max);
}

/* False when the handle heap is full (the caller stops spawning for this frame). */
static bool spawn(void) {
    uint32_t len = payload_size(W.frame, rng_next(&W.rng));
    sp_handle h = sp_handle_alloc(W.heap, sizeof(entity) + len, 16);
    entity *e = sp_handle_resolve(W.heap, h);
    if (!e) {
        W.failed_spawns++;
        return false;
    }
    e->id = W.next_id++;
    e->len = len;
    e->pos[0] = e->pos[1] = 0;
    e->vel[0] = (float)(e->id % 7) - 3;
    e->vel[1] = (float)(e->id % 5) - 2;
    for (uint32_t i = 0; i < len; i++) e->payload[i] = (uint8_t)(e->id + i);
    W.ents[W.count++] = h;
    return true;
}

static void despawn(uint32_t i) {
    sp_handle_free(W.heap, W.ents[i]);
    W.ents[i] = W.ents[--W.count];
}

/* Mailbox c belongs to the piece whose range holds entity c * GRAIN: one owner per frame,
 * whatever way parallel_for split the range. */
static void mail_collect(uint64_t c) {
    for (event *ev = W.mail[c], *next; ev; ev = next) {
        next = ev->next;
        if (ev->check != ev->id * 2654435761u) atomic_fetch_add(&W.damaged, 1);
        atomic_fetch_add(&W.events_checked, 1);
        sp_tcache_free(ev); /* allocated last frame, often by another worker: a remote free */
    }
    W.mail[c] = NULL;
}

/* One piece of the update: entities [begin, end). */
static void update_range(void *arg, uint64_t begin, uint64_t end) {
    (void)arg;
    uint64_t first_box = (begin + GRAIN - 1) / GRAIN;
    for (uint64_t c = first_box; c * GRAIN < end; c++) mail_collect(c);
    bool has_box = first_box * GRAIN < end;
    /* This call's render records, from the frame arena on the worker running it. */
    render_rec *out = sp_arena_alloc(sizeof(render_rec) * (end - begin));
    if (out) {
        unsigned k = atomic_fetch_add(&W.piece_count[W.frame & 1], 1);
        if (k < MAX_PIECES)
            W.pieces[W.frame & 1][k] = (render_piece){(uint32_t)begin, (uint32_t)end, out};
        else
            atomic_fetch_add(&W.damaged, 1);
    } else {
        atomic_fetch_add(&W.arena_refused, 1);
    }
    for (uint64_t i = begin; i < end; i++) {
        entity *e = sp_handle_pin(W.heap, W.ents[i]);
        if (!e) {
            atomic_fetch_add(&W.damaged, 1);
            continue;
        }
        for (uint32_t k = 0; k < e->len; k += 61)
            if (e->payload[k] != (uint8_t)(e->id + k)) atomic_fetch_add(&W.damaged, 1);
        e->pos[0] += e->vel[0] * 0.016f;
        e->pos[1] += e->vel[1] * 0.016f;
        if (out)
            out[i - begin] =
                (render_rec){e->id, {e->pos[0], e->pos[1]}, render_check(e->id, e->pos)};
        sp_handle_unpin(W.heap, W.ents[i]);
        if (has_box && i % 64 == 0) {
            event *ev = sp_tcache_alloc(sizeof *ev + (i % 200));
            if (!ev) continue;
            ev->id = e->id;
            ev->check = e->id * 2654435761u;
            ev->next = W.mail[first_box];
            W.mail[first_box] = ev;
        }
    }
}

static void update_job(void *arg) {
    (void)arg;
    sp_parallel_for(sp_scheduler(), 0, W.count, GRAIN, update_range, NULL);
}

/* After the update: this frame's records are complete, last frame's are still valid. Each
 * record must match its hash and come from an entity that existed; the pieces of a frame must
 * cover exactly the entities it updated. */
static void render_job(void *arg) {
    (void)arg;
    for (int b = 0; b < 2; b++) {
        unsigned n = atomic_load(&W.piece_count[b]);
        if (n > MAX_PIECES) n = MAX_PIECES;
        uint64_t covered = 0; /* records checked: the entities the pieces cover */
        for (unsigned k = 0; k < n; k++) {
            const render_piece *p = &W.pieces[b][k];
            covered += p->end - p->begin;
            for (uint32_t i = 0; i < p->end - p->begin; i++) {
                const render_rec *r = &p->recs[i];
                if (r->check != render_check(r->id, r->pos) || r->id >= W.next_id)
                    atomic_fetch_add(&W.damaged, 1);
            }
        }
        /* A frame with refused pieces covers fewer (counted there, not as damage). */
        if (covered != W.render_count[b] && atomic_load(&W.arena_refused) == 0)
            atomic_fetch_add(&W.damaged, 1);
        atomic_fetch_add(&W.render_checked, covered);
    }
}

static void free_world(void) {
    while (W.count) despawn(W.count - 1);
    for (int i = 0; i < MAILBOXES; i++)
        for (event *ev = W.mail[i], *next; ev; ev = next) {
            next = ev->next;
            sp_tcache_free(ev);
        }
    memset(W.mail, 0, sizeof W.mail);
}

/* The whole of s as a number, or NAN. */
static double number(const char *s) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    return end != s && *end == '\0' && errno == 0 ? v : NAN;
}

int main(int argc, char **argv) {
    bool help = argc > 1 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0);
    double seconds = argc > 1 && !help ? number(argv[1]) : 2.0;
    double entities = argc > 2 ? number(argv[2]) : 20000;
    if (help || argc > 3 || !(seconds > 0 && seconds <= 3600) ||
        !(entities >= 1 && entities <= MAX_ENTITIES / 2 && entities == floor(entities))) {
        fprintf(help ? stdout : stderr,
                "usage: %s [SECONDS (0-3600], default 2] [ENTITIES 1-%d, default 20000]\n", argv[0],
                MAX_ENTITIES / 2);
        if (help && (fflush(stdout) != 0 || ferror(stdout))) return 1;
        return help ? 0 : 2;
    }
    sp_desc desc = {0};
    desc.huge_pages = true;
    sp_result r = sp_init(&desc);
    if (r != SP_OK) {
        fprintf(stderr, "sp_init failed in %s: %s\n", sp_init_failure() ? sp_init_failure() : "?",
                sp_result_name(r));
        return 1;
    }
    sp_status st;
    sp_status_get(&st);
    sp_jobs_status js;
    sp_jobs_status_get(sp_scheduler(), &js);
    static const char *pages[] = {"normal", "transparent huge", "huge"};

    W.heap = sp_handles();
    W.rng = 42;
    W.updated = sp_counter_create(sp_scheduler(), "updated");
    sp_tcache_status t0;
    sp_tcache_status_get(&t0);
    while (W.count < (uint32_t)entities && spawn()) {
    }
    printf("spindle-demo: %u entities, %.1f s; %u workers + main thread; %zu MiB reserved "
           "(%s pages)\n",
           W.count, seconds, js.workers, st.reserved >> 20, pages[st.pages]);
    /* A runtime call that failed: counted, named once, and the exit status says so. */
    uint64_t failed_calls = W.updated ? 0 : 1;
    const char *first_failure = W.updated ? NULL : "sp_counter_create";
#define CALL(expr)                                                                                 \
    do {                                                                                           \
        sp_result call_r_ = (expr);                                                                \
        if (call_r_ != SP_OK && failed_calls++ == 0) {                                             \
            first_failure = #expr;                                                                 \
            fprintf(stderr, "spindle-demo: %s: %s\n", #expr, sp_result_name(call_r_));             \
        }                                                                                          \
    } while (0)

    uint64_t start = sp_time_ns(), last_print = start, frames = 0, moved = 0, overflows = 0;
    uint64_t worst_frame = 0, jobs = 0;
    while (W.updated) {
        CALL(sp_frame_begin());
        /* Churn: despawn ~1%, spawn back to the target (the size mix drifts). */
        for (uint32_t k = 0; k < entities / 100 + 1 && W.count; k++)
            despawn((uint32_t)(rng_next(&W.rng) % W.count));
        while (W.count < (uint32_t)entities && spawn()) {
        }
        atomic_store(&W.piece_count[W.frame & 1], 0);
        W.render_count[W.frame & 1] = W.count;
        sp_job_desc update = {.fn = update_job, .name = "update"};
        sp_job_desc render = {.fn = render_job, .name = "render"};
        CALL(sp_submit(&update, 1, W.updated));
        /* The render job waits for the update (deferred on its counter), the frame for the
         * render job (the frame counter); the update's own counter is waited for here. */
        CALL(sp_jobs_submit_after(sp_scheduler(), W.updated, 0, &render, 1, sp_frame_counter()));
        CALL(sp_counter_wait(W.updated, 0));
        CALL(sp_frame_end());
        W.frame++;
        frames++;
        sp_frame_stats fs;
        sp_frame_stats_last(&fs);
        moved += fs.handle_moved;
        overflows += fs.arena_overflows;
        jobs += fs.jobs_run;
        if (fs.frame_ns > worst_frame) worst_frame = fs.frame_ns;
        uint64_t now = sp_time_ns();
        if (now - last_print >= 1000000000u || now - start >= (uint64_t)(seconds * 1e9)) {
            sp_handle_heap_status hs;
            sp_handle_heap_status_get(W.heap, &hs);
            printf("  frame %6" PRIu64 ": %5.2f ms, %4" PRIu64 " jobs, arena %5zu KiB (peak "
                   "%5zu), heap %6zu KiB, handles %6zu KiB live, holes %5zu KiB (%4.1f%% of the "
                   "heap's used span), %7zu KiB moved\n",
                   fs.frame, fs.frame_ns / 1e6, fs.jobs_run, fs.arena_bytes >> 10,
                   fs.arena_peak >> 10, fs.heap_bytes >> 10, fs.handle_bytes >> 10,
                   hs.hole_bytes >> 10,
                   hs.used_bytes ? 100.0 * (double)hs.hole_bytes / (double)hs.used_bytes : 0.0,
                   fs.handle_moved >> 10);
            last_print = now;
        }
        if (now - start >= (uint64_t)(seconds * 1e9)) break;
    }
    double elapsed = (sp_time_ns() - start) / 1e9;

    /* Tear down: free the world, two empty frames reclaim the arena, then check the figures. */
    free_world();
    for (int i = 0; i < 2; i++) {
        CALL(sp_frame_begin());
        CALL(sp_frame_end());
    }
    sp_tcache_trim();
    sp_handle_heap_status hs;
    sp_handle_heap_status_get(W.heap, &hs);
    if (W.updated) sp_counter_destroy(W.updated);
    uint64_t damaged = atomic_load(&W.damaged);
    uint64_t refused = atomic_load(&W.arena_refused);
    printf("spindle-demo: %" PRIu64 " frames in %.2f s (%.0f fps, worst %.2f ms), %" PRIu64
           " jobs, %" PRIu64 " MiB compacted, %" PRIu64 " arena overflows; checked %" PRIu64
           " events, %" PRIu64 " render records: %" PRIu64 " damaged\n",
           frames, elapsed, frames / elapsed, worst_frame / 1e6, jobs, moved >> 20, overflows,
           (uint64_t)atomic_load(&W.events_checked), (uint64_t)atomic_load(&W.render_checked),
           damaged);
    if (refused)
        printf("spindle-demo: %" PRIu64 " update pieces found no arena memory for their render "
               "records\n",
               refused);
    if (failed_calls)
        printf("spindle-demo: %" PRIu64 " runtime calls failed, the first %s\n", failed_calls,
               first_failure);
    /* Blocks not freed: live ones, less the freed ones still in their owners' inboxes (the
     * main thread freed the last events, most of them remotely). */
    sp_tcache_status t1;
    sp_tcache_status_get(&t1);
    size_t kept0 = t0.live_blocks - t0.remote_pending, kept1 = t1.live_blocks - t1.remote_pending;
    if (W.failed_spawns)
        printf("spindle-demo: %" PRIu64 " spawns found the handle heap full\n", W.failed_spawns);
    bool leaked = hs.live_handles != 0 || kept1 != kept0;
    if (hs.live_handles) printf("spindle-demo: %zu handles still live\n", (size_t)hs.live_handles);
    if (kept1 != kept0)
        printf("spindle-demo: %zu thread-cache blocks not freed at the end, %zu at the start\n",
               kept1, kept0);
    r = sp_shutdown();
    if (r != SP_OK) printf("spindle-demo: sp_shutdown: %s\n", sp_result_name(r));
    bool written = fflush(stdout) == 0 && !ferror(stdout);
    if (!written) fprintf(stderr, "spindle-demo: writing the output failed\n");
    return damaged || leaked || refused || failed_calls || W.failed_spawns || r != SP_OK || !written
               ? 1
               : 0;
}
