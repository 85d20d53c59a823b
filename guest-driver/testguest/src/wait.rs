//! How the test guest waits for the balloon: sleeping in WFI until the
//! device's interrupt or the virtual timer (when the device tree has a GIC
//! this guest can drive), or polling as before (when it has none).
//!
//! Interrupts stay masked at the CPU (PSTATE.I): WFI wakes on a pending
//! interrupt even so, and the guest then takes it by reading the GIC's
//! acknowledge register, acknowledges the device (the balloon driver reads
//! and clears InterruptStatus) or turns the timer off, and ends it (EOI).

use crate::arch::{self, counter};
use crate::board::{Board, GicInfo, Irq};
use crate::gic::{self, Gic};
use guest_driver::Wait;

/// Interrupts taken per wake-up at most before going back to the caller.
const TAKE_PER_WAKE: usize = 8;
/// The architected virtual timer PPI, if the tree has no timer node.
const VIRTUAL_TIMER: Irq = Irq {
    intid: 27,
    edge: false,
};
/// How long a polling wait sleeps between polls of the target.
const POLL_INTERVAL_US: u64 = 10_000;

/// Sleeping until interrupts.
pub struct Interrupts {
    gic: Gic,
    balloon: u32,
    timer: u32,
}

/// How this guest waits.
pub enum Waiter {
    Interrupts(Interrupts),
    Polling,
}

impl Waiter {
    /// Sets up the GIC for the balloon's interrupt and the virtual timer's, or
    /// falls back to polling (and says why). Prints how the guest waits.
    pub fn new(board: &Board, balloon_slot: Option<(u64, u64)>) -> Waiter {
        let balloon = balloon_slot.and_then(|(base, _)| board.virtio_irq_of(base));
        let Some(info) = board.gic else {
            println!("no GIC in the device tree: polling");
            return Waiter::Polling;
        };
        // A tree that names the other GIC than the CPU's is wrong about the
        // board (Tidal on GICv3 hosts still describes a GICv2 it does not
        // provide; touching it stops the VM): trust neither, poll.
        let sysregs = arch::cpu_has_gicv3_interface();
        match info {
            GicInfo::V2 { .. } if sysregs => {
                println!(
                    "GICv2 in the device tree, but the CPU has a GICv3 interface (ID_AA64PFR0_EL1.GIC): polling"
                );
                return Waiter::Polling;
            }
            GicInfo::V3 { .. } if !sysregs => {
                println!(
                    "GICv3 in the device tree, but the CPU has no GICv3 interface (ID_AA64PFR0_EL1.GIC): polling"
                );
                return Waiter::Polling;
            }
            _ => {}
        }
        let Some(balloon) = balloon else {
            println!("no interrupt for the balloon in the device tree: polling");
            return Waiter::Polling;
        };
        let timer = board.virtual_timer.unwrap_or(VIRTUAL_TIMER);
        let gic = match Gic::init(info) {
            Ok(gic) => gic,
            Err(e) => {
                println!("GIC: {e}: polling");
                return Waiter::Polling;
            }
        };
        arch::virtual_timer_off();
        gic.enable(balloon);
        gic.enable(timer);
        println!(
            "interrupts via {} (virtio INTID {}, {}; virtual timer INTID {})",
            gic.name(),
            balloon.intid,
            if balloon.edge { "edge" } else { "level" },
            timer.intid
        );
        Waiter::Interrupts(Interrupts {
            gic,
            balloon: balloon.intid,
            timer: timer.intid,
        })
    }

    /// Waits for something to do, at the latest until the counter reaches
    /// `deadline`: the balloon's interrupt (through `wait_once`, which
    /// acknowledges it at the device) or the timer. A polling guest sleeps a
    /// while instead.
    pub fn sleep_until(&mut self, deadline: u64, wait_once: impl FnOnce(&mut Self)) {
        match self {
            Waiter::Interrupts(_) => {
                if counter() < deadline {
                    arch::virtual_timer_fire_at(deadline);
                    wait_once(self);
                }
            }
            Waiter::Polling => arch::delay_us(POLL_INTERVAL_US),
        }
    }
}

impl Wait for Waiter {
    fn wait(&mut self, acknowledge: &mut dyn FnMut()) {
        let Waiter::Interrupts(irq) = self else {
            core::hint::spin_loop();
            return;
        };
        gic::wait_for_interrupt();
        for _ in 0..TAKE_PER_WAKE {
            let Some(acked) = irq.gic.acknowledge() else {
                break;
            };
            if acked.intid == irq.balloon {
                acknowledge();
            } else if acked.intid == irq.timer {
                arch::virtual_timer_off();
            }
            irq.gic.end(acked);
        }
    }
}
