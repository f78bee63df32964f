/* sp_fiber_ctx_switch for x86-64 SysV (see fiber_ctx.h for the contract and offsets).
 *
 * void sp_fiber_ctx_switch(sp_fiber_ctx *from  (rdi), sp_fiber_ctx *to  (rsi))
 *
 * Saves rbx rbp r12-r15, MXCSR and the x87 control word, and the resume point (return address
 * and the rsp a `ret` would leave) in *from; loads the same from *to and jumps to its resume
 * point. The jump is indirect, not `ret`: a `ret` to another stack misses the return-stack
 * predictor on every switch (a switch ending in `ret` measured 7.4-8.3 ns on these VMs against
 * 2.2-2.4 ns for this ending, outside bench/; not re-measured there). A fresh context
 * (sp_fiber_ctx_init) resumes at its entry function with rdi = to.
 *
 * MXCSR: the ABI makes only its control bits (6-15: masks, rounding, DAZ, FTZ) callee-saved;
 * its status flags (0-5, sticky exception bits) are caller-saved. So the switch loads `to`'s
 * control bits merged with the current flags, and only when the control bits differ. Why
 * (measured on the 2-vCPU VMs, Xeon family 6 model 167, with a throwaway ping-pong harness):
 * an ldmxcsr that changes the status flags costs 35-60 ns one way, every time; one that
 * changes only control bits, or loads the value already there, costs ~1 ns. A plain
 * stmxcsr/ldmxcsr of the full word runs at 3-5 ns while both fibers' flags are equal, and at
 * 35-60 ns once they differ (one inexact double division sets PE): that was the "fast for the first
 * ~10^7 switches" effect, an artefact of when the harness first did FP arithmetic, not a
 * count, a timer interrupt or kernel FPU state (pinning, an early sched_yield, 200 ms of
 * spinning first, vzeroupper, mfence/lfence/sfence, copying through a register or a 16/64-bit
 * slot, skipping an equal full word: none changed it). Now: 2.8 ns one way with equal modes,
 * 4.2-4.7 ns when the two fibers' modes differ on every switch (no FP state: 2.0 ns); through
 * sp_fiber_switch in bench_fiber, fibers' flags differing: 2.9 ns, against 55-59 ns for the full
 * word reload. fnstcw/fldcw cost ~0.5 ns; fldcw is skipped when the word is unchanged.
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
    movl    FIBER_MXCSR(%rdi), %eax     /* current MXCSR, flags included */
    movl    FIBER_MXCSR(%rsi), %ecx
    xorl    %eax, %ecx
    andl    $0xffc0, %ecx               /* control bits that differ */
    jz      1f
    xorl    %ecx, %eax                  /* to's control bits, the current status flags */
    movl    %eax, -8(%rsp)              /* red zone of from's stack (rsp not switched yet) */
    ldmxcsr -8(%rsp)
1:  movzwl  FIBER_X87CW(%rdi), %eax
    cmpw    FIBER_X87CW(%rsi), %ax
    je      2f
    fldcw   FIBER_X87CW(%rsi)
2:
    movq    FIBER_SP(%rsi), %rsp
    movq    %rsi, %rdi                  /* a fresh context's entry(ctx) gets its own ctx */
    jmpq    *FIBER_PC(%rsi)
    .cfi_endproc
    .size   sp_fiber_ctx_switch, .-sp_fiber_ctx_switch

    .section .note.GNU-stack, "", @progbits
