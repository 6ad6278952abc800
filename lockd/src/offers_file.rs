//! The offers file (`lockd serve --offers FILE`): quantity-pool offers set at startup.
//!
//! JSON, one object mapping pool names to lists of offers, each as the `offer` request
//! takes it (`max_lease_time_ms` and `requirements` optional):
//!
//! ```json
//! {"gpus": [
//!   {"name": "node-a", "quantity": 8, "attributes": {"model": "h100", "mem_gib": "80"}},
//!   {"name": "node-b", "quantity": 4, "attributes": {"model": "a100"},
//!    "max_lease_time_ms": 600000, "requirements": "team in (infer,train)"}
//! ]}
//! ```
//!
//! The file wins at every start: each offer in it is set (created, or changed to what the
//! file says), offers added at run time by `lockd offer` and absent from the file are kept.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::kinds::quantity::OfferSpec;
use crate::kinds::selector::Selector;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OfferEntry {
    name: String,
    quantity: u32,
    #[serde(default)]
    attributes: BTreeMap<String, String>,
    #[serde(default)]
    max_lease_time_ms: Option<u64>,
    #[serde(default)]
    requirements: Option<String>,
}

/// Parse offers-file text into (pool, offer) pairs, in file order. Errors name the pool and
/// offer at fault.
pub fn parse(text: &str) -> Result<Vec<(String, OfferSpec)>, String> {
    let pools: BTreeMap<String, Vec<OfferEntry>> =
        serde_json::from_str(text).map_err(|e| format!("offers file: {e}"))?;
    let mut out = Vec::new();
    for (pool, offers) in pools {
        if pool.is_empty() || pool.len() > crate::proto::MAX_NAME_LEN {
            return Err(format!(
                "offers file: pool name {pool:?} is empty or too long"
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for o in offers {
            if !seen.insert(o.name.clone()) {
                return Err(format!(
                    "offers file: pool {pool:?}: offer {:?} twice",
                    o.name
                ));
            }
            let requirements = match o.requirements.as_deref() {
                None => Selector::everything(),
                Some(t) => Selector::parse(t).map_err(|e| {
                    format!(
                        "offers file: pool {pool:?}: offer {:?}: requirements: {e}",
                        o.name
                    )
                })?,
            };
            if o.max_lease_time_ms == Some(0) {
                return Err(format!(
                    "offers file: pool {pool:?}: offer {:?}: max_lease_time_ms must be positive",
                    o.name
                ));
            }
            out.push((
                pool.clone(),
                OfferSpec {
                    name: o.name,
                    quantity: o.quantity,
                    attributes: o.attributes,
                    max_lease_time_ms: o.max_lease_time_ms,
                    requirements,
                },
            ));
        }
    }
    Ok(out)
}

/// Read and parse the offers file.
pub fn load(path: &Path) -> Result<Vec<(String, OfferSpec)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("offers file {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn parses_pools_and_refuses_bad_entries_with_their_name() {
        let o = parse(
            r#"{"gpus":[{"name":"a","quantity":8,"attributes":{"model":"h100"}},
                        {"name":"b","quantity":4,"requirements":"team in (x,y)","max_lease_time_ms":1000}]}"#,
        )
        .unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!((o[1].0.as_str(), o[1].1.quantity), ("gpus", 4));
        assert_eq!(o[1].1.requirements.to_string(), "team in (x,y)");
        for (bad, why) in [
            (
                r#"{"p":[{"name":"a","quantity":1},{"name":"a","quantity":2}]}"#,
                "twice",
            ),
            (
                r#"{"p":[{"name":"a","quantity":1,"requirements":"x in ("}]}"#,
                "\"a\": requirements",
            ),
            (
                r#"{"p":[{"name":"a","quantity":1,"colour":"red"}]}"#,
                "unknown field",
            ),
            (
                r#"{"p":[{"name":"a","quantity":1,"max_lease_time_ms":0}]}"#,
                "positive",
            ),
            ("[]", "offers file"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
