//! Virtio-mmio slot 0, the balloon: a register access given to its
//! transport over the VM's RAM (`device_memory::DeviceView`), what it did
//! said on the console (rate-limited), and its interrupt line driven (an
//! InterruptACK that leaves bits set signals a new edge). Its state is the
//! transport's and the balloon's.

use super::super::cpu::{GuestContext, PhysCpu};
use super::super::device_memory::DeviceView;
use super::super::device_memory::MappedView;
use super::super::exit::VcpuExit;
use super::super::exit_profile::ExitKind;
use super::super::fast::{line_at, Fast, FastExit, Traced};
use super::super::fault::{BadAccessKind, Device};
use super::super::fdt::layout;
use super::super::irq;
use super::super::ratelimit::Lines;
use super::super::state::Vm;
use super::{MmioDevice, Refused};
use crate::addr::GuestAddr;
use crate::balloon::Balloon;
use crate::savestate::{StateError, StateReader, StateWriter};
use crate::virtio::mmio::{MmioTransport, INTERRUPT_ACK, QUEUE_NOTIFY};

/// The balloon's window.
pub struct BalloonWindow;

/// Whether `ipa` is this VM's balloon QueueNotify register: `bus::route`'s
/// answer `Window::Balloon(QUEUE_NOTIFY)`, without its walk over the other
/// windows (`bus.rs` asserts none contains it). For the notify fast path.
#[inline]
pub fn is_notify(vm: &Vm, ipa: GuestAddr) -> bool {
    vm.devices.balloon.is_some() && ipa == layout::VIRTIO_BASE + QUEUE_NOTIFY
}

/// The balloon's fast path (`handle::fast_exit` takes it for a 4-byte
/// store to its QueueNotify): taken when the address is the QueueNotify as
/// `bus::route` decodes it ([`is_notify`]; not RAM) and the transport's
/// [`empty_notify`](crate::virtio::mmio::MmioTransport::empty_notify) finds
/// the queue live with nothing new in its avail ring, read through the VM's
/// stage 2 without backing a page ([`MappedView`]: a ring page without a
/// frame goes the full way, which backs it). The notification is counted
/// and the exit recorded as a `virtio-notify`.
///
/// It takes its arguments one by one, in registers: a [`Fast`] passed by
/// value is spilled to the stack, 11 more instructions on the notify
/// (bounded at 500, `cargo xtask bench bare-metal`); built here, it costs
/// nothing.
#[inline(never)]
pub fn empty_notify(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    exit: &VcpuExit,
    before: u32,
) -> Option<FastExit> {
    let fast = Fast::new(vm, cpu, vcpu, ctx, exit, before);
    let VcpuExit::MmioWrite {
        ipa,
        width,
        reg,
        insn_len,
    } = *fast.exit
    else {
        return None;
    };
    if !fast.plain_access(ipa) {
        return None;
    }
    let (Some(balloon), Some(ram)) = (
        fast.vm.devices.balloon.as_mut(),
        fast.vm.memory.ram.as_mut(),
    ) else {
        return None;
    };
    if !line_at(
        fast.vm.devices.vgic.as_ref(),
        irq::VIRTIO_INTID,
        balloon.interrupt_pending(),
    ) {
        return None;
    }
    let value = fast.ctx.reg(reg);
    let mut view = MappedView {
        ram,
        mem: fast.cpu.memory(),
    };
    if !balloon.empty_notify(width, value as u32, &mut view) {
        return None;
    }
    let traced = Traced {
        what: "write",
        ipa,
        width,
        device: Device::Virtio,
        value,
    };
    Some(FastExit::quiet(fast.finish(
        ExitKind::VirtioNotify,
        traced,
        insn_len,
    )))
}

impl MmioDevice for BalloonWindow {
    const DEVICE: Device = Device::Virtio;

    #[inline]
    fn window(vm: &Vm) -> Option<(GuestAddr, u64)> {
        vm.devices.balloon.as_ref()?;
        Some((layout::VIRTIO_BASE, layout::VIRTIO_STRIDE))
    }

    fn read(
        vm: &mut Vm,
        _cpu: &mut impl PhysCpu,
        _vcpu: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, Refused> {
        super::read_transport(vm.devices.balloon.as_mut(), offset, width)
    }

    fn write(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        _vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<(), Refused> {
        let now = cpu.uptime_us();
        let (Some(balloon), Some(ram)) = (vm.devices.balloon.as_mut(), vm.memory.ram.as_mut())
        else {
            return Err(Refused::new(BadAccessKind::Unmapped));
        };
        // Pages a deflate backs get what a fault would give them.
        ram.set_page_fill(balloon.device().page_fill());
        let mut view = DeviceView {
            ram,
            mem: cpu.memory(),
            now_us: now,
        };
        let before = *balloon.device().stats();
        let hint_before = balloon.device().hint_run().copied();
        let event = balloon
            .write(offset, width, value as u32, &mut view)
            .map_err(Refused::virtio)?;
        let mut lines = Lines {
            lines: &mut vm.console.lines,
            out: &mut vm.console.out,
            name: &vm.name,
            now_us: now,
        };
        if let Some(msg) = event.message() {
            lines.say(
                super::super::balloon_ctl::event_kind(msg),
                format_args!("balloon: {msg}"),
            );
        }
        super::super::balloon_ctl::report_rejections(&mut lines, &before, balloon.device().stats());
        super::super::balloon_ctl::report_hint_end(
            lines.out,
            lines.name,
            hint_before,
            balloon.device().hint_run(),
        );
        match offset {
            INTERRUPT_ACK => irq::update_virtio_after_ack(vm, cpu),
            _ => irq::update_virtio(vm, cpu),
        }
        Ok(())
    }

    fn store_kind(offset: u64) -> ExitKind {
        super::virtio_store_kind(offset)
    }

    fn save(vm: &Vm, w: &mut StateWriter) {
        super::save_optional(w, vm.devices.balloon.as_ref(), MmioTransport::save);
    }

    /// A balloon offering what the VM's configuration offers, over its RAM.
    fn restore(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError> {
        let config = vm
            .devices
            .balloon
            .as_ref()
            .map(|b| (b.device().offered_features(), b.device().ram_pfns()));
        super::restore_optional(r, &mut vm.devices.balloon, "balloon", |r| {
            let t = MmioTransport::<Balloon>::restore(r)?;
            let restored = (t.device().offered_features(), t.device().ram_pfns());
            if Some(restored) != config {
                return Err(StateError::Invalid("a balloon of another configuration"));
            }
            Ok(t)
        })
    }
}
