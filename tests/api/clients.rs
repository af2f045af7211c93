//! The clients idpool is for, generated from the document it serves: the
//! document is valid OpenAPI 3.1, a property-based run (schemathesis) finds
//! no server error and no answer the document does not predict, and a
//! Python client (openapi-python-client) and TypeScript types
//! (openapi-typescript) drive the service. The tools are pinned and
//! installed under target/sdk by scripts/sdk-tools.sh.

use std::path::{Path, PathBuf};
use std::process::Command;

use reqwest::StatusCode;

use crate::support::app::{TestApp, TestEnv, create_key};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/sdk with the pinned tools in it (installed once, under a lock,
/// since tests run in processes of their own).
pub fn tools() -> PathBuf {
    let sdk = repo().join("target/sdk");
    std::fs::create_dir_all(&sdk).expect("target/sdk");
    run(
        Command::new("flock")
            .arg(sdk.join(".lock"))
            .arg(repo().join("scripts/sdk-tools.sh")),
        "installing the client tools",
    );
    sdk
}

/// Runs `command` and fails the test, with its output, unless it succeeds.
pub fn run(command: &mut Command, what: &str) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    stdout
}

/// A clean work directory for one test.
fn workdir(sdk: &Path, name: &str) -> PathBuf {
    let dir = sdk.join("work").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("work dir");
    dir
}

/// The document the running app serves, written to `dir`.
async fn served_document(app: &TestApp, dir: &Path) -> PathBuf {
    let response = app
        .client
        .get(app.url("/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let path = dir.join("openapi.json");
    std::fs::write(&path, response.bytes().await.unwrap()).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_and_committed_documents_are_valid_openapi_3_1() {
    let sdk = tools();
    let app = TestEnv::new().spawn().await;
    let dir = workdir(&sdk, "validate");
    let served = served_document(&app, &dir).await;
    for document in [served, repo().join("openapi/openapi.json")] {
        let said = run(
            Command::new(sdk.join("venv/bin/openapi-spec-validator")).arg(&document),
            "openapi-spec-validator",
        );
        assert!(said.contains("OK"), "{said}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_valid_requests_get_no_server_error_and_no_answer_the_document_does_not_predict() {
    let sdk = tools();
    let app = TestEnv::new().spawn().await;
    let dir = workdir(&sdk, "schemathesis");
    let key = create_key(&app.state, &[], true).await;
    // Every check schemathesis has (its default), as scripts/sdk/
    // schemathesis.toml tunes them, NUL allowed in generated strings: the
    // document's patterns say where the server refuses it.
    let said = run(
        Command::new(sdk.join("venv/bin/st"))
            .current_dir(&dir)
            .arg("--config-file")
            .arg(repo().join("scripts/sdk/schemathesis.toml"))
            .args(["run", &app.url("/openapi.json")])
            .args(["--header", &format!("Authorization: Bearer {key}")])
            .args(["--max-examples", "40", "--seed", "20261123"])
            .args(["--generation-allow-x00", "true"])
            .args(["--suppress-health-check", "all"]),
        "schemathesis",
    );
    let summary = said
        .lines()
        .skip_while(|l| !l.contains("Test cases:"))
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    println!("schemathesis: {summary}");
    assert!(summary.contains("passed"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_client_generated_from_the_served_document_drives_the_service() {
    let sdk = tools();
    let app = TestEnv::new().spawn().await;
    let dir = workdir(&sdk, "python");
    let document = served_document(&app, &dir).await;
    run(
        Command::new(sdk.join("venv/bin/openapi-python-client"))
            .current_dir(&dir)
            .args([
                "generate",
                "--meta",
                "none",
                "--output-path",
                "idpool_client",
            ])
            .arg("--config")
            .arg(repo().join("scripts/sdk/python-client.yaml"))
            .arg("--path")
            .arg(&document),
        "openapi-python-client generate",
    );
    let key = create_key(&app.state, &["PYC"], false).await;
    let said = run(
        Command::new(sdk.join("venv/bin/python"))
            .arg(repo().join("scripts/sdk/check.py"))
            .current_dir(&dir)
            .env("PYTHONPATH", &dir)
            .env("IDPOOL_URL", &app.address)
            .env("IDPOOL_KEY", &key),
        "the Python client",
    );
    assert!(said.contains("python client: ok"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typescript_types_generated_from_the_served_document_drive_the_service() {
    let sdk = tools();
    let app = TestEnv::new().spawn().await;
    // Inside the npm directory, so the generated code finds openapi-fetch.
    let dir = workdir(&sdk, "../node/check");
    let document = served_document(&app, &dir).await;
    let bin = sdk.join("node/node_modules/.bin");
    run(
        Command::new(bin.join("openapi-typescript"))
            .arg(&document)
            .arg("--output")
            .arg(dir.join("idpool.ts")),
        "openapi-typescript",
    );
    for file in ["check.ts", "tsconfig.json"] {
        std::fs::copy(repo().join("scripts/sdk").join(file), dir.join(file)).unwrap();
    }
    run(
        Command::new(bin.join("tsc")).arg("-p").arg(&dir),
        "tsc --strict",
    );
    let key = create_key(&app.state, &["TSC"], false).await;
    let said = run(
        Command::new("node")
            .arg(dir.join("out/check.js"))
            .env("IDPOOL_URL", &app.address)
            .env("IDPOOL_KEY", &key),
        "the TypeScript client",
    );
    assert!(said.contains("typescript client: ok"), "{said}");
}
