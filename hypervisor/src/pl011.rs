//! The guest's PL011 UART (Arm PrimeCell UART, TRM DDI 0183), as a portable
//! state machine: enough for Linux's amba-pl011 driver and its earlycon.
//!
//! On the guest board it sits at IPA `0x0900_0000` with SPI 1 (INTID 33).
//! The owner forwards guest accesses to [`Pl011::read`] and [`Pl011::write`],
//! prints [`Pl011Effect::output`] bytes (prefixed with the VM's name), feeds
//! console input with [`Pl011::push_input`], and drives the vGIC line with
//! [`Pl011::irq_level`] whenever an effect says it may have changed (a read of
//! DR can lower it too: sample it after reads as well, or simply after every
//! access; driving the line with an unchanged level is harmless).
//!
//! # Model
//!
//! - It identifies as an Arm PL011 r1p5 (PeriphID 0x11, 0x10, 0x34, 0x00;
//!   PCellID 0x0d, 0xf0, 0x05, 0xb1), which has 32-byte FIFOs: Linux's
//!   driver reads the revision to pick its FIFO size.
//! - Transmission is instant. A DR write outputs its low byte whatever
//!   UARTEN and TXE say (Linux's earlycon writes DR of a UART the firmware
//!   may not have enabled, and QEMU transmits in that case too; such bytes
//!   are counted). FR therefore never shows TXFF or BUSY and always shows
//!   TXFE.
//! - The receive FIFO holds 32 bytes (1 with LCR_H.FEN clear). Input that
//!   does not fit is refused ([`Pl011::push_input`] returns false) and the
//!   console keeps it; nothing is lost to an overrun. Input is accepted even
//!   while the UART is disabled.
//! - Interrupts: RXRIS is set when the receive FIFO reaches the IFLS
//!   trigger level and cleared by ICR or by reading below it; RTRIS (the
//!   receive timeout) is set whenever a byte arrives or a DR read leaves
//!   data behind (time is not modelled, so "the line went idle" is assumed
//!   at once) and cleared by ICR or by emptying the FIFO: a single byte is
//!   delivered at once. TXRIS is set each time a DR write has drained the
//!   (instant) transmit FIFO and cleared by ICR; as on the hardware it is
//!   not set out of reset. Linux writes DR until TXFF (never) and enables
//!   TXIM only when it still has data, in which case the interrupt is
//!   already raised: it never stalls. MIS = RIS & IMSC, and the interrupt
//!   output is MIS != 0. Modem-status and error interrupts never occur.
//! - Loopback, IrDA, DMA and the modem lines are not modelled: their
//!   registers (CR bits, ILPR, DMACR) are stored and read back.
//!
//! Accesses may be 1, 2 or 4 bytes wide (Linux uses 16-bit accesses unless
//! told `reg-io-width = 4`; earlycon writes DR with single bytes), aligned
//! to their width. Narrow reads return the addressed part of the register;
//! narrow writes to the low part of a register zero-extend, writes to a
//! higher part are ignored. Bad widths, misalignment and offsets without a
//! register read as zero and ignore writes; they are counted in
//! [`Pl011Counters`].

use crate::register_access::{check_access, UP_TO_WORD};
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};
use platform::uart::pl011 as fields;

/// Data register.
pub const UARTDR: u64 = 0x000;
/// Receive status (read) / error clear (write).
pub const UARTRSR: u64 = 0x004;
/// Flag register.
pub const UARTFR: u64 = 0x018;
/// IrDA low-power counter.
pub const UARTILPR: u64 = 0x020;
/// Integer baud rate divisor.
pub const UARTIBRD: u64 = 0x024;
/// Fractional baud rate divisor.
pub const UARTFBRD: u64 = 0x028;
/// Line control.
pub const UARTLCR_H: u64 = 0x02c;
/// Control.
pub const UARTCR: u64 = 0x030;
/// Interrupt FIFO level select.
pub const UARTIFLS: u64 = 0x034;
/// Interrupt mask set/clear.
pub const UARTIMSC: u64 = 0x038;
/// Raw interrupt status.
pub const UARTRIS: u64 = 0x03c;
/// Masked interrupt status.
pub const UARTMIS: u64 = 0x040;
/// Interrupt clear (write-only).
pub const UARTICR: u64 = 0x044;
/// DMA control.
pub const UARTDMACR: u64 = 0x048;
/// First peripheral identification register.
pub const UARTPERIPHID0: u64 = 0xfe0;
/// First PrimeCell identification register.
pub const UARTPCELLID0: u64 = 0xff0;
/// Size of the register window.
pub const PL011_SIZE: u64 = 0x1000;

/// Registers that [`Pl011::mirror_block`] covers: DR up to DMACR.
pub const MIRROR_BLOCK_WORDS: usize = (UARTDMACR / 4 + 1) as usize;
/// PeriphID0..3 then PCellID0..3 as words from [`UARTPERIPHID0`]: the
/// rest of the mirror page (constant).
pub const MIRROR_ID_WORDS: [u32; 8] = [
    PERIPH_ID[0] as u32,
    PERIPH_ID[1] as u32,
    PERIPH_ID[2] as u32,
    PERIPH_ID[3] as u32,
    PCELL_ID[0] as u32,
    PCELL_ID[1] as u32,
    PCELL_ID[2] as u32,
    PCELL_ID[3] as u32,
];

/// PeriphID0..3: part 0x011 (PL011), designer 0x41 (Arm), revision 3 (r1p5).
pub const PERIPH_ID: [u8; 4] = [0x11, 0x10, 0x34, 0x00];
/// PCellID0..3: the PrimeCell signature.
pub const PCELL_ID: [u8; 4] = [0x0d, 0xf0, 0x05, 0xb1];

// The bits are the driver's definitions (`platform::uart::pl011`), so the
// device a guest sees and the one the hypervisor drives agree.
/// FR: receive FIFO empty.
pub const FR_RXFE: u32 = fields::UARTFR::RXFE::SET.value;
/// FR: transmit FIFO full (never set).
pub const FR_TXFF: u32 = fields::UARTFR::TXFF::SET.value;
/// FR: receive FIFO full.
pub const FR_RXFF: u32 = fields::UARTFR::RXFF::SET.value;
/// FR: transmit FIFO empty (always set).
pub const FR_TXFE: u32 = fields::UARTFR::TXFE::SET.value;
/// FR: UART busy transmitting (never set).
pub const FR_BUSY: u32 = fields::UARTFR::BUSY::SET.value;

/// CR: UART enable.
pub const CR_UARTEN: u32 = fields::UARTCR::UARTEN::SET.value;
/// CR: transmit enable.
pub const CR_TXE: u32 = fields::UARTCR::TXE::SET.value;
/// CR: receive enable.
pub const CR_RXE: u32 = fields::UARTCR::RXE::SET.value;

/// LCR_H: FIFOs enabled.
pub const LCR_H_FEN: u32 = fields::UARTLCR_H::FEN::SET.value;

/// Interrupt bit (IMSC/RIS/MIS/ICR): receive.
pub const INT_RX: u32 = fields::UARTIMSC::RXIM::SET.value;
/// Interrupt bit: transmit.
pub const INT_TX: u32 = fields::UARTIMSC::TXIM::SET.value;
/// Interrupt bit: receive timeout.
pub const INT_RT: u32 = fields::UARTIMSC::RTIM::SET.value;
/// All eleven interrupt bits.
pub const INT_ALL: u32 = 0x7ff;

/// Depth of the receive FIFO when enabled.
pub const RX_FIFO_SIZE: usize = 32;

const CR_RESET: u32 = CR_RXE | CR_TXE;
const IFLS_RESET: u32 = 0x12;

/// What a register write did, for the owner to act on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pl011Effect {
    /// A byte the guest transmitted: print it.
    pub output: Option<u8>,
    /// The interrupt output ([`Pl011::irq_level`]) may have changed: drive
    /// the vGIC line with its current value.
    pub irq_changed: bool,
}

impl Pl011Effect {
    /// Nothing to do.
    pub const NONE: Pl011Effect = Pl011Effect {
        output: None,
        irq_changed: false,
    };
}

/// Counters for the shell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pl011Counters {
    /// Bytes transmitted.
    pub tx_bytes: u64,
    /// Of those, bytes written while UARTEN or TXE was clear.
    pub tx_while_disabled: u64,
    /// Bytes received into the FIFO.
    pub rx_bytes: u64,
    /// Input refused because the receive FIFO was full.
    pub rx_refused: u64,
    /// Accesses at offsets without a register, or to the wrong part of
    /// one (ignored).
    pub unknown: u64,
    /// Accesses with a width other than 1, 2, 4 or not aligned to it
    /// (ignored).
    pub bad_width: u64,
    /// Writes to read-only registers (ignored).
    pub read_only_writes: u64,
}

/// One guest's PL011.
#[derive(Clone, Debug)]
pub struct Pl011 {
    rx: [u8; RX_FIFO_SIZE],
    rx_head: usize,
    rx_len: usize,
    ilpr: u32,
    ibrd: u32,
    fbrd: u32,
    lcr_h: u32,
    cr: u32,
    ifls: u32,
    imsc: u32,
    ris: u32,
    dmacr: u32,
    counters: Pl011Counters,
}

impl Default for Pl011 {
    fn default() -> Self {
        Self::new()
    }
}

impl Pl011 {
    /// A UART in its reset state.
    pub const fn new() -> Self {
        Pl011 {
            rx: [0; RX_FIFO_SIZE],
            rx_head: 0,
            rx_len: 0,
            ilpr: 0,
            ibrd: 0,
            fbrd: 0,
            lcr_h: 0,
            cr: CR_RESET,
            ifls: IFLS_RESET,
            imsc: 0,
            ris: 0,
            dmacr: 0,
            counters: Pl011Counters {
                tx_bytes: 0,
                tx_while_disabled: 0,
                rx_bytes: 0,
                rx_refused: 0,
                unknown: 0,
                bad_width: 0,
                read_only_writes: 0,
            },
        }
    }

    /// Back to the reset state (the receive FIFO is emptied; counters kept).
    pub fn reset(&mut self) {
        *self = Pl011 {
            counters: self.counters,
            ..Pl011::new()
        };
    }

    pub fn counters(&self) -> &Pl011Counters {
        &self.counters
    }

    /// The interrupt output: some unmasked interrupt is raised.
    pub fn irq_level(&self) -> bool {
        self.mis() != 0
    }

    fn mis(&self) -> u32 {
        self.ris & self.imsc
    }

    /// The interrupt output once a byte has been written to DR (which
    /// raises TXRIS): whether such a write would leave the line as
    /// [`Pl011::irq_level`] has it is what the vCPU's fast path asks.
    pub fn irq_level_after_transmit(&self) -> bool {
        (self.ris | INT_TX) & self.imsc != 0
    }

    /// Whether a byte written to DR would change what the registers read
    /// (it raises TXRIS, which may be up already): if not, the mirror page
    /// (`vm::uart_mirror`) needs no update after it.
    #[inline]
    pub fn transmit_changes_registers(&self) -> bool {
        self.ris & INT_TX == 0
    }

    /// Bytes waiting in the receive FIFO.
    pub fn rx_len(&self) -> usize {
        self.rx_len
    }

    /// How many bytes the receive FIFO holds (one with the FIFO off).
    pub fn rx_depth(&self) -> usize {
        if self.lcr_h & LCR_H_FEN != 0 {
            RX_FIFO_SIZE
        } else {
            1
        }
    }

    /// The receive interrupt's trigger level (IFLS.RXIFLSEL: 1/8, 1/4, 1/2,
    /// 3/4 or 7/8 full; reserved values act as 1/2), 1 in character mode.
    fn rx_trigger(&self) -> usize {
        if self.lcr_h & LCR_H_FEN == 0 {
            return 1;
        }
        match (self.ifls >> 3) & 7 {
            0 => RX_FIFO_SIZE / 8,
            1 => RX_FIFO_SIZE / 4,
            3 => RX_FIFO_SIZE * 3 / 4,
            4 => RX_FIFO_SIZE * 7 / 8,
            _ => RX_FIFO_SIZE / 2,
        }
    }

    fn flags(&self) -> u32 {
        let mut fr = FR_TXFE;
        if self.rx_len == 0 {
            fr |= FR_RXFE;
        }
        if self.rx_len >= self.rx_depth() {
            fr |= FR_RXFF;
        }
        fr
    }

    /// The registers at offsets `0..MIRROR_BLOCK_WORDS * 4` as 32-bit
    /// reads show them, while reading them changes nothing: with the
    /// receive FIFO empty (a DR read then returns 0 and takes nothing).
    /// `None` while it holds data. What the read-only mirror page holds
    /// (`vm::uart_mirror`), so that a load from it returns what
    /// [`Pl011::read`] would, narrow loads included (the little-endian
    /// bytes of the word), without a trap.
    pub fn mirror_block(&self) -> Option<[u32; MIRROR_BLOCK_WORDS]> {
        if self.rx_len != 0 {
            return None;
        }
        let mut block = [0; MIRROR_BLOCK_WORDS];
        block[(UARTFR / 4) as usize] = self.flags();
        block[(UARTILPR / 4) as usize] = self.ilpr;
        block[(UARTIBRD / 4) as usize] = self.ibrd;
        block[(UARTFBRD / 4) as usize] = self.fbrd;
        block[(UARTLCR_H / 4) as usize] = self.lcr_h;
        block[(UARTCR / 4) as usize] = self.cr;
        block[(UARTIFLS / 4) as usize] = self.ifls;
        block[(UARTIMSC / 4) as usize] = self.imsc;
        block[(UARTRIS / 4) as usize] = self.ris;
        block[(UARTMIS / 4) as usize] = self.mis();
        block[(UARTDMACR / 4) as usize] = self.dmacr;
        Some(block)
    }

    /// Console input for the guest. Returns false (and keeps nothing) if
    /// the receive FIFO is full.
    pub fn push_input(&mut self, byte: u8) -> bool {
        if self.rx_len >= self.rx_depth() {
            self.counters.rx_refused += 1;
            return false;
        }
        self.rx[(self.rx_head + self.rx_len) % RX_FIFO_SIZE] = byte;
        self.rx_len += 1;
        self.counters.rx_bytes += 1;
        self.ris |= INT_RT;
        if self.rx_len >= self.rx_trigger() {
            self.ris |= INT_RX;
        }
        true
    }

    fn pop_input(&mut self) -> u32 {
        if self.rx_len == 0 {
            return 0;
        }
        let byte = self.rx[self.rx_head];
        self.rx_head = (self.rx_head + 1) % RX_FIFO_SIZE;
        self.rx_len -= 1;
        if self.rx_len < self.rx_trigger() {
            self.ris &= !INT_RX;
        }
        if self.rx_len == 0 {
            self.ris &= !INT_RT;
        } else {
            self.ris |= INT_RT;
        }
        u32::from(byte)
    }

    /// Splits an access into its register's word offset and the byte shift
    /// within it, or None (counted) if the width or alignment is bad.
    fn locate(&mut self, offset: u64, width: u8) -> Option<(u64, u32)> {
        if check_access(offset, width, UP_TO_WORD).is_err() {
            self.counters.bad_width += 1;
            return None;
        }
        Some((offset & !3, (offset & 3) as u32 * 8))
    }

    /// A guest read of `width` bytes at `offset`. Reading DR takes a byte
    /// from the receive FIFO (zero if it is empty), which may lower the
    /// interrupt output.
    pub fn read(&mut self, offset: u64, width: u8) -> u32 {
        let Some((reg, shift)) = self.locate(offset, width) else {
            return 0;
        };
        // Only a read covering the low byte of DR consumes data.
        let value = match reg {
            UARTDR if shift == 0 => self.pop_input(),
            UARTDR => 0,
            UARTRSR => 0, // no framing, parity, break or overrun errors
            UARTFR => self.flags(),
            UARTILPR => self.ilpr,
            UARTIBRD => self.ibrd,
            UARTFBRD => self.fbrd,
            UARTLCR_H => self.lcr_h,
            UARTCR => self.cr,
            UARTIFLS => self.ifls,
            UARTIMSC => self.imsc,
            UARTRIS => self.ris,
            UARTMIS => self.mis(),
            UARTICR => 0, // write-only
            UARTDMACR => self.dmacr,
            0xfe0..=0xfec => u32::from(PERIPH_ID[((reg - UARTPERIPHID0) / 4) as usize]),
            0xff0..=0xffc => u32::from(PCELL_ID[((reg - UARTPCELLID0) / 4) as usize]),
            _ => {
                self.counters.unknown += 1;
                0
            }
        };
        let mask = if width == 4 {
            u32::MAX
        } else {
            (1u32 << (8 * u32::from(width))) - 1
        };
        (value >> shift) & mask
    }

    /// [`Pl011::read`] when it leaves [`Pl011::irq_level`] as it is; `None`,
    /// with nothing changed, when it would move the line (a DR read that
    /// empties the receive FIFO or takes it below its trigger level).
    pub fn read_keeping_level(&mut self, offset: u64, width: u8) -> Option<u32> {
        if offset & !3 != UARTDR {
            // Nothing but DR changes on a read (the access counters aside).
            return Some(self.read(offset, width));
        }
        let level = self.irq_level();
        let mut after = self.clone();
        let value = after.read(offset, width);
        (after.irq_level() == level).then(|| {
            *self = after;
            value
        })
    }

    /// A guest write of `width` bytes at `offset`.
    pub fn write(&mut self, offset: u64, width: u8, value: u32) -> Pl011Effect {
        let Some((reg, shift)) = self.locate(offset, width) else {
            return Pl011Effect::NONE;
        };
        if shift != 0 {
            // The upper part of a register: every field a driver writes is
            // in the low bytes.
            self.counters.unknown += 1;
            return Pl011Effect::NONE;
        }
        let level = self.irq_level();
        let mut output = None;
        match reg {
            UARTDR => {
                let byte = value as u8;
                output = Some(byte);
                self.counters.tx_bytes += 1;
                if self.cr & (CR_UARTEN | CR_TXE) != CR_UARTEN | CR_TXE {
                    self.counters.tx_while_disabled += 1;
                }
                // The byte left at once: the transmit FIFO just drained.
                self.ris |= INT_TX;
            }
            UARTRSR => {} // ECR: clears the (never set) error flags
            UARTILPR => self.ilpr = value & 0xff,
            UARTIBRD => self.ibrd = value & 0xffff,
            UARTFBRD => self.fbrd = value & 0x3f,
            UARTLCR_H => {
                self.lcr_h = value & 0xff;
                self.update_rx_trigger();
            }
            UARTCR => self.cr = value & 0xffff,
            UARTIFLS => {
                self.ifls = value & 0x3f;
                self.update_rx_trigger();
            }
            UARTIMSC => self.imsc = value & INT_ALL,
            UARTICR => self.ris &= !(value & INT_ALL),
            UARTDMACR => self.dmacr = value & 0x7,
            UARTFR | UARTRIS | UARTMIS | 0xfe0..=0xffc => self.counters.read_only_writes += 1,
            _ => self.counters.unknown += 1,
        }
        Pl011Effect {
            output,
            irq_changed: self.irq_level() != level,
        }
    }

    /// After a change of FEN or the trigger level, RXRIS reflects whether
    /// the FIFO is at the new trigger level.
    fn update_rx_trigger(&mut self) {
        if self.rx_len > 0 && self.rx_len >= self.rx_trigger() {
            self.ris |= INT_RX;
        } else {
            self.ris &= !INT_RX;
        }
    }
}

/// The saved state's layout version ([`SaveState`]).
const STATE_VERSION: u8 = 1;

impl SaveState for Pl011 {
    fn save(&self, w: &mut StateWriter) {
        w.u8(STATE_VERSION);
        w.bytes(&self.rx);
        w.u64(self.rx_head as u64);
        w.u64(self.rx_len as u64);
        for reg in [
            self.ilpr, self.ibrd, self.fbrd, self.lcr_h, self.cr, self.ifls, self.imsc, self.ris,
            self.dmacr,
        ] {
            w.u32(reg);
        }
        let c = &self.counters;
        for n in [
            c.tx_bytes,
            c.tx_while_disabled,
            c.rx_bytes,
            c.rx_refused,
            c.unknown,
            c.bad_width,
            c.read_only_writes,
        ] {
            w.u64(n);
        }
    }

    /// Registers as the guest can write them (their writable bits), the
    /// receive FIFO's cursor and depth within it.
    fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        r.version("pl011", STATE_VERSION)?;
        let rx = r.array::<RX_FIFO_SIZE>()?;
        let last = RX_FIFO_SIZE as u64 - 1;
        let rx_head = r.at_most(last, "pl011 receive FIFO head")? as usize;
        let rx_len = r.at_most(RX_FIFO_SIZE as u64, "pl011 receive FIFO depth")? as usize;
        Ok(Pl011 {
            rx,
            rx_head,
            rx_len,
            ilpr: r.masked_u32(0xff, "pl011 ILPR")?,
            ibrd: r.masked_u32(0xffff, "pl011 IBRD")?,
            fbrd: r.masked_u32(0x3f, "pl011 FBRD")?,
            lcr_h: r.masked_u32(0xff, "pl011 LCR_H")?,
            cr: r.masked_u32(0xffff, "pl011 CR")?,
            ifls: r.masked_u32(0x3f, "pl011 IFLS")?,
            imsc: r.masked_u32(INT_ALL, "pl011 IMSC")?,
            ris: r.masked_u32(INT_ALL, "pl011 RIS")?,
            dmacr: r.masked_u32(0x7, "pl011 DMACR")?,
            counters: Pl011Counters {
                tx_bytes: r.count("pl011 counter")?,
                tx_while_disabled: r.count("pl011 counter")?,
                rx_bytes: r.count("pl011 counter")?,
                rx_refused: r.count("pl011 counter")?,
                unknown: r.count("pl011 counter")?,
                bad_width: r.count("pl011 counter")?,
                read_only_writes: r.count("pl011 counter")?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::savestate;
    use proptest::prelude::*;

    fn id(uart: &mut Pl011, base: u64) -> u32 {
        (0..4).fold(0, |id, i| {
            id | (uart.read(base + 4 * i, 4) & 0xff) << (8 * i)
        })
    }

    /// What amba-pl011 does: AMBA bus probe, then pl011_hwinit/startup.
    fn linux_startup(uart: &mut Pl011) {
        assert_eq!(id(uart, UARTPCELLID0), 0xb105_f00d);
        let periphid = id(uart, UARTPERIPHID0);
        assert_eq!(periphid & 0x000f_ffff, 0x0004_1011, "Arm PL011");
        assert_eq!((periphid >> 20) & 0xf, 3, "revision 3: 32-byte FIFOs");
        // pl011_hwinit: clear interrupts, mask all but RX.
        uart.write(UARTICR, 2, INT_ALL);
        assert_eq!(uart.read(UARTIMSC, 2), 0);
        uart.write(UARTIMSC, 2, INT_RT | INT_RX);
        // pl011_startup
        uart.write(UARTIFLS, 2, 0x12);
        uart.write(UARTCR, 2, CR_UARTEN | CR_TXE | CR_RXE);
        // set_termios: 115200 8N1 with FIFOs.
        uart.write(UARTIBRD, 2, 13);
        uart.write(UARTFBRD, 2, 1);
        uart.write(UARTLCR_H, 2, LCR_H_FEN | 3 << 5);
        // Flush the receive FIFO.
        for _ in 0..64 {
            if uart.read(UARTFR, 2) & FR_RXFE != 0 {
                break;
            }
            uart.read(UARTDR, 2);
        }
        uart.write(UARTICR, 2, INT_RT | INT_RX);
    }

    #[test]
    fn linux_like_sequence() {
        let mut uart = Pl011::new();
        assert_eq!(uart.read(UARTCR, 4), CR_TXE | CR_RXE);
        assert_eq!(uart.read(UARTFR, 4), FR_TXFE | FR_RXFE);
        // Typed before the driver started: flushed by startup.
        assert!(uart.push_input(b'x'));
        linux_startup(&mut uart);
        assert_eq!(uart.rx_len(), 0);
        assert!(!uart.irq_level());
        assert_eq!(uart.read(UARTLCR_H, 2), 0x70);
        assert_eq!(uart.read(UARTIBRD, 2), 13);
        assert_eq!(uart.read(UARTFBRD, 2), 1);

        // One byte of input: the receive timeout interrupt delivers it.
        assert!(uart.push_input(b'a'));
        assert!(uart.irq_level());
        assert_eq!(uart.read(UARTMIS, 2), INT_RT);
        assert_eq!(uart.read(UARTFR, 2) & FR_RXFE, 0);
        // pl011_int: ICR without RX/RT/TX, then drain until RXFE.
        uart.write(UARTICR, 2, INT_ALL & !(INT_TX | INT_RT | INT_RX));
        assert_eq!(uart.read(UARTDR, 2), u32::from(b'a'));
        assert_ne!(uart.read(UARTFR, 2) & FR_RXFE, 0);
        assert!(!uart.irq_level());

        // A burst past the 1/2 trigger level raises RXRIS too.
        for b in 0..20u8 {
            assert!(uart.push_input(b));
        }
        assert_eq!(uart.read(UARTRIS, 2), INT_RT | INT_RX);
        let mut got = Vec::new();
        while uart.read(UARTFR, 2) & FR_RXFE == 0 {
            got.push(uart.read(UARTDR, 2) as u8);
            if got.len() == 10 {
                assert_eq!(uart.read(UARTRIS, 2), INT_RT, "below the trigger");
            }
        }
        assert_eq!(got, (0..20).collect::<Vec<u8>>());
        assert!(!uart.irq_level());
        assert_eq!(uart.read(UARTDR, 2), 0, "empty FIFO reads zero");

        // Transmit: output at once, TXFF never set, TXRIS raised.
        assert_eq!(uart.read(UARTFR, 2) & (FR_TXFF | FR_BUSY), 0);
        let effect = uart.write(UARTDR, 2, u32::from(b'h'));
        assert_eq!(
            effect,
            Pl011Effect {
                output: Some(b'h'),
                irq_changed: false
            }
        );
        assert_eq!(uart.read(UARTRIS, 2), INT_TX);
        // Enabling TXIM with data left to send: the interrupt is there.
        let effect = uart.write(UARTIMSC, 2, INT_RT | INT_RX | INT_TX);
        assert!(effect.irq_changed);
        assert!(uart.irq_level());
        // pl011_stop_tx masks it again.
        assert!(uart.write(UARTIMSC, 2, INT_RT | INT_RX).irq_changed);
        assert!(!uart.irq_level());
        assert_eq!(uart.counters().tx_bytes, 1);
        assert_eq!(uart.counters().tx_while_disabled, 0);
        // Shutdown clears everything.
        uart.write(UARTICR, 2, 0xffff);
        assert_eq!(uart.read(UARTRIS, 2), 0);
    }

    #[test]
    fn earlycon_writes_bytes_to_a_disabled_uart() {
        let mut uart = Pl011::new();
        uart.write(UARTCR, 4, 0);
        assert_eq!(uart.read(UARTFR, 4) & FR_TXFF, 0);
        let effect = uart.write(UARTDR, 1, 0x1234_5641);
        assert_eq!(effect.output, Some(b'A'));
        assert_eq!(uart.read(UARTFR, 4) & FR_BUSY, 0);
        assert_eq!(uart.counters().tx_while_disabled, 1);
        // No interrupt is unmasked, so no line change.
        assert!(!effect.irq_changed);
    }

    #[test]
    fn fifo_overflow_and_character_mode() {
        let mut uart = Pl011::new();
        // FEN clear: a one-byte holding register.
        assert!(uart.push_input(1));
        assert!(!uart.push_input(2));
        assert_ne!(uart.read(UARTFR, 4) & FR_RXFF, 0);
        assert_eq!(uart.read(UARTRIS, 4), INT_RT | INT_RX);
        // FIFO mode: 32 bytes.
        uart.write(UARTLCR_H, 4, LCR_H_FEN);
        assert_eq!(
            uart.read(UARTRIS, 4),
            INT_RT,
            "1 byte is below the 1/2 trigger"
        );
        for b in 2..=32u8 {
            assert!(uart.push_input(b));
        }
        assert!(!uart.push_input(33));
        assert_eq!(uart.counters().rx_refused, 2);
        assert_eq!(uart.read(UARTFR, 4) & (FR_RXFF | FR_RXFE), FR_RXFF);
        for b in 1..=32u8 {
            assert_eq!(uart.read(UARTDR, 4), u32::from(b));
        }
        assert_eq!(uart.read(UARTFR, 4) & (FR_RXFF | FR_RXFE), FR_RXFE);
        assert_eq!(uart.read(UARTRSR, 4), 0);
        // Trigger levels: 1/8 of 32 is 4 bytes.
        uart.write(UARTIFLS, 4, 0);
        for b in 0..3 {
            uart.push_input(b);
        }
        assert_eq!(uart.read(UARTRIS, 4) & INT_RX, 0);
        uart.push_input(3);
        assert_eq!(uart.read(UARTRIS, 4) & INT_RX, INT_RX);
        // ICR clears RXRIS even with data left; new data sets it again.
        uart.write(UARTICR, 4, INT_RX | INT_RT);
        assert_eq!(uart.read(UARTRIS, 4), 0);
        uart.push_input(4);
        assert_eq!(uart.read(UARTRIS, 4), INT_RX | INT_RT);
        // Reset empties the FIFO but keeps the counters.
        uart.reset();
        assert_eq!(uart.rx_len(), 0);
        assert_eq!(uart.counters().rx_refused, 2);
    }

    #[test]
    fn widths_and_unknown_offsets() {
        let mut uart = Pl011::new();
        // Narrow reads of the ID registers and of parts of a register.
        assert_eq!(uart.read(UARTPERIPHID0 + 8, 1), 0x34);
        assert_eq!(uart.read(UARTPCELLID0 + 12, 2), 0xb1);
        assert_eq!(uart.read(UARTCR + 1, 1), 0x03);
        assert_eq!(uart.read(UARTCR + 2, 2), 0);
        assert_eq!(uart.read(UARTIFLS, 1), 0x12);
        // Writes to a higher part are ignored.
        assert_eq!(uart.write(UARTCR + 1, 1, 0), Pl011Effect::NONE);
        assert_eq!(uart.read(UARTCR, 4), CR_TXE | CR_RXE);
        // Reading DR's upper byte does not consume input.
        uart.push_input(7);
        assert_eq!(uart.read(UARTDR + 1, 1), 0);
        assert_eq!(uart.rx_len(), 1);
        // Bad widths and alignment.
        assert_eq!(uart.read(UARTFR, 8), 0);
        assert_eq!(uart.read(UARTFR, 3), 0);
        assert_eq!(uart.read(UARTFR + 2, 4), 0);
        assert_eq!(uart.write(UARTDR + 1, 2, 0x41), Pl011Effect::NONE);
        assert_eq!(uart.counters().bad_width, 4);
        // Unknown offsets and read-only registers.
        for offset in [0x008, 0x014, 0x04c, 0x800, 0xfdc, 0x1000, !3] {
            assert_eq!(uart.read(offset, 4), 0, "offset {offset:#x}");
            assert_eq!(uart.write(offset, 4, !0), Pl011Effect::NONE);
        }
        assert_eq!(uart.counters().unknown, 1 + 14);
        uart.write(UARTFR, 4, 0);
        uart.write(UARTMIS, 4, 0);
        uart.write(UARTPERIPHID0, 4, 0);
        assert_eq!(uart.counters().read_only_writes, 3);
        assert_eq!(uart.read(UARTICR, 4), 0);
        // Stored registers are masked to their width.
        uart.write(UARTDMACR, 4, !0);
        uart.write(UARTILPR, 4, !0);
        uart.write(UARTIMSC, 4, !0);
        assert_eq!(uart.read(UARTDMACR, 4), 7);
        assert_eq!(uart.read(UARTILPR, 4), 0xff);
        assert_eq!(uart.read(UARTIMSC, 4), INT_ALL);
    }

    /// The mirror page image of `uart` (when it has one): every aligned
    /// 1-, 2- and 4-byte load from it returns what [`Pl011::read`] does,
    /// and such a read changes nothing the guest can see.
    fn mirror_reads_as_the_model(uart: &Pl011) -> Result<(), TestCaseError> {
        let Some(block) = uart.mirror_block() else {
            prop_assert!(uart.rx_len() > 0);
            return Ok(());
        };
        let mut page = [0u8; PL011_SIZE as usize];
        for (i, word) in block.iter().enumerate() {
            page[4 * i..4 * i + 4].copy_from_slice(&word.to_le_bytes());
        }
        let ids = UARTPERIPHID0 as usize;
        for (i, word) in MIRROR_ID_WORDS.iter().enumerate() {
            page[ids + 4 * i..ids + 4 * i + 4].copy_from_slice(&word.to_le_bytes());
        }
        for width in [1u8, 2, 4] {
            for offset in (0..PL011_SIZE).step_by(usize::from(width)) {
                let at = offset as usize;
                let mut bytes = [0u8; 4];
                bytes[..usize::from(width)].copy_from_slice(&page[at..at + usize::from(width)]);
                let mut model = uart.clone();
                prop_assert_eq!(
                    u32::from_le_bytes(bytes),
                    model.read(offset, width),
                    "offset {:#x} width {}",
                    offset,
                    width
                );
                prop_assert_eq!(model.mirror_block(), Some(block));
                prop_assert_eq!(model.irq_level(), uart.irq_level());
            }
        }
        Ok(())
    }

    #[test]
    fn a_saved_state_outside_what_the_guest_can_reach_is_refused() {
        let mut uart = Pl011::new();
        uart.write(UARTCR, 4, 0x301);
        for b in b"abc" {
            uart.push_input(*b);
        }
        let saved = savestate::to_bytes(&uart);
        let back: Pl011 = savestate::from_bytes(&saved).expect("restores");
        assert_eq!(format!("{back:?}"), format!("{uart:?}"));
        // Byte offsets: version 0, FIFO 1..33, head 33..41, depth 41..49,
        // then ILPR, IBRD, FBRD, LCR_H, CR, IFLS, IMSC, RIS, DMACR.
        let reg = |i: usize| 49 + 4 * i;
        let refused = |at: usize, bytes: &[u8]| {
            let mut bad = saved.clone();
            bad[at..at + bytes.len()].copy_from_slice(bytes);
            savestate::from_bytes::<Pl011>(&bad).unwrap_err()
        };
        assert_eq!(
            refused(0, &[2]),
            StateError::Version {
                device: "pl011",
                found: 2
            }
        );
        assert_eq!(
            refused(33, &[32]),
            StateError::Invalid("pl011 receive FIFO head")
        );
        assert_eq!(
            refused(41, &[33]),
            StateError::Invalid("pl011 receive FIFO depth")
        );
        assert_eq!(refused(reg(2), &[0x40]), StateError::Invalid("pl011 FBRD"));
        assert_eq!(refused(reg(6), &[0, 8]), StateError::Invalid("pl011 IMSC"));
        assert_eq!(
            savestate::from_bytes::<Pl011>(&saved[..saved.len() - 1]).unwrap_err(),
            StateError::Truncated
        );
        let mut longer = saved.clone();
        longer.push(0);
        assert_eq!(
            savestate::from_bytes::<Pl011>(&longer).unwrap_err(),
            StateError::Trailing
        );
    }

    proptest! {
        /// Random guest traffic never panics, the FIFO never exceeds its
        /// depth, and the line is always MIS != 0.
        #[test]
        fn random_traffic(ops in proptest::collection::vec(
            (0u8..3, prop_oneof![0u64..0x50, 0xfd0u64..0x1008, any::<u64>()], any::<u8>(), any::<u32>()),
            1..300,
        )) {
            let mut uart = Pl011::new();
            for (kind, offset, width, value) in ops {
                let width = if width < 200 { [1, 2, 4][usize::from(width % 3)] } else { width };
                let level = uart.irq_level();
                match kind {
                    0 => {
                        let mut kept = uart.clone();
                        let value = uart.read(offset, width);
                        match kept.read_keeping_level(offset, width) {
                            Some(v) => {
                                prop_assert_eq!(v, value);
                                prop_assert_eq!(uart.irq_level(), level);
                                prop_assert_eq!(format!("{kept:?}"), format!("{uart:?}"));
                            }
                            None => prop_assert!(uart.irq_level() != level),
                        }
                    }
                    1 => {
                        let predicted = uart.irq_level_after_transmit();
                        let changes = uart.transmit_changes_registers();
                        let block = uart.mirror_block();
                        let effect = uart.write(offset, width, value);
                        if offset == UARTDR && !changes {
                            prop_assert_eq!(uart.mirror_block(), block);
                        }
                        prop_assert_eq!(effect.irq_changed, uart.irq_level() != level);
                        if offset == UARTDR && effect.output.is_some() {
                            prop_assert_eq!(uart.irq_level(), predicted);
                        }
                    }
                    _ => {
                        let full = uart.read(UARTFR, 4) & FR_RXFF != 0;
                        prop_assert_eq!(uart.push_input(value as u8), !full);
                    }
                }
                prop_assert!(uart.rx_len() <= RX_FIFO_SIZE);
                // Every state the guest can reach is saved and restored
                // as it is.
                let restored: Pl011 = savestate::from_bytes(&savestate::to_bytes(&uart))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(format!("{restored:?}"), format!("{uart:?}"));
                mirror_reads_as_the_model(&uart)?;
                prop_assert_eq!(uart.irq_level(), uart.read(UARTMIS, 4) != 0);
                let fr = uart.read(UARTFR, 4);
                prop_assert_eq!(fr & FR_RXFE != 0, uart.rx_len() == 0);
                prop_assert_eq!(fr & (FR_TXFF | FR_BUSY), 0);
            }
        }
    }
}
