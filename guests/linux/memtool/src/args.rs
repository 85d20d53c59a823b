//! Command-line parsing, kept apart so the host tests can check it.

pub const USAGE: &str = "usage: tidal-mem pagefault <MiB> <seconds> | hog <MiB> [hold-seconds] | alloc-free <MiB> | touch-loop <MiB> <seconds>";

/// Most MiB one workload maps (the test guests have at most a few GiB).
const MAX_MIB: usize = 64 * 1024;

#[derive(Debug, PartialEq, Eq)]
pub enum Workload {
    PageFault { mib: usize, seconds: u64 },
    Hog { mib: usize, hold: u64 },
    AllocFree { mib: usize },
    TouchLoop { mib: usize, seconds: u64 },
}

fn mib(arg: Option<&String>) -> Result<usize, String> {
    let arg = arg.ok_or("missing the size in MiB")?;
    match arg.parse::<usize>() {
        Ok(m) if (1..=MAX_MIB).contains(&m) => Ok(m),
        _ => Err(format!("'{arg}' is not a size in MiB (1..={MAX_MIB})")),
    }
}

fn seconds(arg: Option<&String>, default: Option<u64>) -> Result<u64, String> {
    match (arg, default) {
        (None, Some(d)) => Ok(d),
        (None, None) => Err("missing the number of seconds".into()),
        (Some(a), _) => a
            .parse()
            .map_err(|_| format!("'{a}' is not a number of seconds")),
    }
}

pub fn parse(args: &[String]) -> Result<Workload, String> {
    let rest = args.get(1..).unwrap_or_default();
    let (max, workload) = match args.first().map(String::as_str) {
        Some("pagefault") => (
            2,
            Workload::PageFault {
                mib: mib(rest.first())?,
                seconds: seconds(rest.get(1), None)?,
            },
        ),
        Some("hog") => (
            2,
            Workload::Hog {
                mib: mib(rest.first())?,
                hold: seconds(rest.get(1), Some(0))?,
            },
        ),
        Some("alloc-free") => (
            1,
            Workload::AllocFree {
                mib: mib(rest.first())?,
            },
        ),
        Some("touch-loop") => (
            2,
            Workload::TouchLoop {
                mib: mib(rest.first())?,
                seconds: seconds(rest.get(1), None)?,
            },
        ),
        Some(other) => return Err(format!("unknown workload '{other}'")),
        None => return Err("no workload given".into()),
    };
    if rest.len() > max {
        return Err(format!("too many arguments: '{}'", rest[max]));
    }
    Ok(workload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Workload, String> {
        parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn workloads_parse() {
        assert_eq!(
            p("pagefault 128 10"),
            Ok(Workload::PageFault {
                mib: 128,
                seconds: 10
            })
        );
        assert_eq!(p("hog 300"), Ok(Workload::Hog { mib: 300, hold: 0 }));
        assert_eq!(p("hog 300 5"), Ok(Workload::Hog { mib: 300, hold: 5 }));
        assert_eq!(p("alloc-free 256"), Ok(Workload::AllocFree { mib: 256 }));
        assert_eq!(
            p("touch-loop 16 30"),
            Ok(Workload::TouchLoop {
                mib: 16,
                seconds: 30
            })
        );
    }

    #[test]
    fn bad_input_says_what_is_wrong() {
        assert!(p("").unwrap_err().contains("no workload"));
        assert!(p("swap 1").unwrap_err().contains("unknown workload 'swap'"));
        assert!(p("hog").unwrap_err().contains("missing the size"));
        assert!(p("hog 0").unwrap_err().contains("'0' is not a size"));
        assert!(p("hog lots").unwrap_err().contains("'lots'"));
        assert!(p("pagefault 8").unwrap_err().contains("seconds"));
        assert!(p("alloc-free 8 9").unwrap_err().contains("too many"));
    }
}
