//! The VM core on the host: a VM started over a fake CPU and fake RAM,
//! exits fed in as the world switch would decode them, and their effects
//! checked — device registers, console lines, injected exceptions, PSCI,
//! the balloon moving pages in and out of the pool, stops and resets, and
//! a hostile guest's arbitrary exits.

use guest_bundle::{BundleBuilder, VmMemory, VmSpec};
use proptest::prelude::*;

use super::balloon_ctl;
use super::check::{self, FrameFacts, VmFacts};
use super::cpu::{GuestContext, PhysCpu};
use super::exit::{FaultKind, VcpuExit};
use super::exit_profile::ExitKind;
use super::fault::{BadAccessKind, OnBadAccess};
use super::fdt::layout;
use super::handle::{self, Outcome, Shown};
use super::inject::GuestException;
use super::irq;
use super::lifecycle::{self, KernelImage, KERNEL_OFFSET};
use super::manage;
use super::memory::HostMemory;
use super::outbox::Notice;
use super::psci;
use super::state::{GuestGic, InjectedFailure, Power, Vm, VmState};
use super::testing::FakeCpu;
use crate::addr::{GuestAddr, PhysAddr};
use crate::balloon::F_VERSION_1;
use crate::console::terminal::Terminal;
use crate::mm::frames::{FrameUse, PAGE_SIZE};
use crate::pl011;
use crate::virtio::mmio;
use crate::virtio::testing::{DriverMemory, DriverQueue};

mod snapshot_tests;
mod vcpu_loop_tests;
mod virtio_console_tests;

/// RAM of the fake board, in pages (16 MiB).
const BOARD_PAGES: u64 = 4096;
/// RAM of the test VM (8 MiB).
const VM_RAM: u64 = 8 << 20;
const UART_DR: GuestAddr = layout::UART_BASE;
const UART_FR: GuestAddr = GuestAddr::new(layout::UART_BASE.raw() + 0x18);

/// A kernel with an arm64 Image header (text_offset 0x1000, image_size 1 MiB).
fn kernel() -> Vec<u8> {
    let mut k = vec![0u8; 8192];
    k[8..16].copy_from_slice(&0x1000u64.to_le_bytes());
    k[16..24].copy_from_slice(&(1u64 << 20).to_le_bytes());
    k[56..60].copy_from_slice(b"ARM\x64");
    k[4096..4100].copy_from_slice(b"CODE");
    k
}

/// A bundle of one VM, `vcpus` vCPUs on CPUs 1.., with a balloon, all its
/// RAM backed at start (prealloc: the tests below count every page).
fn spec(vcpus: u32, on_bad_access: u32) -> guest_bundle::VmEntry<'static> {
    let memory = VmMemory {
        prealloc: true,
        ..VmMemory::default()
    };
    spec_with(vcpus, on_bad_access, memory)
}

/// [`spec`] with these memory settings.
fn spec_with(vcpus: u32, on_bad_access: u32, memory: VmMemory) -> guest_bundle::VmEntry<'static> {
    spec_sized(vcpus, on_bad_access, memory, VM_RAM)
}

/// [`spec_with`] with `ram_size` bytes of RAM.
fn spec_sized(
    vcpus: u32,
    on_bad_access: u32,
    memory: VmMemory,
    ram_size: u64,
) -> guest_bundle::VmEntry<'static> {
    spec_devices(
        vcpus,
        on_bad_access,
        memory,
        ram_size,
        guest_bundle::devices::BALLOON,
    )
}

/// [`spec_sized`] with these device bits.
fn spec_devices(
    vcpus: u32,
    on_bad_access: u32,
    memory: VmMemory,
    ram_size: u64,
    devices: u64,
) -> guest_bundle::VmEntry<'static> {
    let bytes = BundleBuilder::new()
        .add_vm_with_memory(
            VmSpec {
                name: "guest".into(),
                ram_size,
                vcpus,
                cpu_affinity: ((1u64 << vcpus) - 1) << 1,
                kernel: kernel(),
                initrd: Some(vec![0x5a; 3000]),
                cmdline: Some("console=ttyAMA0".into()),
                balloon_features: if devices & guest_bundle::devices::BALLOON != 0 {
                    F_VERSION_1
                } else {
                    0
                },
                devices,
                on_bad_access,
                restore: None,
            },
            memory,
        )
        .expect("valid VM")
        .build();
    super::testing::first_vm(bytes)
}

/// VM 0 with `vcpus` vCPUs and a GICv3, started on a fake CPU 0 (the shell's).
fn started(vcpus: u32) -> (Vm, FakeCpu) {
    started_with(vcpus, 0, GuestGic::V3)
}

fn started_with(vcpus: u32, on_bad_access: u32, gic: GuestGic) -> (Vm, FakeCpu) {
    let mut vm = Vm::new(0, spec(vcpus, on_bad_access), gic);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    (vm, cpu)
}

/// vCPU `vcpu` enters its run loop on `cpu`'s CPU; its first context.
fn enter(vm: &mut Vm, cpu: &mut FakeCpu, vcpu: usize) -> GuestContext {
    cpu.index = vm.vcpus.cpu(vcpu);
    let (pc, x0) = lifecycle::enter(vm, vcpu).expect("may enter");
    GuestContext::new(pc, x0)
}

fn exit(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, exit: VcpuExit) -> Outcome {
    handle::after_exit(vm, cpu, 0, ctx, exit, 0)
}

/// A load or store to a RAM page without a frame: the stage-2 translation
/// fault its first touch takes.
fn first_touch(ipa: GuestAddr, write: bool) -> VcpuExit {
    VcpuExit::Abort {
        ipa,
        write,
        instruction: false,
        fault: FaultKind::Translation,
    }
}

fn store(ipa: GuestAddr, width: u8) -> VcpuExit {
    VcpuExit::MmioWrite {
        ipa,
        width,
        reg: 1,
        insn_len: 4,
    }
}

fn load(ipa: GuestAddr, width: u8) -> VcpuExit {
    VcpuExit::MmioRead {
        ipa,
        width,
        reg: 2,
        sign_extend: false,
        sixty_four: false,
        insn_len: 4,
    }
}

/// The lines waiting in the VM's outbox (taken).
fn lines(vm: &mut Vm) -> Vec<String> {
    let (notices, dropped) = vm.console.out.take();
    assert_eq!(dropped, 0);
    notices
        .iter()
        .filter_map(|n| match n {
            Notice::Line(l) => Some(l.to_string()),
            _ => None,
        })
        .collect()
}

/// `check` over the fake board: every invariant the shell's command checks.
fn assert_check(vm: &Vm, cpu: &mut FakeCpu) {
    let facts = FrameFacts::of(&cpu.host.frames, BOARD_PAGES * PAGE_SIZE);
    let vms = [VmFacts {
        id: vm.id,
        name: &vm.name,
        stopped: vm.state == VmState::Stopped,
        ram: vm
            .memory
            .ram
            .as_ref()
            .map(|r| check::RamFacts::of(r, &mut cpu.host)),
    }];
    let result = check::check(&facts, &vms);
    assert!(result.is_ok(), "check failed: {:?}", result.err());
}

#[test]
fn start_loads_the_kernel_initrd_and_tree_and_hands_vcpu_0_to_its_cpu() {
    let (mut vm, mut cpu) = started(1);
    assert_eq!(vm.state, VmState::Running);
    assert_eq!(cpu.handed, vec![(1, 0, 0)]);
    assert_eq!(cpu.icache_invalidations, 1, "code was written to guest RAM");
    assert_eq!(cpu.host.frames.guest_pages(0), VM_RAM / PAGE_SIZE);
    let image = KernelImage::parse(&kernel());
    assert_eq!(image.entry(), layout::RAM_BASE + KERNEL_OFFSET + 0x1000);
    let ram = vm.memory.ram.as_mut().expect("RAM");
    let mut code = [0u8; 4];
    ram.read(&mut cpu.host, image.entry() + 4096, &mut code)
        .expect("kernel in RAM");
    assert_eq!(&code, b"CODE");
    let mut magic = [0u8; 4];
    ram.read(&mut cpu.host, layout::RAM_BASE, &mut magic)
        .expect("tree in RAM");
    assert_eq!(magic, [0xd0, 0x0d, 0xfe, 0xed]);
    // The initrd starts at the first 2 MiB boundary past the kernel's footprint.
    let initrd = GuestAddr::new((image.entry() + (1 << 20)).raw().next_multiple_of(2 << 20));
    let mut first = [0u8; 1];
    ram.read(&mut cpu.host, initrd, &mut first).expect("initrd");
    assert_eq!(first, [0x5a]);
    let ctx = enter(&mut vm, &mut cpu, 0);
    assert_eq!(
        (ctx.elr, ctx.x[0]),
        (image.entry().raw(), layout::RAM_BASE.raw())
    );
    assert_check(&vm, &mut cpu);
}

/// Stage 2 covers 16 GiB of guest-physical space, RAM from 1 GiB: a VM
/// whose RAM would end past it (vmconfig allows 8 GiB) is refused before
/// anything is allocated; one that ends exactly there starts.
#[test]
fn ram_beyond_the_guest_physical_space_is_refused() {
    let too_big = crate::mm::stage2::IPA_LIMIT.raw() - layout::RAM_BASE.raw() + (2 << 20);
    let mut vm = Vm::new(
        0,
        spec_sized(1, 0, VmMemory::default(), too_big),
        GuestGic::V3,
    );
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    let refused = lifecycle::start(&mut vm, &mut cpu).unwrap_err();
    assert!(refused.contains("beyond the 16 GiB"), "{refused}");
    assert_eq!(cpu.host.frames.guest_pages(0), 0, "nothing was allocated");
    let fits = too_big - (2 << 20);
    let mut vm = Vm::new(0, spec_sized(1, 0, VmMemory::default(), fits), GuestGic::V3);
    lifecycle::start(&mut vm, &mut cpu).expect("the largest RAM that fits starts");
}

#[test]
fn a_second_start_and_a_missing_cpu_are_refused() {
    let (mut vm, mut cpu) = started(1);
    assert_eq!(
        lifecycle::start(&mut vm, &mut cpu),
        Err("it is already running")
    );
    let mut vm = Vm::new(0, spec(2, 0), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    cpu.online = 0b10; // CPU 2 is missing
    assert!(lifecycle::start(&mut vm, &mut cpu).is_err());
    assert_eq!(cpu.host.frames.guest_pages(0), 0, "nothing was allocated");
}

/// A guest PC at the top of the address space: stepping past a trapped
/// instruction wraps to 0 as the hardware's PC does (it panicked on the
/// overflow check: the VM stopped as for a hypervisor failure).
#[test]
fn stepping_past_the_last_instruction_wraps_the_pc() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    for exit_kind in [store(UART_DR, 4), load(UART_FR, 4)] {
        ctx.elr = u64::MAX - 3;
        assert_eq!(
            exit(&mut vm, &mut cpu, &mut ctx, exit_kind),
            Outcome::Continue
        );
        assert_eq!(ctx.elr, 0);
    }
}

#[test]
fn console_bytes_become_one_line_and_registers_read_back() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    for &b in b"hello\n" {
        ctx.x[1] = u64::from(b);
        let pc = ctx.elr;
        assert_eq!(
            exit(&mut vm, &mut cpu, &mut ctx, store(UART_DR, 4)),
            Outcome::Continue
        );
        assert_eq!(ctx.elr, pc + 4, "the store is stepped over");
    }
    assert_eq!(lines(&mut vm), vec!["[guest] hello"]);
    ctx.x[2] = 0xdead;
    exit(&mut vm, &mut cpu, &mut ctx, load(UART_FR, 4));
    assert_ne!(ctx.x[2], 0xdead, "FR was read into x2");
    assert_eq!(vm.counters.profile.get(ExitKind::MmioUart).count, 7);
}

#[test]
fn a_focused_console_is_shown_live() {
    let (mut vm, mut cpu) = started(1);
    vm.console.focused = true;
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    for &b in b"/ # " {
        ctx.x[1] = u64::from(b);
        exit(&mut vm, &mut cpu, &mut ctx, store(UART_DR, 4));
    }
    let (notices, _) = vm.console.out.take();
    assert!(notices.iter().all(|n| matches!(
        n,
        Notice::Live {
            complete: false,
            ..
        }
    )));
    assert!(!notices.is_empty());
}

#[test]
fn bad_accesses_get_aborts_counted_and_rate_limited_lines() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    // Nothing is at 0x3000_0000: an external abort on the load.
    let pc = ctx.elr;
    ctx.far = 0x1234;
    assert_eq!(
        exit(
            &mut vm,
            &mut cpu,
            &mut ctx,
            load(GuestAddr::new(0x3000_0000), 4)
        ),
        Outcome::Continue
    );
    assert_eq!(
        cpu.injected,
        vec![(
            GuestException::DataAbort { write: false },
            Some(0x1234),
            true
        )]
    );
    assert_eq!(ctx.elr, pc + 4, "the fake handler resumed past it");
    // A 2-byte read of virtio config: the device refuses it.
    exit(
        &mut vm,
        &mut cpu,
        &mut ctx,
        load(layout::VIRTIO_BASE + mmio::CONFIG + 1, 2),
    );
    assert_eq!(vm.counters.bad_access.injected, 2);
    assert_eq!(
        vm.counters.bad_access.by_kind[BadAccessKind::Unmapped.index()],
        1
    );
    let said = lines(&mut vm);
    assert_eq!(said.len(), 2);
    assert!(
        said[0].starts_with("tidal: [guest] data abort injected: "),
        "{said:?}"
    );
    assert!(said[1].contains("virtio"), "{said:?}");
    // A flood: ten lines at once, then the rest held back.
    for _ in 0..100 {
        exit(
            &mut vm,
            &mut cpu,
            &mut ctx,
            load(GuestAddr::new(0x3000_0000), 4),
        );
    }
    assert_eq!(cpu.injected.len(), 102, "every bad access gets its abort");
    assert!(lines(&mut vm).len() <= 10);
    assert_check(&vm, &mut cpu);
}

#[test]
fn under_the_stop_policy_a_bad_access_stops_the_vm() {
    let (mut vm, mut cpu) = started_with(1, guest_bundle::bad_access::STOP, GuestGic::V3);
    assert_eq!(vm.on_bad_access, OnBadAccess::Stop);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let outcome = exit(
        &mut vm,
        &mut cpu,
        &mut ctx,
        store(GuestAddr::new(0x3000_0000), 4),
    );
    assert!(matches!(outcome, Outcome::Stop(_)));
    assert!(cpu.injected.is_empty());
    lifecycle::begin_stop(&mut vm, &mut cpu, "test", false);
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(vm.state, VmState::Stopped);
    assert_eq!(cpu.host.frames.guest_pages(0), 0, "every page went back");
    assert_check(&vm, &mut cpu);
}

#[test]
fn unemulated_system_registers_are_undefined() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let sysreg = VcpuExit::SysReg {
        encoding: (3, 0, 15, 2, 0),
        reg: 3,
        read: true,
        insn_len: 4,
    };
    exit(&mut vm, &mut cpu, &mut ctx, sysreg);
    assert_eq!(cpu.injected[0].0, GuestException::Undefined);
    assert_eq!(
        vm.counters.bad_access.by_kind[BadAccessKind::SystemRegister.index()],
        1
    );
}

#[test]
fn psci_brings_up_a_second_vcpu_and_powers_off() {
    let (mut vm, mut cpu) = started(2);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let call = |vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, args: [u64; 4]| {
        ctx.x[..4].copy_from_slice(&args);
        let outcome = exit(vm, cpu, ctx, VcpuExit::Hvc { imm: 0 });
        (outcome, ctx.x[0])
    };
    let version = call(
        &mut vm,
        &mut cpu,
        &mut ctx,
        [smccc::psci::PSCI_VERSION.into(), 0, 0, 0],
    );
    assert_eq!(version, (Outcome::Continue, 0x1_0000));
    let on = [smccc::psci::PSCI_CPU_ON_64.into(), 1, 0x4008_0000, 42];
    assert_eq!(
        call(&mut vm, &mut cpu, &mut ctx, on),
        (Outcome::Continue, 0)
    );
    assert_eq!(cpu.handed.last(), Some(&(2, 0, 1)), "vCPU 1 went to CPU 2");
    assert_eq!(
        vm.vcpus.power(1),
        Power::Starting {
            entry: 0x4008_0000,
            context: 42
        }
    );
    assert_eq!(call(&mut vm, &mut cpu, &mut ctx, on).1, psci::ALREADY_ON);
    let info = [smccc::psci::PSCI_AFFINITY_INFO_64.into(), 1, 0, 0];
    assert_eq!(call(&mut vm, &mut cpu, &mut ctx, info).1, 2, "ON_PENDING");
    let bad = [smccc::psci::PSCI_CPU_ON_64.into(), 7, 0, 0];
    assert_eq!(
        call(&mut vm, &mut cpu, &mut ctx, bad).1,
        psci::INVALID_PARAMETERS
    );
    // vCPU 1 starts where CPU_ON said.
    let ctx1 = enter(&mut vm, &mut cpu, 1);
    assert_eq!((ctx1.elr, ctx1.x[0]), (0x4008_0000, 42));
    assert_eq!(call(&mut vm, &mut cpu, &mut ctx, info).1, 0, "ON");
    let unknown = [0x8400_00ff, 0, 0, 0];
    assert_eq!(
        call(&mut vm, &mut cpu, &mut ctx, unknown).1,
        psci::NOT_SUPPORTED
    );
    let off = [smccc::psci::PSCI_SYSTEM_OFF.into(), 0, 0, 0];
    let (outcome, _) = call(&mut vm, &mut cpu, &mut ctx, off);
    assert!(matches!(outcome, Outcome::Stop(_)));
    // The stop kicks the other vCPU's CPU; the last one out frees the RAM.
    cpu.index = 1;
    lifecycle::begin_stop(&mut vm, &mut cpu, "powered off", false);
    assert!(cpu.kicks.contains(&2));
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(vm.state, VmState::StopRequested, "vCPU 1 is still inside");
    lifecycle::leave(&mut vm, &mut cpu, 1, true);
    assert_eq!(vm.state, VmState::Stopped);
    assert_eq!(cpu.host.frames.guest_pages(0), 0);
    assert!(lines(&mut vm)
        .iter()
        .any(|l| l.contains("VM stopped: powered off; 2048 pages returned to the pool")));
    assert_check(&vm, &mut cpu);
}

#[test]
fn a_guest_reset_starts_the_vm_again() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    ctx.x[0] = smccc::psci::PSCI_SYSTEM_RESET.into();
    assert_eq!(
        exit(&mut vm, &mut cpu, &mut ctx, VcpuExit::Hvc { imm: 0 }),
        Outcome::Reset
    );
    lifecycle::begin_stop(&mut vm, &mut cpu, "reset", true);
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(vm.state, VmState::Running);
    assert_eq!(vm.counters.starts, 2);
    assert_eq!(cpu.handed.len(), 2);
    assert_eq!(cpu.host.frames.guest_pages(0), VM_RAM / PAGE_SIZE);
    assert_check(&vm, &mut cpu);
}

#[test]
fn wfi_sleeps_only_when_nothing_is_pending() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let wfi = VcpuExit::Wait {
        wfe: false,
        insn_len: 4,
    };
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, wfi), Outcome::Idle);
    let wfe = VcpuExit::Wait {
        wfe: true,
        insn_len: 4,
    };
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, wfe), Outcome::Continue);
    // An interrupt listed but not taken yet: no sleep.
    cpu.lrs[0] = crate::vgic::LR_PENDING | 33;
    vm.vcpus.listed_mut(0).unwrap()[0] = Some(33);
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, wfi), Outcome::Continue);
}

/// A guest with the virtual GIC sleeps in WFI itself, on every vCPU; one
/// without it (no interrupt would end the sleep at EL2) traps WFI. Setting
/// a statistics interval kicks vCPU 0, which may be asleep.
#[test]
fn wfi_traps_only_where_a_sleep_must_be_bounded() {
    let (mut vm, mut cpu) = started(2);
    for vcpu in 0..2 {
        assert!(!handle::traps_wfi(&vm, vcpu), "vCPU {vcpu}");
    }
    assert!(cpu.wfi_trapped, "a vCPU starts with WFI trapped");
    handle::before_entry(&mut vm, &mut cpu, 0);
    assert!(!cpu.wfi_trapped);

    cpu.kicks.clear();
    assert_eq!(
        balloon_ctl::set_stats_interval(&mut vm, &mut cpu, 5),
        Some(())
    );
    assert_eq!(cpu.kicks, vec![vm.vcpus.cpu(0)]);
    // No statistics queue was negotiated: nothing is scheduled, no trap.
    assert!(!handle::traps_wfi(&vm, 0));

    let (mut bare, mut bare_cpu) = started_with(1, 0, GuestGic::None);
    assert!(handle::traps_wfi(&bare, 0));
    handle::before_entry(&mut bare, &mut bare_cpu, 0);
    assert!(bare_cpu.wfi_trapped);

    // While the pool wants frames zeroed ahead, an idle vCPU comes to EL2
    // to do it; then it sleeps in the guest again.
    cpu.zeroing = true;
    handle::before_entry(&mut vm, &mut cpu, 1);
    assert!(cpu.wfi_trapped);
    cpu.zeroing = false;
    handle::before_entry(&mut vm, &mut cpu, 1);
    assert!(!cpu.wfi_trapped);
}

#[test]
fn physical_interrupts_are_taken_and_the_timer_goes_to_the_guest() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    cpu.pending_irqs = vec![crate::vgic::intid::KICK_SGI, crate::vgic::intid::VTIMER_PPI];
    // One interrupt per exit: the second makes the guest leave again.
    exit(&mut vm, &mut cpu, &mut ctx, VcpuExit::Interrupt);
    assert_eq!(cpu.eois, vec![0]);
    assert_eq!(cpu.pending_irqs.len(), 1, "left for the next exit");
    exit(&mut vm, &mut cpu, &mut ctx, VcpuExit::Interrupt);
    assert_eq!(cpu.eois, vec![0, 27]);
    assert!(cpu.pending_irqs.is_empty());
    assert_eq!(
        cpu.deactivated,
        vec![0],
        "the timer stays active for the guest"
    );
}

#[test]
fn the_hypervisors_own_interrupts_are_taken_once_per_exit() {
    // The console UART's level interrupt on the shell's CPU: still asserted
    // until the shell reads the UART after the exit, so acknowledging it
    // again at once would only find it again.
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let uart = 33;
    cpu.pending_irqs = vec![uart, uart, uart, crate::vgic::intid::KICK_SGI];
    exit(&mut vm, &mut cpu, &mut ctx, VcpuExit::Interrupt);
    assert_eq!(cpu.eois, vec![uart]);
    assert_eq!(cpu.deactivated, vec![uart]);
    assert_eq!(cpu.pending_irqs.len(), 3, "left for the next exit");
    // The same for the hypervisor's timer (the shell's periodic look).
    let timer = crate::vgic::intid::HYP_TIMER_PPI;
    cpu.pending_irqs = vec![timer, timer];
    exit(&mut vm, &mut cpu, &mut ctx, VcpuExit::Interrupt);
    assert_eq!(cpu.eois, vec![uart, timer]);
    assert_eq!(cpu.pending_irqs.len(), 1, "left for the next exit");
}

/// The guest's stores into its own RAM (a driver laying out rings).
struct GuestStores<'a> {
    vm: &'a mut Vm,
    cpu: &'a mut FakeCpu,
}

impl DriverMemory for GuestStores<'_> {
    fn poke(&mut self, ipa: u64, data: &[u8]) {
        let ram = self.vm.memory.ram.as_mut().expect("RAM");
        let ipa = GuestAddr::new(ipa);
        ram.translate_or_back(&mut self.cpu.host, ipa)
            .expect("backed");
        ram.write(&mut self.cpu.host, ipa, data).expect("in RAM");
    }
}

/// A virtio register write, as a trapped guest store.
fn virtio_write(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, off: u64, value: u32) {
    slot_write(vm, cpu, ctx, layout::VIRTIO_BASE + off, value);
}

fn virtio_read(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, off: u64) -> u32 {
    slot_read(vm, cpu, ctx, layout::VIRTIO_BASE + off)
}

/// A 32-bit register write at `ipa`, as a trapped guest store.
fn slot_write(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, ipa: GuestAddr, value: u32) {
    ctx.x[1] = u64::from(value);
    let outcome = exit(vm, cpu, ctx, store(ipa, 4));
    assert_eq!(outcome, Outcome::Continue);
}

/// A 32-bit register read at `ipa`, as a trapped guest load.
fn slot_read(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, ipa: GuestAddr) -> u32 {
    exit(vm, cpu, ctx, load(ipa, 4));
    ctx.x[2] as u32
}

/// What Linux's virtio_mmio does at probe, entirely through trapped
/// accesses to the device at `base`: checks its magic and `device_id`,
/// resets it, accepts VERSION_1 only, sets `queues` up and sets DRIVER_OK.
fn probe_at(
    vm: &mut Vm,
    cpu: &mut FakeCpu,
    ctx: &mut GuestContext,
    base: GuestAddr,
    device_id: u32,
    queues: &[&DriverQueue],
) {
    let write = |vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, off: u64, v: u32| {
        slot_write(vm, cpu, ctx, base + off, v)
    };
    assert_eq!(
        slot_read(vm, cpu, ctx, base + mmio::MAGIC_VALUE),
        mmio::MAGIC
    );
    assert_eq!(slot_read(vm, cpu, ctx, base + mmio::DEVICE_ID), device_id);
    let ack = mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER;
    write(vm, cpu, ctx, mmio::STATUS, 0);
    write(vm, cpu, ctx, mmio::STATUS, ack);
    write(vm, cpu, ctx, mmio::DRIVER_FEATURES_SEL, 1);
    write(vm, cpu, ctx, mmio::DRIVER_FEATURES, 1);
    write(vm, cpu, ctx, mmio::STATUS, ack | mmio::STATUS_FEATURES_OK);
    for (i, q) in queues.iter().enumerate() {
        write(vm, cpu, ctx, mmio::QUEUE_SEL, i as u32);
        write(vm, cpu, ctx, mmio::QUEUE_NUM, q.size.into());
        for (reg, ipa) in [
            (mmio::QUEUE_DESC_LOW, q.desc),
            (mmio::QUEUE_DRIVER_LOW, q.avail),
            (mmio::QUEUE_DEVICE_LOW, q.used),
        ] {
            write(vm, cpu, ctx, reg, ipa as u32);
        }
        write(vm, cpu, ctx, mmio::QUEUE_READY, 1);
    }
    let ok = ack | mmio::STATUS_FEATURES_OK | mmio::STATUS_DRIVER_OK;
    write(vm, cpu, ctx, mmio::STATUS, ok);
    assert_eq!(slot_read(vm, cpu, ctx, base + mmio::STATUS), ok);
}

/// The guest's driver probes the balloon and sets it live, entirely
/// through trapped accesses as Linux's virtio_mmio does, with its inflate
/// and deflate queues (16 entries) at `rings`; returns them.
fn driver_live(
    vm: &mut Vm,
    cpu: &mut FakeCpu,
    ctx: &mut GuestContext,
    rings: u64,
) -> (DriverQueue, DriverQueue) {
    let inflate = DriverQueue::new(16, rings, rings + 0x1000, rings + 0x2000);
    let deflate = DriverQueue::new(16, rings + 0x4000, rings + 0x5000, rings + 0x6000);
    probe_at(vm, cpu, ctx, layout::VIRTIO_BASE, 5, &[&inflate, &deflate]);
    (inflate, deflate)
}

/// The guest puts 16 PFNs in the middle of its RAM (from 2.5 MiB on) on
/// `queue`, its page array at `rings + 0x8000`: the first PFN and the
/// array's address.
fn queue_16_pages(
    vm: &mut Vm,
    cpu: &mut FakeCpu,
    queue: &mut DriverQueue,
    rings: u64,
) -> (u64, u64) {
    let first_pfn = (layout::RAM_BASE + (2 << 20) + (512 << 10)).pfn().raw();
    let pfns: Vec<u8> = (0..16u32)
        .flat_map(|i| (first_pfn as u32 + i).to_le_bytes())
        .collect();
    let array = rings + 0x8000;
    let mut stores = GuestStores { vm, cpu };
    stores.poke(array, &pfns);
    queue.add(&mut stores, &[(array, 64, false)]);
    (first_pfn, array)
}

#[test]
fn a_balloon_driven_by_exits_moves_pages_to_the_pool_and_back() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let rings = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;
    let (mut inflate, mut deflate) = driver_live(&mut vm, &mut cpu, &mut ctx, rings);

    // The host asks for 16 pages: the config-change interrupt is raised.
    let free_before = cpu.host.frames.free_pages();
    balloon_ctl::set_target(&mut vm, &mut cpu, 16).expect("target set");
    assert_eq!(virtio_read(&mut vm, &mut cpu, &mut ctx, mmio::CONFIG), 16);
    assert!(vm
        .devices
        .balloon
        .as_ref()
        .is_some_and(|b| b.interrupt_pending()));
    // The guest inflates 16 pages in the middle of its RAM.
    let (first_pfn, array) = queue_16_pages(&mut vm, &mut cpu, &mut inflate, rings);
    virtio_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 0);
    assert_eq!(
        cpu.host.frames.free_pages(),
        free_before + 16,
        "16 pages back in the pool"
    );
    assert_eq!(cpu.host.frames.guest_pages(0), VM_RAM / PAGE_SIZE - 16);
    assert!(cpu.host.flushes >= 1, "the TLB was invalidated");
    virtio_write(&mut vm, &mut cpu, &mut ctx, mmio::CONFIG + 4, 16);
    assert!(vm.counters.change.is_none(), "the change is complete");
    assert!(lines(&mut vm)
        .iter()
        .any(|l| l.contains("balloon: reached 16 pages: 16 pages inflated")));
    assert_check(&vm, &mut cpu);

    // The guest touches an inflated page again (deflate not told: a
    // migration-like refault): it is backed with a zeroed frame.
    let ipa = GuestAddr::new(first_pfn * PAGE_SIZE + 8);
    let fault = first_touch(ipa, true);
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, fault), Outcome::Continue);
    assert_eq!(cpu.host.frames.guest_pages(0), VM_RAM / PAGE_SIZE - 15);
    let mut word = [0xffu8; 8];
    let ram = vm.memory.ram.as_mut().expect("RAM");
    ram.read(&mut cpu.host, ipa, &mut word).expect("backed");
    assert_eq!(word, [0; 8], "a fresh page reads as zeros");
    assert_check(&vm, &mut cpu);

    // The guest deflates the 16 pages: nothing is backed until it touches
    // one; that fault backs the page and its unbacked neighbours in its
    // aligned block, all reading as zeros.
    {
        let mut stores = GuestStores {
            vm: &mut vm,
            cpu: &mut cpu,
        };
        deflate.add(&mut stores, &[(array, 64, false)]);
    }
    let faults = vm.memory.ram.as_ref().expect("RAM").stats.faults_backed;
    virtio_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 1);
    assert_eq!(cpu.host.frames.guest_pages(0), VM_RAM / PAGE_SIZE - 15);
    let touched = first_pfn + 9;
    let size = handle::FAULT_AROUND_PAGES;
    let block = (touched & !(size - 1))..(touched & !(size - 1)) + size;
    // The deflated pages without a frame (all but the first) in the block.
    let expected = (first_pfn + 1..first_pfn + 16)
        .filter(|p| block.contains(p))
        .count() as u64;
    let fault = first_touch(GuestAddr::new(touched * PAGE_SIZE), false);
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, fault), Outcome::Continue);
    assert_eq!(
        cpu.host.frames.guest_pages(0),
        VM_RAM / PAGE_SIZE - 15 + expected
    );
    let ram = vm.memory.ram.as_mut().expect("RAM");
    assert_eq!(ram.stats.faults_backed, faults + expected);
    for p in block
        .clone()
        .filter(|p| (first_pfn..first_pfn + 16).contains(p))
    {
        let mut word = [0xffu8; 8];
        let mapped = ram.mapped_pages();
        ram.read(&mut cpu.host, GuestAddr::new(p * PAGE_SIZE), &mut word)
            .expect("backed");
        assert_eq!(word, [0; 8]);
        assert_eq!(ram.mapped_pages(), mapped, "page {p:#x} needed no fault");
    }
    assert_check(&vm, &mut cpu);

    // Stop: every page goes back.
    lifecycle::request_stop(&mut vm, &mut cpu).expect("running");
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(cpu.host.frames.guest_pages(0), 0);
    assert_check(&vm, &mut cpu);
}

#[test]
fn list_registers_carry_pending_interrupts_and_retire_them() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    // The guest enables its distributor and SPI 33 (the UART), through exits.
    ctx.x[1] = 0b11;
    exit(&mut vm, &mut cpu, &mut ctx, store(layout::GICD_BASE, 4));
    // ISENABLER1 bit 1 (INTID 33), group 1 via IGROUPR1.
    ctx.x[1] = 1 << 1;
    exit(
        &mut vm,
        &mut cpu,
        &mut ctx,
        store(layout::GICD_BASE + 0x84, 4),
    );
    exit(
        &mut vm,
        &mut cpu,
        &mut ctx,
        store(layout::GICD_BASE + 0x104, 4),
    );
    // The guest turns on receive interrupts and a byte arrives.
    ctx.x[1] = 1 << 4;
    exit(
        &mut vm,
        &mut cpu,
        &mut ctx,
        store(layout::UART_BASE + 0x38, 4),
    );
    ctx.x[1] = 0x301;
    exit(
        &mut vm,
        &mut cpu,
        &mut ctx,
        store(layout::UART_BASE + 0x30, 4),
    );
    assert!(irq::console_input(&mut vm, &mut cpu, b'x'));
    irq::sync_list_registers(&mut vm, &mut cpu, 0);
    let lr = cpu.read_lr(0);
    assert_eq!(lr.intid, 33, "the UART's SPI is listed");
    assert_eq!(vm.vcpus.listed(0).unwrap()[0], Some(33));
    // The guest takes and completes it (the LR goes invalid, with its EOI
    // bit left: a level interrupt asks for a maintenance interrupt on its
    // EOI): it is retired, and the LR cleared.
    cpu.lrs[0] = crate::vgic::LR_EOI;
    exit(&mut vm, &mut cpu, &mut ctx, load(layout::UART_BASE, 4));
    let clears = cpu.lr_clears;
    irq::sync_list_registers(&mut vm, &mut cpu, 0);
    assert_eq!(vm.vcpus.listed(0).unwrap()[0], None);
    assert_eq!(cpu.lrs[0], 0, "no stale EOI bit");
    assert_eq!(cpu.lr_clears, clears + 1);
    // Retired and refilled in the same sync: the new value replaces the
    // old one, with no clear before it.
    assert!(irq::console_input(&mut vm, &mut cpu, b'y'));
    irq::sync_list_registers(&mut vm, &mut cpu, 0);
    assert_eq!(cpu.read_lr(0).intid, 33);
    cpu.lrs[0] = crate::vgic::LR_EOI;
    exit(&mut vm, &mut cpu, &mut ctx, load(layout::UART_BASE, 4));
    assert!(irq::console_input(&mut vm, &mut cpu, b'z'));
    let clears = cpu.lr_clears;
    irq::sync_list_registers(&mut vm, &mut cpu, 0);
    assert_eq!(cpu.read_lr(0).intid, 33, "listed again in the same LR");
    assert_eq!(cpu.lr_clears, clears, "not cleared first");
}

#[test]
fn typed_input_longer_than_the_fifo_reaches_the_guest_whole() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let line: Vec<u8> = (0..300u32).map(|i| b'a' + (i % 26) as u8).collect();
    // Byte by byte, then in batches as the shell passes what it read.
    let (single, batched) = line.split_at(100);
    for &b in single {
        assert!(irq::console_input(&mut vm, &mut cpu, b), "kept");
    }
    for chunk in batched.chunks(64) {
        assert_eq!(
            irq::console_input_bytes(&mut vm, &mut cpu, chunk),
            chunk.len()
        );
    }
    assert_eq!(
        vm.devices.uart.rx_len() + vm.console.input.len(),
        line.len()
    );
    // The guest reads DR until the flag register says the FIFO is empty.
    let mut read = Vec::new();
    loop {
        exit(
            &mut vm,
            &mut cpu,
            &mut ctx,
            load(layout::UART_BASE + 0x18, 4),
        );
        if ctx.x[2] & (1 << 4) != 0 {
            break;
        }
        exit(&mut vm, &mut cpu, &mut ctx, load(layout::UART_BASE, 4));
        read.push(ctx.x[2] as u8);
    }
    assert_eq!(read, line);
    assert!(vm.console.input.is_empty());
    // A guest that reads nothing loses only what does not fit in the queue.
    let room = super::state::CONSOLE_INPUT_MAX + vm.devices.uart.rx_depth();
    let kept = (0..room - 5)
        .filter(|_| irq::console_input(&mut vm, &mut cpu, b'x'))
        .count();
    assert_eq!(kept, room - 5);
    // A batch keeps its first bytes that fit.
    assert_eq!(irq::console_input_bytes(&mut vm, &mut cpu, &[b'y'; 15]), 5);
    assert!(!irq::console_input(&mut vm, &mut cpu, b'z'));
    // A reset forgets it.
    lifecycle::request_stop(&mut vm, &mut cpu).expect("running");
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    lifecycle::start(&mut vm, &mut cpu).expect("starts again");
    assert!(vm.console.input.is_empty());
}

/// The mirror page's word at `offset`, as the guest would load it.
fn mirror_word(vm: &Vm, cpu: &mut FakeCpu, offset: u64) -> u32 {
    let frame = vm.devices.uart_mirror.frame().expect("a mirror frame");
    let mut word = [0u8; 4];
    cpu.host.read(frame + offset, &mut word);
    u32::from_le_bytes(word)
}

/// Whether every register the mirror shows reads as the model has it.
fn assert_mirror_matches(vm: &Vm, cpu: &mut FakeCpu) {
    for offset in (0..pl011::MIRROR_BLOCK_WORDS as u64 * 4)
        .step_by(4)
        .chain((pl011::UARTPERIPHID0..pl011::PL011_SIZE).step_by(4))
    {
        let expected = vm.devices.uart.clone().read(offset, 4);
        assert_eq!(mirror_word(vm, cpu, offset), expected, "offset {offset:#x}");
    }
}

#[test]
fn the_uart_mirror_is_shown_while_reads_change_nothing_and_withdrawn_for_input() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let allocated = cpu.host.frames.pages(FrameUse::Allocated);
    assert!(vm.devices.uart_mirror.is_mapped(), "shown from the start");
    assert_mirror_matches(&vm, &mut cpu);
    // Linux's setup and a byte sent: each store traps and the page follows.
    for (offset, value) in [
        (pl011::UARTLCR_H, 0x70),
        (pl011::UARTIMSC, 0x50),
        (pl011::UARTCR, 0x301),
        (pl011::UARTDR, u64::from(b'x')),
    ] {
        ctx.x[1] = value;
        exit(
            &mut vm,
            &mut cpu,
            &mut ctx,
            store(layout::UART_BASE + offset, 2),
        );
        assert!(vm.devices.uart_mirror.is_mapped());
        assert_mirror_matches(&vm, &mut cpu);
    }
    assert_eq!(
        mirror_word(&vm, &mut cpu, pl011::UARTRIS) & pl011::INT_TX,
        pl011::INT_TX,
        "the byte left: TXRIS as the guest reads it"
    );
    // Input: the page goes, with one TLB invalidation, before the guest
    // can see the byte; reads trap until the FIFO is empty again.
    let flushes = cpu.host.flushes;
    assert!(irq::console_input_bytes(&mut vm, &mut cpu, b"ab") == 2);
    assert!(!vm.devices.uart_mirror.is_mapped());
    assert_eq!(cpu.host.flushes, flushes + 1);
    exit(&mut vm, &mut cpu, &mut ctx, load(layout::UART_BASE, 2));
    assert_eq!(ctx.x[2], u64::from(b'a'));
    assert!(!vm.devices.uart_mirror.is_mapped(), "a byte is left");
    exit(&mut vm, &mut cpu, &mut ctx, load(layout::UART_BASE, 2));
    assert_eq!(ctx.x[2], u64::from(b'b'));
    assert!(vm.devices.uart_mirror.is_mapped(), "empty again");
    assert_mirror_matches(&vm, &mut cpu);
    assert_ne!(
        mirror_word(&vm, &mut cpu, pl011::UARTFR) & pl011::FR_RXFE,
        0
    );
    let stats = vm.devices.uart_mirror.stats;
    assert_eq!((stats.shown, stats.withdrawn), (2, 1));
    // A store to the page is emulated as the store it is: the permission
    // fault decodes to an MMIO write (`exit::decode`), handled as above.
    assert_check(&vm, &mut cpu);
    // A restart keeps the frame: no page per start.
    lifecycle::request_stop(&mut vm, &mut cpu).expect("running");
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    let frame = vm.devices.uart_mirror.frame();
    lifecycle::start(&mut vm, &mut cpu).expect("starts again");
    assert_eq!(vm.devices.uart_mirror.frame(), frame);
    assert!(vm.devices.uart_mirror.is_mapped());
    assert_mirror_matches(&vm, &mut cpu);
    assert_eq!(cpu.host.frames.pages(FrameUse::Allocated), allocated);
    assert_check(&vm, &mut cpu);
}

/// One arbitrary exit a hostile guest could cause.
fn any_exit() -> impl Strategy<Value = VcpuExit> {
    let ipa = prop_oneof![
        (0u64..0x1_0000_0000).prop_map(GuestAddr::new),
        (0u64..0x1000).prop_map(|o| layout::GICD_BASE + o),
        (0u64..0x4_0000).prop_map(|o| layout::GICR_BASE + o),
        (0u64..0x1000).prop_map(|o| layout::UART_BASE + o),
        (0u64..0x200).prop_map(|o| layout::VIRTIO_BASE + o),
        (0u64..VM_RAM).prop_map(|o| layout::RAM_BASE + o),
    ];
    let width = prop_oneof![Just(1u8), Just(2), Just(4), Just(8), 0u8..=16];
    prop_oneof![
        (any::<u64>(), width.clone(), 0u8..=31).prop_map(|(far, width, reg)| {
            VcpuExit::ReadOnlyStore {
                far,
                width,
                reg,
                insn_len: 4,
            }
        }),
        (
            ipa.clone(),
            width.clone(),
            0u8..=31,
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(
                |(ipa, width, reg, sign_extend, sixty_four)| VcpuExit::MmioRead {
                    ipa,
                    width,
                    reg,
                    sign_extend,
                    sixty_four,
                    insn_len: 4
                }
            ),
        (ipa.clone(), width, 0u8..=31).prop_map(|(ipa, width, reg)| VcpuExit::MmioWrite {
            ipa,
            width,
            reg,
            insn_len: 4
        }),
        (ipa, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(ipa, write, instruction, translation)| VcpuExit::Abort {
                ipa,
                write,
                instruction,
                fault: if translation {
                    FaultKind::Translation
                } else {
                    FaultKind::Permission
                },
            }
        ),
        any::<u16>().prop_map(|imm| VcpuExit::Hvc { imm }),
        any::<u16>().prop_map(|imm| VcpuExit::Smc { imm, insn_len: 4 }),
        any::<bool>().prop_map(|wfe| VcpuExit::Wait { wfe, insn_len: 4 }),
        Just(VcpuExit::Interrupt),
        (
            0u8..4,
            0u8..8,
            0u8..16,
            0u8..16,
            0u8..8,
            0u8..=31,
            any::<bool>()
        )
            .prop_map(|(op0, op1, crn, crm, op2, reg, read)| VcpuExit::SysReg {
                encoding: (op0, op1, crn, crm, op2),
                reg,
                read,
                insn_len: 4
            }),
        any::<u64>().prop_map(|esr| VcpuExit::Unknown { esr }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever exits a guest causes, with whatever register values: the
    /// core never panics, the VM owns exactly what it maps, nothing it
    /// does reaches outside its RAM, and a stop gives every page back.
    #[test]
    fn a_hostile_guest_cannot_break_the_core(
        exits in proptest::collection::vec((any_exit(), any::<[u64; 4]>()), 1..200),
        gic_v2 in any::<bool>(),
    ) {
        let gic = if gic_v2 { GuestGic::V2 {
                gicv: PhysAddr::new(0x0804_0000),
            } } else { GuestGic::V3 };
        let (mut vm, mut cpu) = started_with(2, 0, gic);
        let mut ctx = enter(&mut vm, &mut cpu, 0);
        for (exit, regs) in exits {
            ctx.x[..4].copy_from_slice(&regs);
            let outcome = handle::after_exit(&mut vm, &mut cpu, 0, &mut ctx, exit, 0);
            let _ = vm.console.out.take();
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
            let pages = vm.memory.ram.as_ref().map_or(0, |r| r.mapped_pages());
            prop_assert!(cpu.host.frames.guest_pages(0) <= VM_RAM / PAGE_SIZE);
            prop_assert!(pages <= VM_RAM / PAGE_SIZE + 2);
            assert_check(&vm, &mut cpu);
        }
        // However it ended, the vCPU leaves and a stop frees everything.
        lifecycle::leave(&mut vm, &mut cpu, 0, true);
        if vm.state != VmState::Stopped {
            lifecycle::request_stop(&mut vm, &mut cpu).ok();
            // A vCPU 1 the guest started must leave too.
            if vm.vcpus.inside() > 0 {
                lifecycle::leave(&mut vm, &mut cpu, 1, true);
            }
        }
        prop_assert_eq!(vm.state, VmState::Stopped);
        prop_assert_eq!(cpu.host.frames.guest_pages(0), 0);
        prop_assert!(cpu.host.frames.check_invariants().is_ok());
        assert_check(&vm, &mut cpu);
    }
}

/// Without prealloc only what the loader wrote is backed; a first touch
/// backs its page and the rest of its aligned block (fault-around).
#[test]
fn ram_is_backed_on_first_touch() {
    let mut vm = Vm::new(0, spec_with(1, 0, VmMemory::default()), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    let loaded = cpu.host.frames.guest_pages(0);
    // The device tree's page, the kernel's two (its bytes, not its 1 MiB
    // footprint), the initrd's one.
    assert_eq!(loaded, 4, "pages backed at load");
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let ipa = layout::RAM_BASE + (6 << 20);
    let touch = first_touch(ipa, true);
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, touch), Outcome::Continue);
    assert_eq!(
        cpu.host.frames.guest_pages(0),
        loaded + handle::FAULT_AROUND_PAGES
    );
    // With the pool below its low watermark a fault backs its page alone.
    cpu.host.pool_low_below = u64::MAX;
    let far = first_touch(ipa + (1 << 20), true);
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, far), Outcome::Continue);
    assert_eq!(
        cpu.host.frames.guest_pages(0),
        loaded + handle::FAULT_AROUND_PAGES + 1
    );
    assert_check(&vm, &mut cpu);
}

/// A VM whose guaranteed memory the pool cannot hold is refused, saying by
/// how much, and takes nothing.
#[test]
fn a_guarantee_the_pool_cannot_hold_is_refused() {
    let memory = VmMemory {
        min: VM_RAM,
        ..VmMemory::default()
    };
    let mut vm = Vm::new(0, spec_with(1, 0, memory), GuestGic::V3);
    // 1024 pages of board, 2048 guaranteed.
    let mut cpu = FakeCpu::new(1024);
    let free = cpu.host.frames.free_pages();
    let e = lifecycle::start(&mut vm, &mut cpu).unwrap_err();
    assert!(e.contains("guaranteed memory cannot be backed"), "{e}");
    let said = lines(&mut vm).join("\n");
    assert!(
        said.contains("cannot guarantee its 8 MiB (memory min): 4 MiB short"),
        "{said}"
    );
    assert_eq!(vm.state, VmState::Stopped);
    assert_eq!(cpu.host.frames.free_pages(), free);
    assert_eq!(cpu.host.frames.reserved(), 0);
}

/// The retried `touch` waits again, and the console now says `why`.
fn still_waits_and_says(
    vm: &mut Vm,
    cpu: &mut FakeCpu,
    ctx: &mut GuestContext,
    touch: VcpuExit,
    why: &str,
) {
    assert_eq!(exit(vm, cpu, ctx, touch), Outcome::WaitMemory);
    let said = lines(vm).join("\n");
    assert!(said.contains(why), "{said}");
}

/// With the pool at its floor only the faulting vCPU waits: the fault is
/// retried, the console says so after a second, and once a frame is free
/// the access goes through.
#[test]
fn a_fault_with_the_pool_at_its_floor_waits_and_then_goes_through() {
    let mut vm = Vm::new(0, spec_with(1, 0, VmMemory::default()), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    let _ = lines(&mut vm);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    // Everything but 8 frames taken; the floor is 8.
    let mut hog = Vec::new();
    while cpu.host.frames.free_pages() > 8 {
        hog.push(cpu.host.frames.alloc(1, 1, FrameUse::Allocated).unwrap());
    }
    cpu.host.frames.set_guest_floor(8);
    let touch = first_touch(layout::RAM_BASE + (6 << 20), true);
    let pc = ctx.elr;
    assert_eq!(
        exit(&mut vm, &mut cpu, &mut ctx, touch),
        Outcome::WaitMemory
    );
    assert_eq!(ctx.elr, pc, "the access is retried");
    assert!(vm.managed.waiting());
    assert!(lines(&mut vm).is_empty(), "nothing said before a second");
    cpu.now_us += 1_200_000;
    still_waits_and_says(
        &mut vm,
        &mut cpu,
        &mut ctx,
        touch,
        "vCPU 0 waits for memory: the pool is at its min watermark",
    );
    assert!(manage::input(&mut vm).waiting, "the manager sees the wait");
    cpu.host
        .frames
        .free(hog.pop().unwrap(), 1, FrameUse::Allocated)
        .unwrap();
    cpu.now_us += 300_000;
    assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, touch), Outcome::Continue);
    let said = lines(&mut vm).join("\n");
    assert!(
        said.contains("vCPU 0 got memory after waiting 1500 ms"),
        "{said}"
    );
    assert!(!vm.managed.waiting());
    assert_eq!((vm.managed.waits_begun, vm.managed.waits_long), (1, 1));
    // `mm raw` counts it slow and keeps its length.
    assert_eq!(vm.managed.waits_slow, 1);
    assert_eq!(vm.managed.wait_longest_us, 1_500_000);
    let row = manage::row(&vm, crate::mm::manager::VmStats::default());
    let mut raw = String::new();
    manage::write_mm_raw(&mut raw, &manage::PoolView::default(), &[("vm", row)]).unwrap();
    assert!(
        raw.contains(" waits_slow=1 wait_longest_us=1500000 hungry=0"),
        "{raw}"
    );
    assert!(raw.contains(" policy=manager"), "{raw}");
}

/// What the manager reads of a VM and how its targets land: an input with
/// the VM's size, backed pages and fault-ins since the last look; a target
/// set quietly; nothing at all for a balloon the shell has taken over.
#[test]
fn the_manager_reads_a_vm_and_sets_its_target_quietly() {
    let mut vm = Vm::new(0, spec_with(1, 0, VmMemory::default()), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    let _ = lines(&mut vm);
    let first = manage::input(&mut vm);
    assert_eq!(first.size, VM_RAM / PAGE_SIZE);
    assert_eq!(first.backed, 4);
    assert!(!first.driver, "no driver has set DRIVER_OK yet");
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    for page in 0..3 {
        let touch = first_touch(layout::RAM_BASE + (6 << 20) + page * PAGE_SIZE, true);
        exit(&mut vm, &mut cpu, &mut ctx, touch);
    }
    // The first touch backs its block (fault-around); the next two pages
    // are in it and fault no more.
    let second = manage::input(&mut vm);
    let block = handle::FAULT_AROUND_PAGES;
    assert_eq!((second.backed, second.fault_ins), (4 + block, block));
    assert_eq!(manage::input(&mut vm).fault_ins, 0, "counted once");
    manage::apply(&mut vm, &mut cpu, 100);
    let device = vm.devices.balloon.as_ref().unwrap().device();
    assert_eq!(device.target(), 100);
    assert_eq!(
        vm.counters.change.map(|c| c.by),
        Some(balloon_ctl::SetBy::Manager)
    );
    assert!(
        lines(&mut vm).is_empty(),
        "no console line per manager move"
    );
    vm.managed.manual = true;
    assert_eq!(manage::input(&mut vm), Default::default());
    manage::apply(&mut vm, &mut cpu, 200);
    assert_eq!(
        vm.devices.balloon.as_ref().unwrap().device().target(),
        100,
        "left alone"
    );
}

/// `set` checks limits against each other and the VM's size; a min raised
/// above low takes low with it.
#[test]
fn set_limits_are_checked() {
    let (mut vm, mut cpu) = started_with(1, 0, GuestGic::V3);
    let pages = VM_RAM / PAGE_SIZE;
    let err = manage::set_limit(&mut vm, &mut cpu, manage::LimitField::Max, VM_RAM * 2);
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("above the VM's RAM size"));
    let err = manage::set_limit(&mut vm, &mut cpu, manage::LimitField::Max, 4097);
    assert!(err.unwrap_err().to_string().contains("multiple of 4K"));
    let l = manage::set_limit(&mut vm, &mut cpu, manage::LimitField::Max, VM_RAM / 2).unwrap();
    assert_eq!(l.max, pages / 2);
    let err = manage::set_limit(&mut vm, &mut cpu, manage::LimitField::Min, VM_RAM);
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("min is above memory max"));
    let err = manage::set_limit(&mut vm, &mut cpu, manage::LimitField::Weight, 0);
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("weight must be 1 to 10000"));
    assert_eq!(vm.managed.limits.max, pages / 2, "refusals change nothing");
    let l = manage::set_limit(&mut vm, &mut cpu, manage::LimitField::Min, VM_RAM / 4).unwrap();
    assert_eq!((l.min, l.low), (pages / 4, pages / 4));
}

/// One exit costing `cost` EL2 instructions (the PMU's count moves by that
/// between the guest leaving and the end of the exit's handling).
fn profiled(
    vm: &mut Vm,
    cpu: &mut FakeCpu,
    ctx: &mut GuestContext,
    exit: VcpuExit,
    cost: u32,
) -> Outcome {
    let before = cpu.instructions;
    cpu.instructions = before.wrapping_add(cost);
    handle::after_exit(vm, cpu, 0, ctx, exit, before)
}

/// `info exits`: each kind of exit lands in its own row of the VM's
/// profile — data aborts by device, stage-2 faults, bad accesses, system
/// registers, HVC, SMC, WFI, WFE, physical interrupts by source, unknown
/// traps — with the instructions the PMU counted for it; the table shows
/// them, `reset` and a restart start it over.
#[test]
fn exits_are_profiled_by_kind() {
    use super::exit_profile::{ExitProfile, KINDS};
    use crate::vgic::intid::{HYP_TIMER_PPI, KICK_SGI, MAINTENANCE_PPI, VTIMER_PPI};
    use crate::virtio::mmio::QUEUE_NOTIFY;

    let (mut vm, mut cpu) = started(1);
    assert_eq!(
        vm.counters.profile,
        ExitProfile::new(cpu.now_us),
        "reset at start"
    );
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    // Across the PMU counter's wrap: still the difference.
    cpu.instructions = u32::MAX - 10;
    let wfi = VcpuExit::Wait {
        wfe: false,
        insn_len: 4,
    };
    let gicr_ctlr = GuestAddr::new(layout::GICR_BASE.raw());
    let sgi1r = VcpuExit::SysReg {
        encoding: crate::vgic::ICC_SGI1R_EL1,
        reg: 1,
        read: false,
        insn_len: 4,
    };
    let ram_page = GuestAddr::new(layout::RAM_BASE.raw() + 0x10_0000);
    let ram_abort = |fault| VcpuExit::Abort {
        ipa: ram_page,
        write: true,
        instruction: false,
        fault,
    };
    // (exit, physical interrupts pending, the kind it must count as)
    let cases: Vec<(VcpuExit, Vec<u32>, ExitKind)> = vec![
        (load(UART_FR, 4), vec![], ExitKind::MmioUart),
        (load(layout::GICD_BASE, 4), vec![], ExitKind::MmioGicd),
        (load(gicr_ctlr, 4), vec![], ExitKind::MmioGicr),
        (load(layout::VIRTIO_BASE, 4), vec![], ExitKind::MmioVirtio),
        // A notify before the driver is live: remembered, nothing else.
        (
            store(layout::VIRTIO_BASE + QUEUE_NOTIFY, 4),
            vec![],
            ExitKind::VirtioNotify,
        ),
        // Neither RAM nor a device: an abort injected.
        (
            load(GuestAddr::new(0x0c00_0000), 4),
            vec![],
            ExitKind::BadAccess,
        ),
        (
            ram_abort(FaultKind::Permission),
            vec![],
            ExitKind::BadAccess,
        ),
        (
            ram_abort(FaultKind::Translation),
            vec![],
            ExitKind::Stage2Fault,
        ),
        // A store with a syndrome to RAM is a fault to back too.
        (store(ram_page, 8), vec![], ExitKind::Stage2Fault),
        (sgi1r, vec![], ExitKind::SysReg),
        (VcpuExit::Hvc { imm: 0 }, vec![], ExitKind::Hvc),
        (
            VcpuExit::Smc {
                imm: 0,
                insn_len: 4,
            },
            vec![],
            ExitKind::Smc,
        ),
        (wfi, vec![], ExitKind::Wfi),
        (
            VcpuExit::Wait {
                wfe: true,
                insn_len: 4,
            },
            vec![],
            ExitKind::Wfe,
        ),
        (VcpuExit::Interrupt, vec![KICK_SGI], ExitKind::IrqKick),
        (
            VcpuExit::Interrupt,
            vec![MAINTENANCE_PPI],
            ExitKind::IrqMaintenance,
        ),
        // The first interrupt taken names the exit.
        (
            VcpuExit::Interrupt,
            vec![VTIMER_PPI, KICK_SGI],
            ExitKind::VTimer,
        ),
        (VcpuExit::Interrupt, vec![HYP_TIMER_PPI], ExitKind::El2Timer),
        (VcpuExit::Interrupt, vec![40], ExitKind::IrqOther),
        // Nothing pending any more by the time it is acknowledged.
        (VcpuExit::Interrupt, vec![], ExitKind::IrqOther),
        (
            VcpuExit::Unknown { esr: 0x3f << 26 },
            vec![],
            ExitKind::Other,
        ),
    ];
    let mut want = [(0u64, 0u64); KINDS];
    for (i, (exit, irqs, kind)) in cases.into_iter().enumerate() {
        ctx.x[0] = smccc::psci::PSCI_VERSION.into();
        ctx.x[1] = 0;
        cpu.pending_irqs = irqs;
        let cost = 100 * (i as u32 + 1);
        let outcome = profiled(&mut vm, &mut cpu, &mut ctx, exit, cost);
        assert!(
            !matches!(outcome, Outcome::Stop(_)),
            "{exit:?}: {outcome:?}"
        );
        want[kind as usize].0 += 1;
        want[kind as usize].1 += u64::from(cost);
        let got = vm.counters.profile.get(kind);
        assert_eq!(
            (got.count, got.instructions),
            want[kind as usize],
            "{exit:?} counts as {kind:?}"
        );
    }
    for kind in ExitKind::ALL {
        let got = vm.counters.profile.get(kind);
        assert_eq!(
            (got.count, got.instructions),
            want[kind as usize],
            "{kind:?}"
        );
        assert!(got.count > 0, "{kind:?} is reachable");
    }
    let total = vm.counters.profile.total();
    // 21 exits costing 100, 200, ... 2100.
    assert_eq!((total.count, total.instructions), (21, 23_100));

    // The table, 2 s after the start.
    let mut text = String::new();
    vm.counters
        .profile
        .write_table("guest", cpu.now_us + 2_000_000, true, &mut text)
        .unwrap();
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows[0], "guest: 21 exits in 2.000 s");
    assert_eq!(rows.len(), 2 + KINDS + 1);
    let row = |label: &str| {
        *rows
            .iter()
            .find(|r| r.split_whitespace().next() == Some(label))
            .unwrap_or_else(|| panic!("no {label} row in\n{text}"))
    };
    // Stage-2 faults: exits 8 and 9, 800 + 900 instructions.
    assert_eq!(
        row("stage2-fault"),
        "  stage2-fault          2   9.5%       1.0           1700        850"
    );
    assert_eq!(
        row("irq-other"),
        "  irq-other             2   9.5%       1.0           3900       1950"
    );
    assert_eq!(
        row("total"),
        "  total                21 100.0%      10.5          23100       1100"
    );
    // `info balloon` sums them up the old way.
    let mut info = String::new();
    super::balloon_info::write_info(&vm, cpu.now_us, &mut info).unwrap();
    assert!(
        info.contains(
            "  exits: 21 (5 MMIO, 2 HVC/SMC, 2 WFI/WFE, 4 faults), 1100 EL2 instructions each on average"
        ),
        "{info}"
    );

    // `info exits <vm> reset`.
    cpu.now_us += 5_000_000;
    vm.counters.profile.reset(cpu.now_us);
    assert_eq!(vm.counters.profile.total().count, 0);
    profiled(&mut vm, &mut cpu, &mut ctx, wfi, 7);
    assert_eq!(vm.counters.profile.get(ExitKind::Wfi).instructions, 7);

    // A guest reset: the new run is profiled from its start.
    ctx.x[0] = smccc::psci::PSCI_SYSTEM_RESET.into();
    cpu.now_us += 1_000_000;
    assert_eq!(
        profiled(&mut vm, &mut cpu, &mut ctx, VcpuExit::Hvc { imm: 0 }, 1),
        Outcome::Reset
    );
    lifecycle::begin_stop(&mut vm, &mut cpu, "reset", true);
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(vm.state, VmState::Running);
    assert_eq!(vm.counters.profile, ExitProfile::new(cpu.now_us));

    // A stop: the rates are up to it.
    lifecycle::begin_stop(&mut vm, &mut cpu, "test", false);
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(vm.state, VmState::Stopped);
    let stopped_at = cpu.now_us;
    assert_eq!(vm.counters.profile.elapsed_us(stopped_at + 9_000_000), 0);
    let mut text = String::new();
    vm.counters
        .profile
        .write_table("guest", stopped_at + 9_000_000, true, &mut text)
        .unwrap();
    assert!(text.starts_with("guest: 0 exits in 0.000 s (until the VM stopped)\n"));
}

/// A VM with a live balloon driver on vCPU 0, for the notify fast path.
struct Live {
    vm: Vm,
    cpu: FakeCpu,
    ctx: GuestContext,
    inflate: DriverQueue,
    /// The terminal the vCPU loop prints to, and what it wrote since the
    /// last look ([`Live::observed`]).
    terminal: Terminal,
    screen: String,
}

impl Live {
    /// Where the driver's rings are.
    const RINGS: u64 = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;

    fn new() -> Self {
        Self::with(1, GuestGic::V3)
    }

    /// A VM of `vcpus` vCPUs with a `gic`, vCPU 0 running.
    fn with(vcpus: u32, gic: GuestGic) -> Self {
        let (mut vm, mut cpu) = started_with(vcpus, 0, gic);
        let mut ctx = enter(&mut vm, &mut cpu, 0);
        let (inflate, _) = driver_live(&mut vm, &mut cpu, &mut ctx, Self::RINGS);
        // The vCPU loop prints what an exit said once it is handled.
        lines(&mut vm);
        Live {
            vm,
            cpu,
            ctx,
            inflate,
            terminal: Terminal::new(),
            screen: String::new(),
        }
    }

    /// One exit costing 100 instructions, as the vCPU loop handles it: the
    /// fast path first when `fast`, the full path if it declines. Whether
    /// the fast path took it.
    fn exit(&mut self, exit: VcpuExit, fast: bool) -> bool {
        let before = self.cpu.instructions;
        self.cpu.instructions = before.wrapping_add(100);
        if fast {
            let taken =
                handle::fast_exit(&mut self.vm, &mut self.cpu, 0, &mut self.ctx, &exit, before);
            if let Some(fast) = taken {
                assert_eq!(fast.recorded, self.cpu.instructions, "recorded up to now");
                let outbox = !self.vm.console.out.is_empty();
                assert_eq!(outbox, fast.shown == Shown::Outbox, "says what it left");
                let echo = self.vm.console.echo.take();
                assert_eq!(
                    echo.is_some(),
                    fast.shown == Shown::Live,
                    "says what it left"
                );
                if let Some(echo) = echo {
                    // Shown as the vCPU loop shows it (`run::show_live`).
                    let name = self.vm.name.clone();
                    self.terminal
                        .guest_live(&mut self.screen, 0, &name, echo.output(), true);
                }
                self.print();
                return true;
            }
        }
        let outcome =
            handle::after_exit(&mut self.vm, &mut self.cpu, 0, &mut self.ctx, exit, before);
        assert_eq!(outcome, Outcome::Continue);
        self.print();
        false
    }

    /// What the vCPU loop does after an exit once the lock is released:
    /// print the outbox (`run::show`; here to `screen`).
    fn print(&mut self) {
        let (notices, dropped) = self.vm.console.out.take();
        assert_eq!(dropped, 0);
        let name = self.vm.name.clone();
        for notice in notices.iter() {
            match (notice, notice.live()) {
                (Notice::Line(line), _) => {
                    self.terminal
                        .lines(&mut self.screen, format_args!("{line}\n"));
                }
                (_, Some(output)) => {
                    self.terminal
                        .guest_live(&mut self.screen, 0, &name, output, true)
                }
                (_, None) => unreachable!("every other notice is live output"),
            }
        }
    }

    /// A `width`-byte store of `value` (in x1) at `ipa`.
    fn store(&mut self, ipa: GuestAddr, width: u8, value: u64, fast: bool) -> bool {
        self.ctx.x[1] = value;
        self.exit(store(ipa, width), fast)
    }

    /// The fast path alone on a notify of queue 0 (x1 is left as it is).
    fn try_fast_notify(&mut self) -> Option<u32> {
        let exit = store(layout::VIRTIO_BASE + mmio::QUEUE_NOTIFY, 4);
        handle::fast_exit(&mut self.vm, &mut self.cpu, 0, &mut self.ctx, &exit, 0)
            .map(|fast| fast.recorded)
    }

    fn notify(&mut self, queue: u64, fast: bool) -> bool {
        self.store(layout::VIRTIO_BASE + mmio::QUEUE_NOTIFY, 4, queue, fast)
    }

    /// The driver queues one page (3 MiB into RAM) on the inflate queue and
    /// notifies.
    fn inflate_one(&mut self, fast: bool) -> bool {
        let pfn = (layout::RAM_BASE + (3 << 20)).pfn().raw() as u32;
        let array = Self::RINGS + 0x8000;
        let mut stores = GuestStores {
            vm: &mut self.vm,
            cpu: &mut self.cpu,
        };
        stores.poke(array, &pfn.to_le_bytes());
        self.inflate.add(&mut stores, &[(array, 4, false)]);
        self.notify(0, fast)
    }

    /// What the exits did, as far as anything outside can tell.
    fn observed(&mut self) -> String {
        self.print();
        let lines = core::mem::take(&mut self.screen);
        // SGIs: what the distributor counted, and vCPU 1's pending ones.
        let sgis = self.vm.devices.vgic.as_mut().map(|g| {
            let pending = (0..4)
                .map(|i| g.read(1, crate::vgic::GICD_SPENDSGIR + 4 * i, 4))
                .collect::<Vec<_>>();
            (*g.counters(), pending)
        });
        let vm = &self.vm;
        let b = vm.devices.balloon.as_ref().expect("balloon");
        let queues: Vec<_> = b
            .queues()
            .iter()
            .map(|q| (q.ready(), q.last_avail_idx(), q.used_idx(), q.in_flight()))
            .collect();
        let counts = ExitKind::ALL.map(|k| vm.counters.profile.get(k).count);
        let uart = (
            vm.devices.uart.counters(),
            vm.devices.uart.irq_level(),
            vm.devices
                .vgic
                .as_ref()
                .map(|g| g.spi_line(irq::UART_INTID)),
            vm.console.input.len(),
            vm.devices.uart_mirror.is_mapped(),
            vm.devices.uart_mirror.stats,
        );
        format!(
            "{:?} {:?} {:#x} {:#x} {queues:?} {:?} {uart:?} pc={:#x} x={:?} spsr={:#x} pool={} mapped={:?} kicks={:?} injected={:?} exits={counts:?} sgis={sgis:?} lines={:?}",
            b.stats(),
            b.device().stats(),
            b.status(),
            b.interrupt_status(),
            vm.devices.vgic.as_ref().map(|g| g.spi_line(irq::VIRTIO_INTID)),
            self.ctx.elr,
            self.ctx.x,
            self.ctx.spsr,
            self.cpu.host.frames.free_pages(),
            vm.memory.ram.as_ref().map(|r| r.mapped_pages()),
            self.cpu.kicks,
            self.cpu.injected,
            lines,
        )
    }
}

/// Two [`Live`] VMs given the same exits, one through the fast path as the
/// vCPU loop tries it, one always the full way.
struct Twins([Live; 2]);

impl Twins {
    fn new() -> Self {
        Twins([Live::new(), Live::new()])
    }

    fn with(vcpus: u32, gic: GuestGic) -> Self {
        Twins([Live::with(vcpus, gic), Live::with(vcpus, gic)])
    }

    /// `f` on both: whether the fast path took it is `expect`, and the
    /// effects are the same.
    fn step(&mut self, what: &str, expect: bool, f: &mut dyn FnMut(&mut Live, bool) -> bool) {
        let [fast, full] = &mut self.0;
        assert_eq!(f(fast, true), expect, "{what}: fast path taken");
        assert!(!f(full, false));
        assert_eq!(fast.observed(), full.observed(), "{what}");
    }
}

/// Linux's setup of its UART, which goes the full way: FIFOs and the
/// receive interrupts on.
fn linux_uart_setup(step: &mut impl FnMut(&str, bool, &mut dyn FnMut(&mut Live, bool) -> bool)) {
    let at = |offset: u64| layout::UART_BASE + offset;
    step("LCR_H", false, &mut |l, f| {
        l.store(at(pl011::UARTLCR_H), 2, 0x70, f)
    });
    step("IMSC", false, &mut |l, f| {
        l.store(at(pl011::UARTIMSC), 2, 0x50, f)
    });
    step("CR", false, &mut |l, f| {
        l.store(at(pl011::UARTCR), 2, 0x301, f)
    });
}

/// The notify fast path takes exactly the notifies with nothing to do, and
/// leaves the VM as the full path would: two VMs get the same exits, one
/// through the fast path as the vCPU loop tries it, one always the full
/// way, and look the same after each. Everything that must go the full
/// way does.
#[test]
fn an_empty_notify_goes_the_fast_way_with_the_full_paths_effects() {
    let mut twins = Twins::new();
    let notify_ipa = layout::VIRTIO_BASE + mmio::QUEUE_NOTIFY;
    let mut step = |what: &str, expect: bool, f: &mut dyn FnMut(&mut Live, bool) -> bool| {
        twins.step(what, expect, f)
    };
    step("empty inflateq", true, &mut |l, f| l.notify(0, f));
    step("empty deflateq", true, &mut |l, f| l.notify(1, f));
    step("no such queue", false, &mut |l, f| l.notify(7, f));
    // A 32-bit store writes the register's low half only.
    step("upper bits", true, &mut |l, f| l.notify(1 << 32, f));
    step("2-byte store", false, &mut |l, f| {
        l.store(notify_ipa, 2, 0, f)
    });
    step("8-byte store", false, &mut |l, f| {
        l.store(notify_ipa, 8, 0, f)
    });
    step("another register", false, &mut |l, f| {
        l.store(notify_ipa + 4, 4, 0, f)
    });
    step("the UART", false, &mut |l, f| l.store(UART_FR, 4, 0x41, f));
    step("a load", false, &mut |l, f| l.exit(load(notify_ipa, 4), f));
    // A PFN queued: the full path inflates it and raises the interrupt.
    step("an inflate queued", false, &mut |l, f| l.inflate_one(f));
    step("empty, interrupt up", true, &mut |l, f| {
        assert!(l
            .vm
            .devices
            .balloon
            .as_ref()
            .is_some_and(|b| b.interrupt_pending()));
        l.notify(0, f)
    });
    step("interrupt acked", false, &mut |l, f| {
        l.store(layout::VIRTIO_BASE + mmio::INTERRUPT_ACK, 4, 1, f)
    });
    step("empty, interrupt down", true, &mut |l, f| l.notify(0, f));
    // The vGIC's line not what the device says: the full path fixes it.
    step("line out of step", false, &mut |l, f| {
        let vgic = l.vm.devices.vgic.as_mut().expect("vGIC");
        vgic.set_level(irq::VIRTIO_INTID, true).expect("an SPI");
        l.notify(0, f)
    });
    // Console text waiting: the full path's caller prints it.
    step("outbox", false, &mut |l, f| {
        l.vm.console.out.line(format_args!("waiting"));
        let taken = l.notify(0, f);
        let _ = l.vm.console.out.take();
        taken
    });
    // A balloon change being measured counts its exits.
    step("a change", false, &mut |l, f| {
        balloon_ctl::set_target(&mut l.vm, &mut l.cpu, 16).expect("target set");
        l.notify(0, f)
    });
    step("change over", false, &mut |l, f| {
        balloon_ctl::set_target(&mut l.vm, &mut l.cpu, 1).expect("target set");
        l.store(layout::VIRTIO_BASE + mmio::CONFIG + 4, 4, 1, f)
    });
    step("again", true, &mut |l, f| {
        assert!(l.vm.counters.change.is_none());
        l.notify(1, f)
    });
    // A ring page without a frame: the fast path never backs it.
    step("ring page unmapped", false, &mut |l, f| {
        let ring = GuestAddr::new(l.inflate.avail);
        let ram = l.vm.memory.ram.as_mut().expect("RAM");
        assert_eq!(ram.release(&mut l.cpu.host, &[ring.pfn()]), 1);
        if f {
            let mapped = ram.mapped_pages();
            l.ctx.x[1] = 0;
            let taken = l.try_fast_notify();
            assert!(taken.is_none());
            assert_eq!(
                l.vm.memory.ram.as_ref().expect("RAM").mapped_pages(),
                mapped
            );
        }
        l.notify(0, false)
    });
    // A stop asked for: the vCPU loop must see it.
    let mut live = Live::new();
    assert!(live.notify(0, true));
    lifecycle::request_stop(&mut live.vm, &mut live.cpu).expect("running");
    let taken = live.try_fast_notify();
    assert!(taken.is_none());
    // `debug fail` armed: the full path fails.
    let mut live = Live::new();
    live.vm.inject_failure = Some(InjectedFailure::Panic);
    let taken = live.try_fast_notify();
    assert!(taken.is_none());
}

/// The UART fast path takes exactly the loads that change nothing but the
/// guest's register (the flag register polled before each byte sent, above
/// all), and leaves the VM as the full path would: the same twins as for
/// the notify fast path.
#[test]
fn a_quiet_uart_read_goes_the_fast_way_with_the_full_paths_effects() {
    let mut twins = Twins::new();
    let mut step = |what: &str, expect: bool, f: &mut dyn FnMut(&mut Live, bool) -> bool| {
        twins.step(what, expect, f)
    };
    let at = |offset: u64| layout::UART_BASE + offset;
    // Linux's setup, as the full path sees it: FIFOs and the receive
    // interrupts on.
    linux_uart_setup(&mut step);
    for width in [2, 4] {
        step("FR", true, &mut |l, f| l.exit(load(UART_FR, width), f));
    }
    step("FR, a byte", true, &mut |l, f| l.exit(load(UART_FR, 1), f));
    step("IMSC read", true, &mut |l, f| {
        l.exit(load(at(pl011::UARTIMSC), 2), f)
    });
    step("MIS read", true, &mut |l, f| {
        l.exit(load(at(pl011::UARTMIS), 2), f)
    });
    step("no register", true, &mut |l, f| {
        l.exit(load(at(0x800), 4), f)
    });
    step("misaligned", true, &mut |l, f| l.exit(load(at(0x19), 2), f));
    step("a store to FR", false, &mut |l, f| {
        l.store(UART_FR, 2, 0, f)
    });
    step("DR, empty", true, &mut |l, f| l.exit(load(UART_DR, 2), f));
    step("DR's upper byte", true, &mut |l, f| {
        l.exit(load(at(1), 1), f)
    });
    step("a byte sent", true, &mut |l, f| {
        l.store(UART_DR, 2, 0x41, f)
    });
    // Input typed: the console raised the interrupt with it; FR shows the
    // bytes without a change.
    step("FR with input", true, &mut |l, f| {
        assert_eq!(irq::console_input_bytes(&mut l.vm, &mut l.cpu, b"hi"), 2);
        assert!(l.vm.devices.uart.irq_level());
        l.exit(load(UART_FR, 2), f)
    });
    // A byte read with another behind it: the receive timeout stays up.
    step("DR with input", true, &mut |l, f| {
        l.exit(load(UART_DR, 2), f)
    });
    step("DR, the last byte", false, &mut |l, f| {
        l.exit(load(UART_DR, 2), f)
    });
    // More input than the FIFO holds waits behind it: the full path feeds
    // the FIFO after each read.
    step("input queued", false, &mut |l, f| {
        let many = [b'x'; 40];
        assert_eq!(irq::console_input_bytes(&mut l.vm, &mut l.cpu, &many), 40);
        assert!(!l.vm.console.input.is_empty());
        l.exit(load(UART_FR, 2), f)
    });
    step("FR, input queued", false, &mut |l, f| {
        l.exit(load(UART_FR, 2), f)
    });
    // The vGIC's line not what the UART says: the full path fixes it.
    step("line out of step", false, &mut |l, f| {
        let level = l.vm.devices.uart.irq_level();
        let vgic = l.vm.devices.vgic.as_mut().expect("vGIC");
        vgic.set_level(irq::UART_INTID, !level).expect("an SPI");
        l.exit(load(UART_FR, 2), f)
    });
    // Console text waiting: the full path's caller prints it.
    step("outbox", false, &mut |l, f| {
        l.vm.console.out.line(format_args!("waiting"));
        let taken = l.exit(load(UART_FR, 2), f);
        let _ = l.vm.console.out.take();
        taken
    });
    // A balloon change being measured counts its exits.
    step("a change", false, &mut |l, f| {
        balloon_ctl::set_target(&mut l.vm, &mut l.cpu, 16).expect("target set");
        l.exit(load(UART_FR, 2), f)
    });
    // A stop asked for: the vCPU loop must see it.
    let mut live = Live::new();
    lifecycle::request_stop(&mut live.vm, &mut live.cpu).expect("running");
    let exit = load(UART_FR, 2);
    let taken = handle::fast_exit(&mut live.vm, &mut live.cpu, 0, &mut live.ctx, &exit, 0);
    assert!(taken.is_none());
}

/// A byte the guest sends goes the fast way while the UART's line stays
/// where it is, and shows on the console as the full path shows it: two
/// VMs get the same exits, one through the fast path as the vCPU loop
/// tries it, one always the full way.
#[test]
fn a_sent_byte_goes_the_fast_way_with_the_full_paths_effects() {
    let mut twins = Twins::new();
    let mut step = |what: &str, expect: bool, f: &mut dyn FnMut(&mut Live, bool) -> bool| {
        twins.step(what, expect, f)
    };
    let at = |offset: u64| layout::UART_BASE + offset;
    let send = |text: &[u8], width: u8| {
        let text = text.to_vec();
        // Every byte is sent; whether all went the fast way.
        move |l: &mut Live, f: bool| {
            text.iter().fold(true, |all, &b| {
                let taken = l.store(UART_DR, width, b.into(), f);
                all && taken
            })
        }
    };
    // Out of reset, and with Linux's setup (receive interrupts only).
    step("a byte before setup", true, &mut send(b"e", 1));
    linux_uart_setup(&mut step);
    step("a line", true, &mut send(b"hello\r\n", 2));
    step("a word", true, &mut send(b"w\n", 4));
    step("a doubleword (refused by the model)", true, &mut |l, f| {
        l.store(UART_DR, 8, 0x41, f)
    });
    step("DR's upper byte", false, &mut |l, f| {
        l.store(at(1), 1, 0x41, f)
    });
    // The console has the keyboard: every byte shows at once.
    step("live", true, &mut |l, f| {
        l.vm.console.focused = true;
        send(b"$ ls\x08\x1b[K\r\n", 2)(l, f)
    });
    // A line longer than a console line is kept: an echo carries each
    // byte's character, and the full one ends the line.
    let mut long = vec![b'x'; super::console_line::LINE_MAX + 8];
    long.extend_from_slice(b"\r\n");
    step("a long live line", true, &mut send(&long, 2));
    // Through the mirror page: a store that found it read-only, placed at
    // its address's offset in the PL011's page (whatever the VA).
    step("a byte through the mirror page", true, &mut |l, f| {
        l.ctx.x[1] = 0x47;
        let exit = VcpuExit::ReadOnlyStore {
            far: 0xffff_8000_1234_5000,
            width: 2,
            reg: 1,
            insn_len: 4,
        };
        l.exit(exit, f)
    });
    // TXIM on with TXRIS raised: the line is up and a byte keeps it up.
    step("TXIM", false, &mut |l, f| {
        l.store(at(pl011::UARTIMSC), 2, 0x70, f)
    });
    step("a byte, line up", true, &mut |l, f| {
        assert!(l.vm.devices.uart.irq_level());
        l.store(UART_DR, 2, 0x42, f)
    });
    // TXRIS cleared: the next byte raises the line, which the full path does.
    step("ICR", false, &mut |l, f| {
        l.store(at(pl011::UARTICR), 2, 0x20, f)
    });
    step("a byte raising the line", false, &mut |l, f| {
        assert!(!l.vm.devices.uart.irq_level());
        l.store(UART_DR, 2, 0x43, f)
    });
    step("IMSC back", false, &mut |l, f| {
        l.store(at(pl011::UARTIMSC), 2, 0x50, f)
    });
    step("line out of step", false, &mut |l, f| {
        let level = l.vm.devices.uart.irq_level();
        let vgic = l.vm.devices.vgic.as_mut().expect("vGIC");
        vgic.set_level(irq::UART_INTID, !level).expect("an SPI");
        l.store(UART_DR, 2, 0x44, f)
    });
    step("outbox", false, &mut |l, f| {
        l.vm.console.out.line(format_args!("waiting"));
        l.store(UART_DR, 2, 0x45, f)
    });
    step("a change", false, &mut |l, f| {
        balloon_ctl::set_target(&mut l.vm, &mut l.cpu, 16).expect("target set");
        l.store(UART_DR, 2, 0x46, f)
    });
}

/// An SGI sent to other vCPUs through a GICv2's GICD_SGIR goes the fast way
/// with the full path's effects (the SGI pending, the target's CPU kicked,
/// the exit recorded); one that reaches the sender itself, the reserved
/// filter, another width, a VM with text waiting and a GICv3's
/// distributor go the full way.
#[test]
fn an_sgi_to_other_vcpus_goes_the_fast_way_with_the_full_paths_effects() {
    let sgir = layout::GICD_BASE + crate::vgic::GICD_SGIR;
    let send = |value: u64| move |l: &mut Live, f: bool| l.store(sgir, 4, value, f);
    let v2 = GuestGic::V2 {
        gicv: PhysAddr::new(0x0804_0000),
    };
    let mut twins = Twins::with(2, v2);
    let mut step = |what: &str, expect: bool, f: &mut dyn FnMut(&mut Live, bool) -> bool| {
        twins.step(what, expect, f)
    };
    step("distributor on", false, &mut |l, f| {
        l.store(layout::GICD_BASE, 4, 1, f)
    });
    step("to vCPU 1 while it is off", true, &mut send(0b10 << 16 | 3));
    step("CPU_ON", false, &mut |l, f| {
        l.ctx.x[..4].copy_from_slice(&[
            smccc::psci::PSCI_CPU_ON_64.into(),
            1,
            layout::RAM_BASE.raw(),
            0,
        ]);
        l.exit(VcpuExit::Hvc { imm: 0 }, f)
    });
    step("to vCPU 1", true, &mut send(0b10 << 16 | 3));
    step("the same again", true, &mut send(0b10 << 16 | 3));
    step("to all but itself", true, &mut send(1 << 24 | 5));
    step("to a list without vCPUs", true, &mut send(0b1100 << 16 | 5));
    step("to itself", false, &mut send(2 << 24 | 6));
    step("to a list with itself", false, &mut send(0b11 << 16 | 7));
    step("reserved filter", false, &mut send(3 << 24 | 1));
    step("a halfword", false, &mut |l, f| l.store(sgir, 2, 1, f));
    step("outbox", false, &mut |l, f| {
        l.vm.console.out.line(format_args!("waiting"));
        send(0b10 << 16 | 2)(l, f)
    });
    let [fast, _] = &twins.0;
    assert!(fast.cpu.kicks.len() >= 2, "vCPU 1's CPU was kicked");
    let mut v3 = Twins::with(2, GuestGic::V3);
    v3.step("GICv3", false, &mut send(0b10 << 16 | 3));
}

/// The fast path's exits are in the profile: one `virtio-notify` each,
/// with every instruction since the previous record.
#[test]
fn fast_notifies_are_profiled() {
    let mut live = Live::new();
    let before = live.vm.counters.profile.get(ExitKind::VirtioNotify);
    let mut at = 1000u32;
    for _ in 0..3 {
        live.cpu.instructions = at.wrapping_add(250);
        let exit = store(layout::VIRTIO_BASE + mmio::QUEUE_NOTIFY, 4);
        live.ctx.x[1] = 0;
        at = handle::fast_exit(&mut live.vm, &mut live.cpu, 1, &mut live.ctx, &exit, at)
            .expect("taken")
            .recorded;
    }
    let after = live.vm.counters.profile.get(ExitKind::VirtioNotify);
    assert_eq!(after.count, before.count + 3);
    assert_eq!(after.instructions, before.instructions + 750);
}

/// The race that left Linux guests' balloons deaf under the memory manager
/// (overcommit test, phase 3): the guest's handler reads InterruptStatus,
/// a new bit is raised before its ACK (a target set from another CPU), and
/// the ACK leaves that bit set with the line still high. With the SPI
/// configured edge-triggered, as the device tree says, no rising edge
/// follows and, before the fix, the interrupt was never delivered again;
/// level-configured, the line keeps it pending.
#[test]
fn a_bit_raised_before_the_guests_ack_is_delivered_edge_or_level() {
    for edge in [true, false] {
        let mut l = Live::new();
        let intid = irq::VIRTIO_INTID;
        // The guest enables its distributor and the device's SPI, group 1,
        // configured as the device tree says (or as level).
        l.store(layout::GICD_BASE, 4, 0b11, false);
        let (word, bit) = (u64::from(intid / 32) * 4, 1u64 << (intid % 32));
        l.store(layout::GICD_BASE + 0x100 + word, 4, bit, false);
        l.store(layout::GICD_BASE + 0x80 + word, 4, bit, false);
        let cfg = layout::GICD_BASE + 0xc00 + u64::from(intid / 16) * 4;
        let edge_bit = u64::from(edge) << (2 * (intid % 16) + 1);
        l.store(cfg, 4, edge_bit, false);
        let vgic = l.vm.devices.vgic.as_ref().expect("vGIC");
        assert_eq!(vgic.spi_is_edge(intid), Some(edge));

        // A page inflated: the used-buffer interrupt, listed.
        l.inflate_one(false);
        irq::sync_list_registers(&mut l.vm, &mut l.cpu, 0);
        assert_eq!(l.cpu.read_lr(0).intid, intid, "edge={edge}: listed");

        // The handler reads the status; a target is set before its ACK.
        l.exit(load(layout::VIRTIO_BASE + mmio::INTERRUPT_STATUS, 4), false);
        assert_eq!(l.ctx.x[2], u64::from(mmio::INT_USED_BUFFER));
        balloon_ctl::set_target(&mut l.vm, &mut l.cpu, 16).expect("target set");
        l.store(
            layout::VIRTIO_BASE + mmio::INTERRUPT_ACK,
            4,
            u64::from(mmio::INT_USED_BUFFER),
            false,
        );
        let b = l.vm.devices.balloon.as_ref().expect("balloon");
        assert_eq!(b.interrupt_status(), mmio::INT_CONFIG_CHANGE);
        // `info balloon` shows where the interrupt stands.
        let mut info = String::new();
        super::balloon_info::write_info(&l.vm, 0, &mut info).unwrap();
        assert!(
            info.contains(
                "  interrupt: status 0x2, line high, pending in the vGIC yes, in a list register yes\n"
            ),
            "{info}"
        );
        assert!(
            info.contains("  queues: 0: next avail 1, used 1, 0 in flight; 1: next avail 0"),
            "{info}"
        );

        // The guest completes the first interrupt: the config change is
        // listed next.
        l.cpu.lrs[0] = 0;
        irq::sync_list_registers(&mut l.vm, &mut l.cpu, 0);
        let vgic = l.vm.devices.vgic.as_ref().expect("vGIC");
        assert!(vgic.is_pending(0, intid) || l.vm.vcpus.listed(0).unwrap().contains(&Some(intid)));
        assert_eq!(
            l.vm.vcpus.listed(0).unwrap()[0],
            Some(intid),
            "edge={edge}: the config change is delivered"
        );
        assert_eq!(l.cpu.read_lr(0).intid, intid);
    }
}

/// Short of memory, the manager asks a balloon for fresh statistics when
/// its sample is missing or older than `STATS_FRESH_US`; never for a VM it
/// leaves alone.
#[test]
fn the_manager_asks_for_fresh_statistics_when_short() {
    let mut vm = Vm::new(0, spec_with(1, 0, VmMemory::default()), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    assert!(manage::want_fresh_stats(&mut vm, 0), "no sample yet");
    let balloon = vm.devices.balloon.as_mut().unwrap();
    balloon.device_mut().set_stats_sample_for_test(1_000_000);
    assert!(!manage::want_fresh_stats(&mut vm, 1_200_000), "fresh");
    assert!(manage::want_fresh_stats(
        &mut vm,
        1_000_001 + manage::STATS_FRESH_US
    ));
    vm.managed.manual = true;
    assert!(!manage::want_fresh_stats(&mut vm, 9_000_000), "left alone");
}

/// A VM is never backed above its `max`: a fault past it waits (its
/// balloon must make room; the board is not exhausted), the console says
/// so after a second, and past the bound the VM stops, its frames back.
#[test]
fn a_vm_is_never_backed_above_its_max() {
    let memory = VmMemory {
        max: VM_RAM - (2 << 20),
        ..VmMemory::default()
    };
    let mut vm = Vm::new(0, spec_with(1, 0, memory), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    let _ = lines(&mut vm);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let max = vm.managed.limits.max;
    let mut page = 0;
    while vm.memory.ram.as_ref().unwrap().mapped_pages() < max {
        let touch = first_touch(layout::RAM_BASE + page * PAGE_SIZE, true);
        assert_eq!(exit(&mut vm, &mut cpu, &mut ctx, touch), Outcome::Continue);
        page += 1;
    }
    assert_eq!(
        vm.memory.ram.as_ref().unwrap().mapped_pages(),
        max,
        "fault-around stops at max"
    );
    let touch = first_touch(layout::RAM_BASE + (VM_RAM - PAGE_SIZE), true);
    assert_eq!(
        exit(&mut vm, &mut cpu, &mut ctx, touch),
        Outcome::WaitMemory
    );
    assert!(!vm.managed.waiting(), "not a wait for the pool");
    assert_eq!(manage::longest_wait_us(&vm, cpu.now_us), None);
    cpu.now_us += manage::WAIT_ANNOUNCE_US;
    still_waits_and_says(
        &mut vm,
        &mut cpu,
        &mut ctx,
        touch,
        "vCPU 0 waits for memory: the VM has its memory max",
    );
    cpu.now_us += manage::WAIT_BOUND_US;
    let Outcome::Stop(why) = exit(&mut vm, &mut cpu, &mut ctx, touch) else {
        panic!("not stopped past the bound");
    };
    assert!(why.contains("more than its memory max"), "{why}");
    lifecycle::begin_stop(&mut vm, &mut cpu, why, false);
    lifecycle::leave(&mut vm, &mut cpu, 0, true);
    assert_eq!(vm.state, VmState::Stopped);
    assert_eq!(cpu.host.frames.guest_pages(0), 0);
}

/// A VM stopped while a vCPU waited for a frame leaves no wait behind:
/// the board's escalation counts only running VMs' waits.
#[test]
fn a_stopped_vm_leaves_no_wait_behind() {
    let mut vm = Vm::new(0, spec_with(1, 0, VmMemory::default()), GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    manage::frame_wait(&mut vm, 0, 0, 0);
    assert_eq!(manage::longest_wait_us(&vm, 7), Some(7));
    lifecycle::begin_stop(&mut vm, &mut cpu, "test", false);
    assert!(!vm.managed.waiting());
    assert_eq!(manage::longest_wait_us(&vm, 9_000_000), None);
}

/// A VM the manager can take nothing back from (no balloon, no prealloc)
/// is named at its start; one with either is not.
#[test]
fn a_vm_without_balloon_or_prealloc_is_named_at_start() {
    let note = "no balloon and no prealloc";
    for (devices, prealloc, named) in [
        (0, false, true),
        (0, true, false),
        (guest_bundle::devices::BALLOON, false, false),
    ] {
        let memory = VmMemory {
            prealloc,
            ..VmMemory::default()
        };
        let mut vm = Vm::new(0, spec_devices(1, 0, memory, VM_RAM, devices), GuestGic::V3);
        let mut cpu = FakeCpu::new(BOARD_PAGES);
        lifecycle::start(&mut vm, &mut cpu).expect("starts");
        let said = lines(&mut vm).join("\n");
        assert_eq!(said.contains(note), named, "{devices} {prealloc}: {said}");
    }
}

/// Every device's state, as [`bus::save_devices`] writes it.
fn devices_state(vm: &Vm) -> Vec<u8> {
    let mut w = crate::savestate::StateWriter::default();
    super::bus::save_devices(vm, &mut w);
    w.into_bytes()
}

#[test]
fn every_device_is_saved_and_restored_into_a_vm_of_the_same_configuration() {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    // State in every device: the driver live, a target set, bytes typed
    // and printed, an interrupt enabled.
    let rings = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;
    driver_live(&mut vm, &mut cpu, &mut ctx, rings);
    balloon_ctl::set_target(&mut vm, &mut cpu, 16).expect("target set");
    irq::console_input_bytes(
        &mut vm,
        &mut cpu,
        b"typed ahead of the guest's reads, more than a FIFO holds",
    );
    for &b in b"hi" {
        ctx.x[1] = u64::from(b);
        exit(&mut vm, &mut cpu, &mut ctx, store(UART_DR, 4));
    }
    let saved = devices_state(&vm);

    // A second VM of the same bundle, started fresh: its devices take the
    // first's state, and save the same bytes.
    let mut twin = Vm::new(0, vm.spec, GuestGic::V3);
    lifecycle::start(&mut twin, &mut FakeCpu::new(BOARD_PAGES)).expect("starts");
    assert_ne!(devices_state(&twin), saved);
    let mut r = crate::savestate::StateReader::new(&saved);
    super::bus::restore_devices(&mut twin, &mut r).expect("restores");
    assert_eq!(r.finish(), Ok(()));
    assert_eq!(devices_state(&twin), saved);
    assert_eq!(twin.devices.balloon.as_ref().unwrap().device().target(), 16);
    assert_eq!(twin.console.input.len(), vm.console.input.len());
    assert!(twin.devices.balloon.as_ref().unwrap().interrupt_pending());

    // A VM without a balloon takes no state that has one.
    let no_balloon = spec_devices(1, 0, VmMemory::default(), VM_RAM, 0);
    let mut other = Vm::new(0, no_balloon, GuestGic::V3);
    lifecycle::start(&mut other, &mut FakeCpu::new(BOARD_PAGES)).expect("starts");
    let mut r = crate::savestate::StateReader::new(&saved);
    assert_eq!(
        super::bus::restore_devices(&mut other, &mut r),
        Err(crate::savestate::StateError::Invalid("balloon"))
    );
    // Nor does a VM with another GIC.
    let v2 = GuestGic::V2 {
        gicv: crate::addr::PhysAddr::new(0x0801_0000),
    };
    let mut other = Vm::new(0, vm.spec, v2);
    lifecycle::start(&mut other, &mut FakeCpu::new(BOARD_PAGES)).expect("starts");
    let mut r = crate::savestate::StateReader::new(&saved);
    assert_eq!(
        super::bus::restore_devices(&mut other, &mut r),
        Err(crate::savestate::StateError::Invalid(
            "vGIC of another version or size"
        ))
    );
}
