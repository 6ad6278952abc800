//! The one reader of Prometheus / OpenMetrics text expositions in tests: samples with their
//! labels, so that assertions name a series and compare its value exactly, whatever the
//! format's comments, ordering or number formatting.

use std::collections::BTreeMap;
use std::time::Duration;

/// One sample of a Prometheus / OpenMetrics text exposition: `name{labels} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed `/metrics` page: samples only (`# HELP`, `# TYPE`, `# UNIT`, `# EOF` and exemplars
/// ignored), so that assertions hold for the Prometheus text format and OpenMetrics alike.
#[derive(Clone, Debug)]
pub struct Metrics {
    pub samples: Vec<Sample>,
    pub text: String,
}

impl Metrics {
    /// Parses an exposition; panics on a sample line it cannot read (a broken page must fail).
    pub fn parse(text: &str) -> Metrics {
        let mut samples = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // Drop an exemplar (` # {...} v`).
            let line = line.split(" # ").next().unwrap_or(line);
            let (name, labels, rest) = match line.find('{') {
                Some(i) => {
                    let close = line[i..]
                        .rfind('}')
                        .unwrap_or_else(|| panic!("unclosed labels in {line:?}"))
                        + i;
                    (
                        &line[..i],
                        parse_labels(&line[i + 1..close]),
                        &line[close + 1..],
                    )
                }
                None => {
                    let sp = line
                        .find(' ')
                        .unwrap_or_else(|| panic!("no value in {line:?}"));
                    (&line[..sp], BTreeMap::new(), &line[sp..])
                }
            };
            let v = rest
                .split_whitespace()
                .next()
                .unwrap_or_else(|| panic!("no value in {line:?}"));
            let value = match v {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse()
                    .unwrap_or_else(|e| panic!("bad value {v:?} in {line:?}: {e}")),
            };
            samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        Metrics {
            samples,
            text: text.to_string(),
        }
    }

    /// The value of the sample `name` whose labels include `labels` (None if absent).
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }

    /// Like [`get`](Self::get), panicking with the page when the sample is missing.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no {name}{labels:?} in\n{}", self.text))
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let eq = rest.find('=').unwrap_or_else(|| panic!("bad labels {s:?}"));
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        assert!(after.starts_with('"'), "bad labels {s:?}");
        let mut val = String::new();
        let mut chars = after[1..].char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => val.push('\n'),
                    Some((_, c)) => val.push(c),
                    None => {}
                },
                '"' => {
                    end = Some(i + 2);
                    break;
                }
                c => val.push(c),
            }
        }
        let end = end.unwrap_or_else(|| panic!("unterminated label value in {s:?}"));
        out.insert(key, val);
        rest = after[end..].trim_start_matches([',', ' ']);
    }
    out
}

impl Metrics {
    /// The value of one series written as in the exposition, `name` or
    /// `name{k="v",...}` (labels in any order, all of them required); panics with the page when
    /// it is absent or matches more than one sample.
    pub fn series(&self, series: &str) -> f64 {
        let (name, labels) = match series.find('{') {
            Some(i) => (
                &series[..i],
                parse_labels(series[i + 1..].trim_end_matches('}')),
            ),
            None => (series, BTreeMap::new()),
        };
        let found: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.name == name && s.labels == labels)
            .map(|s| s.value)
            .collect();
        assert_eq!(found.len(), 1, "{series} exactly once in\n{}", self.text);
        found[0]
    }
}

/// Every sample of an exposition (see [`Metrics::parse`]).
pub fn samples(text: &str) -> Vec<Sample> {
    Metrics::parse(text).samples
}

/// The value of exactly one series of an exposition (see [`Metrics::series`]).
pub fn series(text: &str, series: &str) -> f64 {
    Metrics::parse(text).series(series)
}

/// GET `/metrics` on loopback `port` through the workspace's HTTP client; panics unless the
/// answer is 200.
pub fn scrape(port: u16) -> Metrics {
    let r = crate::http::get(
        &format!("http://127.0.0.1:{port}/metrics"),
        Duration::from_secs(5),
    )
    .unwrap_or_else(|| panic!("no answer from /metrics on port {port}"));
    assert_eq!(r.status, 200, "GET /metrics: {}", r.body);
    Metrics::parse(&r.body)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP lockd_grants New leases.\n# TYPE lockd_grants counter\nlockd_grants_total 3\nlockd_held{resource=\"a \\\"b\\\"\"} 1\nx_bucket{le=\"+Inf\",k=\"v\"} 7 # {trace=\"1\"} 0.5\n# EOF\n";

    #[test]
    fn samples_labels_and_exemplars() {
        let m = Metrics::parse(PAGE);
        assert_eq!(m.samples.len(), 3);
        assert_eq!(m.value("lockd_grants_total", &[]), 3.0);
        assert_eq!(m.value("lockd_held", &[("resource", "a \"b\"")]), 1.0);
        assert_eq!(m.series("x_bucket{k=\"v\",le=\"+Inf\"}"), 7.0);
        assert_eq!(m.get("lockd_grants_total", &[("x", "y")]), None);
    }

    #[test]
    #[should_panic(expected = "exactly once")]
    fn a_series_must_name_all_its_labels() {
        Metrics::parse(PAGE).series("x_bucket{le=\"+Inf\"}");
    }

    #[test]
    #[should_panic(expected = "no value")]
    fn a_broken_page_fails() {
        Metrics::parse("lockd_grants_total\n");
    }
}
