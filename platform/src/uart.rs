//! The console UART drivers: the PL011 and the BCM2835 mini UART, polled,
//! on a register base the caller has mapped; the receive interrupt can be
//! turned on so that a CPU waiting for input sleeps until a byte arrives.
//!
//! They keep the line settings the firmware chose (the baud divisors in
//! particular, since only the firmware knows the UART clock) and only make
//! sure the transmitter and receiver are on.

use core::fmt;

use tock_registers::interfaces::{Readable, Writeable};
use tock_registers::registers::{ReadOnly, ReadWrite};
use tock_registers::{register_bitfields, register_structs};

use crate::{Uart, UartKind};

/// The PL011's register fields (PrimeCell UART PL011 TRM, section 3.3):
/// this driver's, and the ones the hypervisor's emulated PL011 offers its
/// guests (`hypervisor::pl011`). The interrupt bits are the same in
/// UARTIMSC, UARTRIS, UARTMIS and UARTICR.
pub mod pl011 {
    use tock_registers::register_bitfields;

    register_bitfields! {u32,
        pub UARTDR [
            /// The received or transmitted byte (the upper bits are error flags).
            DATA OFFSET(0) NUMBITS(8) []
        ],
        pub UARTFR [
            TXFE OFFSET(7) NUMBITS(1) [],
            RXFF OFFSET(6) NUMBITS(1) [],
            TXFF OFFSET(5) NUMBITS(1) [],
            RXFE OFFSET(4) NUMBITS(1) [],
            BUSY OFFSET(3) NUMBITS(1) []
        ],
        pub UARTLCR_H [
            /// Stick parity.
            SPS OFFSET(7) NUMBITS(1) [],
            WLEN OFFSET(5) NUMBITS(2) [
                Bits8 = 0b11
            ],
            FEN OFFSET(4) NUMBITS(1) [],
            /// Two stop bits.
            STP2 OFFSET(3) NUMBITS(1) [],
            /// Even parity.
            EPS OFFSET(2) NUMBITS(1) [],
            /// Parity enable.
            PEN OFFSET(1) NUMBITS(1) [],
            /// Send break.
            BRK OFFSET(0) NUMBITS(1) []
        ],
        pub UARTCR [
            RXE OFFSET(9) NUMBITS(1) [],
            TXE OFFSET(8) NUMBITS(1) [],
            UARTEN OFFSET(0) NUMBITS(1) []
        ],
        pub UARTIMSC [
            /// Receive timeout: bytes in the FIFO and the line quiet.
            RTIM OFFSET(6) NUMBITS(1) [],
            /// Transmit: the FIFO fell to its trigger level.
            TXIM OFFSET(5) NUMBITS(1) [],
            /// Receive: the FIFO reached its trigger level.
            RXIM OFFSET(4) NUMBITS(1) []
        ]
    }
}

use pl011::{UARTCR, UARTDR, UARTFR, UARTIMSC, UARTLCR_H};

register_bitfields! {u32,
    AUX_MU_IO [
        DATA OFFSET(0) NUMBITS(8) []
    ],
    AUX_MU_IER [
        /// Must be set for any interrupt (BCM2835 datasheet errata: the
        /// bits are documented as don't-care).
        REQUIRED OFFSET(2) NUMBITS(2) [],
        /// Receive interrupt (the datasheet swaps it with transmit, bit 1).
        RX OFFSET(0) NUMBITS(1) []
    ],
    AUX_MU_LSR [
        /// Transmitter idle: FIFO empty and the last bit sent.
        TX_IDLE OFFSET(6) NUMBITS(1) [],
        /// Transmitter empty: the FIFO can take at least one byte.
        TX_EMPTY OFFSET(5) NUMBITS(1) [],
        DATA_READY OFFSET(0) NUMBITS(1) []
    ],
    AUX_MU_CNTL [
        TX_EN OFFSET(1) NUMBITS(1) [],
        RX_EN OFFSET(0) NUMBITS(1) []
    ]
}

register_structs! {
    /// The PL011 registers these drivers use.
    Pl011Regs {
        (0x00 => dr: ReadWrite<u32, UARTDR::Register>),
        (0x04 => _reserved0),
        (0x18 => fr: ReadOnly<u32, UARTFR::Register>),
        (0x1c => _reserved1),
        (0x2c => lcr_h: ReadWrite<u32, UARTLCR_H::Register>),
        (0x30 => cr: ReadWrite<u32, UARTCR::Register>),
        (0x34 => _reserved2),
        (0x38 => imsc: ReadWrite<u32, UARTIMSC::Register>),
        (0x3c => @END),
    },
    /// The mini UART's registers (from AUX_MU_IO).
    AuxUartRegs {
        (0x00 => io: ReadWrite<u32, AUX_MU_IO::Register>),
        (0x04 => ier: ReadWrite<u32, AUX_MU_IER::Register>),
        (0x08 => _reserved0),
        (0x14 => lsr: ReadOnly<u32, AUX_MU_LSR::Register>),
        (0x18 => _reserved1),
        (0x20 => cntl: ReadWrite<u32, AUX_MU_CNTL::Register>),
        (0x24 => @END),
    }
}

/// An MMIO register block `T` at a fixed base (kept as an address so that a
/// driver stays `Send` and `Sync` as before).
struct Regs<T> {
    base: usize,
    block: core::marker::PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Regs<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Regs({:#x})", self.base)
    }
}

impl<T> Regs<T> {
    const fn new(base: usize) -> Self {
        Self {
            base,
            block: core::marker::PhantomData,
        }
    }

    fn get(&self) -> &T {
        // SAFETY: the driver's constructor contract says `base` maps this
        // device's registers for as long as the driver lives; they are only
        // accessed through volatile reads and writes of their own width.
        unsafe { &*(self.base as *const T) }
    }
}

/// ARM PrimeCell PL011.
#[derive(Debug)]
pub struct Pl011 {
    regs: Regs<Pl011Regs>,
    /// Bytes the transmit FIFO certainly has room for without a look at
    /// FR: every PL011 revision's FIFO holds at least [`TX_FIFO_MIN`],
    /// all free when FR shows TXFE. Only [`Pl011::put_byte`] writes DR.
    tx_room: u8,
    /// LCR_H.FEN as [`Pl011::init`] left it (off: a one-byte holding
    /// register, so TXFE means room for one).
    fifo_on: bool,
}

/// The smallest PL011 transmit FIFO (r1p3 and earlier; r1p5 has 32).
const TX_FIFO_MIN: u8 = 16;

impl Pl011 {
    /// # Safety
    ///
    /// `base` must be the address at which this PL011's register block is
    /// mapped as device memory, for as long as the value lives, and nothing
    /// else may drive the device meanwhile.
    pub const unsafe fn new(base: usize) -> Self {
        Self {
            regs: Regs::new(base),
            tx_room: 0,
            fifo_on: false,
        }
    }

    /// Enables the UART, TX and RX; sets 8N1 with the FIFOs on if it was set
    /// otherwise. The baud divisors are left as the firmware set them.
    pub fn init(&mut self) {
        use UARTLCR_H::{BRK, EPS, FEN, PEN, SPS, STP2, WLEN};
        let regs = self.regs.get();
        let cr = regs.cr.extract();
        let lcr = regs.lcr_h.get();
        let want = (BRK::CLEAR
            + PEN::CLEAR
            + EPS::CLEAR
            + STP2::CLEAR
            + SPS::CLEAR
            + WLEN::Bits8
            + FEN::SET)
            .modify(lcr);
        if lcr != want {
            // The TRM asks for the UART to be disabled, and idle, while the
            // line control register changes. BUSY stays set while a disabled
            // UART holds queued bytes, so wait only if it is sending.
            if cr.is_set(UARTCR::UARTEN) {
                self.flush();
            }
            let regs = self.regs.get();
            regs.cr.set((UARTCR::UARTEN::CLEAR).modify(cr.get()));
            regs.lcr_h.set(want);
        }
        self.regs
            .get()
            .cr
            .set(cr.get() | (UARTCR::UARTEN::SET + UARTCR::TXE::SET + UARTCR::RXE::SET).value);
        self.fifo_on = true;
        self.tx_room = 0;
    }

    pub fn put_byte(&mut self, b: u8) {
        let regs = self.regs.get();
        // FR is read once per FIFO's worth when the FIFO drains as fast as
        // it fills (under QEMU each read is a trip through its device
        // model and lock), per byte when it does not.
        if self.tx_room == 0 {
            let fr = loop {
                let fr = regs.fr.extract();
                if !fr.is_set(UARTFR::TXFF) {
                    break fr;
                }
                core::hint::spin_loop();
            };
            self.tx_room = if self.fifo_on && fr.is_set(UARTFR::TXFE) {
                TX_FIFO_MIN
            } else {
                1
            };
        }
        regs.dr.write(UARTDR::DATA.val(b.into()));
        self.tx_room -= 1;
    }

    pub fn try_get_byte(&mut self) -> Option<u8> {
        let regs = self.regs.get();
        (!regs.fr.is_set(UARTFR::RXFE)).then(|| regs.dr.read(UARTDR::DATA) as u8)
    }

    /// Raises the UART's interrupt while received bytes wait (the FIFO at
    /// its trigger level, or any byte once the line is quiet).
    pub fn enable_rx_interrupt(&mut self) {
        let imsc = &self.regs.get().imsc;
        imsc.set(imsc.get() | (UARTIMSC::RXIM::SET + UARTIMSC::RTIM::SET).value);
    }

    /// Waits until every queued byte has left the shift register.
    pub fn flush(&mut self) {
        while self.regs.get().fr.is_set(UARTFR::BUSY) {
            core::hint::spin_loop();
        }
    }
}

/// The BCM2835 auxiliary "mini" UART (the Pi 4's default console). Its clock
/// follows the VPU core clock, which the firmware fixes when it sets the baud.
#[derive(Debug)]
pub struct Bcm2835AuxUart {
    regs: Regs<AuxUartRegs>,
}

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
            regs: Regs::new(base),
        }
    }

    /// Makes sure the transmitter and receiver are enabled; the baud rate and
    /// data size stay as the firmware set them.
    pub fn init(&mut self) {
        let cntl = &self.regs.get().cntl;
        let enabled = AUX_MU_CNTL::RX_EN::SET + AUX_MU_CNTL::TX_EN::SET;
        if !cntl.matches_all(enabled) {
            cntl.set(cntl.get() | enabled.value);
        }
    }

    pub fn put_byte(&mut self, b: u8) {
        let regs = self.regs.get();
        while !regs.lsr.is_set(AUX_MU_LSR::TX_EMPTY) {
            core::hint::spin_loop();
        }
        regs.io.write(AUX_MU_IO::DATA.val(b.into()));
    }

    pub fn try_get_byte(&mut self) -> Option<u8> {
        let regs = self.regs.get();
        regs.lsr
            .is_set(AUX_MU_LSR::DATA_READY)
            .then(|| regs.io.read(AUX_MU_IO::DATA) as u8)
    }

    /// Raises the AUX interrupt while a received byte waits (the transmit
    /// interrupt stays off).
    pub fn enable_rx_interrupt(&mut self) {
        self.regs
            .get()
            .ier
            .write(AUX_MU_IER::RX::SET + AUX_MU_IER::REQUIRED.val(0b11));
    }

    /// Waits until the FIFO is empty and the transmitter idle.
    pub fn flush(&mut self) {
        while !self.regs.get().lsr.is_set(AUX_MU_LSR::TX_IDLE) {
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

    /// Turns the receive interrupt on (routing it is the caller's).
    pub fn enable_rx_interrupt(&mut self) {
        match self {
            Self::Pl011(u) => u.enable_rx_interrupt(),
            Self::Aux(u) => u.enable_rx_interrupt(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A PL011 register block in plain memory: DR keeps the last byte
    /// written, FR reads whatever the test stored.
    #[repr(C, align(4096))]
    struct FakeBlock([u32; 1024]);

    const FR: usize = 0x18 / 4;
    const TXFE: u32 = 1 << 7;
    const TXFF: u32 = 1 << 5;

    /// Runs `f` on a thread: false if it has not returned within a second
    /// (it spins on FR showing the FIFO full).
    fn returns(f: impl FnOnce() + Send + 'static) -> bool {
        let (done, wait) = mpsc::channel();
        std::thread::spawn(move || {
            f();
            let _ = done.send(());
        });
        wait.recv_timeout(Duration::from_secs(1)).is_ok()
    }

    #[test]
    fn fr_is_read_once_per_fifo_when_it_drains() {
        let block: &'static mut FakeBlock = Box::leak(Box::new(FakeBlock([0; 1024])));
        let base = block as *mut FakeBlock as usize;
        let fr = |value: u32| {
            // SAFETY: the leaked block lives for the test; the UART only
            // reads FR and writes DR.
            unsafe { core::ptr::write_volatile((base as *mut u32).add(FR), value) }
        };
        // SAFETY: the block stands in for the registers, used by this UART only.
        let mut uart = unsafe { Pl011::new(base) };
        uart.fifo_on = true;
        fr(TXFE);
        uart.put_byte(b'a');
        // Empty at the first byte: 15 more go without a look at FR, even
        // though FR now says full.
        fr(TXFF);
        let (uart, more) = {
            let (tx, rx) = mpsc::channel();
            let ok = returns(move || {
                for _ in 0..15 {
                    uart.put_byte(b'b');
                }
                let _ = tx.send(uart);
            });
            (rx.recv_timeout(Duration::from_millis(10)).ok(), ok)
        };
        assert!(more, "a byte within the FIFO's room waited on FR");
        let mut uart = uart.expect("the thread handed the UART back");
        // The 17th looks again, and waits while FR says full.
        let spins = returns(move || uart.put_byte(b'c'));
        assert!(!spins, "the 17th byte did not wait for room");
    }

    #[test]
    fn without_fifo_every_byte_looks_at_fr() {
        let block: &'static mut FakeBlock = Box::leak(Box::new(FakeBlock([0; 1024])));
        let base = block as *mut FakeBlock as usize;
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile((base as *mut u32).add(FR), TXFE) };
        // SAFETY: as above; never `init`ed, so the FIFO is not known on.
        let mut uart = unsafe { Pl011::new(base) };
        uart.put_byte(b'a');
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile((base as *mut u32).add(FR), TXFF) };
        assert!(!returns(move || uart.put_byte(b'b')));
    }
}
