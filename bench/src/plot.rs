//! Pictures of runs, as SVG drawn with `plotters`: HdrHistogram's classic latency
//! percentile distribution (latency against percentile, the percentile axis stretched
//! as `1/(1-p)` on a log scale so that the tail gets the room), and, for runs over many
//! sizes (`-a`), latency and bandwidth against message size. Several runs go on one
//! chart, one colour each, for comparison.
//!
//! Inputs are [`Run`]s: from `shmhca-perf --json` files ([`Run::from_json`]), from
//! HdrHistogram `.hgrm` percentile-distribution files, shmhca-perf's or any other tool's
//! ([`Run::from_hgrm`]), or from a run in progress (`shmhca-perf --svg`).

use plotters::prelude::*;
use serde_json::Value;

/// One size of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    /// Message size in bytes.
    pub size: u64,
    /// Latency runs: typical (median), 99% and 99.9% latency in µs.
    pub lat_us: Option<[f64; 3]>,
    /// Bandwidth runs: average bandwidth in MiB/s and message rate in Mpps.
    pub bw: Option<(f64, f64)>,
    /// Latency runs: the percentile distribution, `(percentile in [0, 1), µs)`.
    pub dist: Vec<(f64, f64)>,
}

/// One run to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// The legend's name for it.
    pub label: String,
    /// Its sizes, in order.
    pub rows: Vec<Row>,
}

impl Run {
    /// A run from an `shmhca-perf --json` document (or the same shape built in memory).
    ///
    /// # Errors
    /// A message naming what is missing.
    pub fn from_json(label: &str, doc: &Value) -> Result<Run, String> {
        let results = doc["results"]
            .as_array()
            .ok_or("no \"results\" array: not a shmhca-perf --json file")?;
        let f = |r: &Value, k: &str| r[k].as_f64();
        let rows = results
            .iter()
            .map(|r| {
                let size = r["bytes"]
                    .as_u64()
                    .ok_or("a result without \"bytes\"".to_string())?;
                let lat_us = match (f(r, "t_typical_usec"), f(r, "p99_usec"), f(r, "p99_9_usec")) {
                    (Some(a), Some(b), Some(c)) => Some([a, b, c]),
                    _ => None,
                };
                let bw = f(r, "bw_average_mib_sec").zip(f(r, "msg_rate_mpps"));
                if lat_us.is_none() && bw.is_none() {
                    return Err(format!(
                        "the result for {size} bytes has neither latency nor bandwidth figures"
                    ));
                }
                let dist = r["percentiles"]
                    .as_array()
                    .map(|ps| {
                        ps.iter()
                            .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                            .collect()
                    })
                    .unwrap_or_default();
                Ok(Row {
                    size,
                    lat_us,
                    bw,
                    dist,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        if rows.is_empty() {
            return Err("\"results\" is empty".into());
        }
        Ok(Run {
            label: label.to_string(),
            rows,
        })
    }

    /// A run from HdrHistogram percentile-distribution text (`.hgrm`: the columns
    /// `Value Percentile TotalCount 1/(1-Percentile)`, values in µs as shmhca-perf writes
    /// them). Files holding several sizes (`#[Size = N bytes]` lines) give one row each.
    ///
    /// # Errors
    /// A message naming the first line that is not part of the format.
    pub fn from_hgrm(label: &str, text: &str) -> Result<Run, String> {
        let mut rows: Vec<Row> = Vec::new();
        let mut cur = Row::default();
        for (n, line) in text.lines().enumerate() {
            let t = line.trim();
            if let Some(size) = t
                .strip_prefix("#[Size = ")
                .and_then(|s| s.strip_suffix(" bytes]"))
            {
                if !cur.dist.is_empty() {
                    rows.push(std::mem::take(&mut cur));
                }
                cur.size = size
                    .parse()
                    .map_err(|_| format!("line {}: bad size in {t:?}", n + 1))?;
                continue;
            }
            if t.is_empty() || t.starts_with('#') || t.starts_with("Value") {
                continue;
            }
            let cols: Vec<&str> = t.split_whitespace().collect();
            let parsed = (cols.len() >= 3)
                .then(|| Some((cols[0].parse::<f64>().ok()?, cols[1].parse::<f64>().ok()?)))
                .flatten();
            match parsed {
                Some((v, p)) if (0.0..=1.0).contains(&p) && v.is_finite() => {
                    if p < 1.0 {
                        cur.dist.push((p, v));
                    }
                }
                _ => {
                    return Err(format!(
                        "line {}: {t:?} is not a percentile-distribution line (Value Percentile TotalCount ...)",
                        n + 1
                    ));
                }
            }
        }
        if !cur.dist.is_empty() {
            rows.push(cur);
        }
        if rows.is_empty() {
            return Err("no percentile lines: not an .hgrm file".into());
        }
        Ok(Run {
            label: label.to_string(),
            rows,
        })
    }
}

const PANEL: (u32, u32) = (960, 460);

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

/// Bytes as `2`, `4K`, `8M`.
fn size_label(x: f64) -> String {
    let b = x.round() as u64;
    match b {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// The percentile of `1/(1-p) = x`, as HdrHistogram's plots label it.
fn pct_label(x: f64) -> String {
    let p = 100.0 * (1.0 - 1.0 / x);
    let s = format!("{p:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}%")
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// The legend box, top left.
macro_rules! legend {
    ($c:expr) => {
        $c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)
    };
}

fn err(e: impl std::fmt::Display) -> String {
    format!("drawing the chart: {e}")
}

/// The percentile-distribution panel: one line per `(label, points)`. Latency is on a
/// linear axis, as in HdrHistogram's plots, unless the lines span more than 50x (runs
/// over many sizes): then on a log axis, so that the small sizes do not lie flat at 0.
fn percentile_panel(area: &Area<'_>, lines: &[(String, Vec<(f64, f64)>)]) -> Result<(), String> {
    let pts = lines.iter().flat_map(|(_, p)| p.iter());
    let x_max = pts
        .clone()
        .map(|(p, _)| 1.0 / (1.0 - p))
        .fold(10.0f64, f64::max)
        .max(10.0);
    let y_max = pts.clone().map(|(_, v)| *v).fold(0.0f64, f64::max) * 1.05 + 1e-3;
    let y_min = pts
        .map(|(_, v)| *v)
        .filter(|v| *v > 0.0)
        .fold(f64::MAX, f64::min);
    let mut b = ChartBuilder::on(area);
    b.caption("Latency by percentile", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    let x = (1.0f64..x_max).log_scale();
    if y_min != f64::MAX && y_max / y_min > 50.0 {
        let mut c = b
            .build_cartesian_2d(x, (y_min / 1.5..y_max * 1.5).log_scale())
            .map_err(err)?;
        c.configure_mesh()
            .x_desc("percentile")
            .y_desc("latency (µs, log scale)")
            .x_label_formatter(&|x| pct_label(*x))
            .draw()
            .map_err(err)?;
        percentile_lines(&mut c, lines)
    } else {
        let mut c = b.build_cartesian_2d(x, 0.0f64..y_max).map_err(err)?;
        c.configure_mesh()
            .x_desc("percentile")
            .y_desc("latency (µs)")
            .x_label_formatter(&|x| pct_label(*x))
            .draw()
            .map_err(err)?;
        percentile_lines(&mut c, lines)
    }
}

/// The lines and legend of the percentile panel, on either latency axis.
fn percentile_lines<'a, 'b, X, Y>(
    c: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<X, Y>>,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String>
where
    'b: 'a,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (i, (label, p)) in lines.iter().enumerate() {
        let col = color(i);
        c.draw_series(LineSeries::new(
            p.iter().map(|(q, v)| (1.0 / (1.0 - q), *v)),
            col.stroke_width(2),
        ))
        .map_err(err)?
        .label(label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
    }
    legend!(c)
}

/// A panel of a figure against message size (both axes logarithmic): one line per
/// `(label, points)`.
fn size_panel(
    area: &Area<'_>,
    title: &str,
    y_desc: &str,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String> {
    let pts = lines.iter().flat_map(|(_, p)| p.iter());
    let x_min = pts
        .clone()
        .map(|(x, _)| *x)
        .fold(f64::MAX, f64::min)
        .max(1.0);
    let x_max = pts
        .clone()
        .map(|(x, _)| *x)
        .fold(2.0, f64::max)
        .max(x_min * 2.0);
    let y_min = pts
        .clone()
        .map(|(_, y)| *y)
        .filter(|y| *y > 0.0)
        .fold(f64::MAX, f64::min);
    let y_max = pts.map(|(_, y)| *y).fold(0.0f64, f64::max).max(1e-3);
    let y_lo = if y_min == f64::MAX { 1e-3 } else { y_min / 1.5 };
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x_min / 1.2..x_max * 1.2).log_scale().base(2.0),
            (y_lo..y_max * 1.5).log_scale(),
        )
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc(y_desc)
        .x_label_formatter(&|x| size_label(*x))
        .draw()
        .map_err(err)?;
    for (i, (label, p)) in lines.iter().enumerate() {
        let col = color(i);
        c.draw_series(LineSeries::new(p.iter().copied(), col.stroke_width(2)))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
        c.draw_series(p.iter().map(|pt| Circle::new(*pt, 3, col.filled())))
            .map_err(err)?;
    }
    legend!(c)
}

/// The sizes whose distributions a multi-size latency run shows (too many lines read as
/// none): about every 4th power of two, and the largest.
fn picked_sizes(rows: &[Row]) -> Vec<&Row> {
    let with: Vec<&Row> = rows.iter().filter(|r| !r.dist.is_empty()).collect();
    let n = with.len();
    with.into_iter()
        .enumerate()
        .filter(|(i, _)| i % 4 == 0 || *i + 1 == n)
        .map(|(_, r)| r)
        .collect()
}

/// Draws `runs` as one SVG document, titled `title`: a latency-against-size and a
/// bandwidth-against-size panel where the runs have several sizes, and a percentile
/// distribution panel where they have distributions.
///
/// # Errors
/// Nothing to draw, or plotters fails.
pub fn render(title: &str, runs: &[Run]) -> Result<String, String> {
    let multi = runs.iter().any(|r| r.rows.len() > 1);
    let mut lat_lines = Vec::new();
    let mut bw_lines = Vec::new();
    let mut dist_lines = Vec::new();
    for run in runs {
        if multi && run.rows.len() > 1 {
            let lat: Vec<(f64, f64)> = run
                .rows
                .iter()
                .filter_map(|r| r.lat_us.map(|l| (r.size as f64, l[0])))
                .collect();
            if !lat.is_empty() {
                let p99: Vec<(f64, f64)> = run
                    .rows
                    .iter()
                    .filter_map(|r| r.lat_us.map(|l| (r.size as f64, l[1])))
                    .collect();
                lat_lines.push((format!("{} typical", run.label), lat));
                lat_lines.push((format!("{} 99%", run.label), p99));
            }
            let bw: Vec<(f64, f64)> = run
                .rows
                .iter()
                .filter_map(|r| r.bw.map(|b| (r.size as f64, b.0)))
                .collect();
            if !bw.is_empty() {
                bw_lines.push((run.label.clone(), bw));
            }
        }
        let rows = if run.rows.len() > 1 && runs.len() == 1 {
            picked_sizes(&run.rows)
        } else if run.rows.len() == 1 {
            run.rows.iter().collect()
        } else {
            Vec::new()
        };
        for r in rows {
            if !r.dist.is_empty() {
                let label = if run.rows.len() > 1 || runs.len() == 1 {
                    format!("{} {} B", run.label, r.size)
                } else {
                    run.label.clone()
                };
                dist_lines.push((label, r.dist.clone()));
            }
        }
    }
    let panels = usize::from(!lat_lines.is_empty())
        + usize::from(!bw_lines.is_empty())
        + usize::from(!dist_lines.is_empty());
    if panels == 0 {
        return Err(
            "nothing to draw: give latency runs (with percentiles or .hgrm) or runs over several sizes (-a)".into(),
        );
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PANEL.0, 40 + PANEL.1 * panels as u32))
            .into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root.titled(title, ("sans-serif", 24)).map_err(err)?;
        let areas = root.split_evenly((panels, 1));
        let mut next = areas.iter();
        if !lat_lines.is_empty() {
            let a = next.next().ok_or("layout")?;
            size_panel(a, "Latency by message size", "latency (µs)", &lat_lines)?;
        }
        if !bw_lines.is_empty() {
            let a = next.next().ok_or("layout")?;
            size_panel(
                a,
                "Bandwidth by message size",
                "bandwidth (MiB/s)",
                &bw_lines,
            )?;
        }
        if !dist_lines.is_empty() {
            let a = next.next().ok_or("layout")?;
            percentile_panel(a, &dist_lines)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HGRM: &str = "       Value     Percentile TotalCount 1/(1-Percentile)\n\n       1.000 0.000000000000          1           1.00\n       2.000 0.500000000000         50           2.00\n       9.000 0.990000000000         99         100.00\n      12.000 1.000000000000        100\n#[Mean    =        2.000, StdDeviation   =        1.000]\n";

    #[test]
    fn hgrm_parses_and_draws() {
        let run = Run::from_hgrm("a", HGRM).unwrap();
        assert_eq!(run.rows[0].dist, vec![(0.0, 1.0), (0.5, 2.0), (0.99, 9.0)]);
        let svg = render(
            "t",
            &[
                run.clone(),
                Run {
                    label: "b".into(),
                    ..run
                },
            ],
        )
        .unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("Latency by percentile"));
        assert!(svg.contains(">\na\n<") || svg.contains(">a<"), "legend");
    }

    #[test]
    fn garbage_is_refused_with_the_line() {
        let e = Run::from_hgrm("x", "hello world\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
        assert!(Run::from_json("x", &serde_json::json!({"a": 1})).is_err());
        assert!(render("t", &[]).is_err());
    }

    #[test]
    fn sizes_draw_latency_and_bandwidth_panels() {
        let lat = Run {
            label: "lat".into(),
            rows: (1..=4)
                .map(|e| Row {
                    size: 1 << e,
                    lat_us: Some([1.0 * e as f64, 2.0, 3.0]),
                    ..Row::default()
                })
                .collect(),
        };
        let bw = Run {
            label: "bw".into(),
            rows: (1..=4)
                .map(|e| Row {
                    size: 1 << e,
                    bw: Some((100.0 * e as f64, 1.0)),
                    ..Row::default()
                })
                .collect(),
        };
        let svg = render("t", &[lat, bw]).unwrap();
        assert!(
            svg.contains("Latency by message size") && svg.contains("Bandwidth by message size")
        );
    }
}
