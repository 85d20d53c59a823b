//! Boot code, the EL1 vector table, the boot page table, and the few system
//! registers the guest needs.
//!
//! `_start` (the arm64 Image header, then `primary_entry`) runs with the MMU
//! off and x0 = the device tree's address. Before any Rust code it enables
//! FP/SIMD, sets up the stack, turns on the MMU with an identity map (the first
//! GiB device memory, the second GiB, where RAM starts, normal write-back
//! memory; [`map_ram`] adds further GiBs of RAM), zeroes .bss and installs the
//! vector table.

use core::arch::{asm, global_asm};

/// MAIR_EL1: attr0 = Device-nGnRnE, attr1 = Normal, inner/outer write-back
/// read/write-allocate, attr2 = Normal non-cacheable.
const MAIR: u64 = (0xff << 8) | (0x44 << 16);
/// TCR_EL1 without IPS: T0SZ = 25 (39-bit VA, walks start at level 1), inner
/// and outer write-back walks, inner shareable, 4 KiB granule, EPD1 (no TTBR1).
const TCR: u64 = 25 | (1 << 8) | (1 << 10) | (3 << 12) | (1 << 23);
/// SCTLR_EL1: the v8.0 RES1 bits, M (MMU), C (data cache), SA (SP alignment
/// check), I (instruction cache). A (alignment check) stays off.
const SCTLR: u64 = 0x30d0_0800 | (1 << 0) | (1 << 2) | (1 << 3) | (1 << 12);
/// Level-1 block: valid block, AF, and the given memory attribute index.
const BLOCK: u64 = 0b01 | (1 << 10);
/// A 1 GiB block of Device-nGnRnE memory (attribute index 0), never executable.
const DEVICE_BLOCK: u64 = BLOCK | (1 << 53) | (1 << 54);
/// A 1 GiB block of normal memory, inner shareable, not executable at EL0.
const NORMAL_BLOCK: u64 = BLOCK | (1 << 2) | (3 << 8) | (1 << 54);
/// A 1 GiB block of normal non-cacheable memory (attribute index 2), not
/// executable at EL0.
const NC_BLOCK: u64 = BLOCK | (2 << 2) | (3 << 8) | (1 << 54);
/// Where [`NC_BLOCK`] aliases of the first GiB (the devices) are mapped,
/// for the `wild` mode's probes: one never executable, one executable at EL1.
pub const DATA_ALIAS: usize = 256 << 30;
pub const EXEC_ALIAS: usize = 257 << 30;

global_asm!(
    r#"
    .section .text.head, "ax"
    .global _start
_start:
    b       primary_entry           // code0
    .long   0                       // code1
    .quad   0                       // text_offset
    .quad   __image_size            // image_size
    .quad   0xa                     // flags: LE, 4 KiB pages, anywhere in RAM
    .quad   0                       // res2
    .quad   0                       // res3
    .quad   0                       // res4
    .ascii  "ARM\x64"               // magic
    .long   0                       // res5

    .section .text.boot, "ax"
primary_entry:
    mov     x19, x0
    // FP/SIMD at EL1 and EL0 (CPACR_EL1.FPEN = 0b11): Rust uses it.
    mov     x1, #(3 << 20)
    msr     cpacr_el1, x1
    isb
    adrp    x1, __stack_top
    add     x1, x1, :lo12:__stack_top
    mov     sp, x1

    // MMU: identity map from boot_l1, IPS = the CPU's PA range (max 48 bits).
    ldr     x1, ={mair}
    msr     mair_el1, x1
    mrs     x1, id_aa64mmfr0_el1
    and     x1, x1, #0xf
    mov     x2, #5
    cmp     x1, x2
    csel    x1, x1, x2, ls
    ldr     x2, ={tcr}
    orr     x2, x2, x1, lsl #32
    msr     tcr_el1, x2
    adrp    x1, boot_l1
    msr     ttbr0_el1, x1
    isb
    tlbi    vmalle1
    ic      iallu
    dsb     nsh
    isb
    ldr     x1, ={sctlr}
    msr     sctlr_el1, x1
    isb

    adrp    x1, __bss_start
    add     x1, x1, :lo12:__bss_start
    adrp    x2, __bss_end
    add     x2, x2, :lo12:__bss_end
1:  cmp     x1, x2
    b.hs    2f
    stp     xzr, xzr, [x1], #16
    b       1b
2:
    adrp    x1, vectors
    add     x1, x1, :lo12:vectors
    msr     vbar_el1, x1
    isb
    mov     x0, x19
    bl      rust_main
3:  wfe
    b       3b
    .ltorg

    // EL1 vector table: every exception is fatal, but a synchronous one
    // from EL1h while a probe is armed (see `probe`). x0 = the vector's index.
    .balign 0x800
vectors:
    .irp    i, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
    .balign 0x80
    .if \i == 4
    b       probe_entry
    .else
    mov     x0, #\i
    b       exception_entry
    .endif
    .endr
probe_entry:
    // PROBE: armed, ESR, FAR, ELR. Armed: record the syndrome, disarm and
    // resume after the access (after the `blr` for an instruction abort).
    stp     x0, x1, [sp, #-16]!
    adrp    x0, PROBE
    add     x0, x0, :lo12:PROBE
    ldr     x1, [x0]
    cbz     x1, 1f
    str     xzr, [x0]
    mrs     x1, esr_el1
    str     x1, [x0, #8]
    mrs     x1, far_el1
    str     x1, [x0, #16]
    mrs     x1, elr_el1
    str     x1, [x0, #24]
    mrs     x1, esr_el1
    lsr     x1, x1, #26
    cmp     x1, #0x21
    mrs     x1, elr_el1
    add     x1, x1, #4
    csel    x1, x30, x1, eq
    msr     elr_el1, x1
    ldp     x0, x1, [sp], #16
    eret
1:  ldp     x0, x1, [sp], #16
    mov     x0, #4
    b       exception_entry
exception_entry:
    // Fresh stack: nothing returns from here.
    adrp    x1, __stack_top
    add     x1, x1, :lo12:__stack_top
    mov     sp, x1
    b       rust_exception

    // The boot translation table (level 1, 1 GiB blocks); map_ram adds RAM
    // above 2 GiB.
    .section .data.pagetable, "aw"
    .balign 4096
    .global boot_l1
boot_l1:
    .quad   {device}                // 0x0000_0000: devices (GIC, UART, virtio, ...)
    .quad   0x40000000 | {normal}   // 0x4000_0000: RAM
    .fill   254, 8, 0
    .quad   {nc_xn}                 // DATA_ALIAS: the first GiB, normal non-cacheable
    .quad   {nc}                    // EXEC_ALIAS: the same, executable
    .fill   254, 8, 0
"#,
    mair = const MAIR,
    tcr = const TCR,
    sctlr = const SCTLR,
    device = const DEVICE_BLOCK,
    normal = const NORMAL_BLOCK,
    nc_xn = const NC_BLOCK | (1 << 53),
    nc = const NC_BLOCK,
);

extern "C" {
    static mut boot_l1: [u64; 512];
    static __image_start: u8;
    static __image_end: u8;
}

/// The guest image's first and last-plus-one address (including .bss and the stack).
pub fn image_range() -> (u64, u64) {
    // Taking the address of an extern static needs no `unsafe`.
    (
        &raw const __image_start as u64,
        &raw const __image_end as u64,
    )
}

/// Maps `[base, end)` as normal memory in 1 GiB blocks where the boot table
/// has no entry yet (RAM above 0x8000_0000; the table covers 512 GiB).
pub fn map_ram(base: u64, end: u64) {
    let first = base >> 30;
    let last = (end - 1) >> 30;
    for index in first..=last.min(511) {
        // SAFETY: single core, and the boot table is only ever written here;
        // invalid entries are not cached in the TLB, so making one valid needs
        // only the barriers below.
        unsafe {
            let entry = (&raw mut boot_l1).cast::<u64>().add(index as usize);
            if entry.read_volatile() == 0 {
                entry.write_volatile((index << 30) | NORMAL_BLOCK);
            }
        }
    }
    // SAFETY: barriers only.
    unsafe { asm!("dsb ishst", "isb", options(nostack, preserves_flags)) };
}

/// Reads a 32-bit device register with one `ldr w, [x]`.
///
/// # Safety
///
/// `addr` must be a mapped device register that may be read.
pub unsafe fn mmio_read32(addr: usize) -> u32 {
    let value: u32;
    // SAFETY: the caller's promise.
    unsafe {
        asm!("ldr {v:w}, [{a}]", a = in(reg) addr, v = out(reg) value, options(nostack, preserves_flags));
    }
    value
}

/// Writes a 32-bit device register with one `str w, [x]`.
///
/// # Safety
///
/// `addr` must be a mapped device register that may be written.
pub unsafe fn mmio_write32(addr: usize, value: u32) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!("str {v:w}, [{a}]", a = in(reg) addr, v = in(reg) value, options(nostack, preserves_flags));
    }
}

/// The virtual counter (CNTVCT_EL0).
pub fn counter() -> u64 {
    let value: u64;
    // SAFETY: reading the counter has no side effects; EL1 may always read it.
    unsafe { asm!("isb", "mrs {}, cntvct_el0", out(reg) value, options(nostack, nomem)) };
    value
}

/// The counter frequency in Hz (CNTFRQ_EL0), never 0.
pub fn counter_hz() -> u64 {
    let value: u64;
    // SAFETY: reading CNTFRQ_EL0 has no side effects.
    unsafe { asm!("mrs {}, cntfrq_el0", out(reg) value, options(nostack, nomem)) };
    value.max(1)
}

/// Busy-waits for `us` microseconds.
pub fn delay_us(us: u64) {
    let end = counter() + counter_hz() * us / 1_000_000;
    while counter() < end {
        core::hint::spin_loop();
    }
}

/// PSCI SYSTEM_OFF through `hvc #0` (the conduit of QEMU virt at EL1 and of
/// the Tidal board).
pub fn system_off() -> ! {
    // SAFETY: a PSCI call; if it returns (it should not), we park the CPU.
    unsafe {
        asm!("hvc #0", inout("x0") 0x8400_0008u64 => _, options(nostack), clobber_abi("C"));
    }
    loop {
        // SAFETY: waiting for an event has no effect on memory.
        unsafe { asm!("wfe", options(nostack, nomem)) };
    }
}

/// The probe the vector table's `probe_entry` fills: armed, then ESR_EL1,
/// FAR_EL1 and ELR_EL1 of the exception it caught.
#[no_mangle]
static PROBE: [core::sync::atomic::AtomicU64; 4] =
    [const { core::sync::atomic::AtomicU64::new(0) }; 4];

/// What a probe caught.
#[derive(Clone, Copy)]
pub struct Caught {
    pub esr: u64,
    pub far: u64,
    pub elr: u64,
}

/// Runs `access` with the probe armed: a synchronous exception it takes at
/// EL1 is recorded and the guest carries on after the faulting instruction.
pub fn probe(access: impl FnOnce()) -> Option<Caught> {
    use core::sync::atomic::Ordering::SeqCst;
    PROBE[0].store(1, SeqCst);
    access();
    if PROBE[0].swap(0, SeqCst) != 0 {
        return None;
    }
    Some(Caught {
        esr: PROBE[1].load(SeqCst),
        far: PROBE[2].load(SeqCst),
        elr: PROBE[3].load(SeqCst),
    })
}

fn read_esr_far_elr() -> (u64, u64, u64) {
    let (esr, far, elr): (u64, u64, u64);
    // SAFETY: reading the EL1 syndrome registers has no side effects.
    unsafe {
        asm!(
            "mrs {0}, esr_el1",
            "mrs {1}, far_el1",
            "mrs {2}, elr_el1",
            out(reg) esr, out(reg) far, out(reg) elr,
            options(nostack, nomem),
        );
    }
    (esr, far, elr)
}

#[no_mangle]
extern "C" fn rust_exception(vector: u64) -> ! {
    const FROM: [&str; 4] = ["EL1t", "EL1h", "EL0 (AArch64)", "EL0 (AArch32)"];
    const KIND: [&str; 4] = ["synchronous", "IRQ", "FIQ", "SError"];
    let (esr, far, elr) = read_esr_far_elr();
    println!(
        "EXCEPTION {} from {}: ESR_EL1=0x{:x} (EC 0x{:x}) FAR_EL1=0x{:x} ELR_EL1=0x{:x}",
        KIND[(vector % 4) as usize],
        FROM[(vector / 4) as usize % 4],
        esr,
        esr >> 26,
        far,
        elr
    );
    println!("powering off");
    system_off()
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    println!("PANIC: {}", info);
    system_off()
}

/// A full-system data synchronisation barrier: ring writes become visible to
/// the device before the notification that follows.
pub fn dsb() {
    // SAFETY: a barrier only.
    unsafe { asm!("dsb sy", options(nostack, preserves_flags)) };
}

/// CNTV_CTL_EL0.ENABLE (IMASK, bit 1, stays clear).
const CNTV_ENABLE: u64 = 1 << 0;

/// Arms the virtual timer to fire when the virtual counter reaches `deadline`.
pub fn virtual_timer_fire_at(deadline: u64) {
    // SAFETY: the EL1 virtual timer is this guest's own; programming it only
    // raises its (level) interrupt when the counter passes `deadline`.
    unsafe {
        asm!(
            "msr cntv_cval_el0, {cval}",
            "msr cntv_ctl_el0, {ctl}",
            "isb",
            cval = in(reg) deadline,
            ctl = in(reg) CNTV_ENABLE,
            options(nostack, nomem),
        );
    }
}

/// Turns the virtual timer off (its interrupt line drops) until it is armed again.
pub fn virtual_timer_off() {
    // SAFETY: as in `virtual_timer_fire_at`.
    unsafe { asm!("msr cntv_ctl_el0, xzr", "isb", options(nostack, nomem)) };
}

/// Whether the CPU implements the GICv3 system-register CPU interface
/// (ID_AA64PFR0_EL1.GIC, bits 27:24, non-zero).
pub fn cpu_has_gicv3_interface() -> bool {
    let pfr0: u64;
    // SAFETY: reading an ID register has no side effects.
    unsafe { asm!("mrs {}, id_aa64pfr0_el1", out(reg) pfr0, options(nostack, nomem)) };
    (pfr0 >> 24) & 0xf != 0
}

/// The bad accesses of the `wild` mode, each one instruction; each returns
/// that instruction's address (what ELR_EL1 must say if it faults).
pub mod bad {
    use core::arch::asm;

    /// `ldrh` (a 2-byte load) from `addr`.
    ///
    /// # Safety
    ///
    /// Run under [`super::probe`]: `addr` may fault.
    pub unsafe fn read16(addr: usize) -> u64 {
        let at: u64;
        // SAFETY: the caller's promise.
        unsafe {
            asm!("adr {at}, 1f", "1: ldrh {v:w}, [{a}]", a = in(reg) addr, v = out(reg) _,
                 at = out(reg) at, options(nostack, preserves_flags));
        }
        at
    }

    /// `str` of a 32-bit word to `addr`.
    ///
    /// # Safety
    ///
    /// As [`read16`].
    pub unsafe fn write32(addr: usize) -> u64 {
        let at: u64;
        // SAFETY: the caller's promise.
        unsafe {
            asm!("adr {at}, 1f", "1: str wzr, [{a}]", a = in(reg) addr, at = out(reg) at,
                 options(nostack, preserves_flags));
        }
        at
    }

    /// `ldr` of a 32-bit word from `addr`.
    ///
    /// # Safety
    ///
    /// As [`read16`].
    pub unsafe fn read32(addr: usize) -> u64 {
        let at: u64;
        // SAFETY: the caller's promise.
        unsafe {
            asm!("adr {at}, 1f", "1: ldr {v:w}, [{a}]", a = in(reg) addr, v = out(reg) _,
                 at = out(reg) at, options(nostack, preserves_flags));
        }
        at
    }

    /// `ldp` of two 64-bit words from `addr` (no instruction syndrome).
    ///
    /// # Safety
    ///
    /// As [`read16`].
    pub unsafe fn load_pair(addr: usize) -> u64 {
        let at: u64;
        // SAFETY: the caller's promise.
        unsafe {
            asm!("adr {at}, 1f", "1: ldp {v}, {w}, [{a}]", a = in(reg) addr, v = out(reg) _,
                 w = out(reg) _, at = out(reg) at, options(nostack, preserves_flags));
        }
        at
    }

    /// `blr` to `target`: the fetch faults there and the probe returns to
    /// the instruction after the `blr`.
    ///
    /// # Safety
    ///
    /// As [`read16`]; `target` must fault on the fetch (never run code).
    pub unsafe fn call(target: usize) {
        // SAFETY: the caller's promise; only x30 changes (the link).
        unsafe {
            asm!("blr {t}", t = in(reg) target, out("x30") _, options(nostack));
        }
    }
}
