//! Failure domains: whom a hypervisor failure (a panic, an EL2 exception)
//! belongs to, and what it ends.
//!
//! Work done for one VM (its vCPU's loop) is that VM's domain: a failure
//! there stops that VM. Work done for the whole board (the memory
//! manager's tick, zeroing ahead, the shell) is a [`Service`]'s domain: a
//! failure there turns that service off (the shell: abandons the command)
//! and every VM goes on. A service handling one VM's input (the manager
//! reading a VM's statistics, setting its target) is that VM's domain
//! again, as an [`Domain::Input`]: the VM whose numbers caused the failure
//! is stopped, never the one whose CPU happened to run the service.
//!
//! Each recovery point a CPU arms carries a [`Point`] packed in a `u64`
//! (the arch layer keeps it as an opaque tag): the domain, and the locks
//! the CPU held when it was armed, so that a failure releases only the
//! locks taken inside the domain that failed. The services' on/off state
//! lives here too. Plain data, host-tested.

use core::fmt::{self, Write};
use core::sync::atomic::{AtomicBool, Ordering};

/// Work the hypervisor does for the whole board.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Service {
    /// The memory manager's tick: balloon targets from the pool's state.
    Manager = 1,
    /// Zeroing free frames ahead of time while CPUs idle.
    Zeroing = 2,
    /// The operator's shell (one command at a time).
    Shell = 3,
}

impl Service {
    const ALL: [Service; 3] = [Service::Manager, Service::Zeroing, Service::Shell];

    fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as u8 == code)
    }

    /// What the console calls it.
    pub fn name(self) -> &'static str {
        match self {
            Service::Manager => "memory manager",
            Service::Zeroing => "zeroing ahead",
            Service::Shell => "shell",
        }
    }

    /// What a failure leaves behind, said after the reason.
    pub fn after_failure(self) -> &'static str {
        match self {
            Service::Manager => "balloons left as they are",
            Service::Zeroing => "frames are zeroed when a guest takes them",
            Service::Shell => "the command is abandoned, the shell goes on",
        }
    }

    /// Whether a failure turns the service off (the shell stays: it is
    /// the operator's only way in, and each command starts afresh).
    pub fn stops_on_failure(self) -> bool {
        !matches!(self, Service::Shell)
    }
}

/// Whom a recovery point's work belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// A vCPU's loop: the VM running on this CPU.
    Vcpu,
    /// Board-wide work.
    Service(Service),
    /// `service` handling VM `vm`'s input.
    Input { vm: usize, service: Service },
}

/// A recovery point's tag: its domain and the locks held when it was
/// armed (`crate::held` bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    pub domain: Domain,
    pub held_at_entry: u32,
}

const KIND_VCPU: u64 = 0;
const KIND_SERVICE: u64 = 1;
const KIND_INPUT: u64 = 2;

impl Point {
    /// The tag a recovery point carries.
    pub fn encode(self) -> u64 {
        let (kind, service, vm) = match self.domain {
            Domain::Vcpu => (KIND_VCPU, 0, 0),
            Domain::Service(s) => (KIND_SERVICE, s as u64, 0),
            Domain::Input { vm, service } => (KIND_INPUT, service as u64, (vm as u64) & 0xffff),
        };
        kind << 56 | service << 48 | vm << 32 | u64::from(self.held_at_entry)
    }

    /// The point a tag stands for; an unknown tag (0 included) is a vCPU's
    /// with no lock held at entry, as the vCPU loop arms it.
    pub fn decode(tag: u64) -> Self {
        let held_at_entry = tag as u32;
        let service = Service::from_code((tag >> 48) as u8);
        let vm = ((tag >> 32) & 0xffff) as usize;
        let domain = match (tag >> 56, service) {
            (KIND_SERVICE, Some(s)) => Domain::Service(s),
            (KIND_INPUT, Some(service)) => Domain::Input { vm, service },
            _ => Domain::Vcpu,
        };
        Point {
            domain,
            held_at_entry,
        }
    }
}

/// Where `debug fail-board` and `debug fail-input` inject a failure: the
/// memory manager's next tick, zeroing ahead's next decision, or the
/// manager's reading of VM `id`'s input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectInto {
    Manager,
    Zeroing,
    Input(usize),
}

/// Longest reason kept for a service that stopped.
pub const REASON_BYTES: usize = 160;

/// A service's state: on, or off since a failure (and why).
pub struct ServiceState {
    off: AtomicBool,
    reason: spin::Mutex<heapless::String<REASON_BYTES>>,
}

impl ServiceState {
    pub const fn new() -> Self {
        Self {
            off: AtomicBool::new(false),
            reason: spin::Mutex::new(heapless::String::new()),
        }
    }

    /// Whether a failure turned it off.
    pub fn is_off(&self) -> bool {
        self.off.load(Ordering::Acquire)
    }

    /// Turn it off for `why` (cut to [`REASON_BYTES`]); false if it was
    /// already off.
    pub fn turn_off(&self, why: fmt::Arguments) -> bool {
        if self.off.swap(true, Ordering::AcqRel) {
            return false;
        }
        // Only the CPU that turned it off writes; readers try, never wait.
        if let Some(mut reason) = self.reason.try_lock() {
            reason.clear();
            let _ = Cut(&mut reason).write_fmt(why);
        }
        true
    }

    /// Why it is off (empty if on, or if the reason is being written).
    pub fn reason(&self) -> heapless::String<REASON_BYTES> {
        self.reason
            .try_lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }
}

impl Default for ServiceState {
    fn default() -> Self {
        Self::new()
    }
}

/// Writes what fits, drops the rest (a reason is never an error).
struct Cut<'a, const N: usize>(&'a mut heapless::String<N>);

impl<const N: usize> Write for Cut<'_, N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            if self.0.push(c).is_err() {
                break;
            }
        }
        Ok(())
    }
}

/// The services' states, indexed by [`Service`].
pub struct Services([ServiceState; 3]);

impl Services {
    pub const fn new() -> Self {
        Self([const { ServiceState::new() }; 3])
    }

    pub fn get(&self, service: Service) -> &ServiceState {
        &self.0[service as usize - 1]
    }
}

impl Default for Services {
    fn default() -> Self {
        Self::new()
    }
}

/// The line the console prints when a failure ends `service`'s work.
pub struct FailureLine<'a> {
    pub service: Service,
    pub what: fmt::Arguments<'a>,
}

impl fmt::Display for FailureLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.service.stops_on_failure() {
            "stopped"
        } else {
            "command failed"
        };
        write!(
            f,
            "tidal: {} {verb}: {}; {}",
            self.service.name(),
            self.what,
            self.service.after_failure()
        )
    }
}

#[cfg(test)]
mod tests {
    extern crate alloc;
    use alloc::string::ToString;

    use super::*;

    #[test]
    fn points_round_trip() {
        for domain in [
            Domain::Vcpu,
            Domain::Service(Service::Manager),
            Domain::Service(Service::Zeroing),
            Domain::Service(Service::Shell),
            Domain::Input {
                vm: 7,
                service: Service::Manager,
            },
        ] {
            for held in [0, 1, 0x8000_0102, u32::MAX] {
                let p = Point {
                    domain,
                    held_at_entry: held,
                };
                assert_eq!(Point::decode(p.encode()), p);
            }
        }
    }

    #[test]
    fn a_plain_tag_is_a_vcpu() {
        // `recovery::run_recoverable` arms with tag 0: the vCPU loop.
        assert_eq!(
            Point::decode(0),
            Point {
                domain: Domain::Vcpu,
                held_at_entry: 0
            }
        );
        // A service code nobody knows is not a service.
        assert_eq!(
            Point::decode(KIND_SERVICE << 56 | 9 << 48).domain,
            Domain::Vcpu
        );
    }

    #[test]
    fn a_service_turns_off_once_with_its_reason() {
        let services = Services::new();
        let mm = services.get(Service::Manager);
        assert!(!mm.is_off());
        assert!(mm.turn_off(format_args!(
            "attempt to add with overflow at {}:{}",
            "x.rs", 3
        )));
        assert!(!mm.turn_off(format_args!("again")));
        assert!(mm.is_off());
        assert_eq!(
            mm.reason().as_str(),
            "attempt to add with overflow at x.rs:3"
        );
        assert!(!services.get(Service::Zeroing).is_off());
    }

    #[test]
    fn a_long_reason_is_cut() {
        let s = ServiceState::new();
        let long = "é".repeat(200);
        s.turn_off(format_args!("{long}"));
        assert!(s.reason().len() <= REASON_BYTES);
        assert!(s.reason().starts_with("éé"));
    }

    #[test]
    fn failure_lines() {
        let line = FailureLine {
            service: Service::Manager,
            what: format_args!("boom at a.rs:1"),
        }
        .to_string();
        assert_eq!(
            line,
            "tidal: memory manager stopped: boom at a.rs:1; balloons left as they are"
        );
        let line = FailureLine {
            service: Service::Shell,
            what: format_args!("boom"),
        }
        .to_string();
        assert_eq!(
            line,
            "tidal: shell command failed: boom; the command is abandoned, the shell goes on"
        );
    }
}
