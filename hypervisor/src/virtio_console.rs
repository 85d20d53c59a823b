//! The virtio console (virtio 1.2 section 5.3), device side: one port, no
//! multiport, no size or emergency write. It exists for speed. A guest's
//! PL011 costs a trap for every byte it sends and two for every byte it
//! reads; through this device a whole write is one notification and a whole
//! line typed is one interrupt (Linux: `virtio_console`, `/dev/hvc0`).
//!
//! The device owns no buffer of its own: what the guest sends goes to the
//! VM's console through [`ConsoleIo::output`] while the transmit chain is
//! read, and typed input waits in the VM's input queue until the driver
//! has posted receive buffers ([`VirtioConsole::receive`]). Every chain is
//! checked like the balloon's: direction of each descriptor, RAM only,
//! bounded length; a bad one sets DEVICE_NEEDS_RESET.
//!
//! # Bounded work per pass
//!
//! A pass over a queue (a notify's exit, typed input, a tick) takes at
//! most [`CHAINS_PER_PASS`] chains and, on the transmit queue, starts no
//! new chain once [`TX_BYTES_PER_PASS`] bytes were shown: a guest whose
//! other vCPU publishes chains as fast as the device returns them cannot
//! keep the vCPU that notified (and the VM lock, which the shell's `stop`,
//! `info` and `check` wait for) in the loop. A pass cut short remembers
//! it ([`VirtioConsole::has_more`]); the rest is taken by the guest's
//! next notify or by [`VirtioConsole::resume`], which the memory tick
//! calls (`vm::irq::flush_vconsole`), one pass per tick. Linux's hvc
//! writes one chain and waits for it: it never meets the bound.

use crate::virtio::{
    DescChain, DeviceError, DeviceErrorKind, GuestMemory, VirtioDevice, VirtioDeviceIo, Virtqueue,
    VIRTIO_F_VERSION_1,
};

/// Virtio device ID of a console.
pub const DEVICE_ID: u32 = 3;
/// Port 0's receive queue: buffers the device fills with typed input.
pub const RECEIVEQ: usize = 0;
/// Port 0's transmit queue: what the guest prints.
pub const TRANSMITQ: usize = 1;
/// QueueNumMax of both queues (Linux fills its receive queue with one page
/// per entry, up to this many).
pub const QUEUE_SIZE: u16 = 64;
/// Longest transmit chain accepted: Linux's hvc sends at most a page; a
/// longer chain is refused rather than read for an unbounded time.
pub const MAX_TX_CHAIN: u32 = 64 * 1024;
/// Most chains one pass over a queue takes: a queue's worth.
pub const CHAINS_PER_PASS: usize = QUEUE_SIZE as usize;
/// Bytes of output after which a transmit pass starts no new chain (it
/// finishes the chain it is in: one chain is at most [`MAX_TX_CHAIN`]).
pub const TX_BYTES_PER_PASS: u64 = 64 * 1024;
/// Bytes copied at a time between guest memory and the console.
const PIECE: usize = 128;
/// The config space (cols, rows, max_nr_ports, emerg_wr): meaningful only
/// with features this device does not offer, so it reads as zeros.
const CONFIG_SIZE: u64 = 12;

/// What the console device does to the VM besides its memory: output to
/// show, input to hand over.
pub trait ConsoleIo {
    /// The guest printed `bytes`.
    fn output(&mut self, bytes: &[u8]);
    /// Whether typed input waits for the guest.
    fn input_waiting(&self) -> bool;
    /// Copy up to `buf.len()` bytes of waiting input, oldest first, after
    /// the first `skip`, leaving them waiting; how many.
    fn peek_input(&self, skip: usize, buf: &mut [u8]) -> usize;
    /// The first `count` bytes of waiting input were delivered.
    fn consume_input(&mut self, count: usize);
}

/// What the device moved since the VM started, for `info console`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsoleStats {
    /// Bytes the guest printed, and the transmit chains they came in.
    pub bytes_out: u64,
    pub chains_out: u64,
    /// Bytes of input given to the guest, and the receive buffers used.
    pub bytes_in: u64,
    pub buffers_in: u64,
    /// Passes cut short by their bound with chains maybe left
    /// ([`CHAINS_PER_PASS`], [`TX_BYTES_PER_PASS`]).
    pub passes_cut: u64,
}

/// The device model (behind an [`crate::virtio::MmioTransport`]).
#[derive(Debug, Default)]
pub struct VirtioConsole {
    stats: ConsoleStats,
    /// A transmit or receive pass stopped at its bound: the queue may
    /// hold more ([`VirtioConsole::resume`]).
    tx_more: bool,
    rx_more: bool,
}

impl VirtioConsole {
    pub const fn new() -> Self {
        Self {
            stats: ConsoleStats {
                bytes_out: 0,
                chains_out: 0,
                bytes_in: 0,
                buffers_in: 0,
                passes_cut: 0,
            },
            tx_more: false,
            rx_more: false,
        }
    }

    pub fn stats(&self) -> &ConsoleStats {
        &self.stats
    }

    /// Whether a pass stopped at its bound and the queues may hold more
    /// for [`resume`](Self::resume).
    pub fn has_more(&self) -> bool {
        self.tx_more || self.rx_more
    }

    /// One more pass over each queue whose last pass stopped at its bound
    /// (the memory tick calls it, so chains a guest published and does not
    /// notify again for still go out). Bounded like every pass.
    pub fn resume<E: GuestMemory + ConsoleIo + ?Sized>(
        &mut self,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        if self.tx_more {
            self.transmit(queues, env)?;
        }
        if self.rx_more {
            self.receive(queues, env)?;
        }
        Ok(())
    }

    /// A pass ended: `cut` if by its bound.
    fn pass_ended(&mut self, cut: bool) -> bool {
        if cut {
            self.stats.passes_cut += 1;
        }
        cut
    }

    /// Move waiting input into the receive buffers the driver posted, one
    /// buffer after another, each used as far as the input goes, at most
    /// [`CHAINS_PER_PASS`] of them. Does nothing while no input waits (a
    /// buffer is taken only to be filled).
    pub fn receive<E: GuestMemory + ConsoleIo + ?Sized>(
        &mut self,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        let Some(q) = queues.get_mut(RECEIVEQ) else {
            return Ok(());
        };
        if !q.ready() {
            return Ok(());
        }
        let err = |e| DeviceError::from_queue(RECEIVEQ, "receiveq", e);
        self.rx_more = false;
        let mut taken = 0;
        while env.input_waiting() {
            if taken == CHAINS_PER_PASS {
                self.rx_more = self.pass_ended(true);
                break;
            }
            let Some(chain) = q.pop(env).map_err(err)? else {
                break;
            };
            taken += 1;
            let head = chain.head();
            one_direction(&chain, RECEIVEQ)?;
            let room = chain.writable_len();
            if room == 0 {
                return Err(DeviceError::request(
                    RECEIVEQ,
                    "receiveq",
                    head,
                    DeviceErrorKind::BadLength {
                        len: 0,
                        multiple_of: 1,
                    },
                ));
            }
            // Input leaves its queue only once the buffer is returned: a
            // chain that fails half way loses the guest nothing typed.
            let mut written = 0u32;
            let mut piece = [0u8; PIECE];
            while written < room {
                let want = PIECE.min((room - written) as usize);
                let got = env.peek_input(written as usize, &mut piece[..want]);
                if got == 0 {
                    break;
                }
                // The chain's writable part is `room` bytes and `got` fits.
                chain
                    .write_writable_at(env, written, &piece[..got])
                    .map_err(err)?;
                written += got as u32;
            }
            q.push_used(env, head, written).map_err(err)?;
            env.consume_input(written as usize);
            self.stats.bytes_in += u64::from(written);
            self.stats.buffers_in += 1;
        }
        Ok(())
    }

    /// Show the chains the driver queued for transmission and return them,
    /// as many as one pass takes ([`CHAINS_PER_PASS`],
    /// [`TX_BYTES_PER_PASS`]).
    fn transmit<E: GuestMemory + ConsoleIo + ?Sized>(
        &mut self,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        let Some(q) = queues.get_mut(TRANSMITQ) else {
            return Ok(());
        };
        let err = |e| DeviceError::from_queue(TRANSMITQ, "transmitq", e);
        self.tx_more = false;
        let (mut chains, mut bytes) = (0, 0u64);
        loop {
            if chains == CHAINS_PER_PASS || bytes >= TX_BYTES_PER_PASS {
                self.tx_more = self.pass_ended(true);
                break;
            }
            let Some(chain) = q.pop(env).map_err(err)? else {
                break;
            };
            chains += 1;
            let head = chain.head();
            one_direction(&chain, TRANSMITQ)?;
            let len = chain.readable_len();
            if len > MAX_TX_CHAIN {
                return Err(DeviceError::request(
                    TRANSMITQ,
                    "transmitq",
                    head,
                    DeviceErrorKind::TooLong {
                        len,
                        max: MAX_TX_CHAIN,
                    },
                ));
            }
            let mut done = 0u32;
            let mut piece = [0u8; PIECE];
            while done < len {
                let want = PIECE.min((len - done) as usize);
                let got = chain
                    .read_readable_at(env, done, &mut piece[..want])
                    .map_err(err)?;
                if got == 0 {
                    break;
                }
                env.output(&piece[..got]);
                done += got as u32;
                // Counted as shown: a chain refused half way (a buffer
                // outside RAM) has shown its first part already.
                self.stats.bytes_out += got as u64;
            }
            q.push_used(env, head, 0).map_err(err)?;
            bytes += u64::from(done);
            self.stats.chains_out += 1;
        }
        Ok(())
    }
}

/// Whether every descriptor of `chain` goes the way `queue` carries data:
/// device-writable on the receive queue, driver-written on the transmit
/// queue. The first that does not is the error that stops the device.
fn one_direction(chain: &DescChain, queue: usize) -> Result<(), DeviceError> {
    let receive = queue == RECEIVEQ;
    let Some(d) = chain.descriptors().iter().find(|d| d.writable != receive) else {
        return Ok(());
    };
    let (name, kind) = if receive {
        (
            "receiveq",
            DeviceErrorKind::UnexpectedReadable { desc: d.index },
        )
    } else {
        (
            "transmitq",
            DeviceErrorKind::UnexpectedWritable { desc: d.index },
        )
    };
    Err(DeviceError::request(queue, name, chain.head(), kind))
}

impl VirtioDevice for VirtioConsole {
    fn name(&self) -> &'static str {
        "virtio-console"
    }
    fn device_id(&self) -> u32 {
        DEVICE_ID
    }
    fn device_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }
    fn queue_count(&self) -> usize {
        2
    }
    fn queue_max_size(&self, _queue: usize) -> u16 {
        QUEUE_SIZE
    }
    fn queue_name(&self, queue: usize) -> &'static str {
        match queue {
            RECEIVEQ => "receiveq",
            _ => "transmitq",
        }
    }
    fn config_read(&self, offset: u64, data: &mut [u8]) {
        let _ = (offset, CONFIG_SIZE);
        data.fill(0);
    }
    fn config_write(&mut self, _offset: u64, _data: &[u8]) {}
    fn activate(&mut self, _features: u64) {}
    fn defers_used_signal(&self, queue: usize) -> bool {
        // Linux's hvc writes spin on the used ring until the device returns
        // the buffer, which it did before the notify's exit returned.
        queue == TRANSMITQ
    }
    fn quiet_when_empty(&self, queue: usize) -> bool {
        // An empty transmit notification changes nothing; a receive one
        // may have input to deliver.
        queue == TRANSMITQ
    }
}

impl<E: GuestMemory + ConsoleIo + ?Sized> VirtioDeviceIo<E> for VirtioConsole {
    fn reset(&mut self, _env: &mut E) {
        // Nothing is held: chains are returned as they are processed, and
        // input waits in the VM's queue. Queues start over empty.
        self.tx_more = false;
        self.rx_more = false;
    }

    fn notify(
        &mut self,
        queue: usize,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        match queue {
            TRANSMITQ => self.transmit(queues, env),
            _ => self.receive(queues, env),
        }
    }
}

/// The layout version of the console's saved state.
const STATE_VERSION: u8 = 1;

/// Its counters and whether a pass was cut short (what the memory tick's
/// resume picks up after a restore as before it).
impl crate::savestate::SaveState for VirtioConsole {
    fn save(&self, w: &mut crate::savestate::StateWriter) {
        w.u8(STATE_VERSION);
        let s = &self.stats;
        for n in [
            s.bytes_out,
            s.chains_out,
            s.bytes_in,
            s.buffers_in,
            s.passes_cut,
        ] {
            w.u64(n);
        }
        w.bool(self.tx_more);
        w.bool(self.rx_more);
    }

    fn restore(
        r: &mut crate::savestate::StateReader<'_>,
    ) -> Result<Self, crate::savestate::StateError> {
        r.version("virtio console", STATE_VERSION)?;
        Ok(VirtioConsole {
            stats: ConsoleStats {
                bytes_out: r.count("virtio console counter")?,
                chains_out: r.count("virtio console counter")?,
                bytes_in: r.count("virtio console counter")?,
                buffers_in: r.count("virtio console counter")?,
                passes_cut: r.count("virtio console counter")?,
            },
            tx_more: r.bool("virtio console transmit pass cut")?,
            rx_more: r.bool("virtio console receive pass cut")?,
        })
    }
}

#[cfg(test)]
mod tests;
