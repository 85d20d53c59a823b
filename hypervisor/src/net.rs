//! The board's network: a virtio-net device behind one of the board's
//! virtio-mmio slots (on QEMU `virt`, the card `cargo xtask run --net`
//! attaches), driven by the hypervisor itself with the virtio-drivers
//! crate, with smoltcp's TCP/IP stack over it at the address the bundle
//! carries (`[board] address`; no DHCP). Guests never see it: no guest's
//! stage-2 map or device tree has the board's virtio-mmio slots (as for
//! the disk, [`crate::disk`]).
//!
//! Polled, never its interrupt: the shell polls it from its idle loop and
//! from the looks it takes from a guest's exits ([`poll`]), in the shell's
//! failure domain, under the lock below that only the shell's CPU takes.
//! A poll with nothing arrived and nothing due is one read of the receive
//! queue's used index. Every length and address the network gives is
//! checked before use: a bad frame is counted as an error and dropped.
//! Target only (the frame table behind the DMA, and MMIO).

extern crate alloc;

use alloc::boxed::Box;
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use core::fmt::Write;

use guest_bundle::BoardAddress;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, ChecksumCapabilities, DeviceCapabilities, Medium};
use smoltcp::socket::icmp;
use smoltcp::time::Instant;
use smoltcp::wire::{
    EthernetAddress, HardwareAddress, Icmpv4Packet, Icmpv4Repr, IpAddress, IpCidr, Ipv4Address,
};
use spin::Mutex;
use virtio_drivers::device::net::VirtIONetRaw;
use virtio_drivers::transport::mmio::MmioTransport;
use virtio_drivers::transport::DeviceType;

use crate::arch::aarch64;
use crate::dma::FrameHal;

/// Receive buffers the card holds (and the transmit queue's size).
const QUEUE_SIZE: usize = 16;
/// Bytes of each receive buffer: a header and an Ethernet frame.
const BUF_LEN: usize = 2048;
/// The largest Ethernet frame (without its FCS) sent or accepted.
const MTU: usize = 1514;
/// The ICMP identifier of the board's echo requests.
const PING_IDENT: u16 = 0x7464;
/// Bytes of payload in an echo request.
const PING_PAYLOAD: usize = 32;
/// How long an echo request waits for its reply.
const PING_TIMEOUT_US: u64 = 1_000_000;
/// The longest a quiet interface waits between polls it asked for.
const MAX_POLL_WAIT_US: u64 = 1_000_000;
/// Offset of the virtio-net `status` field in a virtio-mmio slot (its
/// configuration space starts at 0x100: 6 bytes of MAC, then `status`).
const STATUS_OFFSET: u64 = 0x106;

type Card = VirtIONetRaw<FrameHal, MmioTransport<'static>, QUEUE_SIZE>;

/// What went through the card since boot.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Frames refused (too long, too short, a bad length or buffer from
    /// the card) or that the card failed to take back or to send.
    pub rx_errors: u64,
    pub tx_errors: u64,
}

/// The card as smoltcp's device. The card holds `QUEUE_SIZE` receive
/// buffers (on the heap, at addresses that do not move), each under the
/// token the card's queue gave it; a received frame is copied out into
/// `rx` and its buffer goes straight back to the card.
struct NetDevice {
    card: Card,
    /// Receive buffers by token: `Some` while the card has it.
    buffers: Vec<Option<Box<[u8]>>>,
    counters: Counters,
    rx: [u8; MTU],
    tx: [u8; MTU],
}

impl NetDevice {
    fn new(mut card: Card) -> Result<NetDevice, &'static str> {
        let mut buffers: Vec<Option<Box<[u8]>>> = (0..QUEUE_SIZE).map(|_| None).collect();
        for _ in 0..QUEUE_SIZE {
            let mut buf = vec![0u8; BUF_LEN].into_boxed_slice();
            // SAFETY: the buffer is kept (on the heap, not moved) in
            // `buffers` under its token and not touched until the card
            // gives the token back (`take_frame`), nor freed before: the
            // card is dropped (its queues unset) before the buffers.
            let Ok(token) = (unsafe { card.receive_begin(&mut buf) }) else {
                // The card may hold those given before: never freed.
                core::mem::forget(buffers);
                return Err("the card took no receive buffer");
            };
            match buffers.get_mut(usize::from(token)) {
                Some(slot @ None) => *slot = Some(buf),
                _ => {
                    core::mem::forget((buf, buffers));
                    return Err("the card's queue gave a token twice");
                }
            }
        }
        Ok(NetDevice {
            card,
            buffers,
            counters: Counters::default(),
            rx: [0; MTU],
            tx: [0; MTU],
        })
    }

    /// The next good frame into `rx`, its length; bad ones are counted
    /// and dropped.
    fn take_frame(&mut self) -> Option<usize> {
        for _ in 0..QUEUE_SIZE {
            // The token is the card's word: it must name a buffer the
            // card holds (else nothing more is received: a broken card).
            let token = self.card.poll_receive()?;
            let Some(Some(buf)) = self.buffers.get_mut(usize::from(token)) else {
                self.counters.rx_errors += 1;
                return None;
            };
            // SAFETY: `buf` is the buffer given to the card under `token`.
            let Ok((header, len)) = (unsafe { self.card.receive_complete(token, buf) }) else {
                self.counters.rx_errors += 1;
                return None;
            };
            // The lengths are the card's word too: checked before the
            // frame is sliced out of the buffer.
            let frame = header
                .checked_add(len)
                .and_then(|end| buf.get(header..end))
                .filter(|f| (14..=MTU).contains(&f.len()));
            let got = match (frame, self.rx.get_mut(..len)) {
                (Some(frame), Some(to)) => {
                    to.copy_from_slice(frame);
                    Some(len)
                }
                _ => None,
            };
            // SAFETY: as in `new`: the same buffer, kept in its slot until
            // the card gives it back under the new token.
            match unsafe { self.card.receive_begin(buf) } {
                Ok(again) if again == token => {}
                Ok(again) => {
                    let moved = self
                        .buffers
                        .get_mut(usize::from(token))
                        .and_then(Option::take);
                    match self.buffers.get_mut(usize::from(again)) {
                        Some(slot @ None) => *slot = moved,
                        // Cannot happen with the driver's own free list;
                        // the card keeps a buffer we can no longer name.
                        _ => self.counters.rx_errors += 1,
                    }
                }
                Err(_) => self.counters.rx_errors += 1,
            }
            match got {
                Some(len) => {
                    self.counters.rx_packets += 1;
                    self.counters.rx_bytes += len as u64;
                    return Some(len);
                }
                None => self.counters.rx_errors += 1,
            }
        }
        None
    }
}

struct RxToken<'a> {
    frame: &'a [u8],
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.frame)
    }
}

struct TxToken<'a> {
    card: &'a mut Card,
    buf: &'a mut [u8; MTU],
    counters: &'a mut Counters,
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        // smoltcp keeps to the MTU it was given; a longer frame is cut
        // (and so refused by the other side) rather than a panic.
        let frame = &mut self.buf[..len.min(MTU)];
        let result = f(frame);
        // Sent and waited for: the card is done with the frame on return.
        match self.card.send(frame) {
            Ok(()) => {
                self.counters.tx_packets += 1;
                self.counters.tx_bytes += frame.len() as u64;
            }
            Err(_) => self.counters.tx_errors += 1,
        }
        result
    }
}

impl phy::Device for NetDevice {
    type RxToken<'a> = RxToken<'a>;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(RxToken<'_>, TxToken<'_>)> {
        let len = self.take_frame()?;
        Some((
            RxToken {
                frame: self.rx.get(..len)?,
            },
            TxToken {
                card: &mut self.card,
                buf: &mut self.tx,
                counters: &mut self.counters,
            },
        ))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        Some(TxToken {
            card: &mut self.card,
            buf: &mut self.tx,
            counters: &mut self.counters,
        })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MTU;
        caps.max_burst_size = Some(1);
        caps
    }
}

/// A `ping` under way.
struct Ping {
    to: [u8; 4],
    count: u32,
    sent: u32,
    received: u32,
    /// The request waiting for its reply: its sequence number and when it
    /// was sent (uptime, microseconds).
    waiting: Option<(u16, u64)>,
    /// Round trips answered: least, most, sum (microseconds).
    rtt: (u64, u64, u64),
}

/// The board's network once found.
pub struct BoardNet {
    dev: NetDevice,
    iface: Interface,
    sockets: SocketSet<'static>,
    icmp: SocketHandle,
    address: Option<BoardAddress>,
    regs: platform::PhysRange,
    mac: [u8; 6],
    ping: Option<Ping>,
    /// When the interface next wants a poll with nothing arrived.
    poll_at_us: u64,
}

static NET: Mutex<Option<BoardNet>> = Mutex::new(None);

/// What [`probe`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetInfo {
    pub regs: platform::PhysRange,
    pub mac: [u8; 6],
    pub address: Option<BoardAddress>,
}

/// `aa:bb:cc:dd:ee:ff`.
pub struct Mac(pub [u8; 6]);

impl core::fmt::Display for Mac {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

fn now() -> (u64, Instant) {
    let us = aarch64::uptime_us();
    (
        us,
        Instant::from_micros(i64::try_from(us).unwrap_or(i64::MAX)),
    )
}

/// Looks behind the board's virtio-mmio slots (but `skip`, the disk's)
/// for a network card and takes the first, with `address` (the bundle's).
/// Called once at boot, before any VM runs. `Err` says why a card found
/// cannot be used.
pub fn probe(
    slots: &[platform::VirtioMmioSlot],
    skip: Option<platform::PhysRange>,
    address: Option<BoardAddress>,
) -> Option<Result<NetInfo, (platform::PhysRange, &'static str)>> {
    let (transport, regs) = crate::dma::find_device(slots, skip, DeviceType::Network)?;
    Some(take(transport, regs, address).map_err(|why| (regs, why)))
}

fn take(
    transport: MmioTransport<'static>,
    regs: platform::PhysRange,
    address: Option<BoardAddress>,
) -> Result<NetInfo, &'static str> {
    let mut card =
        Card::new(transport).map_err(|_| "the card refused to start (or no DMA memory)")?;
    card.disable_interrupts();
    let mac = card.mac_address();
    let ethernet = EthernetAddress(mac);
    // smoltcp panics on a MAC that is not unicast: the card's word.
    if !ethernet.is_unicast() {
        return Err("its MAC address is not a unicast address");
    }
    let mut dev = NetDevice::new(card)?;
    let (us, instant) = now();
    let mut config = Config::new(HardwareAddress::Ethernet(ethernet));
    config.random_seed = aarch64::counter().0 ^ us.rotate_left(17);
    let mut iface = Interface::new(config, &mut dev, instant);
    if let Some(a) = address {
        let [p, q, r, s] = a.octets();
        iface.update_ip_addrs(|addrs| {
            let _ = addrs.push(IpCidr::new(
                IpAddress::Ipv4(Ipv4Address::new(p, q, r, s)),
                a.prefix(),
            ));
        });
    }
    let buffer = || {
        icmp::PacketBuffer::new(
            vec![icmp::PacketMetadata::EMPTY; 4],
            vec![0; 4 * (PING_PAYLOAD + 64)],
        )
    };
    let mut socket = icmp::Socket::new(buffer(), buffer());
    socket
        .bind(icmp::Endpoint::Ident(PING_IDENT))
        .map_err(|_| "cannot bind the ICMP socket")?;
    let mut sockets = SocketSet::new(vec![]);
    let icmp = sockets.add(socket);
    *NET.lock() = Some(BoardNet {
        dev,
        iface,
        sockets,
        icmp,
        address,
        regs,
        mac,
        ping: None,
        poll_at_us: 0,
    });
    Ok(NetInfo { regs, mac, address })
}

/// One look at the network from the shell: what arrived is handled (ARP,
/// echo requests answered), a `ping` moves on; its lines go to `out`.
/// Cheap when nothing arrived and nothing is due. True while a `ping`
/// runs (the shell then looks again soon).
pub fn poll(out: &mut String) -> bool {
    let mut guard = NET.lock();
    let Some(net) = guard.as_mut() else {
        return false;
    };
    let (us, instant) = now();
    if net.ping.is_none() && us < net.poll_at_us && net.dev.card.poll_receive().is_none() {
        return false;
    }
    net.iface.poll(instant, &mut net.dev, &mut net.sockets);
    if net.ping.is_some() {
        net.step_ping(us, out);
        net.iface.poll(instant, &mut net.dev, &mut net.sockets);
    }
    let wait = net
        .iface
        .poll_delay(instant, &net.sockets)
        .map_or(MAX_POLL_WAIT_US, |d| d.total_micros().min(MAX_POLL_WAIT_US));
    net.poll_at_us = us.saturating_add(wait);
    net.ping.is_some()
}

/// Whether a `ping` runs.
pub fn pinging() -> bool {
    NET.lock().as_ref().is_some_and(|n| n.ping.is_some())
}

impl BoardNet {
    /// Take the replies that came, give up on a request a second old,
    /// send the next request or end with the summary.
    fn step_ping(&mut self, us: u64, out: &mut String) {
        let Some(ping) = self.ping.as_mut() else {
            return;
        };
        let checksum = ChecksumCapabilities::default();
        let socket = self.sockets.get_mut::<icmp::Socket>(self.icmp);
        while socket.can_recv() {
            let Ok((payload, from)) = socket.recv() else {
                break;
            };
            // Untrusted: parsed with its checksum checked; anything but
            // the reply awaited is ignored.
            let Ok(packet) = Icmpv4Packet::new_checked(payload) else {
                continue;
            };
            let Ok(Icmpv4Repr::EchoReply { ident, seq_no, .. }) =
                Icmpv4Repr::parse(&packet, &checksum)
            else {
                continue;
            };
            let [a, b, c, d] = ping.to;
            let expected = IpAddress::Ipv4(Ipv4Address::new(a, b, c, d));
            match ping.waiting {
                Some((seq, sent_at))
                    if seq == seq_no && ident == PING_IDENT && from == expected =>
                {
                    let rtt = us.saturating_sub(sent_at);
                    ping.received += 1;
                    ping.rtt = if ping.received == 1 {
                        (rtt, rtt, rtt)
                    } else {
                        (ping.rtt.0.min(rtt), ping.rtt.1.max(rtt), ping.rtt.2 + rtt)
                    };
                    let _ = writeln!(
                        out,
                        "ping: reply from {a}.{b}.{c}.{d}: seq={seq} time={}",
                        Millis(rtt)
                    );
                    ping.waiting = None;
                }
                _ => {}
            }
        }
        if let Some((seq, sent_at)) = ping.waiting {
            if us.saturating_sub(sent_at) < PING_TIMEOUT_US {
                return;
            }
            let [a, b, c, d] = ping.to;
            let _ = writeln!(
                out,
                "ping: no reply from {a}.{b}.{c}.{d}: seq={seq} timed out after 1 s"
            );
            ping.waiting = None;
        }
        if ping.sent >= ping.count {
            let [a, b, c, d] = ping.to;
            let _ = write!(
                out,
                "ping {a}.{b}.{c}.{d}: {} sent, {} received, {} lost",
                ping.sent,
                ping.received,
                ping.sent - ping.received
            );
            if ping.received > 0 {
                let (min, max, sum) = ping.rtt;
                let _ = write!(
                    out,
                    "; time min/avg/max {}/{}/{}",
                    Millis(min),
                    Millis(sum / u64::from(ping.received)),
                    Millis(max)
                );
            }
            let _ = writeln!(out);
            self.ping = None;
            return;
        }
        let seq = u16::try_from(ping.sent + 1).unwrap_or(u16::MAX);
        let payload = [0x5a_u8; PING_PAYLOAD];
        let request = Icmpv4Repr::EchoRequest {
            ident: PING_IDENT,
            seq_no: seq,
            data: &payload,
        };
        let [a, b, c, d] = ping.to;
        let to = IpAddress::Ipv4(Ipv4Address::new(a, b, c, d));
        match socket.send(request.buffer_len(), to) {
            Ok(buf) => {
                request.emit(&mut Icmpv4Packet::new_unchecked(buf), &checksum);
                ping.sent += 1;
                ping.waiting = Some((seq, us));
            }
            Err(_) => {
                let _ = writeln!(out, "ping: cannot send to {a}.{b}.{c}.{d}; stopped");
                self.ping = None;
            }
        }
    }
}

/// Microseconds as milliseconds with one decimal.
struct Millis(u64);

impl core::fmt::Display for Millis {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}.{} ms", self.0 / 1000, self.0 % 1000 / 100)
    }
}

/// `ping <address> [count]`: begin, unless one runs or the board cannot.
pub fn begin_ping(to: [u8; 4], count: u32, out: &mut String) {
    let mut guard = NET.lock();
    let Some(net) = guard.as_mut() else {
        let _ = writeln!(out, "ping: the board has no network card");
        return;
    };
    if net.address.is_none() {
        let _ = writeln!(
            out,
            "ping: the board has no address ([board] address in its configuration)"
        );
        return;
    }
    if net.ping.is_some() {
        let _ = writeln!(out, "ping: one is under way; wait for it to end");
        return;
    }
    let [a, b, c, d] = to;
    let _ = writeln!(
        out,
        "ping {a}.{b}.{c}.{d}: {count} echo request(s), {PING_PAYLOAD} bytes each, 1 s for each reply"
    );
    net.ping = Some(Ping {
        to,
        count,
        sent: 0,
        received: 0,
        waiting: None,
        rtt: (0, 0, 0),
    });
}

/// The link bit of the card's `status` (VIRTIO_NET_S_LINK_UP). QEMU's
/// stream backend keeps it up while no other board is connected.
fn link_up(regs: platform::PhysRange) -> bool {
    if regs.size() < STATUS_OFFSET + 2 {
        return false;
    }
    let at = regs.start + STATUS_OFFSET;
    // SAFETY: a read of the card's own configuration space, inside its
    // slot (checked above), identity-mapped as device memory; reading it
    // has no side effect.
    let status = unsafe { core::ptr::read_volatile(at as *const u16) };
    status & 1 != 0
}

/// `net`: the card, its address, link and counters.
pub fn write_status(out: &mut String) {
    let guard = NET.lock();
    let Some(net) = guard.as_ref() else {
        let _ = writeln!(
            out,
            "net: the board has no network card (QEMU virt: cargo xtask run --net)"
        );
        return;
    };
    let _ = write!(
        out,
        "net: virtio-net at {:#x}, MAC {}, ",
        net.regs.start,
        Mac(net.mac)
    );
    let _ = match net.address {
        Some(a) => writeln!(out, "address {a}"),
        None => writeln!(out, "no address configured ([board] address)"),
    };
    let link = if link_up(net.regs) { "up" } else { "down" };
    let c = net.dev.counters;
    let _ = writeln!(out, "  link {link}");
    let _ = writeln!(
        out,
        "  in:  {} packets, {} bytes, {} errors",
        c.rx_packets, c.rx_bytes, c.rx_errors
    );
    let _ = writeln!(
        out,
        "  out: {} packets, {} bytes, {} errors",
        c.tx_packets, c.tx_bytes, c.tx_errors
    );
}

/// After a failure in the shell's domain: the lock is free again and a
/// `ping` under way is dropped.
///
/// # Safety
///
/// Only the shell's CPU takes the lock, and the failure abandoned the
/// frame whose guard held it: nothing else uses the network now.
pub unsafe fn recover() {
    if NET.is_locked() {
        // SAFETY: the caller's promise above.
        unsafe { NET.force_unlock() };
    }
    if let Some(net) = NET.lock().as_mut() {
        net.ping = None;
    }
}
