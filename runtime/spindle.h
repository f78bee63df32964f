/* spindle: a C runtime for multithreaded game engines. The umbrella header.
 *
 * Modules, lowest first (each header says which of its calls may run concurrently):
 *   sp_log.h       logger, SP_ERR_* ids, misuse policy, sp_die
 *   sp_platform.h  virtual memory, threads, clocks, futex, mutex
 *   sp_tlsf.h      the central TLSF heap
 *   sp_tcache.h    thread caches over the central heap (alloc, free, ... inline fast paths)
 *   sp_frame.h     double-buffered frame arenas (per-thread bump chunks, reclaimed by parity)
 *   sp_handle.h    the handle-based compacting heap
 *   sp_jobs.h      the fiber job scheduler: workers, counters, priorities, parallel_for
 *   sp_runtime.h   the runtime: sp_init/sp_shutdown, the reservation and its regions, the
 *                  frame loop, between-frames work, per-frame statistics
 */
#ifndef SPINDLE_H
#define SPINDLE_H

#include "sp_frame.h"
#include "sp_handle.h"
#include "sp_jobs.h"
#include "sp_log.h"
#include "sp_platform.h"
#include "sp_runtime.h"
#include "sp_tcache.h"
#include "sp_tlsf.h"

#endif
