//! Restoring a device's saved state (`hypervisor::savestate`) from any
//! bytes: the first byte picks the device (the PL011, the vGIC
//! distributor, the virtio-mmio transport with the balloon or the
//! console, a virtqueue), the rest is its state. Invariants: no panic;
//! the reader accepts only canonical encodings (saving what it restored
//! gives back exactly the bytes it read, so one state has one encoding);
//! and a restored device answers its guest's accesses and the hypervisor's
//! questions without panicking.
#![no_main]

use hypervisor::balloon::Balloon;
use hypervisor::pl011::{Pl011, PL011_SIZE};
use hypervisor::savestate::{SaveState, StateReader, StateWriter};
use hypervisor::vgic::VDistributor;
use hypervisor::virtio::{MmioTransport, Virtqueue};
use hypervisor::virtio_console::VirtioConsole;
use libfuzzer_sys::fuzz_target;

/// What `restore` read of `input`, saved again, is exactly those bytes.
fn canonical<T>(
    input: &[u8],
    restore: impl FnOnce(&mut StateReader<'_>) -> Option<T>,
    save: impl FnOnce(&T, &mut StateWriter),
) -> Option<T> {
    let mut r = StateReader::new(input);
    let device = restore(&mut r)?;
    let left = r.remaining();
    let mut w = StateWriter::default();
    save(&device, &mut w);
    assert_eq!(
        w.into_bytes(),
        input[..input.len() - left],
        "a restored state saves other bytes than it was read from"
    );
    Some(device)
}

fn transport_reads<D: hypervisor::virtio::VirtioDevice>(t: &mut MmioTransport<D>) {
    for offset in (0..0x200).step_by(4) {
        let _ = t.read(offset, 4);
    }
    let _ = t.interrupt_pending();
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, state)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => {
            if let Some(mut uart) = canonical(state, |r| Pl011::restore(r).ok(), Pl011::save) {
                for offset in (0..PL011_SIZE).step_by(4) {
                    let _ = uart.read(offset, 4);
                }
                let _ = uart.irq_level();
                let _ = uart.push_input(b'x');
            }
        }
        1 => {
            if let Some(mut d) =
                canonical(state, |r| VDistributor::restore(r).ok(), VDistributor::save)
            {
                for vcpu in 0..d.vcpus() {
                    if let Some(irq) = d.next_pending(vcpu, |_| false) {
                        assert!(irq.intid < d.irq_end());
                        d.on_listed(vcpu, &irq);
                    }
                }
                let _ = d.pending_vcpus();
            }
        }
        2 => {
            let restore = |r: &mut StateReader<'_>| MmioTransport::<Balloon>::restore(r).ok();
            if let Some(mut t) = canonical(state, restore, MmioTransport::save) {
                transport_reads(&mut t);
                let _ = t.device().ballooned_pages();
            }
        }
        3 => {
            let restore = |r: &mut StateReader<'_>| MmioTransport::<VirtioConsole>::restore(r).ok();
            if let Some(mut t) = canonical(state, restore, MmioTransport::save) {
                transport_reads(&mut t);
                let _ = t.device().has_more();
            }
        }
        4 => {
            let Some((&max, state)) = state.split_first() else {
                return;
            };
            let max = 1u16 << (max % 16);
            let restore = |r: &mut StateReader<'_>| Virtqueue::restore(r, max).ok();
            if let Some(q) = canonical(state, restore, Virtqueue::save) {
                assert!(q.in_flight() <= u32::from(max));
            }
        }
        _ => {
            let _ = canonical(state, |r| Balloon::restore(r).ok(), Balloon::save);
        }
    }
});
