/* The fiber context-switch backends' contract (internal to jobs/fiber*.c and the .S files).
 *
 * A backend provides the saved-context type sp_fiber_ctx, sp_fiber_ctx_init (make a fresh context
 * that starts entry(ctx) on a given stack) and sp_fiber_ctx_switch (save the running context in
 * `from`, resume `to`). Backends: hand-written assembly per architecture (default), or ucontext
 * (meson option fiber_backend=ucontext, which defines SP_FIBER_UCONTEXT).
 *
 * The assembly backend's register-save offsets are the FIBER_* macros below; the .S files
 * include this header and fiber_asm.c checks the struct against them with _Static_assert.
 */
#ifndef SP_FIBER_CTX_H
#define SP_FIBER_CTX_H

#if !defined(SP_FIBER_UCONTEXT) && defined(__x86_64__)
/* x86-64 SysV callee-saved state. MXCSR control bits and the x87 control word are callee-saved
 * too (ABI 3.2.1): saving them makes the floating-point mode per fiber. */
#define FIBER_RBX 0
#define FIBER_RBP 8
#define FIBER_R12 16
#define FIBER_R13 24
#define FIBER_R14 32
#define FIBER_R15 40
#define FIBER_SP 48 /* rsp as after the switch call returned */
#define FIBER_PC 56 /* where to resume: the switch call's return address */
#define FIBER_MXCSR 64
#define FIBER_X87CW 68
#define FIBER_CTX_SIZE 72
#elif !defined(SP_FIBER_UCONTEXT) && defined(__aarch64__)
/* AAPCS64 callee-saved state: x19-x29, x30 (lr, the resume address), sp, d8-d15, and FPCR
 * (rounding, flush-to-zero: per fiber, as on x86-64). */
#define FIBER_X19 0
#define FIBER_X21 16
#define FIBER_X23 32
#define FIBER_X25 48
#define FIBER_X27 64
#define FIBER_X29 80
#define FIBER_PC 88 /* x30 */
#define FIBER_SP 96
#define FIBER_D8 104
#define FIBER_D10 120
#define FIBER_D12 136
#define FIBER_D14 152
#define FIBER_FPCR 168
#define FIBER_CTX_SIZE 176
#elif !defined(SP_FIBER_UCONTEXT)
#error "no assembly fiber switch for this architecture: configure with -Dfiber_backend=ucontext"
#endif

#ifndef __ASSEMBLER__
#include <stddef.h>
#include <stdint.h>

#if defined(SP_FIBER_UCONTEXT)
#include <ucontext.h>
typedef struct sp_fiber_ctx {
    ucontext_t uc;
    void (*entry)(struct sp_fiber_ctx *self);
} sp_fiber_ctx;
#elif defined(__x86_64__)
typedef struct sp_fiber_ctx {
    uint64_t rbx, rbp, r12, r13, r14, r15;
    uint64_t sp, pc;
    uint32_t mxcsr;
    uint16_t x87cw;
} sp_fiber_ctx;
#elif defined(__aarch64__)
typedef struct sp_fiber_ctx {
    uint64_t x19_x29[11];
    uint64_t pc; /* x30 */
    uint64_t sp;
    uint64_t d8_d15[8];
    uint64_t fpcr;
} sp_fiber_ctx;
#endif

typedef void (*sp_fiber_ctx_entry)(sp_fiber_ctx *self);

/* Make `ctx` a fresh context: the first switch to it runs entry(ctx) on the stack
 * [stack_lo, stack_lo + stack_size) (16-byte aligned, size a multiple of 16). Its
 * floating-point control state is copied from the calling thread. entry must never return. */
void sp_fiber_ctx_init(sp_fiber_ctx *ctx, void *stack_lo, size_t stack_size,
                       sp_fiber_ctx_entry entry);

/* Save the caller's callee-saved state in `from` and resume `to`; returns when something
 * switches back to `from`. Assembly backend: a few loads and stores ending in an indirect
 * jump, opaque to the compiler (it sees an ordinary external call). */
void sp_fiber_ctx_switch(sp_fiber_ctx *from, sp_fiber_ctx *to);
#endif

#endif
