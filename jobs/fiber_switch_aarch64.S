/* sp_fiber_ctx_switch for AArch64 AAPCS64 (see fiber_ctx.h for the contract and offsets).
 *
 * void sp_fiber_ctx_switch(sp_fiber_ctx *from  (x0), sp_fiber_ctx *to  (x1))
 *
 * Saves x19-x29, x30 (the resume address), sp, d8-d15 and FPCR in *from; loads the same from
 * *to and branches to its x30. The branch is `br`, not `ret`: a `ret` to another stack misses
 * the return-address predictor on every switch. A fresh context (sp_fiber_ctx_init) resumes
 * at its entry function with x0 = to.
 */
#include "fiber_ctx.h"

    .text
    .globl  sp_fiber_ctx_switch
    .type   sp_fiber_ctx_switch, %function
    .p2align 4
sp_fiber_ctx_switch:
    .cfi_startproc
    stp     x19, x20, [x0, #FIBER_X19]
    stp     x21, x22, [x0, #FIBER_X21]
    stp     x23, x24, [x0, #FIBER_X23]
    stp     x25, x26, [x0, #FIBER_X25]
    stp     x27, x28, [x0, #FIBER_X27]
    stp     x29, x30, [x0, #FIBER_X29]  /* x30 lands in FIBER_PC */
    mov     x16, sp
    str     x16, [x0, #FIBER_SP]
    stp     d8, d9, [x0, #FIBER_D8]
    stp     d10, d11, [x0, #FIBER_D10]
    stp     d12, d13, [x0, #FIBER_D12]
    stp     d14, d15, [x0, #FIBER_D14]
    mrs     x17, fpcr
    str     x17, [x0, #FIBER_FPCR]

    ldp     x19, x20, [x1, #FIBER_X19]
    ldp     x21, x22, [x1, #FIBER_X21]
    ldp     x23, x24, [x1, #FIBER_X23]
    ldp     x25, x26, [x1, #FIBER_X25]
    ldp     x27, x28, [x1, #FIBER_X27]
    ldp     x29, x30, [x1, #FIBER_X29]
    ldr     x16, [x1, #FIBER_SP]
    mov     sp, x16
    ldp     d8, d9, [x1, #FIBER_D8]
    ldp     d10, d11, [x1, #FIBER_D10]
    ldp     d12, d13, [x1, #FIBER_D12]
    ldp     d14, d15, [x1, #FIBER_D14]
    ldr     x16, [x1, #FIBER_FPCR]
    cmp     x16, x17                    /* writing FPCR can stall the pipeline: skip if equal */
    b.eq    1f
    msr     fpcr, x16
1:  mov     x0, x1                      /* a fresh context's entry(ctx) gets its own ctx */
    br      x30
    .cfi_endproc
    .size   sp_fiber_ctx_switch, .-sp_fiber_ctx_switch

/* A fresh context's first instructions (its saved pc, sp_fiber_ctx_init): the entry function
 * (saved as x19) is entered with x30 = 0, the end of the call chain, and x0 = its context (set
 * by the switch). Through x16: a branch target that BTI landing pads accept. */
    .globl  sp_fiber_ctx_start
    .hidden sp_fiber_ctx_start
    .type   sp_fiber_ctx_start, %function
    .p2align 4
sp_fiber_ctx_start:
    .cfi_startproc
    .cfi_undefined x30
    mov     x16, x19
    mov     x30, xzr
    br      x16
    .cfi_endproc
    .size   sp_fiber_ctx_start, .-sp_fiber_ctx_start

    .section .note.GNU-stack, "", %progbits
