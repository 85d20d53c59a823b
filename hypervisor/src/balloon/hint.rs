//! Free page hinting (FREE_PAGE_HINT): the command-id state machine and the
//! record of a run. The queue side (reading the id buffers, validating and
//! discarding hinted blocks) is in the parent module.
//!
//! # Protocol (virtio 1.2 section 5.5.6.4; Linux `virtio_balloon.c`; QEMU
//! `hw/virtio/virtio-balloon.c`)
//!
//! `free_page_hint_cmd_id` is the device's: 0 is STOP, 1 is DONE, 2 and up
//! name a run. The driver reads it on every config-change interrupt.
//!
//! 1. The host starts a run ([`HintState::Requested`]): a fresh id (the
//!    previous one plus one, from 2, wrapping to 2 after `u32::MAX`, so an id
//!    never comes back while the driver could still answer it), shown in the
//!    config, config-change interrupt.
//! 2. The driver answers with a 4-byte driver-written buffer holding that id
//!    ([`HintState::Started`]). A buffer with another id (a stale answer, a
//!    stale STOP of an earlier run) changes nothing and is counted.
//! 3. The driver then adds free blocks as single device-writable buffers.
//!    The device may discard their content: it unmaps them at once and
//!    returns their frames (the next guest access backs a fresh page).
//!    Blocks that arrive while no run is started (not yet answered, stopped
//!    by the host, done, or no run at all) are stale: returned, not
//!    touched, counted.
//! 4. The driver ends with a 4-byte buffer holding STOP (0) when it has no
//!    more free blocks or when it saw the id change. Any id buffer other
//!    than the run's own ends a started run, as in QEMU. The host may ask
//!    for the end first by showing STOP ([`HintState::HostStopped`]); the
//!    driver then sends its STOP.
//! 5. On the driver's STOP the device shows DONE (1) and raises the
//!    config-change interrupt ([`HintState::Done`]): Linux then frees the
//!    hinted blocks it kept allocated. Until DONE the guest may take hinted
//!    pages back (its shrinker) and use them; each such page faults in
//!    stage 2, the run loop tells the device, which counts it as reused.
//!
//! While a run is started the config shows its id (QEMU shows 0 then; Linux
//! only rereads the id on a config change, but a target change during a
//! run would then stop it for no reason). A driver reset abandons the run.

/// Command id STOP.
pub const CMD_ID_STOP: u32 = 0;
/// Command id DONE.
pub const CMD_ID_DONE: u32 = 1;
/// Smallest command id that names a run.
pub const CMD_ID_MIN: u32 = 2;

/// Where the hinting protocol stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintState {
    /// No run since the driver started (config shows STOP).
    Idle,
    /// A run was requested, the driver has not answered (config: its id).
    Requested,
    /// The driver answered; hints are accepted (config: the run's id).
    Started,
    /// The host asked the driver to stop (config: STOP); waiting for its
    /// STOP buffer.
    HostStopped,
    /// The run ended (config: DONE); the guest reuses the hinted pages.
    Done,
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintOutcome {
    /// Still going.
    Running,
    /// The driver sent STOP and the device set DONE.
    Done,
    /// A new run was requested before the driver answered this one.
    Superseded,
    /// The driver reset the device.
    Reset,
}

/// One free page hinting run, for `info balloon`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HintRun {
    pub id: u32,
    /// When the host requested it (the caller's clock, microseconds).
    pub started_us: u64,
    /// When the driver answered with the id.
    pub answered_us: Option<u64>,
    /// When it ended (DONE set, superseded or reset).
    pub ended_us: Option<u64>,
    pub outcome: HintOutcome,
    /// Hint buffers (blocks) accepted.
    pub blocks: u64,
    /// Pages newly hinted (unmapped and returned to the pool).
    pub pages_hinted: u64,
    /// Hinted pages the guest touched again before DONE.
    pub pages_reused: u64,
}

impl HintRun {
    pub(crate) fn new(id: u32, now_us: u64) -> Self {
        HintRun {
            id,
            started_us: now_us,
            answered_us: None,
            ended_us: None,
            outcome: HintOutcome::Running,
            blocks: 0,
            pages_hinted: 0,
            pages_reused: 0,
        }
    }

    /// Time from the request to the end (or to `now_us` while running).
    pub fn elapsed_us(&self, now_us: u64) -> u64 {
        self.ended_us
            .unwrap_or(now_us)
            .saturating_sub(self.started_us)
    }
}

impl core::fmt::Display for HintRun {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let outcome = match self.outcome {
            HintOutcome::Running => "running",
            HintOutcome::Done => "done",
            HintOutcome::Superseded => "superseded before the driver answered",
            HintOutcome::Reset => "abandoned by a driver reset",
        };
        write!(
            f,
            "run {} {outcome}: {} pages hinted in {} blocks, {} reused before DONE",
            self.id, self.pages_hinted, self.blocks, self.pages_reused
        )?;
        if self.answered_us.is_none() && self.outcome != HintOutcome::Running {
            f.write_str(" (the driver never answered)")?;
        }
        if let Some(end) = self.ended_us {
            write!(
                f,
                ", {}",
                super::stats::Seconds(end.saturating_sub(self.started_us))
            )?;
        }
        Ok(())
    }
}

/// Why a hinting run cannot start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintError {
    /// The VM's configuration does not offer FREE_PAGE_HINT.
    NotOffered,
    /// The driver is not running, or did not accept FREE_PAGE_HINT.
    NotNegotiated,
    /// The device needs a reset after a guest error.
    DeviceStopped,
    /// A started run has not ended yet.
    InProgress { id: u32 },
}

impl core::fmt::Display for HintError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            HintError::NotOffered => f.write_str(
                "its balloon does not offer FREE_PAGE_HINT (enable the feature in the VM's configuration)",
            ),
            HintError::NotNegotiated => f.write_str(
                "the guest's balloon driver is not running or did not accept FREE_PAGE_HINT",
            ),
            HintError::DeviceStopped => f.write_str(
                "its balloon device needs a reset after a guest error ('info balloon <vm>' shows it)",
            ),
            HintError::InProgress { id } => write!(
                f,
                "hint run {id} is still going; wait for it to end ('info balloon <vm>' shows it)"
            ),
        }
    }
}

/// The next run id after `id`: never STOP or DONE.
pub(crate) fn next_id(id: u32) -> u32 {
    match id.checked_add(1) {
        Some(n) if n >= CMD_ID_MIN => n,
        _ => CMD_ID_MIN,
    }
}
