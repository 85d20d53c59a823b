//! `hostile-stats`: a guest whose balloon driver is well-behaved in every
//! respect but its statistics, which claim 2^64-1 for every tag Linux sends
//! (0-15: free, total and available memory, disk caches, faults, OOM kills,
//! ...). The guest otherwise runs as in `pattern` mode: it follows the
//! balloon's target, keeps its pool's patterns and beats.
//!
//! Issue 36: a memory manager that adds free memory and disk caches as the
//! guest gives them overflows; the VM stopped for it was whichever one's CPU
//! ran the manager's tick, not this one. The device must clamp these values
//! where they enter and no board service may fail on them.

use guest_driver::{MemoryStats, StatsSource, MAX_STATS};

/// What every statistic claims.
pub const HOSTILE_VALUE: u64 = u64::MAX;

/// A statistics source that claims [`HOSTILE_VALUE`] for tags 0 to
/// [`MAX_STATS`] - 1, and counts the buffers it filled.
#[derive(Default)]
pub struct HostileStats {
    pub sent: u64,
}

impl StatsSource for HostileStats {
    fn memory_stats(&mut self, stats: &mut MemoryStats) {
        for tag in 0..MAX_STATS as u16 {
            stats.set(tag, HOSTILE_VALUE);
        }
        self.sent += 1;
    }
}
