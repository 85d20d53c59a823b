//! The portable exit handling (`vm/handle.rs`): a VM started over the fake
//! CPU and a real frame table (`vm::testing`), as the host tests start it
//! (two vCPUs, a balloon and a virtio console; all RAM backed, in a smaller
//! VM without an initrd, or backed on first touch), fed arbitrary decoded exits as the vCPU loop feeds them
//! (`fast_exit` first, `after_exit` when it declines): loads and stores to
//! every device window, to RAM and outside it, stage-2 aborts, read-only
//! stores, HVC/SMC (PSCI included), WFI/WFE, system registers, unknown
//! traps, with any register values and syndrome, under either bad-access
//! policy (abort or stop).
//!
//! Invariants: no panic; under `stop` no exception is ever injected, and a
//! bad access ends the VM; every injected exception is well formed (the
//! kind the exit calls for: a data abort with the access's direction for a
//! load or store, an instruction abort for a fetch, UNDEFINED for a system
//! register or unknown trap; its ESR_EL1 built from it has the right class,
//! an external-abort status, WnR and FnV as the access says); the VM never
//! reads or writes a frame that is neither its own nor the hypervisor's
//! (`FakeHost::stray_accesses`), owns no more than its RAM, maps only what
//! it owns (`vm::check`), and a stop gives every page back.
#![no_main]

use arbitrary::Arbitrary;
use guest_bundle::{BundleBuilder, VmMemory, VmSpec};
use hypervisor::addr::{GuestAddr, PhysAddr};
use hypervisor::balloon::F_VERSION_1;
use hypervisor::mm::frames::FrameUse;
use hypervisor::mm::frames::PAGE_SIZE;
use hypervisor::vm::check::{self, FrameFacts, VmFacts};
use hypervisor::vm::cpu::GuestContext;
use hypervisor::vm::exit::{FaultKind, VcpuExit};
use hypervisor::vm::fault::OnBadAccess;
use hypervisor::vm::fdt::layout;
use hypervisor::vm::handle::{self, Outcome};
use hypervisor::vm::inject::{self, GuestException, Trapped};
use hypervisor::vm::lifecycle;
use hypervisor::vm::state::{GuestGic, Vm, VmState};
use hypervisor::vm::testing::FakeCpu;
use hypervisor::vm::testing::FakeHost;
use libfuzzer_sys::fuzz_target;
use std::sync::{Mutex, OnceLock};

const BOARD_PAGES: u64 = 2048;
/// The smallest RAM that holds the kernel at its 2 MiB offset, its 1 MiB
/// footprint, the initrd and the tree: every run starts and stops it.
const VM_RAM: u64 = 6 << 20;
/// The VM with all its RAM backed at start has no initrd and only what
/// the kernel and the tree need: each run backs and frees every page of
/// it, and the frame table's per-frame work is most of a run's time.
const PREALLOC_RAM: u64 = 4 << 20;

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Place {
    Any(u64),
    Gicd(u16),
    Gicr(u32),
    Uart(u16),
    Virtio(u16),
    Ram(u32),
}

impl Place {
    fn ipa(self) -> GuestAddr {
        match self {
            Place::Any(a) => GuestAddr::new(a & ((1 << 52) - 1)),
            Place::Gicd(o) => layout::GICD_BASE + u64::from(o % 0x1000),
            Place::Gicr(o) => layout::GICR_BASE + u64::from(o % 0x4_0000),
            Place::Uart(o) => layout::UART_BASE + u64::from(o % 0x1000),
            Place::Virtio(o) => layout::VIRTIO_BASE + u64::from(o % 0x400),
            Place::Ram(o) => layout::RAM_BASE + u64::from(o) % VM_RAM,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Exit {
    Read {
        at: Place,
        width: u8,
        reg: u8,
        sign_extend: bool,
        sixty_four: bool,
    },
    Write {
        at: Place,
        width: u8,
        reg: u8,
    },
    ReadOnlyStore {
        far: u64,
        width: u8,
        reg: u8,
    },
    Abort {
        at: Place,
        write: bool,
        instruction: bool,
        translation: bool,
    },
    Hvc(u16),
    Smc(u16),
    /// A PSCI call by HVC: function ID in x0 from this list or raw.
    Psci {
        function: u8,
        raw: u32,
    },
    Wait(bool),
    Interrupt,
    SysReg {
        op0: u8,
        op1: u8,
        crn: u8,
        crm: u8,
        op2: u8,
        reg: u8,
        read: bool,
    },
    Unknown(u64),
}

const PSCI: [u32; 10] = [
    0x8400_0000, // VERSION
    0x8400_000a, // FEATURES
    0x8400_0002, // CPU_OFF
    0xc400_0003, // CPU_ON (64)
    0x8400_0003, // CPU_ON (32)
    0xc400_0004, // AFFINITY_INFO (64)
    0x8400_0006, // MIGRATE_INFO_TYPE
    0x8400_0008, // SYSTEM_OFF
    0x8400_0009, // SYSTEM_RESET
    0x8400_0001, // CPU_SUSPEND (not offered)
];

/// Legal widths most of the time, any width sometimes.
fn width(w: u8) -> u8 {
    match w % 8 {
        0..=4 => 1 << (w % 4),
        _ => w,
    }
}

impl Exit {
    fn decoded(self, ctx: &mut GuestContext) -> VcpuExit {
        match self {
            Exit::Read {
                at,
                width: w,
                reg,
                sign_extend,
                sixty_four,
            } => VcpuExit::MmioRead {
                ipa: at.ipa(),
                width: width(w),
                reg: reg % 32,
                sign_extend,
                sixty_four,
                insn_len: 4,
            },
            Exit::Write { at, width: w, reg } => VcpuExit::MmioWrite {
                ipa: at.ipa(),
                width: width(w),
                reg: reg % 32,
                insn_len: 4,
            },
            Exit::ReadOnlyStore { far, width: w, reg } => VcpuExit::ReadOnlyStore {
                far,
                width: width(w),
                reg: reg % 32,
                insn_len: 4,
            },
            Exit::Abort {
                at,
                write,
                instruction,
                translation,
            } => VcpuExit::Abort {
                ipa: at.ipa(),
                write,
                instruction,
                fault: if translation {
                    FaultKind::Translation
                } else {
                    FaultKind::Permission
                },
            },
            Exit::Hvc(imm) => VcpuExit::Hvc { imm },
            Exit::Smc(imm) => VcpuExit::Smc { imm, insn_len: 4 },
            Exit::Psci { function, raw } => {
                ctx.x[0] = match PSCI.get(usize::from(function)) {
                    Some(&f) => u64::from(f),
                    None => u64::from(raw),
                };
                VcpuExit::Hvc { imm: 0 }
            }
            Exit::Wait(wfe) => VcpuExit::Wait { wfe, insn_len: 4 },
            Exit::Interrupt => VcpuExit::Interrupt,
            Exit::SysReg {
                op0,
                op1,
                crn,
                crm,
                op2,
                reg,
                read,
            } => VcpuExit::SysReg {
                encoding: (op0 % 4, op1 % 8, crn % 16, crm % 16, op2 % 8),
                reg: reg % 32,
                read,
                insn_len: 4,
            },
            Exit::Unknown(esr) => VcpuExit::Unknown { esr },
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Step {
    exit: Exit,
    regs: [u64; 4],
    /// ESR_EL2 bit 10 (FnV, for an abort) and FAR_EL2 as the trap left
    /// them.
    far_not_valid: bool,
    far: u64,
    /// Microseconds since the previous exit.
    advance: u16,
    /// The guest's PC at the trap (any: a guest may run code anywhere,
    /// up to the last instruction of the address space).
    pc: Option<u64>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    stop_on_bad_access: bool,
    gic_v2: bool,
    prealloc: bool,
    steps: Vec<Step>,
}

fn kernel() -> Vec<u8> {
    let mut k = vec![0u8; 8192];
    k[8..16].copy_from_slice(&0x1000u64.to_le_bytes());
    k[16..24].copy_from_slice(&(1u64 << 20).to_le_bytes());
    k[56..60].copy_from_slice(b"ARM\x64");
    k
}

fn spec(prealloc: bool) -> guest_bundle::VmEntry<'static> {
    let devices = guest_bundle::devices::BALLOON | guest_bundle::devices::CONSOLE;
    let bytes = BundleBuilder::new()
        .add_vm_with_memory(
            VmSpec {
                name: "guest".into(),
                ram_size: if prealloc { PREALLOC_RAM } else { VM_RAM },
                vcpus: 2,
                cpu_affinity: 0b110,
                kernel: kernel(),
                initrd: (!prealloc).then(|| vec![0x5a; 3000]),
                cmdline: Some("console=ttyAMA0".into()),
                balloon_features: F_VERSION_1,
                devices,
                on_bad_access: 0,
                restore: None,
            },
            VmMemory {
                prealloc,
                ..VmMemory::default()
            },
        )
        .expect("valid VM")
        .build();
    hypervisor::vm::testing::first_vm(bytes)
}

fn check(vm: &Vm, cpu: &mut FakeCpu, ram: u64) {
    let facts = FrameFacts::of(&cpu.host.frames, BOARD_PAGES * PAGE_SIZE);
    let vms = [VmFacts {
        id: vm.id(),
        name: vm.name(),
        stopped: vm.state() == VmState::Stopped,
        ram: vm.ram().map(|r| check::RamFacts::of(r, &mut cpu.host)),
    }];
    if let Err(e) = check::check(&facts, &vms) {
        panic!("check failed: {e:?}");
    }
    assert_eq!(
        cpu.host.stray_accesses, 0,
        "the VM reached a frame not its own"
    );
    assert!(cpu.host.frames.guest_pages(0) <= ram / PAGE_SIZE);
}

/// The exception `exit` may get for a refused access.
fn expected(exit: &VcpuExit) -> Option<GuestException> {
    match *exit {
        VcpuExit::MmioRead { .. } => Some(GuestException::DataAbort { write: false }),
        VcpuExit::MmioWrite { .. } | VcpuExit::ReadOnlyStore { .. } => {
            Some(GuestException::DataAbort { write: true })
        }
        VcpuExit::Abort {
            write, instruction, ..
        } => Some(if instruction {
            GuestException::InstructionAbort
        } else {
            GuestException::DataAbort { write }
        }),
        VcpuExit::SysReg { .. } | VcpuExit::Unknown { .. } => Some(GuestException::Undefined),
        _ => None,
    }
}

/// One host for every run: each new `FakeHost` leaks its frame table's
/// storage. A run must leave it as it found it (checked at the end).
static HOST: Mutex<Option<FakeHost>> = Mutex::new(None);

/// The VM's bundle entry, without and with prealloc (built once).
static SPECS: OnceLock<[guest_bundle::VmEntry<'static>; 2]> = OnceLock::new();

fuzz_target!(|input: Input| {
    let specs = SPECS.get_or_init(|| [spec(false), spec(true)]);
    let mut guard = HOST.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = guard.take().unwrap_or_else(|| FakeHost::new(BOARD_PAGES));
    host.stray_accesses = 0;
    let free = host.frames.free_pages();
    let gic = if input.gic_v2 {
        GuestGic::V2 {
            gicv: PhysAddr::new(0x0804_0000),
        }
    } else {
        GuestGic::V3
    };
    let ram = if input.prealloc { PREALLOC_RAM } else { VM_RAM };
    let mut vm = Vm::new(0, specs[usize::from(input.prealloc)], gic);
    let mut cpu = FakeCpu::with_host(host);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    vm.set_on_bad_access(if input.stop_on_bad_access {
        OnBadAccess::Stop
    } else {
        OnBadAccess::Abort
    });
    cpu.index = vm.vcpus().cpu(0);
    let (pc, x0) = lifecycle::enter(&mut vm, 0).expect("may enter");
    let mut ctx = GuestContext::new(pc, x0);
    for (n, step) in input.steps.iter().take(64).enumerate() {
        ctx.x[..4].copy_from_slice(&step.regs);
        ctx.far = step.far;
        if let Some(pc) = step.pc {
            ctx.elr = pc & !3;
        }
        // FnV (ESR_EL2 bit 10) is meaningful only for an external abort;
        // a decoded load or store (a translation or permission fault with
        // a syndrome) has it clear.
        ctx.esr = match step.exit {
            Exit::Abort { .. } if step.far_not_valid => 1 << 10,
            _ => 0,
        };
        let fnv = ctx.esr & (1 << 10);
        cpu.now_us += u64::from(step.advance);
        let exit = step.exit.decoded(&mut ctx);
        let injected = cpu.injected.len();
        let outcome = match handle::fast_exit(&mut vm, &mut cpu, 0, &mut ctx, &exit, 0) {
            Some(_) => Outcome::Continue,
            None => handle::after_exit(&mut vm, &mut cpu, 0, &mut ctx, exit, 0),
        };
        let _ = vm.out().take();
        let _ = vm.take_echo();
        // Aborts: only under `abort`, one per exit at most, well formed.
        let new = &cpu.injected[injected..];
        assert!(new.len() <= 1, "{} exceptions for one exit", new.len());
        if let Some(&(exception, far, il32)) = new.first() {
            assert_eq!(
                vm.on_bad_access(),
                OnBadAccess::Abort,
                "injected under stop"
            );
            assert_eq!(
                Some(exception),
                expected(&exit),
                "{exit:?} got {exception:?}"
            );
            let trapped = Trapped {
                pstate: ctx.spsr,
                pc: ctx.elr,
                far,
                il32,
                vbar: 0x4020_0800,
                set_pan: false,
            };
            let i = inject::exception(exception, &trapped);
            let ec = i.esr_el1 >> 26;
            match exception {
                GuestException::DataAbort { write } => {
                    assert!(ec == inject::EC_DABT_LOWER || ec == inject::EC_DABT_SAME);
                    assert_eq!(i.esr_el1 & 0x3f, 0x10, "synchronous external abort");
                    assert_eq!(i.esr_el1 & (1 << 6) != 0, write, "WnR");
                    assert_eq!(i.esr_el1 & (1 << 10) != 0, far.is_none(), "FnV");
                    assert_eq!(i.far_el1, far);
                    if far.is_some() {
                        assert_eq!(fnv, 0, "FAR passed on though FnV");
                        assert_eq!(far, Some(step.far));
                    }
                }
                GuestException::InstructionAbort => {
                    assert!(ec == inject::EC_IABT_LOWER || ec == inject::EC_IABT_SAME);
                    assert_eq!(i.esr_el1 & 0x3f, 0x10);
                    assert!(i.far_el1.is_some());
                }
                GuestException::Undefined => {
                    assert_eq!(ec, inject::EC_UNKNOWN);
                    assert_eq!(i.esr_el1 & 0x1ff_ffff, 0, "no ISS");
                    assert_eq!(i.far_el1, None);
                }
            }
            let il = i.esr_el1 & (1 << 25) != 0;
            match exception {
                GuestException::Undefined => assert_eq!(il, il32, "IL: the trapped instruction's"),
                _ => assert!(il, "IL is RES1 for an abort"),
            }
        }
        match outcome {
            Outcome::Continue | Outcome::Idle | Outcome::WaitMemory => {}
            Outcome::Stop(why) => {
                lifecycle::begin_stop(&mut vm, &mut cpu, why, false);
                break;
            }
            Outcome::Reset => {
                lifecycle::begin_stop(&mut vm, &mut cpu, "reset", true);
                break;
            }
            Outcome::VcpuOff => break,
        }
        // The stray count and the VM's page count every exit; the walk over
        // the frame table and the stage-2 tables (most of a run's time)
        // every 32nd and at the end.
        assert_eq!(
            cpu.host.stray_accesses, 0,
            "the VM reached a frame not its own"
        );
        assert!(cpu.host.frames.guest_pages(0) <= ram / PAGE_SIZE);
        if n % 32 == 31 {
            check(&vm, &mut cpu, ram);
        }
    }
    check(&vm, &mut cpu, ram);
    // However it ended, the vCPU leaves and a stop frees everything.
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    if vm.state() != VmState::Stopped {
        lifecycle::request_stop(&mut vm, &mut cpu).ok();
        if vm.vcpus().inside() > 0 {
            lifecycle::leave(&mut vm, &mut cpu, 1, true);
        }
    }
    assert_eq!(vm.state(), VmState::Stopped);
    assert_eq!(
        cpu.host.frames.guest_pages(0),
        0,
        "a stop gives every page back"
    );
    // The frame table's invariants are part of the check.
    check(&vm, &mut cpu, ram);
    // The VM is dropped: its hypervisor page (the UART mirror, kept while
    // the VM exists) goes back, and the host is as it was.
    if let Some(frame) = vm.uart_mirror().frame() {
        cpu.host
            .frames
            .free(frame, 1, FrameUse::Allocated)
            .expect("the mirror page is the hypervisor's");
    }
    assert_eq!(cpu.host.frames.free_pages(), free, "the host is as it was");
    *guard = Some(cpu.host);
});
