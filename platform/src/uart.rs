//! The console UART drivers: the PL011 and the BCM2835 mini UART, polled,
//! on a register base the caller has mapped.
//!
//! They keep the line settings the firmware chose (the baud divisors in
//! particular, since only the firmware knows the UART clock) and only make
//! sure the transmitter and receiver are on.

use core::fmt;
use core::ptr::{read_volatile, write_volatile};

use crate::{Uart, UartKind};

/// An MMIO register block at a fixed base.
#[derive(Debug)]
struct Regs {
    base: usize,
}

impl Regs {
    fn read(&self, off: usize) -> u32 {
        // SAFETY: the driver's constructor contract says `base` maps this
        // device's registers, and every `off` used is a register inside it.
        unsafe { read_volatile((self.base + off) as *const u32) }
    }

    fn write(&mut self, off: usize, v: u32) {
        // SAFETY: as in `read`; registers are 32-bit and naturally aligned.
        unsafe { write_volatile((self.base + off) as *mut u32, v) }
    }
}

/// ARM PrimeCell PL011.
#[derive(Debug)]
pub struct Pl011 {
    regs: Regs,
}

const DR: usize = 0x00;
const FR: usize = 0x18;
const LCR_H: usize = 0x2c;
const CR: usize = 0x30;
const FR_BUSY: u32 = 1 << 3;
const FR_RXFE: u32 = 1 << 4;
const FR_TXFF: u32 = 1 << 5;
const LCR_H_FEN: u32 = 1 << 4;
const LCR_H_WLEN8: u32 = 0b11 << 5;
/// Break, parity enable, even parity, two stop bits, word length, stick parity.
const LCR_H_FRAME: u32 = 0b1 | 0b10 | 0b100 | 0b1000 | (0b11 << 5) | (1 << 7);
const CR_UARTEN: u32 = 1 << 0;
const CR_TXE: u32 = 1 << 8;
const CR_RXE: u32 = 1 << 9;

impl Pl011 {
    /// # Safety
    ///
    /// `base` must be the address at which this PL011's register block is
    /// mapped as device memory, for as long as the value lives, and nothing
    /// else may drive the device meanwhile.
    pub const unsafe fn new(base: usize) -> Self {
        Self {
            regs: Regs { base },
        }
    }

    /// Enables the UART, TX and RX; sets 8N1 with the FIFOs on if it was set
    /// otherwise. The baud divisors are left as the firmware set them.
    pub fn init(&mut self) {
        let cr = self.regs.read(CR);
        let lcr = self.regs.read(LCR_H);
        let want = (lcr & !LCR_H_FRAME) | LCR_H_WLEN8 | LCR_H_FEN;
        if lcr != want {
            // The TRM asks for the UART to be disabled, and idle, while the
            // line control register changes. BUSY stays set while a disabled
            // UART holds queued bytes, so wait only if it is sending.
            if cr & CR_UARTEN != 0 {
                self.flush();
            }
            self.regs.write(CR, cr & !CR_UARTEN);
            self.regs.write(LCR_H, want);
        }
        self.regs.write(CR, cr | CR_UARTEN | CR_TXE | CR_RXE);
    }

    pub fn put_byte(&mut self, b: u8) {
        while self.regs.read(FR) & FR_TXFF != 0 {
            core::hint::spin_loop();
        }
        self.regs.write(DR, b.into());
    }

    pub fn try_get_byte(&mut self) -> Option<u8> {
        // The upper DR bits are error flags: the byte is the low 8.
        (self.regs.read(FR) & FR_RXFE == 0).then(|| self.regs.read(DR) as u8)
    }

    /// Waits until every queued byte has left the shift register.
    pub fn flush(&mut self) {
        while self.regs.read(FR) & FR_BUSY != 0 {
            core::hint::spin_loop();
        }
    }
}

/// The BCM2835 auxiliary "mini" UART (the Pi 4's default console). Its clock
/// follows the VPU core clock, which the firmware fixes when it sets the baud.
#[derive(Debug)]
pub struct Bcm2835AuxUart {
    regs: Regs,
}

const AUX_MU_IO: usize = 0x00;
const AUX_MU_LSR: usize = 0x14;
const AUX_MU_CNTL: usize = 0x20;
const LSR_DATA_READY: u32 = 1 << 0;
const LSR_TX_EMPTY: u32 = 1 << 5;
const LSR_TX_IDLE: u32 = 1 << 6;
const CNTL_RX_EN: u32 = 1 << 0;
const CNTL_TX_EN: u32 = 1 << 1;

impl Bcm2835AuxUart {
    /// # Safety
    ///
    /// `base` must be the address at which the mini UART's registers (the
    /// `brcm,bcm2835-aux-uart` node's `reg`, e.g. 0xfe215040) are mapped as
    /// device memory, for as long as the value lives; the firmware must have
    /// enabled the mini UART in AUX_ENABLES (it does when it is the console);
    /// nothing else may drive the device meanwhile.
    pub const unsafe fn new(base: usize) -> Self {
        Self {
            regs: Regs { base },
        }
    }

    /// Makes sure the transmitter and receiver are enabled; the baud rate and
    /// data size stay as the firmware set them.
    pub fn init(&mut self) {
        let cntl = self.regs.read(AUX_MU_CNTL);
        if cntl & (CNTL_RX_EN | CNTL_TX_EN) != CNTL_RX_EN | CNTL_TX_EN {
            self.regs.write(AUX_MU_CNTL, cntl | CNTL_RX_EN | CNTL_TX_EN);
        }
    }

    pub fn put_byte(&mut self, b: u8) {
        // "Transmitter empty" means the FIFO can take at least one byte.
        while self.regs.read(AUX_MU_LSR) & LSR_TX_EMPTY == 0 {
            core::hint::spin_loop();
        }
        self.regs.write(AUX_MU_IO, b.into());
    }

    pub fn try_get_byte(&mut self) -> Option<u8> {
        (self.regs.read(AUX_MU_LSR) & LSR_DATA_READY != 0).then(|| self.regs.read(AUX_MU_IO) as u8)
    }

    /// Waits until the FIFO is empty and the transmitter idle.
    pub fn flush(&mut self) {
        while self.regs.read(AUX_MU_LSR) & LSR_TX_IDLE == 0 {
            core::hint::spin_loop();
        }
    }
}

/// The console, whichever kind the tree named.
#[derive(Debug)]
pub enum ConsoleUart {
    Pl011(Pl011),
    Aux(Bcm2835AuxUart),
}

impl ConsoleUart {
    /// A driver for `uart` with its registers at `base` (the virtual address
    /// at which `uart.regs` is mapped; `uart.regs.start` under an identity
    /// map).
    ///
    /// # Safety
    ///
    /// As [`Pl011::new`] or [`Bcm2835AuxUart::new`], for the kind of `uart`.
    pub unsafe fn new(uart: &Uart, base: usize) -> Self {
        match uart.kind {
            // SAFETY: forwarded to our caller.
            UartKind::Pl011 => Self::Pl011(unsafe { Pl011::new(base) }),
            // SAFETY: forwarded to our caller.
            UartKind::Bcm2835Aux => Self::Aux(unsafe { Bcm2835AuxUart::new(base) }),
        }
    }

    /// A driver for `uart` at its physical address, for an identity map.
    ///
    /// # Safety
    ///
    /// As [`ConsoleUart::new`] with `base = uart.regs.start`.
    pub unsafe fn from_uart(uart: &Uart) -> Self {
        // SAFETY: forwarded to our caller.
        unsafe { Self::new(uart, uart.regs.start as usize) }
    }

    pub fn init(&mut self) {
        match self {
            Self::Pl011(u) => u.init(),
            Self::Aux(u) => u.init(),
        }
    }

    pub fn put_byte(&mut self, b: u8) {
        match self {
            Self::Pl011(u) => u.put_byte(b),
            Self::Aux(u) => u.put_byte(b),
        }
    }

    pub fn try_get_byte(&mut self) -> Option<u8> {
        match self {
            Self::Pl011(u) => u.try_get_byte(),
            Self::Aux(u) => u.try_get_byte(),
        }
    }

    pub fn flush(&mut self) {
        match self {
            Self::Pl011(u) => u.flush(),
            Self::Aux(u) => u.flush(),
        }
    }
}

impl fmt::Write for ConsoleUart {
    /// Writes `s` with each "\n" sent as "\r\n", as terminals expect.
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            if b == b'\n' {
                self.put_byte(b'\r');
            }
            self.put_byte(b);
        }
        Ok(())
    }
}
