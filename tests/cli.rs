//! The command line contract (SPEC section 2): `check` accepts every shipped example and
//! rejects bad configs with exit 2 and a message naming file and YAML path.

mod common;

use common::cli;

#[test]
fn every_example_config_is_accepted() {
    let mut seen = 0;
    for entry in
        std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/config")).expect("config dir")
    {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let out = cli(&["check", "--config", path.to_str().expect("utf-8")]);
        assert!(
            out.status.success(),
            "{} rejected: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("METHOD"), "route table printed: {text}");
        seen += 1;
    }
    assert!(seen >= 2, "at least two example configs ship");
}

#[test]
fn bad_config_exits_2_naming_file_and_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.yaml");
    std::fs::write(
        &path,
        "upstreams:\n  - name: mail\n    url: http://127.0.0.1:9001\n    routes:\n      - name: send\n        match: { method: POST, path: /send }\n        concurrent: sometimes\n",
    )
    .expect("write");
    let out = cli(&["check", "--config", path.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(err.contains("upstreams[0].routes[0].concurrent"), "{err}");
    assert!(err.contains("expected one of reject | wait"), "{err}");
    let missing = cli(&["check", "--config", "/nonexistent/idemproxy.yaml"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr)
        .contains("/nonexistent/idemproxy.yaml: cannot read file"));
}

#[test]
fn usage_errors_exit_2() {
    let out = cli(&[
        "records",
        "list",
        "--status",
        "done",
        "--config",
        concat!(env!("CARGO_MANIFEST_DIR"), "/config/idemproxy.yaml"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown status `done`"));
    let out = cli(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn the_demo_runs_and_shows_one_side_effect_per_call() {
    let out = cli(&["demo"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("two proxy crashes: 2 emails sent"), "{text}");
    assert!(text.contains("replayed=true"), "{text}");
}

/// First-hour papercuts (issue 38): a reader that stops early, the default config looked
/// for from elsewhere, and logs written to a pipe.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/idemproxy.yaml");
    for _ in 0..3 {
        let mut child = std::process::Command::new(common::BIN)
            .args(["check", "--config", config])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run idemproxy");
        // `| head -c 0`: the reader is gone before the first line is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(out.status.code(), Some(0), "{err}");
    }
}

#[test]
fn serve_without_a_config_says_where_it_looked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(common::BIN)
        .arg("serve")
        .current_dir(dir.path())
        .output()
        .expect("run idemproxy");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config/idemproxy.yaml"), "{err}");
    assert!(err.contains("--config PATH"), "{err}");
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
}

#[test]
fn logs_to_a_pipe_have_no_colours() {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = common::config(dir.path(), "http://127.0.0.1:1");
    let proxy = common::ProxyProc::start(dir.path(), &yaml);
    proxy.wait_for_log("listening", std::time::Duration::from_secs(10));
    let lines = proxy.stderr_lines();
    assert!(!lines.is_empty());
    for line in &lines {
        assert!(
            !line.contains('\u{1b}'),
            "ANSI escape in a piped log line: {line:?}"
        );
    }
}
