//! A VM's vCPUs: how many, the physical CPU each is pinned to, each one's
//! PSCI power state, how many are inside their run loop, and which INTID
//! each one's list registers hold.
//!
//! Invariants, kept by the methods: the count is 1 to `MAX_VCPUS` and
//! never changes; no more vCPUs are inside than there are; a vCPU that
//! leaves its loop holds no list register; a vCPU out of range is off and
//! lists nothing.

use crate::limits::{MAX_LRS, MAX_VCPUS};

/// A vCPU's power state, as PSCI sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Power {
    Off,
    /// CPU_ON accepted: enter at `entry` with x0 = `context`.
    Starting {
        entry: u64,
        context: u64,
    },
    On,
}

/// Which INTID each list register of a vCPU holds.
pub type Listed = [Option<u32>; MAX_LRS];

pub struct Vcpus {
    count: usize,
    cpus: [usize; MAX_VCPUS],
    power: [Power; MAX_VCPUS],
    inside: usize,
    listed: [Listed; MAX_VCPUS],
}

impl Vcpus {
    /// One vCPU per bit of `affinity` (a CPU mask), at most `MAX_VCPUS`,
    /// at least one (pinned to no CPU if the mask is empty), all off.
    pub(super) fn pinned(affinity: u64) -> Self {
        let mut cpus = [usize::MAX; MAX_VCPUS];
        let mut count = 0;
        for bit in 0..64 {
            if affinity & (1 << bit) != 0 && count < MAX_VCPUS {
                cpus[count] = bit;
                count += 1;
            }
        }
        Self {
            count: count.max(1),
            cpus,
            power: [Power::Off; MAX_VCPUS],
            inside: 0,
            listed: [[None; MAX_LRS]; MAX_VCPUS],
        }
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// The physical CPUs the vCPUs are pinned to, vCPU 0 first.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus[..self.count]
    }

    /// The physical CPU `vcpu` is pinned to (`usize::MAX`, no CPU, if
    /// there is no such vCPU).
    pub fn cpu(&self, vcpu: usize) -> usize {
        self.cpus().get(vcpu).copied().unwrap_or(usize::MAX)
    }

    pub fn power(&self, vcpu: usize) -> Power {
        self.power[..self.count]
            .get(vcpu)
            .copied()
            .unwrap_or(Power::Off)
    }

    /// Set one vCPU's power state; a vCPU out of range stays off.
    pub(super) fn set_power(&mut self, vcpu: usize, power: Power) {
        if let Some(p) = self.power[..self.count].get_mut(vcpu) {
            *p = power;
        }
    }

    /// Whether every vCPU is off.
    pub fn all_off(&self) -> bool {
        self.power.iter().all(|p| *p == Power::Off)
    }

    /// Every vCPU off.
    pub(super) fn power_off_all(&mut self) {
        self.power = [Power::Off; MAX_VCPUS];
    }

    /// The VM starts: vCPU 0 on, the others off, no list register held.
    pub(super) fn boot(&mut self) {
        self.listed = [[None; MAX_LRS]; MAX_VCPUS];
        self.power = [Power::Off; MAX_VCPUS];
        self.power[0] = Power::On;
    }

    /// The vCPUs that are not off and are pinned to a CPU other than `me`,
    /// with that CPU: those to kick for them to see an event.
    pub fn awake_elsewhere(&self, me: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.count)
            .filter(move |&v| self.power[v] != Power::Off && self.cpus[v] != me)
            .map(|v| (v, self.cpus[v]))
    }

    /// How many vCPUs are inside their run loop.
    pub fn inside(&self) -> usize {
        self.inside
    }

    /// A vCPU enters its run loop.
    pub(super) fn enter(&mut self) {
        self.inside = (self.inside + 1).min(self.count);
    }

    /// `vcpu` leaves its run loop: its list registers are given up.
    pub(super) fn leave(&mut self, vcpu: usize) {
        if let Some(listed) = self.listed[..self.count].get_mut(vcpu) {
            *listed = [None; MAX_LRS];
        }
        self.inside = self.inside.saturating_sub(1);
    }

    /// The VM failed in the hypervisor's path: whatever its vCPUs were
    /// doing, none is inside or on any more.
    pub(super) fn forget(&mut self) {
        self.inside = 0;
        self.power_off_all();
        self.listed = [[None; MAX_LRS]; MAX_VCPUS];
    }

    /// What `vcpu`'s list registers hold; None for no such vCPU.
    pub fn listed(&self, vcpu: usize) -> Option<&Listed> {
        self.listed[..self.count].get(vcpu)
    }

    pub fn listed_mut(&mut self, vcpu: usize) -> Option<&mut Listed> {
        self.listed[..self.count].get_mut(vcpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_vcpu_per_cpu_of_the_mask_and_at_least_one() {
        let v = Vcpus::pinned(0b1010);
        assert_eq!(v.count(), 2);
        assert_eq!(v.cpus(), &[1, 3]);
        assert_eq!(v.cpu(2), usize::MAX);
        let none = Vcpus::pinned(0);
        assert_eq!(none.count(), 1);
        assert_eq!(none.cpu(0), usize::MAX);
        assert_eq!(Vcpus::pinned(u64::MAX).count(), MAX_VCPUS);
    }

    #[test]
    fn no_more_inside_than_vcpus_and_leaving_frees_the_list_registers() {
        let mut v = Vcpus::pinned(0b11);
        v.boot();
        v.listed_mut(1).unwrap()[0] = Some(33);
        for _ in 0..5 {
            v.enter();
        }
        assert_eq!(v.inside(), 2);
        v.leave(1);
        assert_eq!(v.listed(1), Some(&[None; MAX_LRS]));
        assert_eq!(v.inside(), 1);
        v.leave(0);
        v.leave(0);
        assert_eq!(v.inside(), 0);
    }

    #[test]
    fn a_vcpu_out_of_range_is_off_and_lists_nothing() {
        let mut v = Vcpus::pinned(0b1);
        v.set_power(1, Power::On);
        assert_eq!(v.power(1), Power::Off);
        assert!(v.listed_mut(1).is_none());
        v.boot();
        assert_eq!(v.power(0), Power::On);
        assert!(!v.all_off());
        v.set_power(
            0,
            Power::Starting {
                entry: 1,
                context: 2,
            },
        );
        assert_eq!(v.awake_elsewhere(7).collect::<Vec<_>>(), vec![(0, 0)]);
        assert_eq!(v.awake_elsewhere(0).count(), 0);
        v.forget();
        assert!(v.all_off());
    }
}
