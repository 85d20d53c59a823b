//! Converting between the generic timer's ticks and microseconds, for any
//! counter frequency the firmware programs in CNTFRQ_EL0: 62.5 MHz under
//! QEMU, 54 MHz on the Raspberry Pi 4 (its crystal), 1 GHz on Armv8.6+
//! cores. Portable, so the arithmetic is tested on the host.

/// `count` ticks of a `freq` Hz counter in microseconds, with two 64-bit
/// divisions (one instruction each) instead of a 128-bit one (a library
/// call): whole seconds, then the remainder, which is below `freq` so
/// `rem * 1_000_000` cannot overflow for any counter under 18 THz. A zero
/// frequency (a firmware that left CNTFRQ_EL0 unset) reads as no time.
pub fn ticks_to_us(count: u64, freq: u64) -> u64 {
    if freq == 0 {
        return 0;
    }
    (count / freq) * 1_000_000 + (count % freq) * 1_000_000 / freq
}

/// `micros` microseconds in ticks of a `freq` Hz counter, rounded up (a
/// wait is at least as long as asked) and at least one (a timer armed for
/// zero ticks would fire at once, forever).
/// 64-bit divisions only, as in [`ticks_to_us`].
pub fn us_to_ticks(micros: u64, freq: u64) -> u64 {
    let whole_s = (micros / 1_000_000).saturating_mul(freq);
    let rest = (micros % 1_000_000 * freq).div_ceil(1_000_000);
    whole_s.saturating_add(rest).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QEMU: u64 = 62_500_000;
    const PI4: u64 = 54_000_000;
    const GHZ: u64 = 1_000_000_000;

    #[test]
    fn ticks_to_microseconds_at_every_board_frequency() {
        for freq in [QEMU, PI4, GHZ, 19_200_000] {
            assert_eq!(ticks_to_us(freq, freq), 1_000_000, "{freq} Hz");
            assert_eq!(ticks_to_us(freq.div_ceil(1_000_000), freq), 1, "{freq} Hz");
            assert_eq!(ticks_to_us(0, freq), 0);
            // Ten years of uptime: exact, no overflow.
            let ten_years_s = 10 * 365 * 24 * 3600u64;
            assert_eq!(
                ticks_to_us(ten_years_s * freq, freq),
                ten_years_s * 1_000_000
            );
        }
        // The Pi 4's 54 MHz: 27 ticks are half a microsecond (rounded down),
        // 54 one; 100 ms is 5.4 million ticks.
        assert_eq!(ticks_to_us(27, PI4), 0);
        assert_eq!(ticks_to_us(54, PI4), 1);
        assert_eq!(ticks_to_us(5_400_000, PI4), 100_000);
        assert_eq!(ticks_to_us(123, 0), 0);
    }

    #[test]
    fn microseconds_to_ticks_for_timer_waits() {
        assert_eq!(us_to_ticks(10_000, PI4), 540_000);
        assert_eq!(us_to_ticks(10_000, QEMU), 625_000);
        assert_eq!(us_to_ticks(1, QEMU), 63, "62.5 ticks, rounded up");
        assert_eq!(us_to_ticks(1, PI4), 54);
        assert_eq!(us_to_ticks(0, PI4), 1, "never zero");
        assert_eq!(us_to_ticks(1_000_000, GHZ), GHZ);
        for freq in [QEMU, PI4, GHZ] {
            for us in [1, 999, 10_000, 1_000_000] {
                let back = ticks_to_us(us_to_ticks(us, freq), freq);
                assert_eq!(back, us, "{us} us at {freq} Hz round-trips");
            }
        }
    }
}
