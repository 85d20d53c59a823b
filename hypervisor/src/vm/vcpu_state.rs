//! A vCPU's state, saved: its PSCI power state and, for a vCPU that runs,
//! its general and FP/SIMD registers, PC and PSTATE, its EL1 system
//! registers and virtual timer, its virtual CPU interface (list registers,
//! VMCR, active priorities) and which INTID each list register holds for
//! the virtual distributor. A paused vCPU writes it on its own CPU (the
//! EL1 registers and the virtual interface are live only there); a
//! restored vCPU loads it before its first entry.
//!
//! Reading it is parsing untrusted input, and some of it is loaded into
//! registers the guest cannot write itself: a PSTATE must name EL0 or EL1
//! in AArch64 (an EL2 mode would return into the hypervisor), and a list
//! register must be one the hypervisor could have written: canonical in
//! the GIC version's encoding, an INTID the VM's distributor has, linked
//! to a physical interrupt only for the virtual timer (a guest could
//! otherwise deactivate any physical interrupt), and matching what the
//! distributor is told it holds.

use super::cpu::GuestContext;
use super::vcpus::{Listed, Power};
use crate::hw::context::{El1State, VirtualInterface};
use crate::hw::gic_lr::{encode_lr, encode_lr_v3, parse_lr, parse_lr_v3, LrStatus};
use crate::limits::MAX_LRS;
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};
use crate::vgic::intid::VTIMER_PPI;

const _: () = assert!(crate::hw::gic_lr::MAX_LIST_REGISTERS == MAX_LRS);

/// The layout version of a vCPU's saved state.
const VERSION: u8 = 1;

/// The PSTATE bits a guest may hold: N, Z, C, V, DIT, UAO, PAN, SS, IL,
/// SSBS, D, A, I, F, and M[3:0] (M[4], AArch32, is refused).
const PSTATE_KNOWN: u64 =
    0xf000_0000 | 1 << 24 | 1 << 23 | 1 << 22 | 1 << 21 | 1 << 20 | 1 << 12 | 0x3c0 | 0xf;

/// Whether `pstate` returns to EL0t, EL1t or EL1h in AArch64, with no
/// unknown bit.
pub fn pstate_is_guests(pstate: u64) -> bool {
    pstate & !PSTATE_KNOWN == 0 && matches!(pstate & 0xf, 0b0000 | 0b0100 | 0b0101)
}

/// The registers of a running vCPU.
#[derive(Clone)]
pub struct Running {
    pub ctx: GuestContext,
    pub el1: El1State,
    pub vif: VirtualInterface,
    pub listed: Listed,
}

/// A vCPU's state.
#[derive(Clone)]
pub struct VcpuState {
    pub power: Power,
    /// Its registers when it runs (`power` is `On`).
    pub running: Option<Running>,
}

impl VcpuState {
    /// A vCPU that is off, or starting (not yet entered).
    pub fn not_running(power: Power) -> Self {
        Self {
            power,
            running: None,
        }
    }

    /// Check what cannot be checked without the VM: its GIC version (2 or
    /// 3; none: no list register may be used) and its distributor's
    /// INTIDs (`intids`: SGIs, PPIs and SPIs).
    pub fn check_for(&self, gic: u8, intids: u32) -> Result<(), StateError> {
        let Some(r) = self.running.as_ref() else {
            return Ok(());
        };
        let bad = StateError::Invalid;
        for i in 0..MAX_LRS {
            let raw = r.vif.lrs[i];
            let listed = r.listed[i];
            if raw == 0 {
                continue;
            }
            if i >= usize::from(r.vif.count) {
                return Err(bad("a list register beyond the CPU's"));
            }
            let lr = match gic {
                2 => {
                    let v = u32::try_from(raw).map_err(|_| bad("list register"))?;
                    let lr = parse_lr(v);
                    if u64::from(encode_lr(&lr)) != raw {
                        return Err(bad("list register"));
                    }
                    lr
                }
                3 => {
                    let lr = parse_lr_v3(raw);
                    if encode_lr_v3(&lr) != raw {
                        return Err(bad("list register"));
                    }
                    lr
                }
                _ => return Err(bad("list register without a GIC")),
            };
            if lr.intid >= intids {
                return Err(bad("list register INTID"));
            }
            if lr.hw && (lr.intid != VTIMER_PPI || lr.physical_id != Some(VTIMER_PPI)) {
                return Err(bad("list register linked to a physical interrupt"));
            }
            if lr.state != LrStatus::Invalid && listed != Some(lr.intid) {
                return Err(bad("list register the distributor does not know of"));
            }
        }
        for listed in r.listed.iter().flatten() {
            if *listed >= intids {
                return Err(bad("listed INTID"));
            }
        }
        Ok(())
    }

    /// Whether its virtual timer is listed linked to the physical one
    /// (pending or active): the physical interrupt must then be active on
    /// the CPU it is restored on, as the hypervisor left it when it
    /// listed it.
    pub fn timer_linked(&self, gic: u8) -> bool {
        self.running.as_ref().is_some_and(|r| {
            r.vif.lrs.iter().any(|&raw| {
                let lr = match gic {
                    2 => parse_lr(raw as u32),
                    3 => parse_lr_v3(raw),
                    _ => return false,
                };
                lr.hw && lr.state != LrStatus::Invalid
            })
        })
    }
}

fn power_code(p: Power) -> (u8, u64, u64) {
    match p {
        Power::Off => (0, 0, 0),
        Power::Starting { entry, context } => (1, entry, context),
        Power::On => (2, 0, 0),
    }
}

impl SaveState for VcpuState {
    fn save(&self, w: &mut StateWriter) {
        w.u8(VERSION);
        let (code, entry, context) = power_code(self.power);
        w.u8(code);
        w.u64(entry);
        w.u64(context);
        w.bool(self.running.is_some());
        let Some(r) = self.running.as_ref() else {
            return;
        };
        for x in r.ctx.x {
            w.u64(x);
        }
        w.u64(r.ctx.elr);
        w.u64(r.ctx.spsr);
        for q in r.ctx.fp {
            w.bytes(&q.to_le_bytes());
        }
        w.u64(r.ctx.fpsr);
        w.u64(r.ctx.fpcr);
        for v in r.el1.to_array() {
            w.u64(v);
        }
        w.u8(r.vif.count);
        for lr in r.vif.lrs {
            w.u64(lr);
        }
        w.u32(r.vif.vmcr);
        w.u32(r.vif.apr[0]);
        w.u32(r.vif.apr[1]);
        for l in r.listed {
            w.bool(l.is_some());
            w.u32(l.unwrap_or(0));
        }
    }

    fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        let version = r.u8()?;
        if version != VERSION {
            return Err(StateError::Version {
                device: "vCPU",
                found: version,
            });
        }
        let code = r.u8()?;
        let entry = r.u64()?;
        let context = r.u64()?;
        let power = match code {
            0 => Power::Off,
            1 => Power::Starting { entry, context },
            2 => Power::On,
            _ => return Err(StateError::Invalid("vCPU power state")),
        };
        if code != 1 && (entry, context) != (0, 0) {
            return Err(StateError::Invalid("vCPU power state"));
        }
        let running = r.bool("vCPU registers")?;
        if running != (power == Power::On) {
            return Err(StateError::Invalid("vCPU registers"));
        }
        if !running {
            return Ok(Self::not_running(power));
        }
        let mut ctx = GuestContext::new(0, 0);
        for x in ctx.x.iter_mut() {
            *x = r.u64()?;
        }
        ctx.elr = r.u64()?;
        ctx.spsr = r.u64()?;
        if !pstate_is_guests(ctx.spsr) {
            return Err(StateError::Invalid(
                "vCPU PSTATE (not EL0 or EL1 in AArch64)",
            ));
        }
        for q in ctx.fp.iter_mut() {
            *q = u128::from_le_bytes(r.array::<16>()?);
        }
        ctx.fpsr = r.u64()?;
        ctx.fpcr = r.u64()?;
        let mut el1 = [0u64; 26];
        for v in el1.iter_mut() {
            *v = r.u64()?;
        }
        let mut vif = VirtualInterface {
            count: r.u8()?,
            ..VirtualInterface::default()
        };
        if usize::from(vif.count) > MAX_LRS {
            return Err(StateError::Invalid("list register count"));
        }
        for lr in vif.lrs.iter_mut() {
            *lr = r.u64()?;
        }
        vif.vmcr = r.u32()?;
        vif.apr = [r.u32()?, r.u32()?];
        let mut listed: Listed = [None; MAX_LRS];
        for l in listed.iter_mut() {
            let some = r.bool("listed INTID")?;
            let intid = r.u32()?;
            if !some && intid != 0 {
                return Err(StateError::Invalid("listed INTID"));
            }
            *l = some.then_some(intid);
        }
        Ok(Self {
            power,
            running: Some(Running {
                ctx,
                el1: El1State::from_array(el1),
                vif,
                listed,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::gic_lr::{lr_value, lr_value_v3, PendingIrq};
    use crate::savestate::{from_bytes, to_bytes};

    fn running(gic: u8) -> VcpuState {
        let mut ctx = GuestContext::new(0x4008_0000, 7);
        ctx.x[30] = 0xdead;
        ctx.fp[3] = 1 << 100;
        let irq = PendingIrq {
            intid: 27,
            priority: 0xa0,
            source_cpu: None,
            is_level: true,
            group1: true,
        };
        let lr = if gic == 2 {
            u64::from(lr_value(&irq, Some(27)))
        } else {
            lr_value_v3(&irq, Some(27))
        };
        let mut lrs = [0; MAX_LRS];
        lrs[1] = lr;
        let mut listed = [None; MAX_LRS];
        listed[1] = Some(27);
        VcpuState {
            power: Power::On,
            running: Some(Running {
                ctx,
                el1: El1State {
                    ttbr1: 0x1234_5000,
                    cntv_cval: 99,
                    ..El1State::reset()
                },
                vif: VirtualInterface {
                    count: 4,
                    lrs,
                    vmcr: 0xf000_0001,
                    apr: [0, 1 << 20],
                },
                listed,
            }),
        }
    }

    #[test]
    fn a_running_vcpu_saves_and_restores_every_register() {
        for gic in [2, 3] {
            let state = running(gic);
            let bytes = to_bytes(&state);
            let back: VcpuState = from_bytes(&bytes).expect("restores");
            assert_eq!(to_bytes(&back), bytes);
            let r = back.running.as_ref().unwrap();
            assert_eq!(r.ctx.x[30], 0xdead);
            assert_eq!(r.ctx.fp[3], 1 << 100);
            assert_eq!(r.el1.ttbr1, 0x1234_5000);
            back.check_for(gic, 64).expect("valid for its GIC");
            assert!(back.timer_linked(gic));
        }
        let off: VcpuState = from_bytes(&to_bytes(&VcpuState::not_running(Power::Starting {
            entry: 5,
            context: 6,
        })))
        .unwrap();
        assert_eq!(
            off.power,
            Power::Starting {
                entry: 5,
                context: 6
            }
        );
    }

    #[test]
    fn a_pstate_that_would_return_to_el2_or_aarch32_is_refused() {
        assert!(pstate_is_guests(0x3c5));
        assert!(pstate_is_guests(0x3c4));
        assert!(pstate_is_guests(0));
        assert!(!pstate_is_guests(0x3c9), "EL2h");
        assert!(!pstate_is_guests(0x3c8), "EL2t");
        assert!(!pstate_is_guests(0x3d0), "AArch32");
        assert!(!pstate_is_guests(0x3c5 | 1 << 40), "reserved bit");
        let mut state = running(3);
        state.running.as_mut().unwrap().ctx.spsr = 0x3c9;
        assert_eq!(
            from_bytes::<VcpuState>(&to_bytes(&state)).err(),
            Some(StateError::Invalid(
                "vCPU PSTATE (not EL0 or EL1 in AArch64)"
            ))
        );
    }

    #[test]
    fn list_registers_the_hypervisor_could_not_have_written_are_refused() {
        let check = |gic: u8, f: &dyn Fn(&mut Running)| {
            let mut s = running(gic);
            f(s.running.as_mut().unwrap());
            s.check_for(gic, 64)
        };
        for gic in [2u8, 3] {
            assert!(check(gic, &|_| {}).is_ok());
            // Linked to another physical interrupt than the timer's.
            let other = |r: &mut Running| {
                let irq = PendingIrq {
                    intid: 40,
                    priority: 0xa0,
                    source_cpu: None,
                    is_level: true,
                    group1: true,
                };
                r.lrs_set(
                    gic,
                    if gic == 2 {
                        u64::from(lr_value(&irq, Some(40)))
                    } else {
                        lr_value_v3(&irq, Some(40))
                    },
                );
                r.listed[1] = Some(40);
            };
            assert!(check(gic, &other).is_err());
            // An INTID beyond the distributor's.
            assert!(check(gic, &|r| r.listed[1] = Some(64)).is_err());
            // A valid list register the distributor was not told of.
            assert!(check(gic, &|r| r.listed[1] = None).is_err());
            // Beyond the CPU's list registers.
            assert!(check(gic, &|r| r.vif.count = 1).is_err());
            // Reserved bits.
            assert!(check(gic, &|r| r.vif.lrs[1] |= 1 << 21).is_err());
        }
        // A GICv3 value on a GICv2 and none without a GIC.
        let s = running(3);
        assert!(s.check_for(2, 64).is_err());
        assert!(s.check_for(0, 64).is_err());
    }

    impl Running {
        fn lrs_set(&mut self, _gic: u8, value: u64) {
            self.vif.lrs[1] = value;
        }
    }

    #[test]
    fn truncated_or_inconsistent_bytes_are_refused_without_a_panic() {
        let bytes = to_bytes(&running(3));
        for len in 0..bytes.len() {
            assert!(from_bytes::<VcpuState>(&bytes[..len]).is_err());
        }
        let mut off = to_bytes(&VcpuState::not_running(Power::Off));
        off[2] = 1; // an entry for a vCPU that is off
        assert!(from_bytes::<VcpuState>(&off).is_err());
    }
}
