//! Bad guest accesses: what kind each is, what the guest gets for it under
//! the VM's policy ([`OnBadAccess`]), and the per-VM counters the shell
//! shows. Plain data, tested on the host; `run.rs` finds the access and
//! `inject.rs` computes the exception.

use core::fmt;

use super::inject::GuestException;

/// What a VM gets for a bad access (its configuration's `on_bad_access`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnBadAccess {
    /// An exception injected into the guest, as hardware raises it.
    #[default]
    Abort,
    /// The whole VM is stopped.
    Stop,
}

impl OnBadAccess {
    /// From the bundle's `on_bad_access` code (`guest_bundle::bad_access`).
    pub fn from_code(code: u32) -> Option<Self> {
        match code {
            guest_bundle::bad_access::ABORT => Some(Self::Abort),
            guest_bundle::bad_access::STOP => Some(Self::Stop),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Stop => "stop",
        }
    }

    pub fn parse(word: &str) -> Option<Self> {
        match word {
            "abort" => Some(Self::Abort),
            "stop" => Some(Self::Stop),
            _ => None,
        }
    }
}

/// The emulated device window an access hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(all(target_os = "none", feature = "trace"), derive(defmt::Format))]
pub enum Device {
    Virtio,
    GicDistributor,
    GicRedistributor,
    Uart,
}

impl Device {
    pub fn label(self) -> &'static str {
        match self {
            Device::Virtio => "the virtio-mmio device",
            Device::GicDistributor => "the GIC distributor",
            Device::GicRedistributor => "a GIC redistributor",
            Device::Uart => "the PL011",
        }
    }
}

/// Why an access is bad.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadAccessKind {
    /// A device register accessed with a width, alignment or direction the
    /// device does not accept, or an offset where it has no register.
    DeviceRegister(Device),
    /// An access to a device without a valid instruction syndrome (ISV=0:
    /// a load/store pair, a writeback form, SIMD): it cannot be emulated.
    NoSyndrome(Device),
    /// An address that is neither the VM's RAM nor a device.
    Unmapped,
    /// An instruction fetch outside the VM's RAM.
    InstructionFetch,
    /// A fault on RAM that backing the page does not explain.
    RamFault,
    /// A system register the hypervisor does not emulate.
    SystemRegister,
    /// A trap the hypervisor does not handle.
    UnknownExit,
}

/// Number of [`BadAccessKind`] variants (counter slots).
pub const KINDS: usize = 7;

impl BadAccessKind {
    pub fn index(self) -> usize {
        match self {
            BadAccessKind::DeviceRegister(_) => 0,
            BadAccessKind::NoSyndrome(_) => 1,
            BadAccessKind::Unmapped => 2,
            BadAccessKind::InstructionFetch => 3,
            BadAccessKind::RamFault => 4,
            BadAccessKind::SystemRegister => 5,
            BadAccessKind::UnknownExit => 6,
        }
    }

    /// Short names of the counter slots, in [`index`](Self::index) order.
    pub const NAMES: [&'static str; KINDS] = [
        "bad device register",
        "no syndrome",
        "not RAM or device",
        "fetch outside RAM",
        "RAM fault",
        "system register",
        "unknown trap",
    ];

    /// The exception the guest gets (policy `abort`).
    pub fn exception(self, write: bool) -> GuestException {
        match self {
            BadAccessKind::InstructionFetch => GuestException::InstructionAbort,
            BadAccessKind::SystemRegister | BadAccessKind::UnknownExit => GuestException::Undefined,
            _ => GuestException::DataAbort { write },
        }
    }
}

impl fmt::Display for BadAccessKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadAccessKind::DeviceRegister(d) => {
                write!(f, "an access {} does not accept", d.label())
            }
            BadAccessKind::NoSyndrome(d) => write!(
                f,
                "an access the hypervisor cannot emulate (no instruction syndrome: \
                 a load/store pair, writeback or SIMD form) to {}",
                d.label()
            ),
            BadAccessKind::Unmapped => {
                f.write_str("an access to an address that is neither its RAM nor a device")
            }
            BadAccessKind::InstructionFetch => f.write_str("an instruction fetch outside its RAM"),
            BadAccessKind::RamFault => f.write_str("an unexpected fault on its RAM"),
            BadAccessKind::SystemRegister => {
                f.write_str("a system register the hypervisor does not emulate")
            }
            BadAccessKind::UnknownExit => f.write_str("a trap the hypervisor does not handle"),
        }
    }
}

impl GuestException {
    /// What the guest is told, for the console line.
    pub fn label(self) -> &'static str {
        match self {
            GuestException::DataAbort { .. } => "data abort",
            GuestException::InstructionAbort => "instruction abort",
            GuestException::Undefined => "undefined instruction",
        }
    }
}

/// Exceptions injected into one VM, in total and per kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BadAccessStats {
    pub injected: u64,
    pub by_kind: [u64; KINDS],
}

impl BadAccessStats {
    pub fn count(&mut self, kind: BadAccessKind) {
        self.injected = self.injected.saturating_add(1);
        let slot = &mut self.by_kind[kind.index()];
        *slot = slot.saturating_add(1);
    }
}

impl fmt::Display for BadAccessStats {
    /// `3 (2 bad device register, 1 no syndrome)`; kinds never seen are left out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.injected)?;
        let mut first = true;
        for (name, n) in BadAccessKind::NAMES.iter().zip(self.by_kind) {
            if n == 0 {
                continue;
            }
            f.write_str(if first { " (" } else { ", " })?;
            write!(f, "{n} {name}")?;
            first = false;
        }
        if !first {
            f.write_str(")")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_exceptions_and_slots() {
        let all = [
            BadAccessKind::DeviceRegister(Device::Virtio),
            BadAccessKind::NoSyndrome(Device::GicDistributor),
            BadAccessKind::Unmapped,
            BadAccessKind::InstructionFetch,
            BadAccessKind::RamFault,
            BadAccessKind::SystemRegister,
            BadAccessKind::UnknownExit,
        ];
        let slots: Vec<usize> = all.iter().map(|k| k.index()).collect();
        assert_eq!(slots, (0..KINDS).collect::<Vec<_>>());
        assert_eq!(
            BadAccessKind::Unmapped.exception(true),
            GuestException::DataAbort { write: true }
        );
        assert_eq!(
            BadAccessKind::InstructionFetch.exception(false),
            GuestException::InstructionAbort
        );
        assert_eq!(
            BadAccessKind::SystemRegister.exception(false),
            GuestException::Undefined
        );
    }

    #[test]
    fn counters_and_their_line() {
        let mut s = BadAccessStats::default();
        assert_eq!(s.to_string(), "0");
        s.count(BadAccessKind::DeviceRegister(Device::Virtio));
        s.count(BadAccessKind::DeviceRegister(Device::GicDistributor));
        s.count(BadAccessKind::NoSyndrome(Device::Virtio));
        assert_eq!(s.to_string(), "3 (2 bad device register, 1 no syndrome)");
    }

    #[test]
    fn messages_name_the_real_reason() {
        let m = BadAccessKind::NoSyndrome(Device::Virtio).to_string();
        assert!(m.contains("no instruction syndrome"), "{m}");
        assert!(m.contains("virtio-mmio device"), "{m}");
        assert!(!m.contains("neither its RAM"), "{m}");
    }

    #[test]
    fn policy_codes_and_words() {
        assert_eq!(OnBadAccess::from_code(0), Some(OnBadAccess::Abort));
        assert_eq!(OnBadAccess::from_code(1), Some(OnBadAccess::Stop));
        assert_eq!(OnBadAccess::from_code(2), None);
        assert_eq!(OnBadAccess::parse("stop"), Some(OnBadAccess::Stop));
        assert_eq!(OnBadAccess::default().label(), "abort");
    }
}
