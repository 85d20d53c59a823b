//! Host tests of the virtual distributor and the list-register model.

use super::*;
use proptest::prelude::*;

fn rd(d: &mut VDistributor, vcpu: usize, offset: u64) -> u32 {
    d.read(vcpu, offset, 4).unwrap()
}

fn wr(d: &mut VDistributor, vcpu: usize, offset: u64, value: u32) -> VgicEffect {
    d.write(vcpu, offset, 4, value).unwrap()
}

/// What Linux's irq-gic.c does at boot: gic_dist_init on the boot CPU, then
/// gic_cpu_init on every CPU.
fn linux_boot(d: &mut VDistributor) {
    let typer = rd(d, 0, GICD_TYPER);
    let gic_irqs = ((typer & 0x1f) + 1) * 32;
    let gic_irqs = gic_irqs.min(1020);
    // gic_dist_init
    wr(d, 0, GICD_CTLR, 0);
    let mut mask = 0;
    for i in 0..8 {
        mask |= rd(d, 0, GICD_ITARGETSR + i * 4);
        mask |= mask >> 16;
        mask |= mask >> 8;
    }
    let cpumask = (mask & 0xff) * 0x0101_0101;
    for i in (32..gic_irqs).step_by(4) {
        wr(d, 0, GICD_ITARGETSR + u64::from(i), cpumask);
    }
    // gic_dist_config: level triggered, priority 0xa0, deactivated, disabled.
    for i in (32..gic_irqs).step_by(16) {
        wr(d, 0, GICD_ICFGR + u64::from(i / 4), 0);
    }
    for i in (32..gic_irqs).step_by(4) {
        wr(d, 0, GICD_IPRIORITYR + u64::from(i), 0xa0a0_a0a0);
    }
    for i in (32..gic_irqs).step_by(32) {
        wr(d, 0, GICD_ICACTIVER + u64::from(i / 8), 0xffff_ffff);
        wr(d, 0, GICD_ICENABLER + u64::from(i / 8), 0xffff_ffff);
    }
    wr(d, 0, GICD_CTLR, 1);
    // gic_cpu_init / gic_cpu_config on each CPU.
    for cpu in 0..d.vcpus() {
        wr(d, cpu, GICD_ICACTIVER, 0xffff_ffff);
        wr(d, cpu, GICD_ICENABLER, 0xffff_0000);
        wr(d, cpu, GICD_ISENABLER, 0x0000_ffff);
        for i in (0..32).step_by(4) {
            wr(d, cpu, GICD_IPRIORITYR + i, 0xa0a0_a0a0);
        }
    }
}

#[test]
fn config_limits() {
    assert!(VDistributor::new(0, 64).is_err());
    assert!(VDistributor::new(9, 64).is_err());
    assert!(VDistributor::new(1, 989).is_err());
    assert!(VDistributor::new(8, 988).is_ok());
    let mut d = VDistributor::new(1, 0).unwrap();
    assert_eq!(rd(&mut d, 0, GICD_TYPER), 0);
    let mut d = VDistributor::new(8, 40).unwrap();
    // 72 INTIDs round up to 96: ITLinesNumber 2, CPUNumber 7.
    assert_eq!(rd(&mut d, 0, GICD_TYPER), 2 | 7 << 5);
    // Interrupts 72..96 are not implemented: RAZ/WI.
    wr(&mut d, 0, GICD_ISENABLER + 8, 0xffff_ffff);
    assert_eq!(rd(&mut d, 0, GICD_ISENABLER + 8), 0xff);
    assert_eq!(
        d.set_level(72, true),
        Err(VgicError::BadIntid { intid: 72 })
    );
}

#[test]
fn linux_boot_sequence_and_a_level_spi() {
    let mut d = VDistributor::new(2, 64).unwrap();
    assert_eq!(rd(&mut d, 0, GICD_TYPER), 2 | 1 << 5);
    assert_eq!(rd(&mut d, 0, GICD_IIDR), IIDR_VALUE);
    assert_eq!(rd(&mut d, 0, GICD_PIDR2), 0x2b);
    assert_eq!(rd(&mut d, 1, GICD_ITARGETSR), 0x0202_0202);
    linux_boot(&mut d);

    assert_eq!(rd(&mut d, 0, GICD_CTLR), 1);
    assert_eq!(rd(&mut d, 0, GICD_ITARGETSR + 32), 0x0101_0101);
    assert_eq!(rd(&mut d, 0, GICD_IPRIORITYR + 92), 0xa0a0_a0a0);
    assert_eq!(rd(&mut d, 1, GICD_IPRIORITYR + 28), 0xa0a0_a0a0);
    assert_eq!(rd(&mut d, 0, GICD_ISENABLER), 0x0000_ffff);
    assert_eq!(rd(&mut d, 0, GICD_ISENABLER + 4), 0);
    assert_eq!(rd(&mut d, 0, GICD_ICFGR), 0xaaaa_aaaa, "SGIs are edge");
    assert_eq!(rd(&mut d, 0, GICD_ICFGR + 8), 0, "SPIs are level");
    assert_eq!(rd(&mut d, 0, GICD_IGROUPR + 4), 0, "group 0");
    assert_eq!(d.counters().reserved_reads + d.counters().rejected, 0);
    assert_eq!(d.next_pending(0, |_| false), None);

    // The PL011's line (SPI 1 = INTID 33) rises before it is enabled.
    assert_eq!(d.set_level(33, true).unwrap(), VgicEffect::NONE);
    assert!(d.is_pending(0, 33));
    assert_eq!(rd(&mut d, 0, GICD_ISPENDR + 4), 1 << 1);
    // Linux enables it (irq_unmask): now deliverable to vCPU 0.
    let effect = wr(&mut d, 0, GICD_ISENABLER + 4, 1 << 1);
    assert_eq!(effect.kick, 0b01);
    let irq = d.next_pending(0, |_| false).unwrap();
    assert_eq!(
        irq,
        PendingIrq {
            intid: 33,
            priority: 0xa0,
            source_cpu: None,
            is_level: true,
            group1: false
        }
    );
    assert_eq!(d.next_pending(1, |_| false), None);
    let lr = lr_value(&irq, None);
    assert_eq!(lr, 33 | (0xa0 >> 3) << 23 | LR_PENDING | LR_EOI);
    d.on_listed(0, &irq);
    // Still pending (line high) but already in a list register.
    assert!(d.is_pending(0, 33));
    assert_eq!(d.next_pending(0, |id| id == 33), None);
    // The guest's handler drains the UART: the line falls.
    assert_eq!(d.set_level(33, false).unwrap(), VgicEffect::NONE);
    assert!(!d.is_pending(0, 33));
    assert_eq!(d.on_eoi(0, 33), VgicEffect::NONE);
    assert_eq!(d.next_pending(0, |_| false), None);

    // Line high again, still high at EOI: re-pended.
    assert_eq!(d.set_level(33, true).unwrap().kick, 0b01);
    let irq = d.next_pending(0, |_| false).unwrap();
    d.on_listed(0, &irq);
    assert_eq!(d.on_eoi(0, 33).kick, 0b01);
    assert_eq!(d.next_pending(0, |_| false).unwrap().intid, 33);

    // Retarget to vCPU 1 (byte access), then ICPENDR cannot clear a high line.
    let effect = d.write(0, GICD_ITARGETSR + 33, 1, 2).unwrap();
    assert_eq!(effect.kick, 0b10);
    assert_eq!(d.next_pending(0, |_| false), None);
    assert_eq!(d.next_pending(1, |_| false).unwrap().intid, 33);
    wr(&mut d, 0, GICD_ICPENDR + 4, 1 << 1);
    assert!(d.is_pending(1, 33));
    // Disabling the distributor stops delivery; enabling kicks.
    wr(&mut d, 0, GICD_CTLR, 0);
    assert_eq!(d.next_pending(1, |_| false), None);
    assert_eq!(wr(&mut d, 0, GICD_CTLR, 1).kick, 0b10);
}

#[test]
fn edge_spis_latch() {
    let mut d = VDistributor::new(1, 32).unwrap();
    linux_boot(&mut d);
    // SPI 16 (INTID 48, virtio device 0) configured edge.
    wr(&mut d, 0, GICD_ICFGR + 12, 0b10);
    assert_eq!(rd(&mut d, 0, GICD_ICFGR + 12), 0b10);
    wr(&mut d, 0, GICD_ISENABLER + 4, 1 << 16);
    assert_eq!(d.set_level(48, true).unwrap().kick, 1);
    assert_eq!(d.set_level(48, false).unwrap(), VgicEffect::NONE);
    let irq = d.next_pending(0, |_| false).unwrap();
    assert_eq!((irq.intid, irq.is_level), (48, false));
    assert_eq!(lr_value(&irq, None) & LR_EOI, 0);
    d.on_listed(0, &irq);
    assert!(!d.is_pending(0, 48));
    assert_eq!(d.next_pending(0, |_| false), None);
    // A new edge while listed waits in the distributor.
    assert_eq!(d.pend_edge(48).unwrap().kick, 1);
    assert_eq!(d.next_pending(0, |id| id == 48), None);
    assert_eq!(d.next_pending(0, |_| false).unwrap().intid, 48);
    // ICPENDR clears it; ISPENDR sets it.
    wr(&mut d, 0, GICD_ICPENDR + 4, 1 << 16);
    assert!(!d.is_pending(0, 48));
    assert_eq!(wr(&mut d, 0, GICD_ISPENDR + 4, 1 << 16).kick, 1);
    // Active interrupts are not offered again.
    wr(&mut d, 0, GICD_ISACTIVER + 4, 1 << 16);
    assert_eq!(rd(&mut d, 0, GICD_ISACTIVER + 4), 1 << 16);
    assert_eq!(d.next_pending(0, |_| false), None);
    assert_eq!(wr(&mut d, 0, GICD_ICACTIVER + 4, 1 << 16).kick, 1);
    assert_eq!(d.next_pending(0, |_| false).unwrap().intid, 48);
    assert_eq!(d.pend_edge(31), Err(VgicError::BadIntid { intid: 31 }));
    assert_eq!(d.pend_edge(64), Err(VgicError::BadIntid { intid: 64 }));
}

#[test]
fn ppis_are_banked() {
    let mut d = VDistributor::new(2, 32).unwrap();
    linux_boot(&mut d);
    // The virtual timer PPI (INTID 27) on vCPU 1 only.
    assert_eq!(wr(&mut d, 1, GICD_ISENABLER, 1 << 27), VgicEffect::NONE);
    assert_eq!(rd(&mut d, 0, GICD_ISENABLER) & 1 << 27, 0);
    assert_eq!(d.set_ppi_level(0, 27, true).unwrap(), VgicEffect::NONE);
    assert_eq!(d.set_ppi_level(1, 27, true).unwrap().kick, 0b10);
    assert_eq!(d.next_pending(0, |_| false), None);
    let irq = d.next_pending(1, |_| false).unwrap();
    assert_eq!((irq.intid, irq.is_level), (27, true));
    // Targets of private interrupts are read-only.
    d.write(1, GICD_ITARGETSR + 27, 1, 0xff).unwrap();
    assert_eq!(d.read(1, GICD_ITARGETSR + 27, 1).unwrap(), 0b10);
    assert_eq!(
        d.set_ppi_level(2, 27, true),
        Err(VgicError::BadVcpu { vcpu: 2 })
    );
    assert_eq!(
        d.set_ppi_level(0, 33, true),
        Err(VgicError::BadIntid { intid: 33 })
    );
    assert_eq!(d.pend_ppi(0, 27).unwrap(), VgicEffect::NONE);
    assert!(d.is_pending(0, 27));
}

#[test]
fn sgis_with_every_target_filter() {
    let mut d = VDistributor::new(4, 32).unwrap();
    linux_boot(&mut d);
    // Filter 0: the target list (bits for absent vCPUs ignored).
    let effect = wr(&mut d, 0, GICD_SGIR, 0b1111_0010 << 16 | 3);
    assert_eq!(effect.kick, 0b0010);
    let irq = d.next_pending(1, |_| false).unwrap();
    assert_eq!((irq.intid, irq.source_cpu), (3, Some(0)));
    assert_eq!(lr_value(&irq, None), 3 | (0xa0 >> 3) << 23 | LR_PENDING);
    for cpu in [0, 2, 3] {
        assert_eq!(d.next_pending(cpu, |_| false), None);
    }
    assert_eq!(d.read(1, GICD_SPENDSGIR + 3, 1).unwrap(), 0b0001);
    assert_eq!(rd(&mut d, 1, GICD_ISPENDR), 1 << 3);
    d.on_listed(1, &irq);
    assert_eq!(d.next_pending(1, |_| false), None);

    // Filter 1: everyone but the sender.
    let effect = wr(&mut d, 2, GICD_SGIR, 1 << 24 | 0xff << 16 | 5);
    assert_eq!(effect.kick, 0b1011);
    for cpu in [0, 1, 3] {
        let irq = d.next_pending(cpu, |_| false).unwrap();
        assert_eq!((irq.intid, irq.source_cpu), (5, Some(2)));
        let lr = parse_lr(lr_value(&irq, None));
        assert_eq!(lr.source_cpu, Some(2));
        assert!(!lr.eoi);
    }
    assert_eq!(d.next_pending(2, |_| false), None);

    // Filter 2: the sender only.
    assert_eq!(wr(&mut d, 3, GICD_SGIR, 2 << 24 | 7).kick, 0b1000);
    assert!(d.is_pending(3, 7));
    // Filter 3 is reserved.
    assert_eq!(
        wr(&mut d, 0, GICD_SGIR, 3 << 24 | 0xff << 16 | 8),
        VgicEffect::NONE
    );
    assert_eq!(d.counters().sgir_reserved, 1);
    assert_eq!(d.counters().sgis, 1 + 3 + 1);

    // Two sources of SGI 5 on vCPU 0: one list register at a time.
    wr(&mut d, 3, GICD_SGIR, 1 << 16 | 5);
    assert_eq!(d.read(0, GICD_CPENDSGIR + 5, 1).unwrap(), 0b1100);
    let first = d.next_pending(0, |_| false).unwrap();
    assert_eq!(first.source_cpu, Some(2));
    d.on_listed(0, &first);
    assert_eq!(d.next_pending(0, |id| id == 5), None);
    assert_eq!(d.next_pending(0, |_| false).unwrap().source_cpu, Some(3));
    // CPENDSGIR clears a source, SPENDSGIR sets one (word access).
    d.write(0, GICD_CPENDSGIR + 4, 4, 0b1000 << 8).unwrap();
    assert!(!d.is_pending(0, 5));
    assert_eq!(d.write(0, GICD_SPENDSGIR, 4, 0b0100 << 16).unwrap().kick, 1);
    assert_eq!(d.read(0, GICD_SPENDSGIR, 4).unwrap(), 0b0100 << 16);
    // ISPENDR/ICPENDR do not touch SGIs.
    wr(&mut d, 0, GICD_ICPENDR, 0xffff);
    assert!(d.is_pending(0, 2));
    // A disabled SGI is pending but not delivered.
    wr(&mut d, 0, GICD_ICENABLER, 1 << 2);
    assert_eq!(d.next_pending(0, |_| false), None);
}

#[test]
fn priority_ordering() {
    let mut d = VDistributor::new(1, 64).unwrap();
    linux_boot(&mut d);
    wr(&mut d, 0, GICD_ISENABLER + 4, 0xffff_ffff);
    wr(&mut d, 0, GICD_ISENABLER + 8, 0xffff_ffff);
    for (intid, priority) in [
        (40u32, 0x80u8),
        (41, 0x40),
        (42, 0x40),
        (70, 0x10),
        (50, 0x47),
    ] {
        d.write(
            0,
            GICD_IPRIORITYR + u64::from(intid),
            1,
            u32::from(priority),
        )
        .unwrap();
        d.pend_edge(intid).unwrap();
    }
    // 0x47 keeps only its top five bits: 0x40, and ties go to the lowest INTID.
    assert_eq!(d.read(0, GICD_IPRIORITYR + 50, 1).unwrap(), 0x40);
    let mut order = Vec::new();
    while let Some(irq) = d.next_pending(0, |_| false) {
        order.push((irq.intid, irq.priority));
        d.on_listed(0, &irq);
    }
    assert_eq!(
        order,
        [(70, 0x10), (41, 0x40), (42, 0x40), (50, 0x40), (40, 0x80)]
    );

    // already_listed skips the best without hiding the others.
    d.pend_edge(70).unwrap();
    d.pend_edge(40).unwrap();
    assert_eq!(d.next_pending(0, |id| id == 70).unwrap().intid, 40);

    // A group 1 interrupt needs EnableGrp1.
    wr(&mut d, 0, GICD_IGROUPR + 4, 1 << 8);
    assert_eq!(d.next_pending(0, |_| false).unwrap().intid, 70);
    assert_eq!(d.next_pending(0, |id| id == 70), None);
    assert_eq!(wr(&mut d, 0, GICD_CTLR, 3).kick, 1);
    let irq = d.next_pending(0, |id| id == 70).unwrap();
    assert!(irq.group1);
    assert!(parse_lr(lr_value(&irq, None)).group1);
}

#[test]
fn widths_offsets_and_counters() {
    let mut d = VDistributor::new(2, 64).unwrap();
    // Byte-accessible registers: bytes and words agree.
    for i in 0..4 {
        d.write(0, GICD_IPRIORITYR + 36 + i, 1, 0x10 * (i as u32 + 1))
            .unwrap();
    }
    assert_eq!(rd(&mut d, 0, GICD_IPRIORITYR + 36), 0x4030_2010);
    wr(&mut d, 0, GICD_ITARGETSR + 36, 0xff03_0201);
    assert_eq!(d.read(0, GICD_ITARGETSR + 39, 1).unwrap(), 0x03);
    assert_eq!(rd(&mut d, 0, GICD_ITARGETSR + 36), 0x0303_0201);
    // Halfwords, bytes of word-only registers, misalignment: errors.
    assert_eq!(
        d.read(0, GICD_IPRIORITYR, 2),
        Err(VgicError::BadWidth {
            offset: GICD_IPRIORITYR,
            width: 2
        })
    );
    assert!(matches!(
        d.read(0, GICD_CTLR, 1),
        Err(VgicError::BadWidth { .. })
    ));
    assert!(matches!(
        d.write(0, GICD_ISENABLER + 1, 1, 1),
        Err(VgicError::BadWidth { .. })
    ));
    assert!(matches!(
        d.read(0, GICD_IPRIORITYR + 2, 4),
        Err(VgicError::Unaligned { .. })
    ));
    assert!(matches!(d.read(0, 0, 8), Err(VgicError::BadWidth { .. })));
    assert!(matches!(d.read(0, 0, 0), Err(VgicError::BadWidth { .. })));
    assert_eq!(d.read(2, 0, 4), Err(VgicError::BadVcpu { vcpu: 2 }));
    assert_eq!(
        d.read(0, 0x1_0000, 4),
        Err(VgicError::OutOfWindow { offset: 0x1_0000 })
    );
    assert_eq!(
        d.read(0, u64::MAX - 3, 4),
        Err(VgicError::OutOfWindow {
            offset: u64::MAX - 3
        })
    );
    assert_eq!(d.counters().rejected, 9);
    // Reserved offsets read as zero and ignore writes, counted.
    for offset in [
        0x00c, 0x040, 0xd00, 0xe00, 0xf04, 0xf30, 0x7fc, 0xbfc, 0x1000, 0xfffc,
    ] {
        assert_eq!(rd(&mut d, 0, offset), 0, "offset {offset:#x}");
        assert_eq!(wr(&mut d, 0, offset, !0), VgicEffect::NONE);
    }
    assert_eq!(d.counters().reserved_reads, 10);
    assert_eq!(d.counters().reserved_writes, 10);
    // Read-only and write-only registers.
    wr(&mut d, 0, GICD_TYPER, 0);
    wr(&mut d, 0, GICD_PIDR2, 0);
    assert_eq!(rd(&mut d, 0, GICD_PIDR2), 0x2b);
    assert_eq!(d.counters().read_only_writes, 2);
    assert_eq!(rd(&mut d, 0, GICD_SGIR), 0);
    assert_eq!(d.counters().write_only_reads, 1);
    // The identification registers.
    let ids: Vec<u32> = (0..12).map(|i| rd(&mut d, 0, GICD_PIDR4 + 4 * i)).collect();
    assert_eq!(ids, GICD_ID_VALUES);
    // Error messages are printable.
    let _ = alloc::format!(
        "{}",
        VgicError::BadWidth {
            offset: 0x400,
            width: 2
        }
    );
}

#[test]
fn reset_restores_the_reset_state() {
    let mut d = VDistributor::new(2, 32).unwrap();
    linux_boot(&mut d);
    wr(&mut d, 0, GICD_ISENABLER + 4, 0xffff_ffff);
    d.set_level(40, true).unwrap();
    d.reset();
    assert_eq!(rd(&mut d, 0, GICD_CTLR), 0);
    assert_eq!(rd(&mut d, 0, GICD_ISENABLER + 4), 0);
    assert_eq!(rd(&mut d, 0, GICD_ISPENDR + 4), 0);
    assert_eq!(rd(&mut d, 0, GICD_ITARGETSR + 32), 0x0101_0101);
}

#[test]
fn list_register_round_trip() {
    let irq = PendingIrq {
        intid: 1019,
        priority: 0xff,
        source_cpu: None,
        is_level: true,
        group1: true,
    };
    let value = lr_value(&irq, None);
    assert_eq!(value, 1019 | LR_GRP1 | LR_PENDING | 0x1f << 23 | LR_EOI);
    let lr = parse_lr(value);
    assert_eq!(
        lr,
        LrState {
            intid: 1019,
            state: LrStatus::Pending,
            eoi: true,
            hw: false,
            group1: true,
            priority: 0xf8,
            source_cpu: None,
            physical_id: None,
        }
    );
    assert!(!lr.is_free());
    assert_eq!(parse_lr(value & !LR_PENDING).state, LrStatus::Invalid);
    assert!(parse_lr(0).is_free());
    assert_eq!(parse_lr(value | LR_ACTIVE).state, LrStatus::PendingActive);
    assert_eq!(
        parse_lr(value ^ LR_PENDING ^ LR_ACTIVE).state,
        LrStatus::Active
    );
    let hw = parse_lr(LR_HW | 27 | 30 << 10 | LR_ACTIVE);
    assert_eq!(
        (hw.hw, hw.eoi, hw.physical_id, hw.source_cpu),
        (true, false, Some(30), None)
    );
    let sgi = parse_lr(lr_value(
        &PendingIrq {
            intid: 15,
            priority: 0,
            source_cpu: Some(7),
            is_level: false,
            group1: false,
        },
        None,
    ));
    assert_eq!((sgi.intid, sgi.source_cpu, sgi.eoi), (15, Some(7), false));
    // Linked to a physical INTID: HW and PhysicalID replace EOI and the
    // source CPU, whatever the interrupt's kind.
    let level = PendingIrq {
        intid: 27,
        priority: 0xa0,
        source_cpu: Some(3),
        is_level: true,
        group1: true,
    };
    let linked = lr_value(&level, Some(30 | 1 << 10));
    assert_eq!(
        linked,
        27 | (0xa0 >> 3) << 23 | LR_PENDING | LR_GRP1 | LR_HW | 30 << 10
    );
    let back = parse_lr(linked);
    assert_eq!(
        (back.hw, back.eoi, back.physical_id, back.source_cpu),
        (true, false, Some(30), None)
    );
}

#[derive(Clone, Debug)]
enum Op {
    Read {
        vcpu: usize,
        offset: u64,
        width: u8,
    },
    Write {
        vcpu: usize,
        offset: u64,
        width: u8,
        value: u32,
    },
    Level {
        intid: u32,
        level: bool,
    },
    PpiLevel {
        vcpu: usize,
        intid: u32,
        level: bool,
    },
    Edge {
        intid: u32,
    },
    List {
        vcpu: usize,
    },
    Eoi {
        vcpu: usize,
        intid: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let vcpu = 0usize..6;
    // Mostly the interesting part of the window, sometimes anywhere.
    let offset = prop_oneof![
        4 => proptest::sample::select(&[
            GICD_CTLR, GICD_SGIR, GICD_IGROUPR, GICD_IGROUPR + 4, GICD_ISENABLER,
            GICD_ISENABLER + 4, GICD_ICENABLER + 4, GICD_ISPENDR + 4, GICD_ICPENDR + 4,
            GICD_ISACTIVER + 4, GICD_ICACTIVER + 4, GICD_ICFGR + 8, GICD_IPRIORITYR + 32,
            GICD_ITARGETSR + 32, GICD_ITARGETSR + 33, GICD_SPENDSGIR, GICD_CPENDSGIR,
        ][..]),
        4 => (0u64..0x1000).prop_map(|o| o & !3),
        2 => 0u64..0x1000,
        1 => any::<u64>(),
    ];
    let width = prop_oneof![4 => Just(4u8), 2 => Just(1u8), 1 => any::<u8>()];
    let value = prop_oneof![any::<u32>(), Just(!0u32), Just(1u32)];
    let intid = prop_oneof![0u32..100, any::<u32>()];
    prop_oneof![
        1 => (vcpu.clone(), offset.clone(), width.clone())
            .prop_map(|(vcpu, offset, width)| Op::Read { vcpu, offset, width }),
        4 => (vcpu.clone(), offset, width, value).prop_map(|(vcpu, offset, width, value)| {
            Op::Write { vcpu, offset, width, value }
        }),
        2 => (intid.clone(), any::<bool>()).prop_map(|(intid, level)| Op::Level { intid, level }),
        1 => (vcpu.clone(), intid.clone(), any::<bool>())
            .prop_map(|(vcpu, intid, level)| Op::PpiLevel { vcpu, intid, level }),
        1 => intid.clone().prop_map(|intid| Op::Edge { intid }),
        2 => vcpu.clone().prop_map(|vcpu| Op::List { vcpu }),
        1 => (vcpu, intid).prop_map(|(vcpu, intid)| Op::Eoi { vcpu, intid }),
    ]
}

/// Checks through the guest-visible registers that `irq` is one
/// `next_pending(vcpu)` may return.
fn check_deliverable(d: &mut VDistributor, vcpu: usize, irq: &PendingIrq) {
    let intid = irq.intid;
    assert!(intid < d.irq_end());
    let word = GICD_ISENABLER + u64::from(intid / 32) * 4;
    let bit = 1 << (intid % 32);
    let reads = d.counters().reserved_reads;
    assert_ne!(rd(d, vcpu, word) & bit, 0, "enabled");
    assert_ne!(rd(d, vcpu, word + 0x100) & bit, 0, "pending");
    assert_eq!(rd(d, vcpu, word + 0x200) & bit, 0, "not active");
    let group1 = rd(d, vcpu, word - 0x80) & bit != 0;
    assert_eq!(group1, irq.group1);
    let ctlr = rd(d, vcpu, GICD_CTLR);
    assert_ne!(ctlr & if group1 { 2 } else { 1 }, 0, "group enabled");
    let priority = d.read(vcpu, GICD_IPRIORITYR + u64::from(intid), 1).unwrap();
    assert_eq!(priority, u32::from(irq.priority));
    let targets = d.read(vcpu, GICD_ITARGETSR + u64::from(intid), 1).unwrap();
    let targets = targets & ((1 << d.vcpus()) - 1);
    assert_eq!(targets.trailing_zeros() as usize, vcpu, "targeted");
    if intid < 16 {
        let sources = d.read(vcpu, GICD_SPENDSGIR + u64::from(intid), 1).unwrap();
        let source = irq.source_cpu.unwrap();
        assert_ne!(sources & 1 << source, 0, "source pending");
    } else {
        assert_eq!(irq.source_cpu, None);
    }
    assert_eq!(d.counters().reserved_reads, reads);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random guest accesses and injections never panic; `next_pending`
    /// only offers enabled, pending, inactive, targeted interrupts; every
    /// vCPU that gains a deliverable interrupt is kicked.
    #[test]
    fn random_traffic(
        vcpus in 1usize..=8,
        spis in prop_oneof![Just(64u32), 0u32..=988],
        boot in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let mut d = VDistributor::new(vcpus, spis).unwrap();
        if boot {
            linux_boot(&mut d);
            wr(&mut d, 0, GICD_ISENABLER + 4, !0);
        }
        for op in ops {
            // Every state is saved and restored as it is, its pending
            // bitmaps recomputed to the same.
            let saved = crate::savestate::to_bytes(&d);
            let back: VDistributor = crate::savestate::from_bytes(&saved)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(format!("{back:?}"), format!("{d:?}"));
            prop_assert_eq!(crate::savestate::to_bytes(&back), saved);
            let before = d.pending_vcpus();
            let kick = match op {
                Op::Read { vcpu, offset, width } => {
                    let _ = d.read(vcpu, offset, width);
                    0
                }
                Op::Write { vcpu, offset, width, value } => {
                    d.write(vcpu, offset, width, value).map_or(0, |e| e.kick)
                }
                Op::Level { intid, level } => d.set_level(intid, level).map_or(0, |e| e.kick),
                Op::PpiLevel { vcpu, intid, level } => {
                    d.set_ppi_level(vcpu, intid, level).map_or(0, |e| e.kick)
                }
                Op::Edge { intid } => d.pend_edge(intid).map_or(0, |e| e.kick),
                Op::List { vcpu } => {
                    if let Some(irq) = d.next_pending(vcpu, |_| false) {
                        d.on_listed(vcpu, &irq);
                    }
                    // Listing never makes anything new deliverable.
                    prop_assert_eq!(d.pending_vcpus() & !before, 0);
                    continue;
                }
                Op::Eoi { vcpu, intid } => d.on_eoi(vcpu, intid).kick,
            };
            let after = d.pending_vcpus();
            prop_assert_eq!(after & !before & !kick, 0, "a vCPU was not kicked");
            prop_assert_eq!(kick & !((1u32 << vcpus) - 1), 0);
            for vcpu in 0..vcpus {
                prop_assert_eq!(
                    d.next_pending(vcpu, |_| false),
                    super::v3_tests::scan(&d, vcpu),
                    "the pending bitmap agrees with a full scan"
                );
                if let Some(irq) = d.next_pending(vcpu, |_| false) {
                    check_deliverable(&mut d, vcpu, &irq);
                    // Skipping it never offers it again.
                    let other = d.next_pending(vcpu, |id| id == irq.intid);
                    prop_assert!(other.is_none_or(|o| o.intid != irq.intid));
                }
            }
            prop_assert_eq!(d.next_pending(vcpus, |_| false), None);
        }
    }
}
