//! Host tests of the GICv3 face of the virtual distributor.

use super::*;
use proptest::prelude::*;

const SGI: u64 = GICR_SGI_BASE;
const IROUTER: u64 = 0x6000;

fn d3(vcpus: usize) -> VDistributor {
    VDistributor::new_v3(vcpus, 64).unwrap()
}

/// What Linux's irq-gic-v3.c does at boot: gic_dist_init on the boot CPU
/// (all SPIs group 1, level, priority 0xa0, routed to the boot CPU), then,
/// on every CPU, the redistributor wake-up and gic_cpu_config.
fn linux_boot(d: &mut VDistributor) {
    let typer = d.read_dist_v3(0, GICD_TYPER, 4).unwrap();
    let irqs = ((((typer & 0x1f) + 1) * 32) as u32).min(1020);
    d.write_dist_v3(0, GICD_CTLR, 4, 0).unwrap();
    for i in (32..irqs).step_by(32) {
        let o = u64::from(i / 8);
        d.write_dist_v3(0, GICD_IGROUPR + o, 4, !0).unwrap();
        d.write_dist_v3(0, GICD_ICACTIVER + o, 4, !0).unwrap();
        d.write_dist_v3(0, GICD_ICENABLER + o, 4, !0).unwrap();
    }
    for i in (32..irqs).step_by(16) {
        d.write_dist_v3(0, GICD_ICFGR + u64::from(i / 4), 4, 0)
            .unwrap();
    }
    for i in (32..irqs).step_by(4) {
        d.write_dist_v3(0, GICD_IPRIORITYR + u64::from(i), 4, 0xa0a0_a0a0)
            .unwrap();
    }
    d.write_dist_v3(0, GICD_CTLR, 4, (1 << 4) | 3).unwrap();
    for i in 32..irqs {
        d.write_dist_v3(0, IROUTER + 8 * u64::from(i), 8, 0)
            .unwrap();
    }
    for cpu in 0..d.vcpus() {
        // gic_populate_rdist: find the frame whose TYPER names this CPU.
        let frame = (0..d.vcpus())
            .find(|&r| d.read_redist(cpu, r, GICR_TYPER, 8).unwrap() >> 32 == cpu as u64)
            .unwrap();
        let waker = d.read_redist(cpu, frame, GICR_WAKER, 4).unwrap();
        d.write_redist(cpu, frame, GICR_WAKER, 4, waker & !2)
            .unwrap();
        assert_eq!(d.read_redist(cpu, frame, GICR_WAKER, 4).unwrap() & 4, 0);
        d.write_redist(cpu, frame, SGI + GICD_IGROUPR, 4, !0)
            .unwrap();
        d.write_redist(cpu, frame, SGI + GICD_ICACTIVER, 4, !0)
            .unwrap();
        d.write_redist(cpu, frame, SGI + GICD_ICENABLER, 4, 0xffff_0000)
            .unwrap();
        d.write_redist(cpu, frame, SGI + GICD_ISENABLER, 4, 0x0000_ffff)
            .unwrap();
        for i in (0..32).step_by(4) {
            d.write_redist(cpu, frame, SGI + GICD_IPRIORITYR + i, 4, 0xa0a0_a0a0)
                .unwrap();
        }
    }
}

#[test]
fn identifies_as_gicv3_with_affinity_routing() {
    let mut d = d3(2);
    assert_eq!(d.read_dist_v3(0, 0xffe8, 4).unwrap() & 0xf0, 0x30);
    assert_eq!(d.read_redist(0, 1, 0xffe8, 4).unwrap() & 0xf0, 0x30);
    let ctlr = d.read_dist_v3(0, GICD_CTLR, 4).unwrap();
    assert_eq!(
        ctlr & (1 << 4 | 1 << 6),
        1 << 4 | 1 << 6,
        "ARE and DS read 1"
    );
    let typer = d.read_dist_v3(0, GICD_TYPER, 4).unwrap();
    assert_eq!((typer >> 19) & 0x1f, 9, "10 INTID bits");
    assert_eq!(typer & (1 << 17), 0, "no LPIs");
    assert_eq!((typer & 0x1f) + 1, 3, "96 INTIDs for 64 SPIs");
}

#[test]
fn redistributor_typer_names_each_vcpu_and_the_last() {
    let mut d = d3(3);
    for r in 0..3 {
        let typer = d.read_redist(0, r, GICR_TYPER, 8).unwrap();
        assert_eq!(typer >> 32, r as u64, "Aff0");
        assert_eq!((typer >> 8) & 0xffff, r as u64, "processor number");
        assert_eq!(typer & (1 << 4) != 0, r == 2, "Last");
        assert_eq!(typer & 1, 0, "no physical LPIs");
        // The two 32-bit halves agree with the 64-bit read.
        let lo = d.read_redist(0, r, GICR_TYPER, 4).unwrap();
        let hi = d.read_redist(0, r, GICR_TYPER + 4, 4).unwrap();
        assert_eq!(hi << 32 | lo, typer);
    }
    assert!(d.read_redist(0, 3, GICR_TYPER, 8).is_err());
}

#[test]
fn waker_starts_asleep_and_wakes() {
    let mut d = d3(1);
    assert_eq!(d.read_redist(0, 0, GICR_WAKER, 4).unwrap(), 6);
    d.write_redist(0, 0, GICR_WAKER, 4, 0).unwrap();
    assert_eq!(d.read_redist(0, 0, GICR_WAKER, 4).unwrap(), 0);
    d.reset();
    assert_eq!(d.read_redist(0, 0, GICR_WAKER, 4).unwrap(), 6);
}

#[test]
fn spi_follows_irouter_to_its_vcpu() {
    let mut d = d3(2);
    linux_boot(&mut d);
    let intid = 48;
    d.write_dist_v3(0, GICD_ISENABLER + 4, 4, 1 << 16).unwrap();
    let effect = d.set_level(intid, true).unwrap();
    assert!(effect.kicks(0) && !effect.kicks(1));
    assert_eq!(d.next_pending(0, |_| false).unwrap().intid, intid);
    // Rerouting to vCPU 1 moves it (and says vCPU 1 has it now).
    let effect = d
        .write_dist_v3(0, IROUTER + 8 * u64::from(intid), 8, 1)
        .unwrap();
    assert!(effect.kicks(1));
    assert!(d.next_pending(0, |_| false).is_none());
    assert_eq!(d.next_pending(1, |_| false).unwrap().intid, intid);
    assert_eq!(
        d.read_dist_v3(0, IROUTER + 8 * u64::from(intid), 8)
            .unwrap(),
        1
    );
    // A route to a vCPU that does not exist delivers nowhere.
    d.write_dist_v3(0, IROUTER + 8 * u64::from(intid), 4, 7)
        .unwrap();
    assert!(d.pending_vcpus() == 0);
    // Any-vCPU routing delivers to the lowest.
    d.write_dist_v3(0, IROUTER + 8 * u64::from(intid), 4, 1 << 31)
        .unwrap();
    assert_eq!(d.next_pending(0, |_| false).unwrap().intid, intid);
}

#[test]
fn sgi_from_icc_sgi1r_reaches_the_named_vcpus() {
    let mut d = d3(4);
    linux_boot(&mut d);
    // SGI 3 to vCPUs 1 and 2 (TargetList bits 1 and 2, Aff1..3 = 0).
    let effect = d.send_sgi_v3(0, (3 << 24) | 0b110).unwrap();
    assert!(effect.kicks(1) && effect.kicks(2) && !effect.kicks(0) && !effect.kicks(3));
    let irq = d.next_pending(1, |_| false).unwrap();
    assert_eq!(irq.intid, 3);
    d.on_listed(1, &irq);
    assert!(d.next_pending(1, |_| false).is_none());
    assert!(d.next_pending(2, |_| false).is_some());
    // IRM: everyone but the sender.
    let effect = d.send_sgi_v3(2, (5 << 24) | (1 << 40)).unwrap();
    assert_eq!(effect.kick, 0b1011);
    // Another cluster or a range beyond our vCPUs names nobody.
    assert_eq!(d.send_sgi_v3(0, (1 << 24) | (1 << 16) | 1).unwrap().kick, 0);
    assert_eq!(d.send_sgi_v3(0, (1 << 24) | (1 << 44) | 1).unwrap().kick, 0);
    assert!(d.send_sgi_v3(9, 1).is_err());
}

#[test]
fn sgi_pending_bits_of_the_sgi_frame_work() {
    let mut d = d3(2);
    linux_boot(&mut d);
    d.write_redist(0, 1, SGI + GICD_ISPENDR, 4, 1 << 7).unwrap();
    assert_eq!(d.read_redist(0, 1, SGI + GICD_ISPENDR, 4).unwrap(), 1 << 7);
    assert_eq!(d.next_pending(1, |_| false).unwrap().intid, 7);
    d.write_redist(0, 1, SGI + GICD_ICPENDR, 4, 1 << 7).unwrap();
    assert!(d.next_pending(1, |_| false).is_none());
}

#[test]
fn distributor_private_parts_are_raz_wi() {
    let mut d = d3(1);
    d.write_dist_v3(0, GICD_ISENABLER, 4, !0).unwrap();
    assert_eq!(d.read_dist_v3(0, GICD_ISENABLER, 4).unwrap(), 0);
    // The redistributor still has SGIs enabled out of reset, PPIs not.
    assert_eq!(
        d.read_redist(0, 0, SGI + GICD_ISENABLER, 4).unwrap(),
        0xffff
    );
    d.write_dist_v3(0, GICD_ITARGETSR + 32, 4, 0x0202_0202)
        .unwrap();
    assert_eq!(d.read_dist_v3(0, GICD_ITARGETSR + 32, 4).unwrap(), 0);
    d.write_dist_v3(0, GICD_SGIR, 4, 0x0001_0001).unwrap();
    assert_eq!(d.pending_vcpus(), 0);
    assert!(d.counters().reserved_writes >= 3);
}

#[test]
fn ppi_level_and_timer_through_the_redistributor() {
    let mut d = d3(2);
    linux_boot(&mut d);
    d.write_redist(1, 1, SGI + GICD_ISENABLER, 4, 1 << 27)
        .unwrap();
    let effect = d.pend_ppi(1, 27).unwrap();
    assert!(effect.kicks(1));
    assert_eq!(d.next_pending(1, |_| false).unwrap().intid, 27);
    assert!(d.next_pending(0, |_| false).is_none());
}

#[test]
fn bad_accesses_are_errors_not_panics() {
    let mut d = d3(2);
    assert!(d.read_dist_v3(0, 0x1_0000, 4).is_err());
    assert!(d.read_dist_v3(0, GICD_CTLR, 8).is_err());
    assert!(d.read_dist_v3(0, GICD_CTLR, 2).is_err());
    assert!(d.read_dist_v3(0, GICD_CTLR + 1, 1).is_err());
    assert!(d.write_redist(0, 0, GICR_WAKER, 8, 0).is_err());
    assert!(d.read_redist(0, 0, GICR_STRIDE, 4).is_err());
    assert!(d.read_redist(5, 0, 0, 4).is_err());
    // A GICv2 distributor refuses the GICv3 views.
    let mut v2 = VDistributor::new(1, 32).unwrap();
    assert!(v2.read_dist_v3(0, GICD_CTLR, 4).is_err());
    assert!(v2.read_redist(0, 0, GICR_TYPER, 8).is_err());
}

/// `next_pending` the slow way: every INTID, no bitmap.
pub(super) fn scan(d: &VDistributor, vcpu: usize) -> Option<PendingIrq> {
    if vcpu >= d.vcpus() || d.ctlr() == 0 {
        return None;
    }
    let mut best: Option<(u8, u32)> = None;
    for intid in 0..d.irq_end() {
        if !d.deliverable_to(vcpu, intid) {
            continue;
        }
        let priority = d.irq(vcpu, intid)?.priority;
        if best.is_none_or(|(p, _)| priority < p) {
            best = Some((priority, intid));
        }
    }
    let (priority, intid) = best?;
    let irq = d.irq(vcpu, intid)?;
    Some(PendingIrq {
        intid,
        priority,
        source_cpu: (intid < SGI_END).then(|| d.sgi_sources(vcpu, intid).trailing_zeros() as u8),
        is_level: !irq.edge,
        group1: irq.group1,
    })
}

proptest! {
    /// No guest access sequence panics or leaves the state inconsistent.
    #[test]
    fn random_accesses_never_panic(
        ops in prop::collection::vec(
            (0u8..8, 0usize..3, 0u64..0x2_1000, prop::sample::select(vec![1u8, 2, 4, 8]), any::<u64>()),
            1..200,
        )
    ) {
        let mut d = d3(2);
        for (kind, who, offset, width, value) in ops {
            match kind {
                0 => { let _ = d.read_dist_v3(who, offset & 0xffff, width); }
                1 => { let _ = d.write_dist_v3(who, offset & 0xffff, width, value); }
                2 => { let _ = d.read_redist(who, who, offset, width); }
                3 => { let _ = d.write_redist(0, who, offset, width, value); }
                4 => { let _ = d.send_sgi_v3(who, value); }
                5 => { let _ = d.set_level(32 + (value % 70) as u32, value & 1 << 40 != 0); }
                6 => { let _ = d.pend_ppi(who, 16 + (value % 16) as u32); }
                _ => {
                    if let Some(irq) = d.next_pending(who.min(1), |_| false) {
                        d.on_listed(who.min(1), &irq);
                    }
                }
            }
            // Every state is saved and restored as it is, its pending
            // bitmaps recomputed to the same.
            let saved = crate::savestate::to_bytes(&d);
            let back: VDistributor = crate::savestate::from_bytes(&saved)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(format!("{back:?}"), format!("{d:?}"));
            prop_assert_eq!(crate::savestate::to_bytes(&back), saved);
            for v in 0..2 {
                let fast = d.next_pending(v, |_| false);
                prop_assert_eq!(fast, scan(&d, v), "the pending bitmap agrees with a full scan");
                if let Some(irq) = fast {
                    prop_assert!(irq.intid < d.irq_end());
                }
            }
        }
    }

    /// GICv3 list registers round-trip through the model.
    #[test]
    fn lr_v3_round_trip(intid in 0u32..1020, priority in any::<u8>(), level: bool, group1: bool, hw: bool) {
        let irq = PendingIrq { intid, priority, source_cpu: None, is_level: level, group1 };
        let value = lr_value_v3(&irq, hw.then_some(27));
        let lr = parse_lr_v3(value);
        prop_assert_eq!(lr.intid, intid);
        prop_assert_eq!(lr.state, LrStatus::Pending);
        prop_assert_eq!(lr.priority, priority & 0xf8);
        prop_assert_eq!(lr.group1, group1);
        prop_assert_eq!(lr.hw, hw);
        prop_assert_eq!(lr.eoi, level && !hw);
        prop_assert_eq!(lr.physical_id, hw.then_some(27));
    }
}

#[test]
fn typer_names_the_lines_the_vcpus_and_ten_intid_bits() {
    // 96 INTIDs: ITLinesNumber 2; 2 vCPUs: CPUNumber 1; IDbits 9.
    let mut d = d3(2);
    assert_eq!(
        d.read_dist_v3(0, GICD_TYPER, 4).unwrap(),
        2 | 1 << 5 | 9 << 19
    );
    let mut d = d3(8);
    assert_eq!(d.read_dist_v3(0, GICD_TYPER, 4).unwrap() >> 5 & 7, 7);
}

#[test]
fn a_saved_distributor_no_guest_could_write_is_refused() {
    let mut d = d3(2);
    d.write_dist_v3(0, GICD_CTLR, 4, 0x13).unwrap();
    let saved = crate::savestate::to_bytes(&d);
    let back: VDistributor = crate::savestate::from_bytes(&saved).expect("restores");
    assert_eq!(format!("{back:?}"), format!("{d:?}"));
    // Offsets: version 0, GIC version 1, vCPUs 2..10, SPIs 10..14, CTLR
    // 14..18, then per vCPU 32 interrupts (flags, priority, targets) and
    // 16 SGI source bytes.
    let with = |at: usize, bytes: &[u8]| {
        let mut bad = saved.clone();
        bad[at..at + bytes.len()].copy_from_slice(bytes);
        crate::savestate::from_bytes::<VDistributor>(&bad).expect_err("refused")
    };
    use crate::savestate::StateError::Invalid;
    assert_eq!(with(1, &[4]), Invalid("vGIC version"));
    assert_eq!(with(2, &[9]), Invalid("vGIC vCPU count"));
    assert_eq!(with(2, &[0]), Invalid("vGIC size"));
    assert_eq!(with(14, &[4]), Invalid("vGIC CTLR"));
    assert_eq!(with(18, &[0x40]), Invalid("vGIC interrupt flags"));
    assert_eq!(with(19, &[0x01]), Invalid("vGIC interrupt priority"));
    // SGI 0 made level-triggered: flags without the edge bit.
    assert_eq!(with(18, &[0x01]), Invalid("a vGIC SGI not edge-triggered"));
    // An SGI pending from vCPU 2 of a VM with two.
    assert_eq!(with(18 + 96, &[0b100]), Invalid("vGIC SGI source"));
}
