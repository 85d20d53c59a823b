//! Line charts as plain SVG text, for the benches' plots: axes with round
//! ticks, one polyline per series, a legend, and labelled vertical dashed
//! markers. Pure: [`line_chart`] returns the document, the caller writes it.

use std::fmt::Write;

/// One line of the chart.
pub struct Series {
    pub name: String,
    /// (x, y) in data units; points that are not finite are left out.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (a second quantity of the same thing).
    pub dashed: bool,
    /// Index into the palette; by default the series' own index (two
    /// series of one thing share a colour).
    pub color: Option<usize>,
}

impl Series {
    /// A solid line in the next colour.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
            dashed: false,
            color: None,
        }
    }
}

/// What [`line_chart`] draws.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Vertical dashed lines at these x values, each with its label.
    pub markers: Vec<(f64, String)>,
}

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 500.0;
/// The plot area's margins: left, right, top, bottom.
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// The chart as a standalone SVG document.
pub fn line_chart(chart: &Chart) -> String {
    let finite = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite();
    let points = || {
        chart
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter(|p| finite(p)))
    };
    let marker_xs = chart.markers.iter().map(|m| m.0).filter(|x| x.is_finite());
    let xs = points().map(|p| p.0).chain(marker_xs);
    let (x_min, x_max) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let y_max = points().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    // The y axis starts at 0; an empty chart gets 0..1 on both axes.
    let (x_min, x_max) = if x_min.is_finite() {
        (x_min.min(0.0), x_max)
    } else {
        (0.0, 1.0)
    };
    let x_ticks = ticks(x_min, x_max);
    let y_ticks = ticks(0.0, if y_max.is_finite() { y_max } else { 1.0 });
    let (x_lo, x_hi) = (x_ticks[0], x_ticks[x_ticks.len() - 1]);
    let (y_lo, y_hi) = (y_ticks[0], y_ticks[y_ticks.len() - 1]);
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let sx = |x: f64| LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w;
    let sy = |y: f64| TOP + plot_h - (y - y_lo) / (y_hi - y_lo) * plot_h;

    let mut svg = String::new();
    let mut line = |text: String| {
        svg.push_str(&text);
        svg.push('\n');
    };
    line(format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    ));
    line(format!(
        r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    ));
    line(format!(
        r#"<text x="{}" y="24" text-anchor="middle" font-size="16">{}</text>"#,
        LEFT + plot_w / 2.0,
        escape(&chart.title)
    ));
    // Grid and ticks.
    for &x in &x_ticks {
        line(format!(
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#e0e0e0"/>"##,
            sx(x),
            TOP,
            TOP + plot_h
        ));
        line(format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            sx(x),
            TOP + plot_h + 16.0,
            number(x)
        ));
    }
    for &y in &y_ticks {
        line(format!(
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{2:.1}" y2="{1:.1}" stroke="#e0e0e0"/>"##,
            LEFT,
            sy(y),
            LEFT + plot_w
        ));
        line(format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            sy(y) + 4.0,
            number(y)
        ));
    }
    // Axes and their labels.
    line(format!(
        r#"<path d="M{LEFT:.1},{TOP:.1} V{:.1} H{:.1}" fill="none" stroke="black"/>"#,
        TOP + plot_h,
        LEFT + plot_w
    ));
    line(format!(
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 12.0,
        escape(&chart.x_label)
    ));
    line(format!(
        r#"<text x="16" y="{0:.1}" text-anchor="middle" transform="rotate(-90 16 {0:.1})">{1}</text>"#,
        TOP + plot_h / 2.0,
        escape(&chart.y_label)
    ));
    for (x, label) in chart.markers.iter().filter(|m| m.0.is_finite()) {
        line(format!(
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#555555" stroke-dasharray="5,4"/>"##,
            sx(*x),
            TOP,
            TOP + plot_h
        ));
        line(format!(
            r##"<text x="{:.1}" y="{:.1}" fill="#555555">{}</text>"##,
            sx(*x) + 3.0,
            TOP + 12.0,
            escape(label)
        ));
    }
    for (i, series) in chart.series.iter().enumerate() {
        let color = COLORS[series.color.unwrap_or(i) % COLORS.len()];
        let dash = if series.dashed {
            r#" stroke-dasharray="6,3""#
        } else {
            ""
        };
        let mut coords = String::new();
        for &(x, y) in series.points.iter().filter(|p| finite(p)) {
            let _ = write!(
                coords,
                "{}{:.1},{:.1}",
                if coords.is_empty() { "" } else { " " },
                sx(x),
                sy(y)
            );
        }
        line(format!(
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{coords}"/>"#
        ));
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let lx = LEFT + plot_w + 16.0;
        line(format!(
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/>"#,
            lx + 24.0
        ));
        line(format!(
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            escape(&series.name)
        ));
    }
    line("</svg>".into());
    svg
}

/// Round tick values covering `lo..=hi`: steps of 1, 2 or 5 times a power
/// of ten, about six of them, the first at or below `lo`, the last at or
/// above `hi`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let hi = if hi > lo { hi } else { lo + 1.0 };
    let rough = (hi - lo) / 6.0;
    let power = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= rough)
        .unwrap_or(10.0 * power);
    let first = (lo / step).floor();
    let last = (hi / step).ceil();
    (0..=(last - first) as usize)
        .map(|i| (first + i as f64) * step)
        .collect()
}

/// A tick label: whole numbers without decimals.
fn number(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

/// `text` for an SVG text node or attribute.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(series: Vec<Series>) -> Chart {
        Chart {
            title: "Backed <memory> & pool".into(),
            x_label: "time (s)".into(),
            y_label: "MiB".into(),
            series,
            markers: vec![(0.0, "vma hog".into()), (42.5, "vmb hog".into())],
        }
    }

    /// Every tag is closed in order (`<x>` ... `</x>`, or `<x/>`).
    fn balanced(svg: &str) -> bool {
        let mut open = Vec::new();
        for tag in svg.split('<').skip(1) {
            let tag = &tag[..tag.find('>').expect("a tag ends")];
            if let Some(name) = tag.strip_prefix('/') {
                if open.pop() != Some(name.to_string()) {
                    return false;
                }
            } else if !tag.ends_with('/') {
                open.push(tag.split_whitespace().next().unwrap().to_string());
            }
        }
        open.is_empty()
    }

    #[test]
    fn a_well_formed_chart_with_one_polyline_per_series() {
        let series = vec![
            Series::new("vma", vec![(0.0, 100.0), (0.5, 400.0), (1.0, 800.0)]),
            Series::new("pool", vec![(0.0, 1500.0), (0.5, f64::NAN), (1.0, 900.0)]),
            Series::new("empty", vec![]),
        ];
        let svg = line_chart(&chart(series));
        assert!(svg.starts_with("<svg "), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert_eq!(svg.matches("stroke-dasharray").count(), 2, "two markers");
        for bad in ["NaN", "inf"] {
            assert!(!svg.contains(bad), "{bad} in {svg}");
        }
        assert!(balanced(&svg), "{svg}");
        assert!(svg.contains("Backed &lt;memory&gt; &amp; pool"));
        assert!(svg.contains(">vmb hog</text>") && svg.contains(">pool</text>"));
        // The NaN point is left out: the pool's line has two points.
        let pool = svg
            .lines()
            .filter(|l| l.starts_with("<polyline"))
            .nth(1)
            .unwrap();
        let coords = pool.split("points=\"").nth(1).unwrap();
        assert_eq!(coords.split_whitespace().count(), 2, "{pool}");
    }

    #[test]
    fn a_dashed_series_shares_its_colour_when_told() {
        let series = vec![
            Series::new("vma backed", vec![(0.0, 100.0), (1.0, 800.0)]),
            Series {
                dashed: true,
                color: Some(0),
                ..Series::new("vma balloon", vec![(0.0, 0.0), (1.0, 300.0)])
            },
        ];
        let svg = line_chart(&Chart {
            markers: vec![],
            ..chart(series)
        });
        let lines: Vec<&str> = svg.lines().filter(|l| l.starts_with("<polyline")).collect();
        assert_eq!(lines.len(), 2);
        assert!(!lines[0].contains("dasharray") && lines[1].contains("dasharray"));
        let stroke = |l: &str| l.split("stroke=\"").nth(1).unwrap()[..7].to_string();
        assert_eq!(stroke(lines[0]), stroke(lines[1]));
        assert_eq!(stroke(lines[0]), COLORS[0]);
        assert!(balanced(&svg), "{svg}");
    }

    #[test]
    fn an_empty_chart_is_still_drawn() {
        let svg = line_chart(&Chart {
            markers: vec![],
            ..chart(vec![])
        });
        assert!(svg.starts_with("<svg ") && balanced(&svg));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert_eq!(svg.matches("<polyline").count(), 0);
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 1800.0), [0.0, 500.0, 1000.0, 1500.0, 2000.0]);
        assert_eq!(ticks(0.0, 95.0), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let unit = ticks(0.0, 0.0);
        assert_eq!(unit.len(), 6, "{unit:?}");
        assert!((unit[5] - 1.0).abs() < 1e-9, "{unit:?}");
        assert_eq!(ticks(12.0, 130.0)[0], 0.0);
        assert_eq!(number(1500.0), "1500");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(0.5), "0.5");
    }
}
