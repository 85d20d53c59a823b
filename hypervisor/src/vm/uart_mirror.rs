//! The PL011's mirror page: while its receive FIFO is empty and no input
//! waits behind it, reading any of the UART's registers changes nothing
//! ([`Pl011::mirror_block`]), so the UART's page in the guest's stage 2
//! shows, read-only, a frame of ours holding their values. The guest's
//! loads (the flag register Linux reads before each byte it sends, the
//! interrupt status its handler reads) are then plain loads; only its
//! stores trap, as permission faults emulated like any MMIO store. A byte
//! sent costs one exit instead of two.
//!
//! The frame is rewritten, word by changed word, after every access that
//! traps, under the VM's lock and before the guest runs on; each word is
//! cleaned to the point of coherency, because the guest reads the page as
//! device memory (uncached). Input withdraws the page before the byte
//! enters the FIFO (unmapped, the VM's TLBs invalidated on every CPU), so
//! the guest never sees the interrupt before it can read the byte, and
//! every access traps until the FIFO and the queue behind it are empty
//! again.
//!
//! The frame comes from the frame table (use `Allocated`) at the VM's
//! first start and is kept across its restarts: one page per VM, never
//! guest RAM. Without it (no frame was free) every access traps, as
//! before.
//!
//! [`Pl011::mirror_block`]: crate::pl011::Pl011::mirror_block

use super::fdt::layout;
use super::memory::{GuestRam, HostMemory};
use crate::addr::{GuestAddr, PhysAddr};

/// Where the page is shown: the PL011's. It is the one page a VM's stage
/// 2 maps read-only ([`GuestRam::map_read_only_device`] has no other
/// caller), so a store that found a read-only page (a permission fault,
/// for which HPFAR_EL2 is UNKNOWN) found this one
/// (`VcpuExit::read_only_store_at`).
pub const PAGE: GuestAddr = layout::UART_BASE;
use crate::pl011::{Pl011, MIRROR_BLOCK_WORDS, MIRROR_ID_WORDS, UARTPERIPHID0};

/// One VM's mirror page.
#[derive(Debug, Default)]
pub struct UartMirror {
    /// The frame, once allocated.
    frame: Option<PhysAddr>,
    /// Whether the guest's stage 2 shows it now.
    mapped: bool,
    /// The register block as last written to the frame.
    written: [u32; MIRROR_BLOCK_WORDS],
    pub stats: MirrorStats,
}

/// What the mirror did since the VM was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorStats {
    /// Times the page was mapped.
    pub shown: u64,
    /// Times it was withdrawn, for input or at a stop (each a TLB
    /// invalidation).
    pub withdrawn: u64,
    /// Register words rewritten.
    pub words_written: u64,
}

impl UartMirror {
    pub const fn new() -> Self {
        Self {
            frame: None,
            mapped: false,
            written: [0; MIRROR_BLOCK_WORDS],
            stats: MirrorStats {
                shown: 0,
                withdrawn: 0,
                words_written: 0,
            },
        }
    }

    /// The frame, once allocated.
    pub fn frame(&self) -> Option<PhysAddr> {
        self.frame
    }

    /// Whether the guest's stage 2 shows the page now.
    pub fn is_mapped(&self) -> bool {
        self.mapped
    }
}

impl UartMirror {
    /// At VM start, once its RAM (and stage 2) exists: the frame on the
    /// first start (a VM without one traps every access), then the page
    /// shown as [`UartMirror::sync`] decides.
    pub fn start(
        &mut self,
        uart: &Pl011,
        input_waits: bool,
        ram: Option<&mut GuestRam>,
        mem: &mut impl HostMemory,
    ) {
        // The stage 2 it was mapped in went with the last run.
        self.mapped = false;
        if self.frame.is_none() {
            let Some(frame) = mem.alloc_hypervisor_page() else {
                return;
            };
            let mut ids = [0u8; 4 * MIRROR_ID_WORDS.len()];
            for (bytes, word) in ids.chunks_exact_mut(4).zip(MIRROR_ID_WORDS) {
                bytes.copy_from_slice(&word.to_le_bytes());
            }
            mem.write(frame + UARTPERIPHID0, &ids);
            // The frame reads as zero: the block as written so far.
            self.written = [0; MIRROR_BLOCK_WORDS];
            self.frame = Some(frame);
        }
        self.sync(uart, input_waits, ram, mem);
    }

    /// Before console input enters the receive FIFO: the page goes (if
    /// shown), so the guest's next access traps and sees the byte. Also at
    /// a stop, before the stage-2 tables are freed.
    pub fn withdraw(&mut self, ram: Option<&mut GuestRam>, mem: &mut impl HostMemory) {
        if !core::mem::take(&mut self.mapped) {
            return;
        }
        self.stats.withdrawn += 1;
        if let Some(ram) = ram {
            ram.unmap_device(mem, PAGE);
        }
    }

    /// After anything that may have changed the UART (a trapped access,
    /// input moved into the FIFO): the frame brought up to date and shown
    /// if the registers may be read without a trap (`uart`'s receive FIFO
    /// empty, no input waiting behind it), withdrawn if not.
    pub fn sync(
        &mut self,
        uart: &Pl011,
        input_waits: bool,
        ram: Option<&mut GuestRam>,
        mem: &mut impl HostMemory,
    ) {
        let Some(frame) = self.frame else {
            return;
        };
        let Some(ram) = ram else {
            return self.withdraw(None, mem);
        };
        let Some(block) = uart.mirror_block().filter(|_| !input_waits) else {
            return self.withdraw(Some(ram), mem);
        };
        if block != self.written {
            for (i, (&new, old)) in block.iter().zip(self.written.iter_mut()).enumerate() {
                if new != *old {
                    // One store each: a vCPU reading meanwhile sees a
                    // register before or after, never half of it.
                    mem.write_u32(frame + 4 * i as u64, new);
                    *old = new;
                    self.stats.words_written += 1;
                }
            }
        }
        if self.mapped {
            return;
        }
        if ram.map_read_only_device(mem, PAGE, frame).is_ok() {
            self.mapped = true;
            self.stats.shown += 1;
        }
    }
}
