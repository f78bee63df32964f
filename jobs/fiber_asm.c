/* The assembly fiber backend's C half: fresh contexts, and the register-save layout checked
 * against the offsets the .S files use. Architecture-specific by nature (fiber_ctx.h). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fiber_ctx.h"

#define LAYOUT(field, off) _Static_assert(offsetof(sp_fiber_ctx, field) == (off), #field)

#if defined(__x86_64__)
LAYOUT(rbx, FIBER_RBX);
LAYOUT(rbp, FIBER_RBP);
LAYOUT(r12, FIBER_R12);
LAYOUT(r13, FIBER_R13);
LAYOUT(r14, FIBER_R14);
LAYOUT(r15, FIBER_R15);
LAYOUT(sp, FIBER_SP);
LAYOUT(pc, FIBER_PC);
LAYOUT(mxcsr, FIBER_MXCSR);
LAYOUT(x87cw, FIBER_X87CW);
_Static_assert(sizeof(sp_fiber_ctx) == FIBER_CTX_SIZE, "sp_fiber_ctx size");

void sp_fiber_ctx_init(sp_fiber_ctx *ctx, void *stack_lo, size_t stack_size,
                       sp_fiber_ctx_entry entry) {
    memset(ctx, 0, sizeof *ctx);
    /* entry is reached by a jump, so it must find the stack as a call leaves it: rsp = 8 mod
     * 16, with a return address on top. That address is 0: backtraces end there. */
    uint64_t *top = (uint64_t *)((char *)stack_lo + stack_size);
    top[-1] = 0;
    ctx->sp = (uint64_t)(uintptr_t)&top[-1];
    ctx->pc = (uint64_t)(uintptr_t)entry;
    __asm__ volatile("stmxcsr %0" : "=m"(ctx->mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(ctx->x87cw));
}
#elif defined(__aarch64__)
LAYOUT(x19_x29[0], FIBER_X19);
LAYOUT(x19_x29[2], FIBER_X21);
LAYOUT(x19_x29[4], FIBER_X23);
LAYOUT(x19_x29[6], FIBER_X25);
LAYOUT(x19_x29[8], FIBER_X27);
LAYOUT(x19_x29[10], FIBER_X29);
LAYOUT(pc, FIBER_PC);
LAYOUT(sp, FIBER_SP);
LAYOUT(d8_d15[0], FIBER_D8);
LAYOUT(d8_d15[2], FIBER_D10);
LAYOUT(d8_d15[4], FIBER_D12);
LAYOUT(d8_d15[6], FIBER_D14);
LAYOUT(fpcr, FIBER_FPCR);
_Static_assert(sizeof(sp_fiber_ctx) == FIBER_CTX_SIZE, "sp_fiber_ctx size");

/* fiber_switch_aarch64.S: where a fresh context starts (x30 cleared, then entry in x19). */
void sp_fiber_ctx_start(void);

void sp_fiber_ctx_init(sp_fiber_ctx *ctx, void *stack_lo, size_t stack_size,
                       sp_fiber_ctx_entry entry) {
    memset(ctx, 0, sizeof *ctx);
    /* sp stays 16-byte aligned (AAPCS64); x29 = 0 ends the frame chain for backtraces, and
     * the entry starts with x30 = 0 (sp_fiber_ctx_start), so that a DWARF unwinder stops there
     * too: with x30 = entry, as the switch's `br x30` left it, the outermost frame's return
     * address pointed back into the code before entry, whose unwind entry could repeat the
     * same frame without end. */
    ctx->sp = (uint64_t)(uintptr_t)((char *)stack_lo + stack_size);
    ctx->pc = (uint64_t)(uintptr_t)sp_fiber_ctx_start;
    ctx->x19_x29[0] = (uint64_t)(uintptr_t)entry;
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    ctx->fpcr = fpcr;
}
#endif
