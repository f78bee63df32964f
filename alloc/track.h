/* How allocators tell AddressSanitizer and Valgrind which bytes the user may touch.
 *
 * The one header every spindle allocator goes through for these tools. The model:
 *   - a pool handed to an allocator starts out as allocator-internal: user access is an error;
 *   - track_malloc / track_free / track_resize move a user block in and out of that state;
 *   - the allocator's own code reads and writes its metadata (headers, free-list links inside
 *     free blocks) freely: its functions carry TRACK_INTERNAL (ASan does not instrument them)
 *     and run between track_enter / track_leave (Valgrind does not report them).
 * Compiled away entirely when neither tool is in use.
 */
#ifndef SP_TRACK_H
#define SP_TRACK_H

#include <stddef.h>

#include "sp_platform.h" /* SP_ASAN */

#if SP_ASAN
#include <sanitizer/asan_interface.h>
#define TRACK_ASAN 1
#define TRACK_INTERNAL __attribute__((no_sanitize_address))
#else
#define TRACK_ASAN 0
#define TRACK_INTERNAL
#endif

#if defined(SP_TRACK_VALGRIND) && SP_TRACK_VALGRIND
#include <valgrind/memcheck.h>
#define TRACK_VALGRIND 1
#else
#define TRACK_VALGRIND 0
#endif

/* Allocator code is about to touch its own metadata / is done with it (per public call). */
static inline void track_enter(void) {
#if TRACK_VALGRIND
    VALGRIND_DISABLE_ERROR_REPORTING;
#endif
}
static inline void track_leave(void) {
#if TRACK_VALGRIND
    VALGRIND_ENABLE_ERROR_REPORTING;
#endif
}

/* A value the allocator read from memory that may hold uninitialised user bytes (validating
 * a caller's pointer): its bits are meaningful to the allocator whatever the user wrote. */
static inline void track_value_defined(const void *p, size_t n) {
#if TRACK_VALGRIND
    VALGRIND_MAKE_MEM_DEFINED(p, n);
#endif
    (void)p, (void)n;
}

/* [p, p+n) now belongs to the allocator: any user access is reported. */
static inline void track_pool(const void *p, size_t n) {
#if TRACK_ASAN
    ASAN_POISON_MEMORY_REGION(p, n);
#endif
#if TRACK_VALGRIND
    VALGRIND_MAKE_MEM_NOACCESS(p, n);
#endif
    (void)p, (void)n;
}

/* [p, p+n) was decommitted in place (sp_vm_decommit): for Valgrind, inaccessible as a fresh
 * PROT_NONE mapping is, so that a later commit makes it zeroed, defined memory again. */
static inline void track_fresh(const void *p, size_t n) {
#if TRACK_VALGRIND
    VALGRIND_MAKE_MEM_NOACCESS(p, n);
#endif
    (void)p, (void)n;
}

/* [p, p+n) leaves the allocator for good (heap destroyed): plain memory again. */
static inline void track_release(const void *p, size_t n) {
#if TRACK_ASAN
    ASAN_UNPOISON_MEMORY_REGION(p, n);
#endif
#if TRACK_VALGRIND
    VALGRIND_MAKE_MEM_DEFINED(p, n);
#endif
    (void)p, (void)n;
}

/* [p, p+n) was handed to the user (contents undefined unless zeroed). */
static inline void track_malloc(const void *p, size_t n, int zeroed) {
#if TRACK_ASAN
    ASAN_UNPOISON_MEMORY_REGION(p, n);
#endif
#if TRACK_VALGRIND
    VALGRIND_MALLOCLIKE_BLOCK(p, n, 0, zeroed);
#endif
    (void)p, (void)n, (void)zeroed;
}

/* [p, p+n) was handed to the user from a pool that is reclaimed in bulk (a frame arena: no
 * per-block free, the whole used part goes back to track_pool at reclaim). Contents undefined.
 * Unlike track_malloc, Valgrind gets no heap block (there would be no FREELIKE to match it). */
static inline void track_bump(const void *p, size_t n) {
#if TRACK_ASAN
    ASAN_UNPOISON_MEMORY_REGION(p, n);
#endif
#if TRACK_VALGRIND
    VALGRIND_MAKE_MEM_UNDEFINED(p, n);
#endif
    (void)p, (void)n;
}

/* The user gave back the block at p, n bytes long. */
static inline void track_free(const void *p, size_t n) {
#if TRACK_ASAN
    ASAN_POISON_MEMORY_REGION(p, n);
#endif
#if TRACK_VALGRIND
    VALGRIND_FREELIKE_BLOCK(p, 0);
#endif
    (void)p, (void)n;
}

/* The live block at p changed size in place from old_n to new_n bytes. */
static inline void track_resize(const void *p, size_t old_n, size_t new_n) {
#if TRACK_ASAN
    if (new_n > old_n)
        ASAN_UNPOISON_MEMORY_REGION((const char *)p + old_n, new_n - old_n);
    else
        ASAN_POISON_MEMORY_REGION((const char *)p + new_n, old_n - new_n);
#endif
#if TRACK_VALGRIND
    VALGRIND_RESIZEINPLACE_BLOCK(p, old_n, new_n, 0);
#endif
    (void)p, (void)old_n, (void)new_n;
}

/* A block this allocator got from another tracked allocator (a span from a TLSF heap) becomes
 * a pool of its own, whose blocks are then tracked one by one with track_malloc/track_free:
 * Valgrind forgets the outer block (nested malloc-like blocks would overlap). ASan: nothing
 * (the outer block stays addressable; the caller poisons what it hands out with track_pool). */
static inline void track_subpool_begin(const void *p, size_t n) {
#if TRACK_VALGRIND
    VALGRIND_FREELIKE_BLOCK(p, 0);
    VALGRIND_MAKE_MEM_DEFINED(p, n);
#endif
    (void)p, (void)n;
}

/* The pool made by track_subpool_begin goes back to its allocator as the live block it was. */
static inline void track_subpool_end(const void *p, size_t n) {
#if TRACK_VALGRIND
    VALGRIND_MALLOCLIKE_BLOCK(p, n, 0, 0);
#endif
    (void)p, (void)n;
}

#endif
