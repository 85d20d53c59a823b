//! The emulated PL011: any sequence of guest register accesses and console
//! input. Invariants: reads return at most `width` bytes; the receive FIFO
//! behaves as a FIFO (bytes come out of DR in the order they were accepted,
//! never more than its depth are accepted); the interrupt output is
//! RIS & IMSC; a write reports exactly when the interrupt output changed.
#![no_main]

use std::collections::VecDeque;

use arbitrary::Arbitrary;
use hypervisor::pl011::{Pl011, RX_FIFO_SIZE};
use libfuzzer_sys::fuzz_target;

const UARTDR: u64 = 0x000;
const UARTRIS: u64 = 0x03c;
const UARTIMSC: u64 = 0x038;
const UARTMIS: u64 = 0x040;

#[derive(Arbitrary, Debug)]
enum Op {
    Read { offset: u16, width: u8 },
    Write { offset: u16, width: u8, value: u32 },
    Input(u8),
    Reset,
}

fuzz_target!(|ops: Vec<Op>| {
    let mut uart = Pl011::new();
    let mut fifo: VecDeque<u8> = VecDeque::new();
    for op in ops.iter().take(512) {
        let level = uart.irq_level();
        match *op {
            Op::Read { offset, width } => {
                let offset = u64::from(offset);
                let value = uart.read(offset, width);
                if width < 4 {
                    assert!(
                        u64::from(value) < 1u64 << (8 * u32::from(width)),
                        "{value:#x} wider than {width} bytes"
                    );
                }
                let valid = matches!(width, 1 | 2 | 4) && offset % u64::from(width) == 0;
                if valid && offset == UARTDR {
                    let expected = fifo.pop_front().map_or(0, u32::from);
                    assert_eq!(value & 0xff, expected, "DR returns the oldest byte");
                }
            }
            Op::Write {
                offset,
                width,
                value,
            } => {
                let effect = uart.write(u64::from(offset), width, value);
                assert_eq!(effect.irq_changed, uart.irq_level() != level);
                if effect.output.is_some() {
                    assert_eq!(offset & !3, UARTDR as u16);
                }
            }
            Op::Input(byte) => {
                let before = uart.rx_len();
                if uart.push_input(byte) {
                    fifo.push_back(byte);
                    assert_eq!(uart.rx_len(), before + 1);
                } else {
                    assert!(before >= 1, "input refused with an empty FIFO");
                }
            }
            Op::Reset => {
                uart.reset();
                fifo.clear();
            }
        }
        assert_eq!(uart.rx_len(), fifo.len());
        assert!(uart.rx_len() <= RX_FIFO_SIZE);
        let ris = uart.read(UARTRIS, 4);
        let imsc = uart.read(UARTIMSC, 4);
        assert_eq!(uart.read(UARTMIS, 4), ris & imsc);
        assert_eq!(uart.irq_level(), ris & imsc != 0);
    }
});
