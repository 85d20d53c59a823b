//! Two boards on a network under QEMU (issue 40): each board's
//! `virtio-net-device`, driven by the hypervisor with smoltcp at the
//! address its bundle carries, joined to the other's by a TCP stream
//! (`Session::start_pair`); `ping` from one gets the other's replies,
//! `net` counts the packets on both, and `check` stays ok. A board without
//! a card says so. Ignored by plain `cargo test`; `cargo xtask test` runs
//! them.

use std::time::Duration;

use harness::{
    bundle_with_address, log_dir, Artifacts, Board, HarnessError, NetLink, QemuOptions, Session,
    PROMPT,
};

const BOOT: Duration = Duration::from_secs(60);
const COMMAND: Duration = Duration::from_secs(10);

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// `in:  N packets` or `out: N packets` of a `net` answer.
fn packets(net: &str, way: &str) -> u64 {
    let line = net
        .lines()
        .find(|l| l.trim_start().starts_with(way))
        .unwrap_or_else(|| panic!("no '{way}' line in:\n{net}"));
    line.split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in '{line}'"))
}

fn two_boards_ping(board: Board) {
    let bundle = Artifacts::locate().bundle;
    let name = format!("{}-net", board.name());
    let (mut a, mut b) = ok(Session::start_pair(
        board,
        &bundle,
        &name,
        ["10.0.0.1/24", "10.0.0.2/24"],
    ));
    for (s, address, mac) in [(&mut a, "10.0.0.1", "01"), (&mut b, "10.0.0.2", "02")] {
        ok(s.expect(&regex::escape(PROMPT), BOOT));
        let line = format!(
            r"net: virtio-net at 0x[0-9a-f]+, MAC 52:54:00:74:64:{mac}, address {}/24",
            regex::escape(address)
        );
        ok(s.expect_since(&mut 0, &line, COMMAND));
    }
    ok(a.run("ping 10.0.0.2 3", COMMAND));
    let replies = ok(a.expect(
        r"ping 10\.0\.0\.2: 3 sent, (\d) received, \d lost; time min/avg/max ([0-9.]+) ms/([0-9.]+) ms/([0-9.]+) ms",
        COMMAND,
    ));
    assert_eq!(replies[1], "3", "{}", a.output());
    let out = a.output();
    for seq in 1..=3 {
        assert!(
            out.contains(&format!("ping: reply from 10.0.0.2: seq={seq} time=")),
            "{out}"
        );
    }
    eprintln!(
        "ping 10.0.0.2 from 10.0.0.1: min/avg/max {}/{}/{} ms",
        replies[2], replies[3], replies[4]
    );
    for s in [&mut a, &mut b] {
        let net = ok(s.run("net", COMMAND));
        assert!(net.contains("link up"), "{net}");
        // ARP and three echoes each way at least.
        assert!(packets(&net, "in:") >= 4, "{net}");
        assert!(packets(&net, "out:") >= 4, "{net}");
        assert!(net.contains("0 errors"), "{net}");
        s.assert_check();
    }
    // An address nobody has: each request times out after a second.
    ok(a.run("ping 10.0.0.9 1", COMMAND));
    ok(a.expect(r"ping 10\.0\.0\.9: 1 sent, 0 received, 1 lost", COMMAND));
}

fn no_card_says_so(board: Board) {
    let artifacts = Artifacts::locate();
    let opts = QemuOptions::for_board(board, &artifacts);
    let mut s = ok(Session::start(
        &format!("{}-no-net", board.name()),
        board,
        &artifacts,
        &opts,
    ));
    ok(s.expect(&regex::escape(PROMPT), BOOT));
    assert!(!s.output().contains("net: virtio-net"));
    let out = ok(s.run("net", COMMAND));
    assert!(out.contains("net: the board has no network card"), "{out}");
    let out = ok(s.run("ping 10.0.0.2", COMMAND));
    assert!(out.contains("ping: the board has no network card"), "{out}");
}

/// A board whose card has no other board at the end of its link: its
/// echo requests time out (the card's sends still complete: QEMU drops
/// them, and keeps the card's link up meanwhile), nothing comes in.
/// Without an address the card is found and says so.
fn alone_on_the_network(board: Board) {
    let artifacts = Artifacts::locate();
    let name = format!("{}-net-alone", board.name());
    let bundle = log_dir().join(format!("{name}.img"));
    bundle_with_address(&artifacts.bundle, "10.0.0.1/24", &bundle).unwrap();
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.initrd = Some(bundle);
    opts.net = Some(NetLink::Listen(port));
    let mut s = ok(Session::start(&name, board, &artifacts, &opts));
    ok(s.expect(&regex::escape(PROMPT), BOOT));
    ok(s.run("ping 10.0.0.2 2", COMMAND));
    ok(s.expect(r"ping 10\.0\.0\.2: 2 sent, 0 received, 2 lost", COMMAND));
    let net = ok(s.run("net", COMMAND));
    assert!(net.contains("link up"), "{net}");
    assert!(packets(&net, "out:") >= 1, "{net}");
    assert_eq!(packets(&net, "in:"), 0, "{net}");
    s.assert_check();
    drop(s);

    // The bundle as built: no [board] address.
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.net = Some(NetLink::Listen(port));
    let mut s = ok(Session::start(
        &format!("{name}-no-address"),
        board,
        &artifacts,
        &opts,
    ));
    ok(s.expect(&regex::escape(PROMPT), BOOT));
    ok(s.expect_since(
        &mut 0,
        r"net: virtio-net at 0x[0-9a-f]+, MAC 52:54:00:74:64:01, no address configured \(\[board\] address\)",
        COMMAND,
    ));
    let out = ok(s.run("ping 10.0.0.2", COMMAND));
    assert!(out.contains("ping: the board has no address"), "{out}");
}

mod virt_gicv3 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn two_boards_ping() {
        super::two_boards_ping(Board::VirtGicv3);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn no_card_says_so() {
        super::no_card_says_so(Board::VirtGicv3);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn alone_on_the_network() {
        super::alone_on_the_network(Board::VirtGicv3);
    }
}

mod virt_gicv2 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn two_boards_ping() {
        super::two_boards_ping(Board::VirtGicv2);
    }
}
