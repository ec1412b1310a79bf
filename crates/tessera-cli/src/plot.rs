//! `eval --plot`: mean KL divergence against bf16 over bits per stored KV element, one
//! labelled point per scheme; schemes of one family (`affine`, `turbo`, `turbo:noscale`,
//! …) share a colour and a line through the family's best points by bits, so codecs
//! compare at equal bits. The SVG is written by
//! hand; a chart this small does not justify a plotting dependency.

use std::fmt::Write;

pub struct PlotPoint {
    pub label: String,
    pub bits: f64,
    /// Mean KL divergence against bf16; 0 for bf16 itself.
    pub kl: f64,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 64.0;
/// On a log scale, the strip between the "0" row on the bottom axis and the lowest decade.
const ZERO_GAP: f64 = 24.0;
/// Rough width of one character at font-size 12, for keeping labels apart.
const CHAR_W: f64 = 6.8;
/// Family colours, in order of first appearance.
const PALETTE: [&str; 6] = [
    "#1f6fb4", "#e0701b", "#2a9d3c", "#c0392b", "#7b4fb4", "#8c6d31",
];

/// A scheme's family: its codec name and any non-numeric flags (`turbo:4:global` →
/// `turbo:global`; `bf16` → `bf16`).
fn family(label: &str) -> String {
    let mut parts = label.split(':');
    let head = parts.next().unwrap_or("");
    std::iter::once(head)
        .chain(parts.filter(|p| p.parse::<u32>().is_err()))
        .collect::<Vec<_>>()
        .join(":")
}

/// One axis: data range and tick values (for a log axis, `lo` and `hi` are log10 values).
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    ticks: Vec<f64>,
}

impl Axis {
    /// A linear axis from 0, with the range running a little past the largest value so
    /// that point is not drawn on the frame.
    fn linear(max: f64, target_ticks: usize) -> Axis {
        let hi = if max > 0.0 { max * 1.08 } else { 1.0 };
        let step = nice_step(hi / target_ticks as f64);
        let ticks = (0..)
            .map(|i| i as f64 * step)
            .take_while(|t| *t <= hi)
            .collect();
        Axis {
            lo: 0.0,
            hi,
            log: false,
            ticks,
        }
    }

    /// A log axis over `[min, max]` (both positive), ticks at 1, 2 and 5 per decade, or
    /// only at decades when there are many.
    fn log(min: f64, max: f64) -> Axis {
        let (lo, hi) = (min.log10() - 0.25, max.log10() + 0.25);
        let mantissas: &[f64] = if hi - lo > 3.5 {
            &[1.0]
        } else {
            &[1.0, 2.0, 5.0]
        };
        let ticks = (lo.floor() as i32..=hi.ceil() as i32)
            .flat_map(|e| mantissas.iter().map(move |m| m * 10f64.powi(e)))
            .filter(|t| (lo..=hi).contains(&t.log10()))
            .collect();
        Axis {
            lo,
            hi,
            log: true,
            ticks,
        }
    }

    /// Where `v` falls along the axis, 0 at `lo` and 1 at `hi`.
    fn frac(&self, v: f64) -> f64 {
        let v = if self.log { v.log10() } else { v };
        (v - self.lo) / (self.hi - self.lo)
    }
}

/// The smallest of 1, 2, 2.5, 4, 5 or 10 times a power of ten that is at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 4.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * mag)
}

/// Tick text: plain decimals, or `2e-4` style for tiny values.
fn tick_label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() < 1e-3 {
        format!("{v:e}")
    } else {
        let s = format!("{v:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

/// Scales and pixel positions of the points, kept apart from drawing so they can be tested.
pub struct Layout {
    x: Axis,
    y: Axis,
    /// `(x, y)` in SVG pixels (y grows downward), in the order of the points.
    pub positions: Vec<(f64, f64)>,
}

impl Layout {
    fn x_px(&self, bits: f64) -> f64 {
        LEFT + self.x.frac(bits) * (WIDTH - LEFT - RIGHT)
    }

    /// KL 0 sits on the bottom axis; on a log scale the decades start `ZERO_GAP` above it.
    fn y_px(&self, kl: f64) -> f64 {
        let bottom = HEIGHT - BOTTOM;
        if kl <= 0.0 {
            return bottom;
        }
        let gap = if self.y.log { ZERO_GAP } else { 0.0 };
        bottom - gap - self.y.frac(kl) * (HEIGHT - TOP - BOTTOM - gap)
    }
}

/// Linear x from 0 bits; log y when the positive KL values span more than a factor of 20,
/// since one aggressive scheme would otherwise flatten all the others onto the axis.
pub fn layout(points: &[PlotPoint]) -> Layout {
    let max_bits = points.iter().map(|p| p.bits).fold(0.0, f64::max);
    let positive = points.iter().map(|p| p.kl).filter(|k| *k > 0.0);
    let (min_kl, max_kl) = positive.fold((f64::INFINITY, 0.0f64), |(lo, hi), k| {
        (lo.min(k), hi.max(k))
    });
    let y = if max_kl > 0.0 && max_kl / min_kl > 20.0 {
        Axis::log(min_kl, max_kl)
    } else {
        Axis::linear(max_kl, 6)
    };
    let mut layout = Layout {
        x: Axis::linear(max_bits, 5),
        y,
        positions: Vec::new(),
    };
    layout.positions = points
        .iter()
        .map(|p| (layout.x_px(p.bits), layout.y_px(p.kl)))
        .collect();
    layout
}

/// The whole chart as an SVG document.
pub fn kl_vs_bits_svg(points: &[PlotPoint], title: &str) -> String {
    let l = layout(points);
    let (left, right, top, bottom) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    // Y ticks with light grid lines; a log axis also gets the "0" row for bf16.
    let zero_row = l.y.log.then_some(0.0);
    for t in l.y.ticks.iter().copied().chain(zero_row) {
        let y = l.y_px(t);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left - 6.0,
            y + 4.0,
            tick_label(t)
        );
    }
    for &t in &l.x.ticks {
        let x = l.x_px(t);
        let _ = writeln!(
            s,
            r#"<line x1="{x:.1}" y1="{bottom}" x2="{x:.1}" y2="{:.1}" stroke="black"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            bottom + 5.0,
            bottom + 19.0,
            tick_label(t)
        );
    }
    let _ = writeln!(
        s,
        r#"<path d="M{left} {top} V{bottom} H{right}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">bits per KV element stored</text>"#,
        (left + right) / 2.0,
        HEIGHT - 18.0
    );
    let cy = (top + bottom) / 2.0;
    let _ = writeln!(
        s,
        r#"<text x="24" y="{cy:.1}" text-anchor="middle" transform="rotate(-90 24 {cy:.1})">mean KL divergence vs bf16 (nats{})</text>"#,
        if l.y.log { ", log scale" } else { "" }
    );
    // One colour per family; a family of several points gets a line through them by bits
    // and a legend entry.
    let mut families: Vec<String> = Vec::new();
    for p in points {
        let f = family(&p.label);
        if !families.contains(&f) {
            families.push(f);
        }
    }
    let colour_of = |label: &str| {
        let i = families
            .iter()
            .position(|f| *f == family(label))
            .unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    for (i, f) in families.iter().enumerate() {
        // The family's front: by bits, each point that beats every point with fewer or
        // equal bits (what the family achieves at each budget; other points stay dots).
        let mut members: Vec<(&PlotPoint, (f64, f64))> = points
            .iter()
            .zip(&l.positions)
            .filter(|(p, _)| family(&p.label) == *f)
            .map(|(p, &xy)| (p, xy))
            .collect();
        members.sort_by(|a, b| {
            a.0.bits
                .total_cmp(&b.0.bits)
                .then(a.0.kl.total_cmp(&b.0.kl))
        });
        let mut best = f64::INFINITY;
        let members: Vec<(f64, f64)> = members
            .into_iter()
            .filter(|(p, _)| {
                let front = p.kl < best;
                best = best.min(p.kl);
                front
            })
            .map(|(_, xy)| xy)
            .collect();
        if members.len() < 2 {
            continue;
        }
        let path: Vec<String> = members
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let colour = PALETTE[i % PALETTE.len()];
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="1.5"/>"#,
            path.join(" ")
        );
    }
    if families.len() > 1 {
        for (i, f) in families.iter().enumerate() {
            let (x, y) = (right - 150.0, top + 4.0 + 16.0 * i as f64);
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                y - 9.0,
                PALETTE[i % PALETTE.len()],
                x + 16.0,
                y,
                escape(f)
            );
        }
    }
    // Labels go right of their point (left near the right edge), nudged up or down past
    // labels already placed: schemes of similar size and quality would otherwise overprint.
    let mut placed: Vec<(f64, f64, f64, f64)> = Vec::new();
    for (p, &(x, y)) in points.iter().zip(&l.positions) {
        let _ = writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{}"/>"#,
            colour_of(&p.label)
        );
        let w = p.label.chars().count() as f64 * CHAR_W;
        let (tx, anchor, x0) = if x + 8.0 + w > WIDTH - 4.0 {
            (x - 8.0, "end", x - 8.0 - w)
        } else {
            (x + 8.0, "start", x + 8.0)
        };
        // On the bottom axis, the label sits above the line.
        let base = if p.kl <= 0.0 { y - 8.0 } else { y + 4.0 };
        let ty = [0.0, -14.0, 14.0, -28.0, 28.0, -42.0, 42.0]
            .iter()
            .map(|d| base + d)
            .find(|ty| {
                !placed
                    .iter()
                    .any(|&(a, b, c, d)| x0 < c && a < x0 + w && ty - 11.0 < d && b < *ty + 3.0)
            })
            .unwrap_or(base);
        placed.push((x0, ty - 11.0, x0 + w, ty + 3.0));
        if (ty - base).abs() > 0.5 {
            // A nudged label gets a leader line back to its point.
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{y:.1}" x2="{tx:.1}" y2="{:.1}" stroke="#999" stroke-width="0.8"/>"##,
                ty - 4.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{tx:.1}" y="{ty:.1}" text-anchor="{anchor}">{}</text>"#,
            escape(&p.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(label: &str, bits: f64, kl: f64) -> PlotPoint {
        PlotPoint {
            label: label.into(),
            bits,
            kl,
        }
    }

    #[test]
    fn svg_has_one_escaped_label_and_circle_per_point() {
        let points = [
            point("bf16", 16.0, 0.0),
            point("affine:8", 8.5, 0.0004),
            point("affine:4:32", 5.0, 0.03),
            point("cfg<&\">.json", 4.5, 0.05),
        ];
        let svg = kl_vs_bits_svg(&points, "ctx 64 × 1 chunks — a&b.txt");
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<circle").count(), points.len());
        for label in [
            "bf16",
            "affine:8",
            "affine:4:32",
            "cfg&lt;&amp;&quot;&gt;.json",
        ] {
            assert!(svg.contains(&format!(">{label}</text>")), "{label}");
        }
        assert!(svg.contains("a&amp;b.txt"));
        assert!(!svg.contains("cfg<"));
    }

    #[test]
    fn families_share_a_colour_and_a_line() {
        let points = [
            point("bf16", 16.0, 0.0),
            point("affine:8", 8.5, 0.001),
            point("affine:4", 4.5, 0.1),
            point("turbo:4", 4.06, 0.05),
            point("turbo:6:3", 4.56, 0.03),
            point("turbo:4:global", 14.0, 0.02),
        ];
        assert_eq!(family("turbo:4:global"), "turbo:global");
        assert_eq!(family("affine:4:32"), "affine");
        let svg = kl_vs_bits_svg(&points, "t");
        // bf16, affine, turbo, turbo:global; lines only where a family has two points.
        assert_eq!(svg.matches("<polyline").count(), 2);
        // Families take the palette's colours in order of first appearance: bf16, affine,
        // turbo, turbo:global. The palette's colours are all different.
        for (i, a) in PALETTE.iter().enumerate() {
            assert!(!PALETTE[..i].contains(a), "{a} twice in the palette");
        }
        let fill = |label: &str| colour_of_circle(&svg, &points, label);
        let expected = [
            ("bf16", 0),
            ("affine:8", 1),
            ("affine:4", 1),
            ("turbo:4", 2),
            ("turbo:6:3", 2),
            ("turbo:4:global", 3),
        ];
        for (label, i) in expected {
            assert_eq!(fill(label), PALETTE[i], "circle of {label}");
        }
        // Each family's legend swatch, and each line, in the family's colour.
        for (f, i) in [
            ("bf16", 0),
            ("affine", 1),
            ("turbo", 2),
            ("turbo:global", 3),
        ] {
            let entry = svg
                .lines()
                .find(|l| l.starts_with("<rect x=") && l.ends_with(&format!(">{f}</text>")))
                .unwrap_or_else(|| panic!("legend entry of {f}"));
            assert!(
                entry.contains(&format!("fill=\"{}\"", PALETTE[i])),
                "{entry}"
            );
        }
        let strokes: Vec<&str> = svg
            .split("<polyline")
            .skip(1)
            .map(|l| {
                l.split("stroke=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            strokes,
            [PALETTE[1], PALETTE[2]],
            "affine's line, then turbo's"
        );
        // A point beaten at fewer bits stays off its family's line.
        let points = [
            point("turbo:4:3", 3.56, 0.06),
            point("turbo:6:2", 4.06, 0.09),
            point("turbo:5:3", 4.06, 0.035),
        ];
        let svg = kl_vs_bits_svg(&points, "t");
        let l = layout(&points);
        let line = svg.split("<polyline points=\"").nth(1).unwrap();
        let line = line.split('"').next().unwrap();
        let at = |i: usize| format!("{:.1},{:.1}", l.positions[i].0, l.positions[i].1);
        assert_eq!(line, format!("{} {}", at(0), at(2)));
    }

    /// The fill of the circle drawn for `label` (circles come in point order).
    fn colour_of_circle(svg: &str, points: &[PlotPoint], label: &str) -> String {
        let i = points.iter().position(|p| p.label == label).unwrap();
        let circle = svg.split("<circle").nth(i + 1).unwrap();
        circle
            .split("fill=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .to_string()
    }

    #[test]
    fn positions_follow_bits_and_kl() {
        let points = [
            point("bf16", 16.0, 0.0),
            point("affine:8", 8.5, 0.001),
            point("affine:4", 4.5, 0.01),
        ];
        let l = layout(&points);
        let p = &l.positions;
        assert!(
            p[0].0 > p[1].0 && p[1].0 > p[2].0,
            "more bits, further right"
        );
        assert!(p[2].1 < p[1].1 && p[1].1 < p[0].1, "more KL, higher up");
        assert_eq!(p[0].1, HEIGHT - BOTTOM, "KL 0 on the bottom axis");
        assert!(!l.y.log, "a factor of 10 stays linear");
        let wide = layout(&[point("a", 8.5, 0.0005), point("b", 4.5, 0.05)]);
        assert!(wide.y.log, "a factor of 100 goes log");
        assert!(wide.positions[0].1 < HEIGHT - BOTTOM - ZERO_GAP);
        for &(x, y) in p.iter().chain(&wide.positions) {
            assert!((LEFT..=WIDTH - RIGHT).contains(&x) && (TOP..=HEIGHT - BOTTOM).contains(&y));
        }
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick_label(0.30000000000000004), "0.3");
        assert_eq!(tick_label(0.0002), "2e-4");
        assert_eq!(tick_label(16.0), "16");
        assert_eq!(nice_step(3.2), 4.0);
        assert_eq!(nice_step(0.0011), 0.002);
    }
}
