/* The ucontext fiber backend (meson option fiber_backend=ucontext): portable, and slow
 * (glibc swapcontext makes one rt_sigprocmask system call per switch: bench area `fiber`
 * measures it at about 60x the assembly switch). Useful
 * on architectures without an assembly switch and to cross-check the assembly one. */
#include <stdint.h>

#include "fiber_ctx.h"
#include "sp_log.h"

/* makecontext passes int arguments only: the context pointer travels as two halves. */
static void ctx_trampoline(unsigned hi, unsigned lo) {
    sp_fiber_ctx *ctx = (sp_fiber_ctx *)(((uintptr_t)hi << 16 << 16) | (uintptr_t)lo);
    ctx->entry(ctx);
}

void sp_fiber_ctx_init(sp_fiber_ctx *ctx, void *stack_lo, size_t stack_size,
                       sp_fiber_ctx_entry entry) {
    /* getcontext also captures the caller's floating-point control state, which the new
     * context inherits (as with the assembly backend). */
    if (getcontext(&ctx->uc) != 0) sp_die(SP_ERR_OS, "sp_fiber_acquire", ctx, "getcontext failed");
    ctx->uc.uc_stack.ss_sp = stack_lo;
    ctx->uc.uc_stack.ss_size = stack_size;
    ctx->uc.uc_link = NULL;
    ctx->entry = entry;
    uintptr_t p = (uintptr_t)ctx;
    makecontext(&ctx->uc, (void (*)(void))ctx_trampoline, 2, (unsigned)(p >> 16 >> 16),
                (unsigned)(p & 0xffffffffu));
    /* Only makecontext reads the stack fields. Cleared, they keep ASan's swapcontext
     * interceptor from unpoisoning the whole stack at every resume, which erased the redzones
     * of the frames live on it (an overflow of one went unreported). */
    ctx->uc.uc_stack.ss_sp = NULL;
    ctx->uc.uc_stack.ss_size = 0;
}

void sp_fiber_ctx_switch(sp_fiber_ctx *from, sp_fiber_ctx *to) {
    if (swapcontext(&from->uc, &to->uc) != 0)
        sp_die(SP_ERR_OS, "sp_fiber_switch", to, "swapcontext failed");
}
