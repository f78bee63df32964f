/* Soak: an hour of play at 60 frames per second (216,000 frames), compressed in time, on the
 * handle heap, and the same churn on a TLSF heap (which cannot move blocks) for contrast.
 *
 * Churn (seeded, identical for both heaps): each frame despawns and spawns a few objects
 * (0..8 each, drawn per frame, one more of either to steer the population) around a
 * population that drifts between 300 and 700 (period 82,800 frames); sizes are 2^x bytes, x
 * triangular (+-5) around a centre that drifts as a sine between 8 and 14 (period 36,000
 * frames, 10 minutes), clamped to 16 B..64 KiB: live bytes drift between about 0.5 and 17 MiB.
 * Every object is filled with a tag byte; each despawned object and a sample of 8 live ones
 * are checked every frame, all of them every 1,000 frames; sp_handle_heap_check every 20,000.
 *
 * Handle heap: after each frame's churn, sp_handle_compact(BUDGET_NS), then:
 *   - after every frame whose compaction caught up (finished its pass within the budget):
 *     external fragmentation (1 - largest free / free, free = holes + committed above the
 *     top) at most 1%; at least 90% of the frames must catch up, not counting frames whose
 *     compaction lost a quarter of its wall-time budget to preemption (thread CPU time against
 *     wall time); frames that ran out of budget are counted and their worst fragmentation
 *     reported;
 *   - after every frame whose compaction caught up with at least 1 MiB live: committed
 *     memory at most the bytes live objects asked for + 5% (the bound; below 1 MiB
 *     the 16 KiB commit steps alone can exceed 5%). Like the catch-up rate, the memory bounds
 *     skip frames whose compaction lost a quarter of its budget to preemption, or caught up
 *     with less than a quarter of it left: such a call may finish its pass and leave the
 *     decommit to the next frame (seen under load: wall 5 ms against 1 ms of CPU); at least
 *     half the frames must be checked;
 *   - after every frame whose compaction caught up: committed memory at most the bytes live
 *     blocks need (status.needed_bytes: a 16-byte header each + the size rounded up to 16)
 *     + 5% + 64 KiB (the commit granularity and the trim hysteresis floor, which dominate
 *     below ~1 MiB); frames above it are counted over all frames and reported, and so is
 *     committed memory against the bytes asked for (headers weigh on small objects).
 * TLSF: fragmentation from its status and its footprint (highest byte a live block reaches)
 * reported beside it, not checked: it is the contrast.
 *
 * Registered as suite 'soak' only in release builds without sanitizers (tests/meson.build).
 * `soak_handle --frames N` runs a shorter soak; SOAK_TRACE=1 prints the heap every 2,000. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sp_handle.h"
#include "sp_platform.h"
#include "sp_tlsf.h"
#include "test_support.h"

#define BUDGET_NS 2000000u    /* 2 ms per frame for compaction */
#define MEM_FLOOR (64u << 10) /* commit granularity + trim hysteresis floor (sp_handle.h) */
enum { MAX_OBJS = 8192, FRAMES = 216000, PERIOD = 36000, POP_MID = 500, POP_SWING = 200 };

typedef struct obj {
    size_t size;
    sp_handle h; /* handle heap */
    void *p;     /* tlsf */
    uint8_t tag;
} obj;

typedef struct churn {
    ts_rng r;
    uint32_t n; /* live objects: objs[0..n) */
} churn;

static obj objs[MAX_OBJS];
static uint64_t *ns_all; /* compaction time per frame */

static uint64_t thread_cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static size_t draw_size(churn *c, uint32_t frame) {
    double mid = 11.0 + 3.0 * sin(2.0 * 3.14159265358979 * frame / PERIOD);
    double u = (double)ts_rng_next(&c->r) / 18446744073709551616.0;
    double v = (double)ts_rng_next(&c->r) / 18446744073709551616.0;
    double x = mid + (u + v - 1.0) * 5.0;
    size_t s = (size_t)exp2(x);
    return s < 16 ? 16 : s > 65536 ? 65536 : s;
}

static uint32_t target_pop(uint32_t frame) {
    return (uint32_t)(POP_MID + POP_SWING * sin(2.0 * 3.14159265358979 * frame / (PERIOD * 2.3)));
}

/* One frame's despawns (index into objs, swapped out) and spawns: the caller applies them. */
typedef struct frame_ops {
    uint32_t despawn[8], ndespawn;
    size_t spawn[8];
    uint32_t nspawn;
} frame_ops;

static void frame_draw(churn *c, uint32_t frame, frame_ops *f) {
    uint32_t target = target_pop(frame);
    uint32_t k = (uint32_t)ts_rng_range(&c->r, 0, 8);
    uint32_t kd = c->n > target ? (k + 1 < 8 ? k + 1 : 8) : k;
    uint32_t ks = c->n < target ? (k + 1 < 8 ? k + 1 : 8) : k;
    f->ndespawn = 0;
    for (uint32_t i = 0; i < kd && c->n - f->ndespawn > 0; i++) {
        uint32_t j = (uint32_t)ts_rng_range(&c->r, 0, c->n - f->ndespawn - 1);
        f->despawn[f->ndespawn++] = j;
    }
    f->nspawn = 0;
    for (uint32_t i = 0; i < ks && c->n - f->ndespawn + f->nspawn < MAX_OBJS; i++)
        f->spawn[f->nspawn++] = draw_size(c, frame);
}

static uint8_t tag_next(churn *c) {
    return (uint8_t)(ts_rng_next(&c->r) | 1);
}

typedef struct result {
    double frag_max, frag_sum, frag_behind_max;
    uint32_t frames_over_1pct, mem_over_frames;
    double mem_over_max;  /* committed / live - 1, max */
    double live_over_max; /* the same over caught-up frames with live >= 1 MiB */
    uint32_t bad_live;    /* such frames above live + 5% */
    double need_over_max; /* committed / needed - 1, max */
    uint32_t checked_frames, first_caught_up, frames_not_caught_up, frames_preempted;
    uint32_t bad_frag, bad_mem;
    uint32_t mem_preempted; /* caught-up frames whose call lost a quarter of its budget */
    uint32_t mem_checked;   /* caught-up frames, not preempted: the memory bounds apply */
    uint64_t moved, compact_ns_max, compact_ns_sum;
    size_t live_end, mem_end, live_peak, mem_peak;
    bool intact, sound, failed;
    double secs;
} result;

static bool obj_ok(const uint8_t *p, const obj *o) {
    return p && p[0] == o->tag && p[o->size / 2] == o->tag && p[o->size - 1] == o->tag;
}

static void soak_handle(uint32_t frames, result *res) {
    memset(res, 0, sizeof *res);
    res->intact = res->sound = true;
    res->first_caught_up = UINT32_MAX;
    sp_handle_heap *hp =
        sp_handle_heap_create(&(sp_handle_heap_desc){.region_size = (size_t)8 << 30}, NULL);
    churn c = {.n = 0};
    ts_rng_seed(&c.r, 0x50a4);
    uint64_t t0 = sp_time_ns();
    for (uint32_t f = 0; f < frames; f++) {
        frame_ops ops;
        frame_draw(&c, f, &ops);
        for (uint32_t i = 0; i < ops.ndespawn; i++) {
            obj *o = &objs[ops.despawn[i]];
            if (!obj_ok(sp_handle_resolve(hp, o->h), o)) res->intact = false;
            sp_handle_free(hp, o->h);
            *o = objs[--c.n];
        }
        for (uint32_t i = 0; i < ops.nspawn; i++) {
            obj *o = &objs[c.n++];
            o->size = ops.spawn[i];
            o->tag = tag_next(&c);
            o->h = sp_handle_alloc(hp, o->size, 0);
            uint8_t *p = sp_handle_resolve(hp, o->h);
            if (!p) {
                res->failed = true;
                c.n--;
                continue;
            }
            memset(p, o->tag, o->size);
        }
        sp_handle_compact_stats cs;
        uint64_t cpu0 = thread_cpu_ns();
        sp_handle_compact(hp, BUDGET_NS, &cs);
        /* The budget is wall time: a compaction that lost a quarter of it to preemption (a
         * loaded machine) is not held against the catch-up rate. */
        uint64_t cpu = thread_cpu_ns() - cpu0;
        const bool preempted = cs.ns > cpu + BUDGET_NS / 4;
        if (!cs.caught_up && preempted) res->frames_preempted++;
        res->moved += cs.bytes_moved;
        res->compact_ns_sum += cs.ns;
        ns_all[f] = cs.ns;
        if (getenv("SOAK_SLOW") && cs.ns > 2 * BUDGET_NS)
            diag("slow frame %u: %.1f us, moved %llu bytes in %llu blocks", f, cs.ns / 1e3,
                 (unsigned long long)cs.bytes_moved, (unsigned long long)cs.blocks_moved);
        if (cs.ns > res->compact_ns_max) res->compact_ns_max = cs.ns;
        if (!cs.caught_up) res->frames_not_caught_up++;
        if (cs.caught_up && res->first_caught_up == UINT32_MAX) res->first_caught_up = f;
        sp_handle_heap_status st;
        sp_handle_heap_status_get(hp, &st);
        if (cs.caught_up) {
            res->checked_frames++;
            res->frag_sum += st.fragmentation;
            if (st.fragmentation > res->frag_max) res->frag_max = st.fragmentation;
            if (st.fragmentation > 0.01) res->bad_frag++;
        } else if (st.fragmentation > res->frag_behind_max) {
            res->frag_behind_max = st.fragmentation;
        }
        if (st.fragmentation > 0.01) res->frames_over_1pct++;
        double over = st.live_bytes ? (double)st.committed_bytes / st.live_bytes - 1.0 : 0;
        if (st.live_bytes >= (1u << 20) && over > res->mem_over_max) res->mem_over_max = over;
        /* The memory bounds hold once the pass is done and its decommit had its share of the
         * budget: a call that catches up near the end of its budget (preempted, or slowed by
         * the other core's work without being preempted: seen once in 213,000 frames with a
         * build running beside it) may leave the decommit to the next frame. Checked: frames
         * that caught up with a quarter of the budget left, not preempted. */
        const bool mem_checked = cs.caught_up && !preempted && cs.ns <= BUDGET_NS - BUDGET_NS / 4;
        if (cs.caught_up && preempted) res->mem_preempted++;
        res->mem_checked += mem_checked;
        if (mem_checked && st.live_bytes >= (1u << 20)) {
            if (over > res->live_over_max) res->live_over_max = over;
            if (st.committed_bytes > st.live_bytes + st.live_bytes / 20) res->bad_live++;
        }
        double nover = (double)st.committed_bytes / st.needed_bytes - 1.0;
        if (st.live_bytes >= (1u << 20) && nover > res->need_over_max) res->need_over_max = nover;
        if (st.committed_bytes > st.needed_bytes + st.needed_bytes / 20 + MEM_FLOOR) {
            res->mem_over_frames++;
            if (mem_checked) res->bad_mem++;
            if (getenv("SOAK_SLOW") && cs.caught_up)
                diag("memory frame %u: needed %zu used %zu holes %zu committed %zu, compaction "
                     "%.1f us (cpu %.1f us) moved %llu",
                     f, st.needed_bytes, st.used_bytes, st.hole_bytes, st.committed_bytes,
                     cs.ns / 1e3, cpu / 1e3, (unsigned long long)cs.bytes_moved);
        }
        if (getenv("SOAK_TRACE") && f % 2000 == 0)
            diag("frame %u: live %zu (%zu objs) used %zu holes %zu committed %zu frag %.4f", f,
                 st.live_bytes, st.live_handles, st.used_bytes, st.hole_bytes, st.committed_bytes,
                 st.fragmentation);
        if (st.live_bytes > res->live_peak) res->live_peak = st.live_bytes;
        if (st.committed_bytes > res->mem_peak) res->mem_peak = st.committed_bytes;
        /* a sample every frame, everything every 1,000 frames */
        uint32_t from = f % 1000 == 999 ? 0 : (c.n ? (uint32_t)(f * 7919u % c.n) : 0);
        uint32_t to = f % 1000 == 999 ? c.n : (from + 8 < c.n ? from + 8 : c.n);
        for (uint32_t i = from; i < to; i++)
            if (!obj_ok(sp_handle_resolve(hp, objs[i].h), &objs[i])) res->intact = false;
        if (f % 20000 == 19999 && sp_handle_heap_check(hp) != SP_OK) res->sound = false;
    }
    res->secs = (double)(sp_time_ns() - t0) / 1e9;
    sp_handle_heap_status st;
    sp_handle_heap_status_get(hp, &st);
    res->live_end = st.live_bytes;
    res->mem_end = st.committed_bytes;
    if (sp_handle_heap_check(hp) != SP_OK) res->sound = false;
    sp_handle_heap_destroy(hp);
}

/* Lowest to highest live byte of the TLSF heap's objects. */
static size_t footprint(uint32_t n) {
    char *lo = NULL, *hi = NULL;
    for (uint32_t i = 0; i < n; i++) {
        char *p = objs[i].p;
        if (!lo || p < lo) lo = p;
        if (!hi || p + objs[i].size > hi) hi = p + objs[i].size;
    }
    return (size_t)(hi - lo);
}

typedef struct tlsf_result {
    double frag_max, frag_sum, frag_end;
    uint32_t samples;
    size_t footprint_end, footprint_peak, live_end, live_peak;
    double over_max; /* footprint / live - 1, at samples with live >= 1 MiB */
    bool intact, failed;
    double secs;
} tlsf_result;

static void soak_tlsf(uint32_t frames, tlsf_result *res) {
    memset(res, 0, sizeof *res);
    res->intact = true;
    size_t size = (size_t)4 << 30;
    char *mem = sp_vm_reserve(size, 0, false, NULL);
    sp_vm_commit(mem, size); /* pages are faulted in on first touch only */
    sp_tlsf *t = sp_tlsf_create(&(sp_tlsf_desc){.memory = mem, .size = size, .name = "soak"}, NULL);
    churn c = {.n = 0};
    ts_rng_seed(&c.r, 0x50a4);
    size_t live = 0;
    uint64_t t0 = sp_time_ns();
    for (uint32_t f = 0; f < frames; f++) {
        frame_ops ops;
        frame_draw(&c, f, &ops);
        for (uint32_t i = 0; i < ops.ndespawn; i++) {
            obj *o = &objs[ops.despawn[i]];
            if (!obj_ok(o->p, o)) res->intact = false;
            live -= o->size;
            sp_tlsf_free(t, o->p);
            *o = objs[--c.n];
        }
        for (uint32_t i = 0; i < ops.nspawn; i++) {
            obj *o = &objs[c.n++];
            o->size = ops.spawn[i];
            o->tag = tag_next(&c);
            o->p = sp_tlsf_malloc(t, o->size);
            if (!o->p) {
                res->failed = true;
                c.n--;
                continue;
            }
            memset(o->p, o->tag, o->size);
            live += o->size;
        }
        if (live > res->live_peak) res->live_peak = live;
        if (f % 100 == 99) {
            sp_tlsf_status st;
            sp_tlsf_status_get(t, &st);
            /* free space below the footprint: what TLSF could reuse */
            res->samples++;
            res->frag_sum += st.fragmentation;
            if (st.fragmentation > res->frag_max) res->frag_max = st.fragmentation;
            res->frag_end = st.fragmentation;
        }
        if (f % 1000 == 999) { /* footprint: the highest byte a live block reaches */
            size_t fp = footprint(c.n);
            if (fp > res->footprint_peak) res->footprint_peak = fp;
            if (live >= (1u << 20) && (double)fp / live - 1 > res->over_max)
                res->over_max = (double)fp / live - 1;
        }
    }
    res->secs = (double)(sp_time_ns() - t0) / 1e9;
    res->footprint_end = footprint(c.n);
    res->live_end = live;
    for (uint32_t i = 0; i < c.n; i++) sp_tlsf_free(t, objs[i].p);
    sp_tlsf_destroy(t);
    sp_vm_release(mem, size);
}

int main(int argc, char **argv) {
    uint32_t frames = FRAMES;
    if (argc == 3 && strcmp(argv[1], "--frames") == 0) frames = (uint32_t)strtoul(argv[2], 0, 10);
    plan(8);
    result r;
    ns_all = calloc(frames ? frames : 1, sizeof *ns_all);
    soak_handle(frames, &r);
    qsort(ns_all, frames, sizeof *ns_all, cmp_u64);
    diag("handle heap: compaction time per frame p50 %.1f us, p99 %.1f us, p99.9 %.1f us "
         "(budget %u us)",
         ns_all[frames / 2] / 1e3, ns_all[frames - 1 - frames / 100] / 1e3,
         ns_all[frames - 1 - frames / 1000] / 1e3, BUDGET_NS / 1000);
    diag(
        "handle heap: %u frames in %.1f s; compaction caught up first at frame %u, %u frames "
        "ended with work left; moved %.1f GiB; compaction mean %.1f us, max %.1f us (budget %u us)",
        frames, r.secs, r.first_caught_up, r.frames_not_caught_up, (double)r.moved / (1 << 30),
        r.compact_ns_sum / 1e3 / frames, r.compact_ns_max / 1e3, BUDGET_NS / 1000);
    diag("handle heap: fragmentation after compaction max %.4f%%, mean %.4f%% over %u frames; "
         "end: live %.1f MiB, committed %.1f MiB; peak live %.1f "
         "MiB, peak committed %.1f MiB",
         r.frag_max * 100, r.checked_frames ? r.frag_sum * 100 / r.checked_frames : 0,
         r.checked_frames, r.live_end / 1048576.0, r.mem_end / 1048576.0, r.live_peak / 1048576.0,
         r.mem_peak / 1048576.0);
    ok(!r.failed && r.intact, "every allocation succeeded, every object intact");
    ok(r.sound, "heap check every 20,000 frames and at the end");
    ok(r.first_caught_up < 600, "compaction caught up within the first 10 s of play (frame %u)",
       r.first_caught_up);
    diag("handle heap: %u frames (%.2f%%) ran out of budget before catching up; fragmentation "
         "after those: max %.2f%%; frames above 1%% in all: %u",
         r.frames_not_caught_up, 100.0 * r.frames_not_caught_up / frames, r.frag_behind_max * 100,
         r.frames_over_1pct);
    ok(r.bad_frag == 0 && r.checked_frames > (frames - r.frames_preempted) * 9 / 10,
       "fragmentation <= 1%% after every frame whose compaction caught up (%u frames, %u over; "
       "%u more preempted)",
       r.checked_frames, r.bad_frag, r.frames_preempted);
    ok(r.bad_live == 0,
       "committed memory <= live bytes (asked for) + 5%% after every frame whose compaction "
       "caught up with at least 1 MiB live (max %.2f%% over, %u frames above; %u preempted "
       "frames not checked)",
       r.live_over_max * 100, r.bad_live, r.mem_preempted);
    ok(r.bad_mem == 0 && r.mem_checked > frames / 2,
       "committed memory <= needed + 5%% + 64 KiB after every frame whose compaction caught "
       "up (%u over; %u frames checked, at least half; %u preempted)",
       r.bad_mem, r.mem_checked, r.mem_preempted);
    diag("handle heap: memory above needed + 5%% + 64 KiB after %u frames in all; committed "
         "over live (bytes asked for) max %.2f%% (frames with live >= 1 MiB), over needed max "
         "%.2f%%",
         r.mem_over_frames, r.mem_over_max * 100, r.need_over_max * 100);
    tlsf_result t;
    soak_tlsf(frames, &t);
    diag("tlsf, same churn: %.1f s; fragmentation (status, every 100 frames) max %.2f%%, mean "
         "%.2f%%, end %.2f%%; footprint (lowest to highest live byte) at the end %.1f MiB for %.1f "
         "MiB "
         "live (%.1f%% over), peak %.1f MiB (peak live %.1f MiB); footprint over live max "
         "%.1f%% (every 1,000 frames, live >= 1 MiB)",
         t.secs, t.frag_max * 100, t.samples ? t.frag_sum * 100 / t.samples : 0, t.frag_end * 100,
         t.footprint_end / 1048576.0, t.live_end / 1048576.0,
         t.live_end ? ((double)t.footprint_end / t.live_end - 1) * 100 : 0,
         t.footprint_peak / 1048576.0, t.live_peak / 1048576.0, t.over_max * 100);
    ok(!t.failed && t.intact, "tlsf ran the same churn");
    ok(t.live_end == r.live_end, "both heaps end with the same live bytes (%zu)", r.live_end);
    return done();
}
