//! The physical and virtual INTIDs the hypervisor gives a meaning to.

/// The SGI the hypervisor sends to make a CPU leave its guest.
pub const KICK_SGI: u32 = 0;
/// The GIC's maintenance interrupt (list registers need attention).
pub const MAINTENANCE_PPI: u32 = 25;
/// The EL2 physical timer, which bounds how long a CPU sleeps for a guest.
pub const HYP_TIMER_PPI: u32 = 26;
/// The EL1 virtual timer, handed to the guest (the same INTID inside it).
pub const VTIMER_PPI: u32 = 27;
/// What an acknowledge returns when nothing is pending.
pub const SPURIOUS: u32 = 1023;
