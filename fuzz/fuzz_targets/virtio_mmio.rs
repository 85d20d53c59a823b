//! The virtio-mmio register file alone, in front of the host tests' minimal
//! device (`virtio::testing::Sink`: two queues that return every buffer, an
//! 8-byte read-only config space). Invariants:
//! only aligned 32-bit accesses below the config space and aligned 1/2/4-byte
//! config accesses are accepted; reads return no more than their width; the
//! magic, version and IDs never change; FEATURES_OK sticks only for offered
//! features including VERSION_1; DRIVER_OK never stands without
//! FEATURES_OK; a reset (status 0) leaves nothing ready and nothing pending;
//! the interrupt line is InterruptStatus != 0; every buffer the device
//! consumed went back.
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::virtio::mmio::{self, MmioTransport};
use hypervisor::virtio::testing::{Sink, VecMemory};
use hypervisor::virtio::{Virtqueue, VIRTIO_F_VERSION_1};
use libfuzzer_sys::fuzz_target;

const BASE: u64 = 0x4000_0000;

#[derive(Arbitrary, Debug)]
enum Op {
    Read {
        offset: u16,
        width: u8,
    },
    Write {
        offset: u16,
        width: u8,
        value: u32,
    },
    /// The driver writes its memory (rings, descriptors).
    Poke {
        at: u16,
        value: u32,
    },
}

fuzz_target!(|ops: Vec<Op>| {
    let mut t = MmioTransport::new(Sink::default());
    let offered = t.offered_features();
    assert_ne!(offered & VIRTIO_F_VERSION_1, 0);
    let mut mem = VecMemory::new(BASE, 0x4000);
    for op in ops.iter().take(256) {
        match *op {
            Op::Read { offset, width } => {
                let offset = u64::from(offset);
                let r = t.read(offset, width);
                if let Ok(v) = r {
                    check_width(offset, width);
                    if width < 4 {
                        assert!(u64::from(v) < 1 << (8 * u32::from(width)));
                    }
                    match offset {
                        mmio::MAGIC_VALUE => assert_eq!(v, mmio::MAGIC),
                        mmio::VERSION => assert_eq!(v, 2),
                        mmio::DEVICE_ID => assert_eq!(v, 42),
                        mmio::VENDOR_ID => assert_eq!(v, mmio::VENDOR),
                        mmio::STATUS => assert_eq!(v, t.status()),
                        mmio::INTERRUPT_STATUS => assert_eq!(v, t.interrupt_status()),
                        _ => {}
                    }
                }
            }
            Op::Write {
                offset,
                width,
                value,
            } => {
                let offset = u64::from(offset);
                let ready_before: Vec<bool> = t.queues().iter().map(Virtqueue::ready).collect();
                let r = t.write(offset, width, value, &mut mem);
                if r.is_ok() {
                    check_width(offset, width);
                }
                if offset == mmio::STATUS && width == 4 && value == 0 {
                    assert_eq!(t.status(), 0, "reset");
                    assert!(t.queues().iter().all(|q| !q.ready() && q.in_flight() == 0));
                    assert_eq!(t.interrupt_status(), 0);
                }
                if offset != mmio::QUEUE_READY && offset != mmio::STATUS {
                    // Only QueueReady and Status change readiness.
                    let ready: Vec<bool> = t.queues().iter().map(Virtqueue::ready).collect();
                    assert_eq!(
                        ready, ready_before,
                        "readiness changed by a write to {offset:#x}"
                    );
                }
            }
            Op::Poke { at, value } => {
                let at = BASE + u64::from(at % 0x3ffc);
                mem.poke(at, &value.to_le_bytes());
            }
        }
        let status = t.status();
        if status & mmio::STATUS_FEATURES_OK != 0 {
            let n = t.negotiated_features();
            assert_eq!(
                n & !offered,
                0,
                "negotiated {n:#x} beyond offered {offered:#x}"
            );
            assert_ne!(n & VIRTIO_F_VERSION_1, 0);
        } else {
            assert_eq!(t.negotiated_features(), 0);
        }
        if status & mmio::STATUS_DRIVER_OK != 0 {
            assert_ne!(
                status & mmio::STATUS_FEATURES_OK,
                0,
                "DRIVER_OK without FEATURES_OK"
            );
        }
        assert_eq!(t.interrupt_pending(), t.interrupt_status() != 0);
        assert_eq!(t.interrupt_status() & !3, 0);
        for q in t.queues() {
            // Sink returns every chain it pops, unless the device stopped on it.
            if !t.needs_reset() {
                assert_eq!(q.in_flight(), 0);
            }
        }
    }
});

fn check_width(offset: u64, width: u8) {
    if offset < mmio::CONFIG {
        assert_eq!(
            width, 4,
            "{width}-byte register access accepted at {offset:#x}"
        );
        assert_eq!(offset % 4, 0);
    } else {
        assert!(matches!(width, 1 | 2 | 4) && offset.is_multiple_of(u64::from(width)));
        assert!(offset < mmio::WINDOW_SIZE);
    }
}
