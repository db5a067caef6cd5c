//! `loss.svg`: training and evaluation loss against the step, with the entropy floor dashed,
//! written by hand (axes with round ticks, labels, a legend).

use std::fmt::Write as _;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 440.0;
/// Margins: left, right, top, bottom.
const MARGIN: (f64, f64, f64, f64) = (70.0, 20.0, 40.0, 50.0);
const TRAIN_COLOUR: &str = "#1f77b4";
const EVAL_COLOUR: &str = "#d62728";
const FLOOR_COLOUR: &str = "#555555";

/// The plot of `train` and `eval` losses (`(step, loss)`, by step) and the floor.
pub fn loss_svg(train: &[(u64, f64)], eval: &[(u64, f64)], floor: Option<f64>) -> String {
    let finite = |&&(_, loss): &&(u64, f64)| loss.is_finite();
    let points: Vec<(u64, f64)> = train.iter().chain(eval).filter(finite).copied().collect();
    let frame = Frame::of(&points, floor);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">Loss</text>"#,
        MARGIN.0 + frame.plot_w / 2.0
    );
    frame.axes(&mut svg);
    frame.data(&mut svg, train, eval, floor);
    frame.legend(&mut svg, floor.is_some());
    svg.push_str("</svg>\n");
    svg
}

/// The plotting area: its size, the round ticks of both axes, and the ranges they span.
struct Frame {
    plot_w: f64,
    plot_h: f64,
    x_ticks: Vec<f64>,
    y_ticks: Vec<f64>,
    x_max: f64,
    y_min: f64,
    y_max: f64,
}

impl Frame {
    /// The frame that holds `points` (finite losses) and the floor.
    fn of(points: &[(u64, f64)], floor: Option<f64>) -> Frame {
        let last_step = points.iter().map(|p| p.0).max().unwrap_or(1).max(1);
        let losses = points.iter().map(|p| p.1).chain(floor);
        let (low, high) =
            losses.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let (low, high) = if low.is_finite() { (low, high.max(low + 1e-3)) } else { (0.0, 1.0) };
        let y_ticks = ticks(low, high, 6);
        let x_ticks = ticks(0.0, last_step as f64, 8);
        Frame {
            plot_w: WIDTH - MARGIN.0 - MARGIN.1,
            plot_h: HEIGHT - MARGIN.2 - MARGIN.3,
            x_max: x_ticks[x_ticks.len() - 1].max(last_step as f64),
            y_min: y_ticks[0].min(low),
            y_max: y_ticks[y_ticks.len() - 1].max(high),
            x_ticks,
            y_ticks,
        }
    }

    /// The picture's x of a step.
    fn x(&self, step: f64) -> f64 {
        MARGIN.0 + self.plot_w * step / self.x_max
    }

    /// The picture's y of a loss.
    fn y(&self, loss: f64) -> f64 {
        MARGIN.2 + self.plot_h * (1.0 - (loss - self.y_min) / (self.y_max - self.y_min))
    }

    /// The grid, the ticks and their labels, the frame and the axes' names.
    fn axes(&self, svg: &mut String) {
        let (plot_w, plot_h) = (self.plot_w, self.plot_h);
        for &tick in &self.y_ticks {
            let ty = self.y(tick);
            let _ = writeln!(
                svg,
                r##"<line x1="{}" y1="{ty:.1}" x2="{}" y2="{ty:.1}" stroke="#e5e5e5"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                MARGIN.0,
                MARGIN.0 + plot_w,
                MARGIN.0 - 6.0,
                ty + 4.0,
                label(tick)
            );
        }
        for &tick in &self.x_ticks {
            let tx = self.x(tick);
            let _ = writeln!(
                svg,
                r##"<line x1="{tx:.1}" y1="{}" x2="{tx:.1}" y2="{}" stroke="#e5e5e5"/><text x="{tx:.1}" y="{}" text-anchor="middle">{}</text>"##,
                MARGIN.2,
                MARGIN.2 + plot_h,
                MARGIN.2 + plot_h + 18.0,
                label(tick)
            );
        }
        let _ = writeln!(
            svg,
            r#"<rect x="{}" y="{}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>"#,
            MARGIN.0, MARGIN.2
        );
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#,
            MARGIN.0 + plot_w / 2.0,
            HEIGHT - 10.0
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">loss (nats/token)</text>"#,
            MARGIN.2 + plot_h / 2.0
        );
    }

    /// The floor dashed, the two series, and a dot at each evaluation.
    fn data(
        &self,
        svg: &mut String,
        train: &[(u64, f64)],
        eval: &[(u64, f64)],
        floor: Option<f64>,
    ) {
        if let Some(floor) = floor {
            let fy = self.y(floor);
            let _ = writeln!(
                svg,
                r#"<line x1="{}" y1="{fy:.1}" x2="{}" y2="{fy:.1}" stroke="{FLOOR_COLOUR}" stroke-dasharray="6 4"/>"#,
                MARGIN.0,
                MARGIN.0 + self.plot_w
            );
        }
        let polyline = |series: &[(u64, f64)], colour: &str, width: f64| {
            let coords: Vec<String> = series
                .iter()
                .filter(|p| p.1.is_finite())
                .map(|&(s, l)| format!("{:.1},{:.1}", self.x(s as f64), self.y(l)))
                .collect();
            format!(
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="{width}"/>"#,
                coords.join(" ")
            )
        };
        let _ = writeln!(svg, "{}", polyline(train, TRAIN_COLOUR, 1.0));
        let _ = writeln!(svg, "{}", polyline(eval, EVAL_COLOUR, 2.0));
        for &(step, loss) in eval.iter().filter(|p| p.1.is_finite()) {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{EVAL_COLOUR}"/>"#,
                self.x(step as f64),
                self.y(loss)
            );
        }
    }

    /// The legend, top right: the two series, and the floor where there is one.
    fn legend(&self, svg: &mut String, floor: bool) {
        let mut entries = vec![("train loss", TRAIN_COLOUR, ""), ("eval loss", EVAL_COLOUR, "")];
        if floor {
            entries.push(("entropy floor", FLOOR_COLOUR, r#" stroke-dasharray="6 4""#));
        }
        let (lx, ly) = (MARGIN.0 + self.plot_w - 140.0, MARGIN.2 + 10.0);
        let _ = writeln!(
            svg,
            r##"<rect x="{lx}" y="{ly}" width="130" height="{}" fill="white" stroke="#999999"/>"##,
            10.0 + 18.0 * entries.len() as f64
        );
        for (i, (name, colour, dash)) in entries.iter().enumerate() {
            let ey = ly + 16.0 + 18.0 * i as f64;
            let _ = writeln!(
                svg,
                r#"<line x1="{}" y1="{ey}" x2="{}" y2="{ey}" stroke="{colour}" stroke-width="2"{dash}/><text x="{}" y="{}">{name}</text>"#,
                lx + 8.0,
                lx + 32.0,
                lx + 40.0,
                ey + 4.0
            );
        }
    }
}

/// Round tick values covering `low..=high`, about `count` of them (1, 2 or 5 × a power of ten
/// apart).
fn ticks(low: f64, high: f64, count: usize) -> Vec<f64> {
    let raw = (high - low) / count as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (low / step).floor() as i64;
    let last = (high / step).ceil() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// A tick label without trailing zeros.
fn label(value: f64) -> String {
    let text = format!("{value:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 1000.0, 8), vec![0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]);
        let y = ticks(1.05, 4.2, 6);
        assert!(y[0] <= 1.05 && *y.last().unwrap() >= 4.2);
        assert_eq!(label(0.5), "0.5");
        assert_eq!(label(200.0), "200");
    }

    #[test]
    fn plot_has_both_series_the_floor_and_a_legend() {
        let train = [(1, 4.0), (2, 3.0), (3, 2.0)];
        let svg = loss_svg(&train, &[(3, 2.1)], Some(1.09));
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("stroke-dasharray") && svg.contains("entropy floor"));
        assert!(svg.contains("train loss") && svg.contains("eval loss"));
    }
}
