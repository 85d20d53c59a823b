//! Guest memory as an emulated device sees it ([`DeviceView`]): this VM's
//! RAM only, read and written through its stage 2, and the balloon's
//! backend (inflated, reported and hinted pages unmapped and given back).

use super::memory::{GuestRam, HostMemory, RamError};
use crate::addr::{GuestAddr, GuestPfn};
use crate::trace::{self, trace_event};
use crate::virtio::{GuestMemError, GuestMemory};

/// Guest memory as a device sees it: this VM's RAM only.
pub struct DeviceView<'a, M> {
    pub ram: &'a mut GuestRam,
    pub mem: &'a mut M,
    /// The time of the access, for the devices' timestamps.
    pub now_us: u64,
}

/// A refusal of guest RAM as a device sees it: the whole access, from its
/// first IPA (which page failed, or why, is the hypervisor's business).
fn refused<T>(result: Result<T, RamError>, ipa: GuestAddr, len: usize) -> Result<T, GuestMemError> {
    result.map_err(|_| GuestMemError { ipa, len })
}

impl<M: HostMemory> GuestMemory for DeviceView<'_, M> {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        let len = buf.len();
        refused(self.ram.read(self.mem, ipa, buf), ipa, len)
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        refused(self.ram.write(self.mem, ipa, data), ipa, data.len())
    }
}

/// Guest memory as the notify fast path reads it: this VM's RAM, only the
/// pages mapped now (a page without a frame is an error, never backed), and
/// never written.
pub struct MappedView<'a, M> {
    pub ram: &'a mut GuestRam,
    pub mem: &'a mut M,
}

impl<M: HostMemory> GuestMemory for MappedView<'_, M> {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        let len = buf.len();
        refused(self.ram.read_mapped(self.mem, ipa, buf), ipa, len)
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        Err(GuestMemError {
            ipa,
            len: data.len(),
        })
    }
    #[inline]
    fn read_le16(&mut self, ipa: GuestAddr) -> Result<u16, GuestMemError> {
        refused(self.ram.read_u16_mapped(self.mem, ipa), ipa, 2)
    }
}

impl<M> DeviceView<'_, M> {
    /// The `inflate` or `deflate` trace event of one request's PFNs
    /// (ascending); `released`: frames given back to the pool.
    fn trace_pfns(&self, what: &str, pfns: &[GuestPfn], released: u64) {
        trace_event!(
            "{=str} vm{=usize} pages={=usize} pfns {=u64:#x}..={=u64:#x} runs={=usize} released={=u64}",
            what,
            self.ram.vm,
            pfns.len(),
            pfns.first().map_or(0, |p| p.raw()),
            pfns.last().map_or(0, |p| p.raw()),
            trace::runs(pfns),
            released
        );
    }

    /// The `report` or `hint` trace event of blocks given back.
    fn trace_blocks(&self, what: &str, blocks: &[core::ops::Range<GuestPfn>], released: u64) {
        trace_event!(
            "{=str} vm{=usize} blocks={=usize} pages={=u64} released={=u64}",
            what,
            self.ram.vm,
            blocks.len(),
            blocks.iter().map(|b| b.end - b.start).sum::<u64>(),
            released
        );
    }
}

impl<M: HostMemory> crate::balloon::BalloonBackend for DeviceView<'_, M> {
    fn ram_pfns(&self) -> core::ops::Range<GuestPfn> {
        self.ram.pfns()
    }
    fn inflate(&mut self, pfns: &[GuestPfn]) {
        let released = self.ram.release(self.mem, pfns);
        self.trace_pfns("inflate", pfns, released);
    }
    fn deflate(&mut self, pfns: &[GuestPfn]) {
        // The guest takes these pages back; each is backed (zeroed or
        // poisoned) at its first access, with its neighbours (fault-around,
        // `handle::back_page`): a guest that deflates memory it does not
        // touch soon costs no zeroing and no frames now, as under KVM.
        self.trace_pfns("deflate", pfns, 0);
    }
    fn deflate_on_reset(&mut self, pfns: &[GuestPfn]) {
        // Each page is backed at its first access: a driver that reset may
        // not touch them for a long time, and an overcommitted pool should
        // not give them frames before it does.
        self.trace_pfns("deflate", pfns, 0);
    }
    fn now_us(&self) -> Option<u64> {
        Some(self.now_us)
    }
    fn report(&mut self, blocks: &[core::ops::Range<GuestPfn>]) {
        let released = self.ram.release_blocks(self.mem, blocks);
        self.trace_blocks("report", blocks, released);
    }
    fn hint(&mut self, blocks: &[core::ops::Range<GuestPfn>]) {
        let released = self.ram.release_blocks(self.mem, blocks);
        self.trace_blocks("hint", blocks, released);
    }
}

/// Guest memory and the VM's console, as the virtio console sees them:
/// what the guest prints joins its console line (shown live while it has
/// the keyboard), and typed input is taken from the VM's input queue.
pub struct ConsoleView<'a, M> {
    pub memory: DeviceView<'a, M>,
    pub line: &'a mut super::console_line::ConsoleLine,
    pub out: &'a mut super::outbox::Outbox,
    pub name: &'a str,
    pub focused: bool,
    pub input: &'a mut heapless::Deque<u8, { super::state::CONSOLE_INPUT_MAX }>,
}

impl<M: HostMemory> GuestMemory for ConsoleView<'_, M> {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        self.memory.read(ipa, buf)
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        self.memory.write(ipa, data)
    }
}

impl<M> crate::virtio_console::ConsoleIo for ConsoleView<'_, M> {
    fn output(&mut self, bytes: &[u8]) {
        if self.focused {
            let out = &mut *self.out;
            self.line.push_live_bytes(bytes, |output| out.live(output));
            return;
        }
        for &byte in bytes {
            show_byte(self.line, self.out, self.name, false, byte);
        }
    }
    fn input_waiting(&self) -> bool {
        !self.input.is_empty()
    }
    fn peek_input(&self, skip: usize, buf: &mut [u8]) -> usize {
        let mut copied = 0;
        for (slot, &byte) in buf.iter_mut().zip(self.input.iter().skip(skip)) {
            *slot = byte;
            copied += 1;
        }
        copied
    }
    fn consume_input(&mut self, count: usize) {
        for _ in 0..count {
            self.input.pop_front();
        }
    }
}

/// A byte of a guest's console output into its line (`focused`: shown
/// live), a finished line into the outbox.
pub(super) fn show_byte(
    line: &mut super::console_line::ConsoleLine,
    out: &mut super::outbox::Outbox,
    name: &str,
    focused: bool,
    byte: u8,
) {
    if focused {
        let output = line.push_live(byte);
        out.live(output);
    } else if let Some(text) = line.push(byte) {
        out.line(format_args!("[{name}] {text}"));
    }
}
