//! A VM's lifecycle: start (its guaranteed memory held for it, RAM backed
//! on first touch or all at once with prealloc, kernel, initrd and device
//! tree loaded, devices made, vCPU 0 handed to its CPU), the vCPUs
//! entering and leaving, and the stop that the last vCPU out finishes by
//! giving every page back (and starting again after a guest's reset).

use super::cpu::PhysCpu;
use super::fdt::{self, layout, GuestBoard};
use super::manage;
use super::memory::{GuestRam, HostMemory as _};
use super::state::{GuestGic, InjectedFailure, Power, Vm, VmState};
use crate::addr::GuestAddr;
use crate::balloon::Balloon;
use crate::limits::{GUEST_SPIS, MAX_CPUS};
use crate::mm::frames::PAGE_SIZE;
use crate::size::Size;
use crate::vgic::intid::VTIMER_PPI;
use crate::vgic::VDistributor;
use crate::virtio::mmio::MmioTransport;
use crate::virtio_console::VirtioConsole;

/// Where a guest kernel's 2 MiB-aligned base is, above the device tree.
pub const KERNEL_OFFSET: u64 = 2 << 20;

/// What an arm64 `Image` header says about where the kernel goes
/// (Documentation/arch/arm64/booting.rst); a kernel without the header
/// (a bare-metal guest) is loaded as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelImage {
    /// Offset of the image from a 2 MiB-aligned base.
    pub text_offset: u64,
    /// Its whole footprint in memory (including its .bss), at least its length.
    pub footprint: u64,
}

impl KernelImage {
    pub fn parse(kernel: &[u8]) -> Self {
        let field = |at: usize| {
            kernel
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        let arm64 = kernel.get(56..60) == Some(b"ARM\x64".as_slice());
        let (text_offset, image_size) = if arm64 {
            (field(8) & 0x1f_ffff, field(16))
        } else {
            (0, 0)
        };
        Self {
            text_offset,
            footprint: image_size.max(kernel.len() as u64),
        }
    }

    /// The guest physical address the kernel is loaded at and entered.
    pub fn entry(&self) -> GuestAddr {
        layout::RAM_BASE + KERNEL_OFFSET + self.text_offset
    }
}

/// Build a VM's memory and devices, load its kernel, initrd and device
/// tree, and hand vCPU 0 to its CPU.
pub fn start(vm: &mut Vm, cpu: &mut impl PhysCpu) -> Result<(), &'static str> {
    let gic = vm.devices.gic;
    let spec = vm.spec;
    start_from(vm, cpu, true, |_, ram, cpu| {
        load_images(ram, gic, &spec, cpu)
    })?;
    cpu.hand_vcpu(vm.vcpus.cpu(0), vm.id, 0);
    Ok(())
}

/// Build a VM's memory and devices as a start does, then `fill` its RAM
/// and devices (a boot's images, or a snapshot), and mark it running; its
/// vCPUs are the caller's to hand out. `boot`: its RAM is backed all at
/// once if it asks for prealloc (a restore backs what the snapshot holds).
/// If `fill` fails, everything is given back and the VM stays stopped.
pub(super) fn start_from<C: PhysCpu>(
    vm: &mut Vm,
    cpu: &mut C,
    boot: bool,
    fill: impl FnOnce(&mut Vm, &mut GuestRam, &mut C) -> Result<(), &'static str>,
) -> Result<(), &'static str> {
    if vm.state == VmState::Failed {
        return Err("a hypervisor failure left its frames unfreed (see 'check')");
    }
    if vm.state != VmState::Stopped {
        return Err("it is already running");
    }
    let cpus_ok = vm
        .vcpus
        .cpus()
        .iter()
        .all(|&c| c < MAX_CPUS && cpu.cpu_online(c));
    if !cpus_ok {
        return Err("a CPU it is pinned to is not online (CPU 0, the shell's, runs a vCPU only where the console's input interrupt can wake the shell)");
    }
    if vm.vcpus.inside() > 0 {
        return Err("its vCPUs are still leaving; try again");
    }
    let spec = vm.spec;
    if spec.vcpus() as usize != vm.vcpus.count() {
        return Err("its vCPU count and CPU list disagree, or it asks for more than 4 vCPUs");
    }
    let ram_end = layout::RAM_BASE.raw().checked_add(spec.ram_size());
    if ram_end.is_none_or(|end| end > crate::mm::stage2::IPA_LIMIT.raw()) {
        return Err("its RAM would end beyond the 16 GiB guest-physical space stage 2 covers (vmconfig allows at most 8 GiB)");
    }
    let vmid = vm.vmid();
    // Its guaranteed memory (all of it with prealloc, else its min) is held
    // for it first, or it is not started: nothing else is disturbed.
    let guaranteed = manage::guaranteed(vm, &vm.managed.limits);
    if let Err(short) = cpu.memory().guarantee(vm.id, guaranteed) {
        vm.console.out.line(format_args!(
            "tidal: [{}] cannot guarantee its {} ({}): {} short, {} free beside the other VMs' guarantees and the pool's min reserve; stop a VM, lower its memory min, or turn prealloc off",
            vm.name,
            Size(guaranteed * PAGE_SIZE),
            if spec.prealloc() { "prealloc = true" } else { "memory min" },
            Size(short.needed.saturating_sub(short.available) * PAGE_SIZE),
            Size(short.available * PAGE_SIZE)
        ));
        return Err("its guaranteed memory cannot be backed (see the line above)");
    }
    let Ok(mut ram) = GuestRam::new(cpu.memory(), vm.id, vmid, layout::RAM_BASE, spec.ram_size())
    else {
        let _ = cpu.memory().guarantee(vm.id, 0);
        return Err("no memory for its stage-2 tables");
    };
    // Backed on first touch, unless it asks for all of it now.
    if !spec.prealloc() && !spec.has_balloon() {
        vm.console.out.line(format_args!(
            "tidal: [{}] note: no balloon and no prealloc: its RAM is backed as it touches it (up to its memory max, {}) and the memory manager can take none of it back; give it a [vm.devices.balloon] or memory.prealloc = true",
            vm.name,
            Size(vm.managed.limits.max.saturating_mul(PAGE_SIZE))
        ));
    }
    if boot && spec.prealloc() {
        if let Err(e) = ram.populate(cpu.memory()) {
            vm.console
                .out
                .line(format_args!("tidal: [{}] {e}", vm.name));
            give_back(vm, cpu, ram);
            return Err("not enough free memory for its RAM");
        }
    }
    vm.managed.waits = Default::default();
    vm.managed.faults_seen = 0;
    vm.managed.oom_deflated_seen = 0;
    vm.devices.vgic = None;
    vm.vcpus.boot();
    vm.restart = false;
    vm.devices.uart.reset();
    vm.console.input.clear();
    match vm.devices.gic {
        GuestGic::V2 { gicv } => {
            // The guest's GICC (8 KiB) is the hardware virtual CPU interface.
            let mapped = (0..2u64).try_for_each(|page| {
                ram.map_device(
                    cpu.memory(),
                    layout::GICC_BASE + page * PAGE_SIZE,
                    gicv + page * PAGE_SIZE,
                )
            });
            if mapped.is_err() {
                give_back(vm, cpu, ram);
                return Err("its GIC CPU interface cannot be mapped");
            }
            vm.devices.vgic = VDistributor::new(vm.vcpus.count(), GUEST_SPIS).ok();
        }
        GuestGic::V3 => vm.devices.vgic = VDistributor::new_v3(vm.vcpus.count(), GUEST_SPIS).ok(),
        GuestGic::None => {}
    }
    vm.devices.balloon = None;
    if spec.has_balloon() {
        match Balloon::new(spec.balloon_features(), ram.pfns()) {
            Ok(balloon) => vm.devices.balloon = Some(MmioTransport::new(balloon)),
            Err(e) => vm
                .console
                .out
                .line(format_args!("tidal: [{}] no balloon device: {e}", vm.name)),
        }
    }
    vm.devices.vconsole = spec
        .has_virtio_console()
        .then(|| MmioTransport::new(VirtioConsole::new()));
    vm.snap = Default::default();
    if let Err(why) = fill(vm, &mut ram, cpu) {
        give_back(vm, cpu, ram);
        return Err(why);
    }
    vm.memory.ram = Some(ram);
    let input_waits = !vm.console.input.is_empty();
    vm.devices.uart_mirror.start(
        &vm.devices.uart,
        input_waits,
        vm.memory.ram.as_mut(),
        cpu.memory(),
    );
    vm.state = VmState::Running;
    vm.counters.starts += 1;
    // Each run's exits are profiled from its start (`info exits`).
    vm.counters.profile.reset(cpu.uptime_us());
    Ok(())
}

/// Copy the kernel (and initrd) into RAM and write the device tree below it.
fn load_images(
    ram: &mut GuestRam,
    gic: GuestGic,
    spec: &guest_bundle::VmEntry<'_>,
    cpu: &mut impl PhysCpu,
) -> Result<(), &'static str> {
    let kernel = spec.kernel();
    let image = KernelImage::parse(kernel);
    ram.write(cpu.memory(), image.entry(), kernel)
        .map_err(|_| "its kernel does not fit in its RAM")?;
    let mut board = GuestBoard::standard(
        spec.ram_size(),
        spec.vcpus(),
        gic.version(),
        super::fdt::virtio_slots(spec.has_balloon(), spec.has_virtio_console()),
    )
    .map_err(|_| "its virtual board cannot be described")?;
    board.bootargs = spec.cmdline();
    if let Some(initrd) = spec.initrd() {
        // Past the kernel's whole footprint (image_size includes its .bss).
        let too_big = "its initrd does not fit in its RAM";
        let start = image
            .entry()
            .checked_add(image.footprint)
            .and_then(|end| end.raw().checked_next_multiple_of(2 << 20))
            .map(GuestAddr::new)
            .ok_or(too_big)?;
        ram.write(cpu.memory(), start, initrd)
            .map_err(|_| too_big)?;
        let end = start.checked_add(initrd.len() as u64).ok_or(too_big)?;
        board.initrd = Some((start.raw(), end.raw()));
    }
    let dtb = fdt::build(&board).map_err(|_| "its device tree cannot be built")?;
    if dtb.len() as u64 > KERNEL_OFFSET {
        return Err("its device tree is larger than 2 MiB");
    }
    ram.write(cpu.memory(), layout::RAM_BASE, &dtb)
        .map_err(|_| "its device tree does not fit")?;
    // Every write above was cleaned to the point of coherency by the host
    // memory; the kernel's instruction fetches must see it too on a CPU
    // with separate instruction caches (a Cortex-A72), before any vCPU of
    // the VM runs.
    cpu.invalidate_icache();
    Ok(())
}

/// Begin stopping a VM: every vCPU leaves at its next exit (the others are
/// kicked), and the last one out gives the pages back ([`finish_stop`]).
pub fn begin_stop(vm: &mut Vm, cpu: &mut impl PhysCpu, why: &'static str, restart: bool) {
    if vm.state != VmState::StopRequested {
        vm.last_stop = why;
    }
    vm.state = VmState::StopRequested;
    vm.restart |= restart;
    // Its vCPUs wait for frames no more: the board's escalation must not
    // count a stopped VM's last wait.
    vm.managed.waits = Default::default();
    let me = cpu.index();
    for (_, other) in vm.vcpus.awake_elsewhere(me) {
        cpu.kick(other);
    }
    if vm.vcpus.inside() == 0 {
        finish_stop(vm, cpu);
    }
}

/// Free a VM's RAM; the pages returned to the pool. Frames the frame table
/// refuses (a hypervisor bug) stay accounted to the VM and are reported.
fn give_back(vm: &mut Vm, cpu: &mut impl PhysCpu, ram: GuestRam) -> u64 {
    let teardown = ram.destroy(cpu.memory());
    // Dropping a guarantee always succeeds.
    let _ = cpu.memory().guarantee(vm.id, 0);
    if let Some(e) = teardown.error {
        vm.console.out.line(format_args!(
            "tidal: [{}] {} frames could not be returned to the pool and stay accounted to it (a hypervisor bug; 'check' shows them): {e}",
            vm.name, teardown.leaked
        ));
    }
    teardown.freed
}

/// Every vCPU has left: flush the console, give every page back, say why,
/// and start again if the guest asked for a reset.
pub fn finish_stop(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    if let Some(line) = vm.console.line.flush() {
        vm.console.out.line(format_args!("[{}] {line}", vm.name));
    }
    let suppressed = vm.console.lines.take_suppressed();
    if suppressed > 0 {
        vm.console.out.line(format_args!(
            "tidal: [{}] {suppressed} similar messages suppressed",
            vm.name
        ));
    }
    let why = vm.last_stop;
    // The mirror's leaf out of the tables before they are freed.
    super::irq::withdraw_uart_mirror(vm, cpu);
    if let Some(ram) = vm.memory.ram.take() {
        let freed = give_back(vm, cpu, ram);
        vm.console.out.line(format_args!(
            "tidal: [{}] VM stopped: {why}; {freed} pages returned to the pool",
            vm.name
        ));
    }
    vm.counters.last_balloon_stats = vm.devices.balloon.take().map(|b| *b.device().stats());
    vm.devices.vconsole = None;
    vm.devices.vgic = None;
    vm.vcpus.power_off_all();
    vm.state = VmState::Stopped;
    vm.counters.profile.stopped(cpu.uptime_us());
    if core::mem::take(&mut vm.restart) {
        if let Err(e) = start(vm, cpu) {
            vm.console
                .out
                .line(format_args!("tidal: [{}] cannot restart: {e}", vm.name));
        }
    }
}

/// Stop a VM for a failure in its path (`why`), whatever stop was asked
/// before: it says why it stopped, and it does not start again.
pub fn stop_for_failure(vm: &mut Vm, cpu: &mut impl PhysCpu, why: &'static str) {
    vm.restart = false;
    if !matches!(vm.state, VmState::Stopped | VmState::Failed) {
        vm.last_stop = why;
        begin_stop(vm, cpu, why, false);
    }
}

/// A failure in the hypervisor's path left the VM's RAM perhaps half
/// freed: what is left of its `owned` frames stays accounted to it in the
/// frame table (dropping its `GuestRam` frees nothing), and the VM is
/// failed, never started again.
pub fn mark_failed(vm: &mut Vm, owned: u64) {
    vm.memory.ram = None;
    vm.devices.balloon = None;
    vm.devices.vconsole = None;
    vm.devices.vgic = None;
    vm.vcpus.forget();
    vm.state = VmState::Failed;
    vm.last_stop = "a hypervisor failure, and its pages could not be freed";
    vm.console.out.line(format_args!(
        "tidal: [{}] the VM is failed: {owned} frames stay accounted to it; 'check' reports them",
        vm.name
    ));
}

/// Ask a running VM to stop; its vCPUs stop at their next exit.
pub fn request_stop(vm: &mut Vm, cpu: &mut impl PhysCpu) -> Result<(), &'static str> {
    match vm.state {
        VmState::Stopped | VmState::Failed => Err("it is not running"),
        VmState::StopRequested | VmState::Running => {
            begin_stop(vm, cpu, "stopped from the shell", false);
            Ok(())
        }
    }
}

/// `debug fail <vm> [abort|frames]`: make the VM's next exit fail (a
/// panic, a data abort at EL2, or a panic half-way through a frame-table
/// update, with the VM's lock and the frame table held), to show that
/// only this VM ends, or that a broken frame table stops the board.
pub fn inject_failure(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    kind: InjectedFailure,
) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running");
    }
    vm.inject_failure = Some(kind);
    // An exit soon, even from a guest asleep in WFI.
    cpu.kick(vm.vcpus.cpu(0));
    Ok(())
}

/// Where a vCPU starts, and with what in x0: vCPU 0 at the kernel with the
/// device tree's address, the others where PSCI CPU_ON said. None if the
/// vCPU is off.
pub fn vcpu_entry(vm: &mut Vm, vcpu: usize) -> Option<(u64, u64)> {
    let restored = vm.restored_vcpu(vcpu).and_then(|s| s.running.as_ref());
    let entry = match vm.vcpus.power(vcpu) {
        Power::On if restored.is_some() => restored.map_or((0, 0), |r| (r.ctx.elr, r.ctx.x[0])),
        Power::Starting { entry, context } => (entry, context),
        Power::On if vcpu == 0 => (
            KernelImage::parse(vm.spec.kernel()).entry().raw(),
            layout::RAM_BASE.raw(),
        ),
        _ => return None,
    };
    vm.vcpus.set_power(vcpu, Power::On);
    Some(entry)
}

/// A restored vCPU's registers, taken as it enters (its list registers
/// are the distributor's to know again); None for a vCPU that boots.
pub fn take_restored(vm: &mut Vm, vcpu: usize) -> Option<super::vcpu_state::Running> {
    let running = vm.snap.restored.get_mut(vcpu)?.take()?.running?;
    if let Some(listed) = vm.vcpus.listed_mut(vcpu) {
        *listed = running.listed;
    }
    Some(running)
}

/// A vCPU enters its run loop: None if it may not (the VM is not running,
/// or the vCPU is off), else where it starts.
pub fn enter(vm: &mut Vm, vcpu: usize) -> Option<(u64, u64)> {
    if vm.state != VmState::Running || vcpu >= vm.vcpus.count() || vm.memory.ram.is_none() {
        return None;
    }
    let entry = vcpu_entry(vm, vcpu)?;
    vm.vcpus.enter();
    Some(entry)
}

/// A vCPU leaves its run loop: it gives up its CPU's GIC state; the last
/// vCPU out of a stopping VM finishes the stop.
pub fn leave(vm: &mut Vm, cpu: &mut impl PhysCpu, vcpu: usize, power_off: bool) {
    if vm.devices.vgic.is_some() {
        cpu.reset_virtual_interface();
        // The virtual timer may be active, handed to the guest: end it.
        cpu.deactivate(VTIMER_PPI);
    }
    vm.vcpus.leave(vcpu);
    if power_off {
        vm.vcpus.set_power(vcpu, Power::Off);
    }
    cpu.vcpu_left();
    if vm.state == VmState::StopRequested && vm.vcpus.inside() == 0 {
        finish_stop(vm, cpu);
    } else if vm.state == VmState::Running && vm.vcpus.inside() == 0 && vm.vcpus.all_off() {
        begin_stop(
            vm,
            cpu,
            "every vCPU turned itself off (PSCI CPU_OFF)",
            false,
        );
    }
}
