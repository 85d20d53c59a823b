//! The vGIC targets (GICv2 and GICv3): guest register accesses from any
//! vCPU, device lines, and a CPU interface that lists and EOIs what the
//! distributor offers.
//!
//! Invariants: an accepted access has a width and alignment the
//! architecture allows and a read returns no more than its width; an access
//! by or to a vCPU the VM does not have is refused; kicks and pending masks
//! name only existing vCPUs; what `next_pending` offers is pending, in range,
//! and not one the CPU interface already listed.

use arbitrary::Arbitrary;
use hypervisor::vgic::{VDistributor, VgicError, MAX_VCPUS, SPI_BASE};

#[derive(Arbitrary, Debug)]
pub enum Op {
    Read {
        vcpu: u8,
        offset: u32,
        width: u8,
    },
    Write {
        vcpu: u8,
        offset: u32,
        width: u8,
        value: u64,
    },
    /// GICv3 redistributor frame of vCPU `redist`.
    ReadRedist {
        vcpu: u8,
        redist: u8,
        offset: u32,
        width: u8,
    },
    WriteRedist {
        vcpu: u8,
        redist: u8,
        offset: u32,
        width: u8,
        value: u64,
    },
    /// ICC_SGI1R_EL1 (GICv3).
    SendSgi {
        vcpu: u8,
        value: u64,
    },
    SetLevel {
        intid: u16,
        level: bool,
    },
    SetPpiLevel {
        vcpu: u8,
        intid: u16,
        level: bool,
    },
    PendEdge {
        intid: u16,
    },
    PendPpi {
        vcpu: u8,
        intid: u16,
    },
    /// The CPU interface of `vcpu` lists the next pending interrupt.
    List {
        vcpu: u8,
    },
    /// ... and the guest EOIs the oldest listed one.
    Eoi {
        vcpu: u8,
    },
    Reset,
}

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub vcpus: u8,
    pub spis: u16,
    pub ops: Vec<Op>,
}

fn width_fits(value: u64, width: u8) -> bool {
    width >= 8 || value < 1u64 << (8 * u32::from(width))
}

/// Run one input against a GICv2 (`v3` false) or GICv3 distributor.
pub fn run(input: Input, v3: bool) {
    let vcpus = usize::from(input.vcpus % (MAX_VCPUS as u8 + 2));
    let spis = u32::from(input.spis % 1024);
    let made = if v3 {
        VDistributor::new_v3(vcpus, spis)
    } else {
        VDistributor::new(vcpus, spis)
    };
    let mut d = match made {
        Ok(d) => d,
        Err(e) => {
            assert_eq!(e, VgicError::BadConfig { vcpus, spis });
            return;
        }
    };
    let all = (1u32 << vcpus) - 1;
    // Per vCPU, what its list registers hold (INTIDs), oldest first.
    let mut listed: Vec<Vec<u32>> = vec![Vec::new(); vcpus];
    for op in input.ops.iter().take(512) {
        let kick = match *op {
            Op::Read {
                vcpu,
                offset,
                width,
            } => {
                let (vcpu, offset) = (usize::from(vcpu), u64::from(offset));
                let r = if v3 {
                    d.read_dist_v3(vcpu, offset, width)
                } else {
                    d.read(vcpu, offset, width).map(u64::from)
                };
                check_access(&r, vcpu, vcpus, offset, width, v3);
                if let Ok(value) = r {
                    assert!(
                        width_fits(value, width),
                        "{value:#x} from a {width}-byte read"
                    );
                }
                0
            }
            Op::Write {
                vcpu,
                offset,
                width,
                value,
            } => {
                let (vcpu, offset) = (usize::from(vcpu), u64::from(offset));
                let r = if v3 {
                    d.write_dist_v3(vcpu, offset, width, value)
                } else {
                    d.write(vcpu, offset, width, value as u32)
                };
                check_access(&r, vcpu, vcpus, offset, width, v3);
                r.map_or(0, |e| e.kick)
            }
            Op::ReadRedist {
                vcpu,
                redist,
                offset,
                width,
            } => {
                let r = d.read_redist(
                    usize::from(vcpu),
                    usize::from(redist),
                    u64::from(offset),
                    width,
                );
                if !v3 || usize::from(redist) >= vcpus {
                    assert!(r.is_err());
                }
                check_access(&r, usize::from(vcpu), vcpus, u64::from(offset), width, true);
                if let Ok(value) = r {
                    assert!(width_fits(value, width));
                }
                0
            }
            Op::WriteRedist {
                vcpu,
                redist,
                offset,
                width,
                value,
            } => {
                let r = d.write_redist(
                    usize::from(vcpu),
                    usize::from(redist),
                    u64::from(offset),
                    width,
                    value,
                );
                if !v3 || usize::from(redist) >= vcpus {
                    assert!(r.is_err());
                }
                check_access(&r, usize::from(vcpu), vcpus, u64::from(offset), width, true);
                r.map_or(0, |e| e.kick)
            }
            Op::SendSgi { vcpu, value } => {
                let r = d.send_sgi_v3(usize::from(vcpu), value);
                if usize::from(vcpu) >= vcpus {
                    assert!(r.is_err());
                }
                r.map_or(0, |e| e.kick)
            }
            Op::SetLevel { intid, level } => {
                let intid = u32::from(intid);
                let r = d.set_level(intid, level);
                assert_eq!(
                    r.is_ok(),
                    (SPI_BASE..d.irq_end()).contains(&intid),
                    "SPI {intid}"
                );
                r.map_or(0, |e| e.kick)
            }
            Op::SetPpiLevel { vcpu, intid, level } => {
                let r = d.set_ppi_level(usize::from(vcpu), u32::from(intid), level);
                if r.is_ok() {
                    assert!((16..32).contains(&intid) && usize::from(vcpu) < vcpus);
                }
                r.map_or(0, |e| e.kick)
            }
            Op::PendEdge { intid } => {
                let intid = u32::from(intid);
                let r = d.pend_edge(intid);
                assert_eq!(r.is_ok(), (SPI_BASE..d.irq_end()).contains(&intid));
                r.map_or(0, |e| e.kick)
            }
            Op::PendPpi { vcpu, intid } => {
                let r = d.pend_ppi(usize::from(vcpu), u32::from(intid));
                if r.is_ok() {
                    assert!(u32::from(intid) < 32 && usize::from(vcpu) < vcpus);
                }
                r.map_or(0, |e| e.kick)
            }
            Op::List { vcpu } => {
                let vcpu = usize::from(vcpu) % vcpus;
                let lrs = &listed[vcpu];
                if let Some(irq) = d.next_pending(vcpu, |i| lrs.contains(&i)) {
                    assert!(irq.intid < d.irq_end(), "INTID {} past the end", irq.intid);
                    assert!(
                        !lrs.contains(&irq.intid),
                        "INTID {} listed twice",
                        irq.intid
                    );
                    assert!(
                        d.is_pending(vcpu, irq.intid),
                        "INTID {} offered, not pending",
                        irq.intid
                    );
                    if irq.intid < 16 {
                        assert!(irq.source_cpu.is_some_and(|s| usize::from(s) < vcpus));
                    }
                    d.on_listed(vcpu, &irq);
                    if listed[vcpu].len() < 4 {
                        listed[vcpu].push(irq.intid);
                    }
                    assert!(d.has_pending(vcpu) || d.pending_vcpus() & (1 << vcpu) == 0);
                }
                0
            }
            Op::Eoi { vcpu } => {
                let vcpu = usize::from(vcpu) % vcpus;
                if listed[vcpu].is_empty() {
                    0
                } else {
                    let intid = listed[vcpu].remove(0);
                    d.on_eoi(vcpu, intid).kick
                }
            }
            Op::Reset => {
                d.reset();
                listed.iter_mut().for_each(Vec::clear);
                0
            }
        };
        assert_eq!(kick & !all, 0, "kick {kick:#x} names a vCPU the VM lacks");
        assert_eq!(d.pending_vcpus() & !all, 0);
        for vcpu in 0..vcpus {
            assert_eq!(d.has_pending(vcpu), d.pending_vcpus() & (1 << vcpu) != 0);
        }
    }
}

fn check_access<T>(
    r: &Result<T, VgicError>,
    vcpu: usize,
    vcpus: usize,
    offset: u64,
    width: u8,
    v3: bool,
) {
    if vcpu >= vcpus {
        assert!(r.is_err(), "access by vCPU {vcpu} of {vcpus}");
    }
    if r.is_ok() {
        let widths: &[u8] = if v3 { &[1, 4, 8] } else { &[1, 2, 4] };
        assert!(widths.contains(&width), "width {width} accepted");
        assert_eq!(offset % u64::from(width), 0, "unaligned access accepted");
    }
}
