//! A VM saved into a snapshot and started again from one (the stream's
//! layout is `crate::snapshot::format`'s; docs/SNAPSHOT.md describes it).
//!
//! Saving: the VM is paused (`vm::pause`); once it is, [`save`] writes the VM's configuration, its vCPUs, every
//! device's state (`bus::save_devices`) and its memory page by page:
//! pages without a frame (ballooned, hinted, reported, never touched) as
//! a kind alone, all-zero pages as a kind alone, the rest as data. The VM
//! is resumed (`pause::resume`) whatever happened: a failed snapshot leaves it
//! as it was.
//!
//! Restoring ([`restore`]) builds the VM as a start does, then reads the
//! snapshot into it instead of loading a kernel: every part is checked
//! against this VM's configuration and this board before any vCPU runs,
//! and a failure gives everything back, the VM stopped.

extern crate alloc;

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::fmt::Write as _;

use super::bus;
use super::cpu::PhysCpu;
use super::lifecycle;
use super::memory::{GuestRam, HostMemory, RamError};
use super::state::{GuestGic, Vm};
use super::vcpu_state::VcpuState;
use super::vcpus::Power;
use crate::addr::GuestAddr;
use crate::limits::GUEST_SPIS;
use crate::limits::MAX_VCPUS;
use crate::mm::frames::PAGE_SIZE;
use crate::savestate::{self, StateReader, StateWriter};
use crate::snapshot::format::{
    FormatError, Header, Page, SectionKind, Sink, SnapshotReader, SnapshotWriter, Source, Totals,
    PAGE,
};

/// The layout version of the configuration section.
const CONFIG_VERSION: u8 = 1;

/// What identifies the board a snapshot is taken on or restored to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoardId {
    /// The board's kind and GIC version (the store's `board` tag).
    pub tag: u32,
    /// MIDR_EL1 of its CPUs.
    pub midr: u64,
    /// Its generic timer's frequency.
    pub counter_hz: u64,
    /// Whether a guest's virtual counter may run ahead of the physical
    /// one (CNTVOFF_EL2 "negative"). The architecture allows it; QEMU's
    /// timer model does not fire a timer whose CVAL + CNTVOFF overflows
    /// (target/arm's timer recalculation saturates the sum), so on QEMU a guest restored ahead of the
    /// board's clock would never get a timer interrupt.
    pub counter_may_lead: bool,
}

/// The board tag a snapshot records: the board's compatible string
/// (its CRC-32, low byte cleared) and the GIC version its guests get.
pub fn board_tag(compatible: &str, gic: u8) -> u32 {
    crate::bundle_crc::crc32(compatible.as_bytes()) & !0xff | u32::from(gic)
}

/// The GIC version a snapshot records: 0 (none), 2 or 3.
fn gic_code(gic: GuestGic) -> u8 {
    match gic {
        GuestGic::None => 0,
        GuestGic::V2 { .. } => 2,
        GuestGic::V3 => 3,
    }
}

/// What the configuration section holds: what must match for a snapshot
/// to be restored into a VM (its name may differ: `restore ... as`).
fn write_config(vm: &Vm, w: &mut StateWriter) {
    let spec = vm.spec;
    w.u8(CONFIG_VERSION);
    w.u64(spec.ram_size());
    w.u8(vm.vcpus.count() as u8);
    w.u8(gic_code(vm.devices.gic));
    w.bool(spec.has_balloon());
    w.u64(if spec.has_balloon() {
        spec.balloon_features()
    } else {
        0
    });
    w.bool(spec.has_virtio_console());
}

/// What a snapshot wrote, for the shell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveReport {
    pub totals: Totals,
    /// Pages without a frame, by why: in the balloon, hinted free in the
    /// current hinting run, and the rest (reported free, or never touched).
    pub ballooned: u64,
    pub hinted: u64,
    pub other_unbacked: u64,
}

/// Why a snapshot or a restore failed.
#[derive(Debug)]
pub enum SnapError {
    Format(FormatError),
    /// This VM or board cannot take it, and why.
    Refused(alloc::string::String),
    /// The board's clock is behind the guest's on a board whose counter
    /// may not lead ([`BoardId::counter_may_lead`]): the restore can be
    /// done in `wait_s` seconds.
    ClockBehind {
        board_s: u64,
        guest_s: u64,
        wait_s: u64,
    },
}

impl From<FormatError> for SnapError {
    fn from(e: FormatError) -> Self {
        SnapError::Format(e)
    }
}

impl core::fmt::Display for SnapError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SnapError::Format(e) => write!(f, "{e}"),
            SnapError::Refused(why) => f.write_str(why),
            SnapError::ClockBehind {
                board_s,
                guest_s,
                wait_s,
            } => write!(
                f,
                "the board's clock ({board_s} s since boot) is behind the guest's ({guest_s} s), and QEMU's timer model cannot run a guest ahead of the board (a timer whose CVAL + CNTVOFF overflows never fires); it can be restored in {wait_s} s"
            ),
        }
    }
}

fn refused(args: core::fmt::Arguments<'_>) -> SnapError {
    let mut s = alloc::string::String::new();
    let _ = s.write_fmt(args);
    SnapError::Refused(s)
}

/// Write paused `vm` into `sink`: the header, its configuration, vCPUs,
/// devices and memory. `now_count`: the physical counter now.
pub fn save<S: Sink>(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    board: BoardId,
    now_count: u64,
    sink: S,
) -> Result<(S, SaveReport), SnapError> {
    if !super::pause::paused(vm) {
        return Err(refused(format_args!("its vCPUs are not paused")));
    }
    let Some(ram_pages) = vm.memory.ram.as_ref().map(|r| r.pages()) else {
        return Err(refused(format_args!("it has no RAM")));
    };
    let header = Header {
        board: board.tag,
        gic: gic_code(vm.devices.gic),
        midr: board.midr,
        vcpus: vm.vcpus.count() as u8,
        counter_hz: board.counter_hz,
        guest_counter: now_count.wrapping_sub(vm.snap.counter_offset),
        ram_base: super::fdt::layout::RAM_BASE.raw(),
        ram_pages,
    };
    let mut out = SnapshotWriter::new(sink, &header)?;
    let mut w = StateWriter::default();
    write_config(vm, &mut w);
    out.section(SectionKind::Config, &w.into_bytes())?;
    let mut w = StateWriter::default();
    for v in 0..vm.vcpus.count() {
        let state = match vm.snap.captured.get(v).and_then(|c| c.as_deref()) {
            Some(s) => s.clone(),
            None => VcpuState::not_running(match vm.vcpus.power(v) {
                // Inside no loop, yet on: not entered since a restore.
                Power::On => Power::Off,
                p => p,
            }),
        };
        savestate::SaveState::save(&state, &mut w);
    }
    out.section(SectionKind::Vcpus, &w.into_bytes())?;
    let mut w = StateWriter::default();
    bus::save_devices(vm, &mut w);
    out.section(SectionKind::Devices, &w.into_bytes())?;
    let mut report = SaveReport::default();
    let mut page = Box::new([0u8; PAGE]);
    let base = super::fdt::layout::RAM_BASE;
    let Vm {
        memory, devices, ..
    } = vm;
    let Some(ram) = memory.ram.as_mut() else {
        return Err(refused(format_args!("it has no RAM")));
    };
    let balloon = devices.balloon.as_ref().map(|b| b.device());
    for n in 0..ram_pages {
        let ipa = base + n * PAGE_SIZE;
        match ram.read_mapped(cpu.memory(), ipa, &mut page[..]) {
            Ok(()) if page.iter().all(|&b| b == 0) => out.page(Page::Zero)?,
            Ok(()) => out.page(Page::Data(&page))?,
            Err(_) => {
                let pfn = ipa.pfn();
                if balloon.is_some_and(|b| b.is_ballooned(pfn)) {
                    report.ballooned += 1;
                } else if balloon.is_some_and(|b| b.is_hinted(pfn)) {
                    report.hinted += 1;
                } else {
                    report.other_unbacked += 1;
                }
                out.page(Page::NotBacked)?;
            }
        }
    }
    let (sink, totals) = out.finish()?;
    report.totals = totals;
    Ok((sink, report))
}

/// What a restore read, for the shell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    pub totals: Totals,
    /// The guest's clock when the snapshot was taken, in microseconds.
    pub guest_us: u64,
}

/// Start stopped `vm` from the snapshot `source` holds, on this board
/// (`now_count`: the physical counter now). Nothing of the VM runs until
/// every part is read and checked; on any failure its memory is given
/// back and it stays stopped.
pub fn restore<C: PhysCpu, S: Source>(
    vm: &mut Vm,
    cpu: &mut C,
    board: BoardId,
    now_count: u64,
    source: S,
) -> Result<RestoreReport, SnapError> {
    let (mut reader, header) = SnapshotReader::open(source)?;
    check_header(vm, board, &header)?;
    if !board.counter_may_lead && now_count < header.guest_counter {
        let hz = header.counter_hz.max(1);
        return Err(SnapError::ClockBehind {
            board_s: now_count / hz,
            guest_s: header.guest_counter / hz,
            wait_s: (header.guest_counter - now_count) / hz + 1,
        });
    }
    let config = reader.section(SectionKind::Config)?;
    let mut w = StateWriter::default();
    write_config(vm, &mut w);
    if config != w.into_bytes() {
        return Err(refused(format_args!(
            "its configuration (RAM size, vCPUs, GIC, devices and their features) differs from {}'s",
            vm.name
        )));
    }
    let vcpu_bytes = reader.section(SectionKind::Vcpus)?;
    let intids = 32 + GUEST_SPIS;
    let gic = gic_code(vm.devices.gic);
    let mut vcpus: Vec<VcpuState> = Vec::new();
    let mut r = StateReader::new(&vcpu_bytes);
    for _ in 0..vm.vcpus.count() {
        let state = <VcpuState as savestate::SaveState>::restore(&mut r)
            .map_err(|e| refused(format_args!("its vCPU state: {e}")))?;
        state
            .check_for(gic, intids)
            .map_err(|e| refused(format_args!("its vCPU state: {e}")))?;
        // A list register this CPU lacks would keep its interrupt listed
        // for good.
        let here = cpu.list_registers().min(crate::limits::MAX_LRS);
        if let Some(r) = state.running.as_ref().filter(|_| gic != 0) {
            if usize::from(r.vif.count) != here {
                return Err(refused(format_args!(
                    "it was taken on a CPU with {} list registers, this one has {here}",
                    r.vif.count
                )));
            }
        }
        vcpus.push(state);
    }
    r.finish()
        .map_err(|e| refused(format_args!("its vCPU state: {e}")))?;
    if vcpus.iter().all(|s| s.power == Power::Off) {
        return Err(refused(format_args!("every vCPU in it is off")));
    }
    let devices = reader.section(SectionKind::Devices)?;
    let mut report = RestoreReport {
        guest_us: crate::hw::timer::ticks_to_us(header.guest_counter, header.counter_hz),
        ..RestoreReport::default()
    };
    let mut failure = None;
    let started = lifecycle::start_from(vm, cpu, false, |vm, ram, cpu| {
        let result = fill(vm, ram, cpu, &devices, &mut reader, &mut report);
        result.map_err(|e| {
            failure = Some(e);
            "its snapshot could not be restored"
        })
    });
    if let Err(why) = started {
        return Err(failure.unwrap_or_else(|| refused(format_args!("{why}"))));
    }
    // Its clock goes on from the snapshot's: virtual = physical - offset.
    vm.snap.counter_offset = now_count.wrapping_sub(header.guest_counter);
    for (v, state) in vcpus.into_iter().enumerate().take(MAX_VCPUS) {
        vm.vcpus.set_power(v, state.power);
        if state.running.is_some() {
            vm.snap.restored[v] = Some(Box::new(state));
        }
    }
    for v in 0..vm.vcpus.count() {
        if vm.vcpus.power(v) != Power::Off {
            cpu.hand_vcpu(vm.vcpus.cpu(v), vm.id, v);
        }
    }
    Ok(report)
}

/// The snapshot's board, CPU, GIC and size against this VM's.
fn check_header(vm: &Vm, board: BoardId, h: &Header) -> Result<(), SnapError> {
    let gic = gic_code(vm.devices.gic);
    if h.gic != gic {
        return Err(refused(format_args!(
            "it was taken with a GICv{} and this board's guests get a GICv{gic}",
            h.gic
        )));
    }
    if h.board != board.tag {
        return Err(refused(format_args!(
            "it was taken on another board (board tag {:#x}, this one is {:#x})",
            h.board, board.tag
        )));
    }
    // Implementer and part number: another CPU model has other registers.
    const MODEL: u64 = 0xff00_fff0;
    if h.midr & MODEL != board.midr & MODEL {
        return Err(refused(format_args!(
            "it was taken on another CPU (MIDR {:#x}, this one is {:#x})",
            h.midr, board.midr
        )));
    }
    if h.counter_hz != board.counter_hz {
        return Err(refused(format_args!(
            "its timer ran at {} Hz, this board's at {} Hz",
            h.counter_hz, board.counter_hz
        )));
    }
    if h.ram_base != super::fdt::layout::RAM_BASE.raw()
        || h.ram_pages != vm.spec.ram_size() / PAGE_SIZE
        || usize::from(h.vcpus) != vm.vcpus.count()
    {
        return Err(refused(format_args!(
            "its RAM or vCPU count differs from {}'s",
            vm.name
        )));
    }
    Ok(())
}

/// The devices and memory of the snapshot into a VM being started.
fn fill<C: PhysCpu, S: Source>(
    vm: &mut Vm,
    ram: &mut GuestRam,
    cpu: &mut C,
    devices: &[u8],
    reader: &mut SnapshotReader<S>,
    report: &mut RestoreReport,
) -> Result<(), SnapError> {
    let mut r = StateReader::new(devices);
    bus::restore_devices(vm, &mut r).map_err(|e| refused(format_args!("its devices: {e}")))?;
    r.finish()
        .map_err(|e| refused(format_args!("its devices: {e}")))?;
    let balloon = vm.devices.balloon.as_ref().map(|b| b.device());
    let fill_value = balloon.map_or(0, |b| b.page_fill());
    ram.set_page_fill(fill_value);
    let base = super::fdt::layout::RAM_BASE;
    let zero = [0u8; PAGE];
    let totals = reader.pages(|n, page| -> Result<(), SnapError> {
        let ipa = base + n * PAGE_SIZE;
        let pfn = ipa.pfn();
        let held = balloon.is_some_and(|b| b.is_ballooned(pfn) || b.is_hinted(pfn));
        let written = match page {
            Page::NotBacked => return Ok(()),
            _ if held => {
                return Err(refused(format_args!(
                "it holds data for page {n:#x}, which its balloon holds or its guest hinted free"
            )))
            }
            // A page not backed reads as the fill value when touched: an
            // all-zero page needs a frame only when the fill is not zero.
            Page::Zero if fill_value == 0 => return Ok(()),
            Page::Zero => write_page(ram, cpu.memory(), ipa, &zero),
            Page::Data(data) => write_page(ram, cpu.memory(), ipa, data),
        };
        written.map_err(|e| refused(format_args!("its memory: {e}")))
    })?;
    report.totals = totals;
    Ok(())
}

fn write_page(
    ram: &mut GuestRam,
    mem: &mut impl HostMemory,
    ipa: GuestAddr,
    data: &[u8; PAGE],
) -> Result<(), RamError> {
    ram.write(mem, ipa, data)
}
