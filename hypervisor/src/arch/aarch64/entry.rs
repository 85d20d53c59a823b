//! The first instructions: the arm64 Image header, self-relocation, the boot
//! page table, and the entry points of the boot CPU and the secondary CPUs.
//!
//! The image is linked at 0 as a position-independent executable and may be
//! loaded anywhere (QEMU virt puts an Image at RAM + 2 MiB, the Pi firmware at
//! 0x80000 or 0x200000). Until `.rela.dyn` is applied no absolute pointer in
//! data may be used, so this part is assembly that addresses everything
//! PC-relative. Before Rust runs, the MMU is on with an identity map in which
//! the 1 GiB blocks holding the image and the device tree are normal cacheable
//! memory (Rust code assumes unaligned accesses work, which is false with the
//! MMU off) and everything else is device memory; `mmu::init` then replaces
//! it with the precise map built from the device tree.

use core::arch::global_asm;

use aarch64_cpu::registers::{HCR_EL2, MAIR_EL2 as MAIR, SCTLR_EL2 as SCTLR, TCR_EL2 as TCR};

use super::{MAX_CPUS, STACK_SIZE};

/// MMU register values every CPU loads before it runs Rust code. Written by
/// the boot CPU and cleaned to the point of coherency, because secondary CPUs
/// read it with their MMU and caches still off.
#[repr(C)]
pub struct MmuConfig {
    pub mair: u64,
    pub tcr: u64,
    pub ttbr0: u64,
    pub sctlr: u64,
}

#[no_mangle]
pub static mut MMU_CONFIG: MmuConfig = MmuConfig {
    mair: 0,
    tcr: 0,
    ttbr0: 0,
    sctlr: 0,
};

/// MPIDR affinity of each logical CPU, filled by the boot CPU before it
/// starts the others; a secondary finds its index by searching it. Unused
/// slots hold `u64::MAX`, which no MPIDR matches.
#[no_mangle]
pub static mut CPU_MPIDRS: [u64; MAX_CPUS] = [u64::MAX; MAX_CPUS];

#[repr(C, align(4096))]
pub struct BootStacks(pub [[u8; STACK_SIZE]; MAX_CPUS]);

#[no_mangle]
pub static mut BOOT_STACKS: BootStacks = BootStacks([[0; STACK_SIZE]; MAX_CPUS]);

#[repr(C, align(4096))]
pub struct EarlyTable(pub [u64; 512]);

#[no_mangle]
static mut EARLY_L1: EarlyTable = EarlyTable([0; 512]);

// The values the assembly below loads, from aarch64-cpu's named fields
// (`|` of `.value`s: `+` on field values is not `const`).

/// MAIR_EL2: attribute 0 normal write-back, 1 device-nGnRE, 2 normal
/// non-cacheable (`crate::mm::pagetable::MemType`).
pub const MAIR_EL2: u64 = MAIR::Attr0_Normal_Outer::WriteBack_NonTransient_ReadWriteAlloc.value
    | MAIR::Attr0_Normal_Inner::WriteBack_NonTransient_ReadWriteAlloc.value
    | MAIR::Attr1_Device::nonGathering_nonReordering_EarlyWriteAck.value
    | MAIR::Attr2_Normal_Outer::NonCacheable.value
    | MAIR::Attr2_Normal_Inner::NonCacheable.value;

/// SCTLR_EL2 bits that are RES1 without VHE (4, 5, 11, 16, 18, 22, 23, 28,
/// 29); aarch64-cpu names only EOS (11) and EIS (22) of them.
const SCTLR_EL2_RES1: u64 = 0x30c5_0830;

/// SCTLR_EL2 with the MMU on: stack alignment checked, data and
/// instruction caches on.
pub const SCTLR_EL2_ON: u64 = SCTLR_EL2_RES1
    | SCTLR::SA::Enable.value
    | SCTLR::M::Enable.value
    | SCTLR::C::Cacheable.value
    | SCTLR::I::Cacheable.value;

/// TCR_EL2 bits that are RES1 without VHE (23 and 31), which aarch64-cpu
/// does not name.
const TCR_EL2_RES1: u64 = (1 << 31) | (1 << 23);

/// TCR_EL2 but for PS (the boot code adds the CPU's PARange): a 39-bit
/// address space (`crate::mm::pagetable::VA_LIMIT`), write-back
/// write-allocate inner shareable walks, 4 KiB granule.
pub const TCR_EL2_BASE: u64 = TCR_EL2_RES1
    | TCR::T0SZ.val(25).value
    | TCR::IRGN0::WriteBack_ReadAlloc_WriteAlloc_Cacheable.value
    | TCR::ORGN0::WriteBack_ReadAlloc_WriteAlloc_Cacheable.value
    | TCR::SH0::Inner.value
    | TCR::TG0::KiB_4.value;

const _: () = assert!(MAIR_EL2 == 0xff | (0x04 << 8) | (0x44 << 16));
const _: () = assert!(SCTLR_EL2_ON == 0x30C5_0838 | (1 << 0) | (1 << 2) | (1 << 12));
const _: () =
    assert!(TCR_EL2_BASE == (25 | (1 << 8) | (1 << 10) | (3 << 12) | (1 << 31) | (1 << 23)));

// Stays in assembly: it runs before relocation, with the MMU off and no
// stack, where compiled Rust cannot run (see the module docs).
global_asm!(
    r#"
.equ MAX_CPUS, {max_cpus}
.equ STACK_SIZE, {stack_size}
.equ R_AARCH64_RELATIVE, 1027
.equ MAIR_VALUE, {mair}
.equ SCTLR_VALUE, {sctlr}
/* T0SZ 25 (512 GiB identity), inner/outer write-back, inner shareable, 4K
   granule, RES1 bits 31 and 23; PS is filled in from ID_AA64MMFR0_EL1. */
.equ TCR_BASE, {tcr}
/* Block descriptors: valid block, AF, AP[1] (RES1 at EL2); normal memory is
   inner shareable attribute 0, device memory attribute 1 with XN. */
.equ BLOCK_NORMAL, (1 | (1 << 10) | (1 << 6) | (3 << 8) | (0 << 2))
.equ BLOCK_DEVICE_LO, (1 | (1 << 10) | (1 << 6) | (1 << 2))

.section .text.head, "ax"
.global _start
_start:
    /* The arm64 Image header (Documentation/arch/arm64/booting.rst). */
    b       primary_entry
    .long   0
    .quad   0                       /* text_offset */
    .quad   __image_size            /* image_size, including .bss */
    .quad   0xa                     /* little-endian, 4 KiB pages, anywhere in RAM */
    .quad   0
    .quad   0
    .quad   0
    .ascii  "ARM\x64"
    .long   0

primary_entry:
    mov     x19, x0                 /* device tree */
    msr     daifset, #0xf
    mrs     x1, CurrentEL
    lsr     x1, x1, #2
    cmp     x1, #2
    b.ne    park_forever            /* not at EL2: nothing we can do or say */
    bl      el2_cpu_setup
    adr     x20, _start             /* load address = link offset */

    /* Apply R_AARCH64_RELATIVE relocations. */
    adrp    x1, __rela_start
    add     x1, x1, :lo12:__rela_start
    adrp    x2, __rela_end
    add     x2, x2, :lo12:__rela_end
1:  cmp     x1, x2
    b.hs    2f
    ldp     x3, x4, [x1], #16       /* r_offset, r_info */
    ldr     x5, [x1], #8            /* r_addend */
    cmp     x4, #R_AARCH64_RELATIVE
    b.ne    1b
    add     x5, x5, x20
    str     x5, [x20, x3]
    b       1b

    /* Zero .bss. */
2:  adrp    x1, __bss_start
    add     x1, x1, :lo12:__bss_start
    adrp    x2, __bss_end
    add     x2, x2, :lo12:__bss_end
3:  cmp     x1, x2
    b.hs    4f
    stp     xzr, xzr, [x1], #16
    b       3b

    /* Boot page table: every 1 GiB block of the low 512 GiB is device
       memory, except the blocks holding the image and the device tree. */
4:  adrp    x1, EARLY_L1
    add     x1, x1, :lo12:EARLY_L1
    mov     x2, #0
    mov     x4, #BLOCK_DEVICE_LO
    orr     x4, x4, #(1 << 54)      /* XN */
5:  lsl     x3, x2, #30
    orr     x3, x3, x4
    str     x3, [x1, x2, lsl #3]
    add     x2, x2, #1
    cmp     x2, #512
    b.lo    5b
    mov     x4, #BLOCK_NORMAL
    lsr     x2, x20, #30
    and     x2, x2, #511
    lsl     x3, x2, #30
    orr     x3, x3, x4
    str     x3, [x1, x2, lsl #3]
    lsr     x2, x19, #30
    and     x2, x2, #511
    lsl     x3, x2, #30
    orr     x3, x3, x4
    str     x3, [x1, x2, lsl #3]

    /* Publish the MMU settings for this and every other CPU. */
    adrp    x5, MMU_CONFIG
    add     x5, x5, :lo12:MMU_CONFIG
    ldr     x2, =MAIR_VALUE
    str     x2, [x5, #0]
    mrs     x2, ID_AA64MMFR0_EL1
    and     x2, x2, #7              /* PARange */
    cmp     x2, #5
    mov     x3, #5
    csel    x2, x2, x3, ls          /* at most 48 bits */
    ldr     x3, =TCR_BASE
    orr     x3, x3, x2, lsl #16     /* PS */
    str     x3, [x5, #8]
    str     x1, [x5, #16]
    ldr     x2, =SCTLR_VALUE
    str     x2, [x5, #24]

    /* Everything above (relocations, .bss, the boot page table, the MMU
       settings) was written with the MMU off, straight to memory. A line
       the loader left in the data cache for the image still holds what was
       there before: invalidate the image's lines to the point of coherency
       so the first cached reads see what was written (Linux does the same
       for the page tables it builds with the MMU off). The loader cleaned
       the image to PoC (the arm64 boot protocol), so nothing dirty is lost.
       QEMU models no caches: only a real core can show this missing. */
    mrs     x3, CTR_EL0
    ubfx    x3, x3, #16, #4         /* DminLine: log2 of the line in words */
    mov     x4, #4
    lsl     x3, x4, x3              /* line size in bytes */
    sub     x4, x3, #1
    bic     x1, x20, x4
    adrp    x2, __image_end
    add     x2, x2, :lo12:__image_end
6:  dc      ivac, x1
    add     x1, x1, x3
    cmp     x1, x2
    b.lo    6b
    dsb     sy

    /* Stack of CPU 0, then the MMU. */
    adrp    x1, BOOT_STACKS
    add     x1, x1, :lo12:BOOT_STACKS
    mov     x2, #STACK_SIZE
    add     sp, x1, x2
    mov     x0, #0
    msr     tpidr_el2, x0
    bl      mmu_on
    mov     x0, x19
    mov     x1, x20
    bl      rust_boot_cpu_main
    b       park_forever

/* Secondary CPUs arrive here by PSCI CPU_ON or the spin table, at EL2 with
   the MMU off. */
.global secondary_entry
secondary_entry:
    msr     daifset, #0xf
    bl      el2_cpu_setup
    mrs     x1, MPIDR_EL1
    ldr     x2, =0xff00ffffff
    and     x1, x1, x2
    adrp    x2, CPU_MPIDRS
    add     x2, x2, :lo12:CPU_MPIDRS
    mov     x3, #0
1:  ldr     x4, [x2, x3, lsl #3]
    cmp     x4, x1
    b.eq    2f
    add     x3, x3, #1
    cmp     x3, #MAX_CPUS
    b.lo    1b
    b       park_forever
2:  adrp    x1, BOOT_STACKS
    add     x1, x1, :lo12:BOOT_STACKS
    add     x4, x3, #1
    mov     x2, #STACK_SIZE
    madd    x1, x4, x2, x1
    mov     sp, x1
    msr     tpidr_el2, x3
    mov     x19, x3
    bl      mmu_on
    mov     x0, x19
    bl      rust_secondary_cpu_main
    b       park_forever

/* EL2 state every CPU needs before any Rust code: FP/SIMD not trapped (the
   compiler uses it), EL1 is AArch64, the vectors installed. Clobbers x0. */
el2_cpu_setup:
    mov     x0, #0x33ff             /* CPTR_EL2: RES1 bits, TFP clear */
    msr     CPTR_EL2, x0
    mov     x0, #{hcr_boot}         /* HCR_EL2.RW */
    msr     HCR_EL2, x0
    adrp    x0, exception_vectors
    add     x0, x0, :lo12:exception_vectors
    msr     VBAR_EL2, x0
    isb
    ret

/* Load MMU_CONFIG and enable the MMU and caches. Clobbers x0-x2. */
mmu_on:
    adrp    x0, MMU_CONFIG
    add     x0, x0, :lo12:MMU_CONFIG
    ldr     x1, [x0, #0]
    msr     MAIR_EL2, x1
    ldr     x1, [x0, #8]
    msr     TCR_EL2, x1
    ldr     x1, [x0, #16]
    msr     TTBR0_EL2, x1
    isb
    tlbi    alle2
    dsb     nsh
    ic      iallu
    dsb     nsh
    isb
    ldr     x1, [x0, #24]
    msr     SCTLR_EL2, x1
    isb
    ret

.global park_forever
park_forever:
    msr     daifset, #0xf
1:  wfe
    b       1b
"#,
    max_cpus = const MAX_CPUS,
    stack_size = const STACK_SIZE,
    mair = const MAIR_EL2,
    sctlr = const SCTLR_EL2_ON,
    tcr = const TCR_EL2_BASE,
    hcr_boot = const HCR_EL2::RW::EL1IsAarch64.value,
);

extern "C" {
    /// The physical address of this symbol is what PSCI `CPU_ON` and the
    /// spin table are given.
    pub fn secondary_entry();
    pub fn park_forever() -> !;
}
