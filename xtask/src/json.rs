//! The JSON reports the xtask writes (target/bench/*.json,
//! target/fuzz/report.json): each is a `#[derive(Serialize)]` struct beside
//! the code that measures it; this module writes them, and holds the
//! `serialize_with` helpers that give a measurement the decimals it is
//! reported with (the same as in the printed tables) and keep a map's keys
//! in the order the tables list them.

use std::path::Path;

use serde::{Serialize, Serializer};

/// Writes `report` to `path` as pretty-printed JSON ending in a newline,
/// creating the directory.
pub fn write(path: &Path, report: &impl Serialize) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let mut text = serde_json::to_string_pretty(report)
        .map_err(|e| format!("serialising {}: {e}", path.display()))?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// `value` as printed with `decimals` decimals (`{:.N}`), so a report holds
/// the digits the measurement has and not the noise after them.
pub fn rounded(value: f64, decimals: usize) -> f64 {
    format!("{value:.decimals$}")
        .parse()
        .expect("a formatted f64 parses back")
}

/// `serialize_with`: an `f64` rounded to `DECIMALS` decimals. Not-a-number
/// and infinities (e.g. the median of no values) become `null`.
pub fn decimals<const DECIMALS: usize, S: Serializer>(
    value: &f64,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(rounded(*value, DECIMALS))
}

/// `serialize_with`: an `f64` rounded to a whole number and written as an
/// integer (`19652`, not `19652.0`); `null` if it is not finite.
pub fn whole<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    let whole = rounded(*value, 0);
    if whole.is_finite() {
        // Saturates beyond i64, far past any count measured here.
        serializer.serialize_i64(whole as i64)
    } else {
        serializer.serialize_none()
    }
}

/// `serialize_with`: key-value pairs as a JSON object, in their order.
pub fn ordered_map<K: Serialize, V: Serialize, S: Serializer>(
    entries: &[(K, V)],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(entries.iter().map(|(key, value)| (key, value)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Serialize)]
    struct Example {
        #[serde(serialize_with = "decimals::<3, _>")]
        seconds: f64,
        #[serde(serialize_with = "whole")]
        pages_per_s: f64,
        #[serde(serialize_with = "ordered_map")]
        summary: Vec<(&'static str, u32)>,
    }

    #[test]
    fn rounding_is_the_printed_form() {
        assert_eq!(rounded(1.23456, 3), 1.235);
        assert_eq!(rounded(13.04999, 1), 13.0);
        // Ties go the way `{:.N}` prints them.
        assert_eq!(
            rounded(0.25, 1),
            format!("{:.1}", 0.25).parse::<f64>().unwrap()
        );
        assert!(rounded(f64::NAN, 2).is_nan());
    }

    #[test]
    fn helpers_give_numbers_and_ordered_keys() {
        let example = Example {
            seconds: 2.0004999,
            pages_per_s: 19652.4,
            summary: vec![("zeta", 1), ("alpha", 2)],
        };
        let text = serde_json::to_string(&example).unwrap();
        assert_eq!(
            text,
            r#"{"seconds":2.0,"pages_per_s":19652,"summary":{"zeta":1,"alpha":2}}"#
        );
        let not_finite = Example {
            seconds: f64::NAN,
            pages_per_s: f64::INFINITY,
            summary: Vec::new(),
        };
        assert_eq!(
            serde_json::to_value(&not_finite).unwrap(),
            json!({"seconds": null, "pages_per_s": null, "summary": {}})
        );
    }
}
