/* sp_fiber_ctx_switch for x86-64 SysV (see fiber_ctx.h for the contract and offsets).
 *
 * void sp_fiber_ctx_switch(sp_fiber_ctx *from  (rdi), sp_fiber_ctx *to  (rsi))
 *
 * Saves rbx rbp r12-r15, MXCSR and the x87 control word, and the resume point (return address
 * and the rsp a `ret` would leave) in *from; loads the same from *to and jumps to its resume
 * point. The jump is indirect, not `ret`: a `ret` to another stack misses the return-stack
 * predictor on every switch (7-8 ns against 2.2 ns here, NOTES.md). A fresh context
 * (sp_fiber_ctx_init) resumes at its entry function with rdi = to.
 *
 * Cost on the 2-vCPU VMs: 2-4 ns one way without the two FP control words; with them 35-60 ns
 * after the first ~10^7 switches. Dropping stmxcsr alone brings it back to 2.3 ns; skipping an
 * unchanged ldmxcsr/fldcw, vstmxcsr, or stmxcsr through a stack slot do not help, and a loop of
 * stmxcsr (+ldmxcsr) outside a switch costs 0.5-5 ns. Kept because the ABI makes both words
 * callee-saved (per-fiber FP mode); to be investigated before the scheduler relies on it.
 */
#include "fiber_ctx.h"

    .text
    .globl  sp_fiber_ctx_switch
    .type   sp_fiber_ctx_switch, @function
    .p2align 4
sp_fiber_ctx_switch:
    .cfi_startproc
    movq    (%rsp), %rax                /* resume pc of `from` */
    leaq    8(%rsp), %rdx               /* resume sp of `from` */
    movq    %rbx, FIBER_RBX(%rdi)
    movq    %rbp, FIBER_RBP(%rdi)
    movq    %r12, FIBER_R12(%rdi)
    movq    %r13, FIBER_R13(%rdi)
    movq    %r14, FIBER_R14(%rdi)
    movq    %r15, FIBER_R15(%rdi)
    movq    %rdx, FIBER_SP(%rdi)
    movq    %rax, FIBER_PC(%rdi)
    stmxcsr FIBER_MXCSR(%rdi)
    fnstcw  FIBER_X87CW(%rdi)

    movq    FIBER_RBX(%rsi), %rbx
    movq    FIBER_RBP(%rsi), %rbp
    movq    FIBER_R12(%rsi), %r12
    movq    FIBER_R13(%rsi), %r13
    movq    FIBER_R14(%rsi), %r14
    movq    FIBER_R15(%rsi), %r15
    ldmxcsr FIBER_MXCSR(%rsi)
    fldcw   FIBER_X87CW(%rsi)
    movq    FIBER_SP(%rsi), %rsp
    movq    %rsi, %rdi                  /* a fresh context's entry(ctx) gets its own ctx */
    jmpq    *FIBER_PC(%rsi)
    .cfi_endproc
    .size   sp_fiber_ctx_switch, .-sp_fiber_ctx_switch

    .section .note.GNU-stack, "", @progbits
