//! `make bench-quick` still runs: the bench starts its own Postgres, Redis
//! and idpool (here the debug build the test run has just made), drives two
//! small scenarios and writes its table. Figures of a debug build say
//! nothing about speed; this checks the machinery, not the goals.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_bench_runs_its_scenarios_and_writes_its_table() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_idpool-bench"));
    let idpool = bench.with_file_name("idpool");
    assert!(
        idpool.exists(),
        "{} not built; run the whole workspace's tests",
        idpool.display()
    );
    let work = tempfile::tempdir().expect("temp dir");
    let out = work.path().join("latest.json");
    let status = Command::new(&bench)
        .args(["--quick", "--only", "delivery,id-batches"])
        .arg("--binary")
        .arg(&idpool)
        .arg("--out")
        .arg(&out)
        .arg("--pg-dir")
        .arg(work.path().join("postgres"))
        .status()
        .expect("start the bench");
    assert!(status.success(), "the bench failed: {status}");

    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("table written"))
            .expect("table is JSON");
    let figures: Vec<&str> = rows.iter().filter_map(|r| r["figure"].as_str()).collect();
    for expected in [
        "202 -> committed on an idle system, slowest of 5 documents",
        "20000 IDs with POST /ids count 1000 (wall)",
    ] {
        assert!(
            figures.contains(&expected),
            "no row {expected:?} in {figures:?}"
        );
    }
    for row in &rows {
        for field in ["figure", "value", "unit", "goal", "pass"] {
            assert!(row.get(field).is_some(), "row without {field}: {row}");
        }
    }
    let duplicates = rows
        .iter()
        .find(|r| {
            r["figure"]
                .as_str()
                .is_some_and(|f| f.starts_with("duplicates seen"))
        })
        .expect("duplicates row");
    assert_eq!(duplicates["value"], 0.0);
    assert_eq!(duplicates["pass"], true);
}
