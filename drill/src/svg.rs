//! The SVG picture of a drill: a histogram of failover times on a log scale (stacked by
//! failure kind; a hung wake takes seconds where the others take milliseconds), and below it
//! the median failover of each kind split into its phases (detect, grant, wake) as shares of
//! the whole, labelled with the milliseconds.

use plotters::prelude::*;

use crate::report::{KindSummary, RoundRecord};
use crate::schedule::FailureKind;

/// An error while drawing (plotters' errors carry the backend type, so they are flattened).
#[derive(Debug, thiserror::Error)]
#[error("drawing the drill SVG: {0}")]
pub struct SvgError(String);

fn kind_color(k: FailureKind) -> RGBColor {
    match k {
        FailureKind::EngineKill => RGBColor(31, 119, 180),
        FailureKind::SupervisorKill => RGBColor(255, 127, 14),
        FailureKind::DetachedWorker => RGBColor(44, 160, 44),
        FailureKind::HungWake => RGBColor(214, 39, 40),
        FailureKind::LockdCrash => RGBColor(148, 103, 189),
        FailureKind::Revoke => RGBColor(140, 86, 75),
        FailureKind::LockdCrashThenSupervisorKill => RGBColor(227, 119, 194),
        FailureKind::RevokeDuringReconnect => RGBColor(127, 127, 127),
        FailureKind::LockdCrashDuringWake => RGBColor(188, 189, 34),
        FailureKind::DoubleKill => RGBColor(23, 190, 207),
        FailureKind::EngineChildKill => RGBColor(57, 59, 121),
        FailureKind::WorkerKill => RGBColor(173, 73, 74),
        FailureKind::Stop => RGBColor(99, 121, 57),
    }
}

const PHASES: [(&str, RGBColor); 3] = [
    ("kill -> old dead", RGBColor(127, 127, 127)),
    ("old dead -> lease granted", RGBColor(188, 189, 34)),
    ("granted -> new Active", RGBColor(23, 190, 207)),
];

/// Number of failure kinds (histogram columns).
const KINDS: usize = FailureKind::EVERY.len();

/// Histogram bins per decade of milliseconds.
pub const BINS_PER_DECADE: u32 = 8;

/// The bin of a time in milliseconds on the log scale: bin `i` covers
/// `[10^(i/B), 10^((i+1)/B))` ms (B = [`BINS_PER_DECADE`]); times under 0.1 ms go to the
/// bin of 0.1 ms.
pub fn log_bin(ms: f64) -> i32 {
    (ms.max(0.1).log10() * f64::from(BINS_PER_DECADE)).floor() as i32
}

/// Lower edge of a log bin, milliseconds.
pub fn bin_edge(bin: i32) -> f64 {
    10f64.powf(f64::from(bin) / f64::from(BINS_PER_DECADE))
}

/// Histogram counts on the log scale: `(first bin, counts)` where `counts[j]` holds, for bin
/// `first + j`, the rounds per kind in `FailureKind::EVERY` order. Only failover kinds with a
/// measured time are counted.
pub fn histogram(rounds: &[RoundRecord]) -> (i32, Vec<[u32; KINDS]>) {
    let items: Vec<(i32, usize)> = rounds
        .iter()
        .filter(|r| r.kind.expects_failover())
        .filter_map(|r| {
            let us = r.phases.total_us?;
            let k = FailureKind::EVERY.iter().position(|k| *k == r.kind)?;
            Some((log_bin(us as f64 / 1000.0), k))
        })
        .collect();
    let Some(first) = items.iter().map(|(b, _)| *b).min() else {
        return (0, Vec::new());
    };
    let last = items.iter().map(|(b, _)| *b).max().unwrap_or(first);
    let mut counts = vec![[0u32; KINDS]; (last - first + 1) as usize];
    for (b, k) in items {
        counts[(b - first) as usize][k] += 1;
    }
    (first, counts)
}

/// Renders the picture to an SVG document.
pub fn render(
    rounds: &[RoundRecord],
    summary: &[KindSummary],
    title: &str,
) -> Result<String, SvgError> {
    let mut out = String::new();
    draw(&mut out, rounds, summary, title).map_err(SvgError)?;
    Ok(out)
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn draw(
    out: &mut String,
    rounds: &[RoundRecord],
    summary: &[KindSummary],
    title: &str,
) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let root = SVGBackend::with_string(out, (1000, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (upper, lower) = root.split_vertically(470);

    // Upper panel: histogram of total failover time, log x axis, stacked by kind.
    let (first, bins) = histogram(rounds);
    let ymax = bins
        .iter()
        .map(|b| b.iter().sum::<u32>())
        .max()
        .unwrap_or(0)
        .max(1);
    let (lo, hi) = if bins.is_empty() {
        (1.0, 10.0)
    } else {
        let lo_dec = (f64::from(first) / f64::from(BINS_PER_DECADE)).floor();
        let last = first + bins.len() as i32;
        let hi_dec = (f64::from(last) / f64::from(BINS_PER_DECADE)).ceil();
        (10f64.powf(lo_dec), 10f64.powf(hi_dec.max(lo_dec + 1.0)))
    };
    let mut chart = ChartBuilder::on(&upper)
        .caption(
            format!("{title}: failover time (kill -> new Active)"),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..(f64::from(ymax) * 1.15))
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc(format!(
            "failover time, ms (log scale, {BINS_PER_DECADE} bins per decade)"
        ))
        .y_desc("rounds")
        .x_label_formatter(&|v| fmt_ms(*v))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|x| e(&x))?;
    for (ki, kind) in FailureKind::EVERY.iter().enumerate() {
        if !kind.expects_failover()
            || !rounds
                .iter()
                .any(|r| r.kind == *kind && r.phases.total_us.is_some())
        {
            continue;
        }
        let color = kind_color(*kind);
        let rects: Vec<_> = bins
            .iter()
            .enumerate()
            .filter(|(_, b)| b[ki] > 0)
            .map(|(j, b)| {
                let below: u32 = b[..ki].iter().sum();
                let bin = first + j as i32;
                Rectangle::new(
                    [
                        (bin_edge(bin), f64::from(below)),
                        (bin_edge(bin + 1), f64::from(below + b[ki])),
                    ],
                    color.filled(),
                )
            })
            .collect();
        chart
            .draw_series(rects)
            .map_err(|x| e(&x))?
            .label(kind.name())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;

    // Lower panel: each kind's median phases as shares of their sum (the bar), labelled with
    // the milliseconds.
    let kinds: Vec<&KindSummary> = summary
        .iter()
        .filter(|k| k.kind.expects_failover())
        .collect();
    let n = kinds.len().max(1);
    let names: Vec<String> = kinds.iter().map(|k| k.kind.name().to_string()).collect();
    let label = move |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut chart2 = ChartBuilder::on(&lower)
        .caption(
            "median failover by phase (share of the median phases' sum)",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(120)
        .build_cartesian_2d(0f64..100f64, -2.0f64..(n as f64 - 0.4))
        .map_err(|x| e(&x))?;
    chart2
        .configure_mesh()
        // One row below the bars keeps the legend clear of them.
        .y_labels(n + 2)
        .y_label_formatter(&label)
        .x_desc("% of the failover")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .disable_y_mesh()
        .draw()
        .map_err(|x| e(&x))?;
    let sums: Vec<f64> = kinds
        .iter()
        .map(|k| {
            k.median_phase_ms
                .iter()
                .map(|v| v.unwrap_or(0.0))
                .sum::<f64>()
        })
        .collect();
    for (pi, (pname, pcolor)) in PHASES.iter().enumerate() {
        let rects: Vec<_> = kinds
            .iter()
            .zip(&sums)
            .enumerate()
            .filter_map(|(i, (k, sum))| {
                if *sum <= 0.0 {
                    return None;
                }
                let before: f64 = k.median_phase_ms[..pi]
                    .iter()
                    .map(|v| v.unwrap_or(0.0))
                    .sum();
                let len = k.median_phase_ms[pi]?;
                let y = i as f64;
                Some(Rectangle::new(
                    [
                        (100.0 * before / sum, y - 0.25),
                        (100.0 * (before + len) / sum, y + 0.2),
                    ],
                    pcolor.filled(),
                ))
            })
            .collect();
        let c = *pcolor;
        chart2
            .draw_series(rects)
            .map_err(|x| e(&x))?
            .label(*pname)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    let texts: Vec<_> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let p = |v: Option<f64>| v.map_or_else(|| "-".to_string(), fmt_ms);
            Text::new(
                format!(
                    "median {} ms = {} + {} + {} ms",
                    p(k.median_ms),
                    p(k.median_phase_ms[0]),
                    p(k.median_phase_ms[1]),
                    p(k.median_phase_ms[2])
                ),
                (1.0, i as f64 + 0.5),
                ("sans-serif", 12).into_font().color(&BLACK),
            )
        })
        .collect();
    chart2.draw_series(texts).map_err(|x| e(&x))?;
    chart2
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summarize;
    use crate::report::tests::rec;

    #[test]
    fn log_bins_cover_decades() {
        assert_eq!(log_bin(1.0), 0);
        assert_eq!(log_bin(10.0), BINS_PER_DECADE as i32);
        assert_eq!(log_bin(0.0), -(BINS_PER_DECADE as i32));
        assert_eq!(log_bin(0.5), -3);
        for ms in [0.3, 1.0, 7.0, 12.5, 2000.0] {
            let b = log_bin(ms);
            assert!(
                bin_edge(b) <= ms * (1.0 + 1e-9) && ms < bin_edge(b + 1),
                "{ms}"
            );
        }
    }

    #[test]
    fn histogram_counts_failovers_by_kind() {
        let rounds = vec![
            rec(1, FailureKind::EngineKill, 10, 0),
            rec(2, FailureKind::EngineKill, 11, 0),
            rec(3, FailureKind::Revoke, 2000, 0),
            rec(4, FailureKind::LockdCrash, 30, 0),
        ];
        let (first, h) = histogram(&rounds);
        assert_eq!(first, log_bin(10.0));
        assert_eq!(h.len() as i32, log_bin(2000.0) - first + 1);
        assert_eq!(h[0][0], 2);
        assert_eq!(h[h.len() - 1][5], 1);
        assert_eq!(h.iter().map(|b| b.iter().sum::<u32>()).sum::<u32>(), 3);
        assert_eq!(histogram(&[]).1.len(), 0);
    }

    #[test]
    fn renders_an_svg_with_every_kind_and_phase() {
        let rounds: Vec<_> = FailureKind::ALL
            .iter()
            .enumerate()
            .flat_map(|(i, k)| {
                (0..5)
                    .map(move |j| rec((i * 5 + j) as u32, *k, 5 + 400 * i as u64 + j as u64 * 7, 0))
            })
            .collect();
        let svg = render(&rounds, &summarize(&rounds), "test drill").unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for k in FailureKind::ALL.iter().filter(|k| k.expects_failover()) {
            assert!(svg.contains(k.name()), "missing {k}");
        }
        assert!(
            svg.contains("old dead -&gt; lease granted")
                || svg.contains("old dead -> lease granted")
        );
        assert!(
            svg.contains("median 19.0 ms = 1.9 + 3.8 + 13.3 ms"),
            "per-kind label missing"
        );
        assert!(svg.matches("<rect").count() > 20);
        // Nothing measured still renders.
        let empty = render(&[], &[], "empty").unwrap();
        assert!(empty.contains("</svg>"));
    }
}
