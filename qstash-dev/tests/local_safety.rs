//! The dev server is safe on a developer's machine (decision record 0113): `/__dev/*` needs the API token,
//! requests whose `Host` does not name the server (DNS rebinding) are refused, and a non-loopback bind needs a
//! token of one's own.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Stdio;

use common::*;
use qstash_dev::{Config, DEV_TOKEN, DevServer, Faults, StartError};
use reqwest::Method;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

/// Sends `head` (request line and headers, without the blank line) on a fresh connection to `addr` and returns
/// the status and the body as JSON (or as a string). Raw, so the `Host` header is exactly what the test says.
async fn raw(addr: SocketAddr, head: &str) -> (u16, serde_json::Value) {
    raw_with_body(addr, head, "").await
}

/// [`raw`] with a request body (give its `Content-Length` in `head`).
async fn raw_with_body(addr: SocketAddr, head: &str, body: &str) -> (u16, serde_json::Value) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("{head}\r\nConnection: close\r\n\r\n{body}").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut buf))
        .await
        .expect("response in time")
        .unwrap();
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (
        status,
        serde_json::from_str(body).unwrap_or_else(|_| serde_json::Value::String(body.into())),
    )
}

/// A loopback address with the server's port (what a client on this machine connects to).
fn loopback(s: &DevServer) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), s.addr().port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_api_needs_the_api_token() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let c = http();
    let url = |p: &str| format!("{}{p}", server.url());

    let r = c.get(url("/__dev/config")).send().await.unwrap();
    assert_eq!(r.status(), 401, "no token");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"], "Unauthorized", "the API's JSON error");
    let r = c
        .get(url("/__dev/config"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "wrong token");

    let (st, v) = api.call(Method::GET, "/__dev/config").await;
    assert_eq!(st, 200, "bearer token: {v}");
    assert_eq!(v["token"], server.token());
    let r = c
        .get(url(&format!(
            "/__dev/config?qstash_token={}",
            server.token().replace('=', "%3D")
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "?qstash_token=");

    // The control endpoints refuse too, and change nothing.
    api.publish_ok(&sink.url("/t"), &[], "x").await;
    server.handle().wait_idle(WAIT).await.unwrap();
    let r = c
        .put(url("/__dev/faults"))
        .body(r#"{"publish_5xx_rate": 1.0}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(server.handle().faults(), Faults::default());
    let r = c.post(url("/__dev/reset")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(server.handle().stats().accepted, 1, "not reset");
    for (m, p) in [
        (Method::GET, "/__dev/attempts"),
        (Method::DELETE, "/__dev/attempts"),
        (Method::GET, "/__dev/stats"),
        (Method::GET, "/__dev/dlq"),
        (Method::GET, "/__dev/messages"),
        (Method::POST, "/__dev/wait-idle?timeout_ms=1"),
    ] {
        let r = c.request(m.clone(), url(p)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{m} {p}");
    }
    assert_eq!(server.handle().attempts().len(), 1, "attempt log kept");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_rebinding_host_is_refused_on_api_and_dev_routes() {
    let server = server(0.001, |_| {}).await;
    let addr = loopback(&server);
    let port = addr.port();
    let auth = format!("Authorization: Bearer {}", server.token());

    for path in ["/v2/keys", "/__dev/config", "/v2/nothing-here"] {
        let (st, v) = raw(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: evil.example:{port}\r\n{auth}"),
        )
        .await;
        assert_eq!(st, 421, "{path}: {v}");
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("evil.example")),
            "{path}: JSON error naming the host: {v}"
        );
    }
    // Without a token too (the Host check comes first), and a publish is not even counted.
    let (st, _) = raw(
        addr,
        &format!("GET /__dev/config HTTP/1.1\r\nHost: evil.example:{port}"),
    )
    .await;
    assert_eq!(st, 421);
    let (st, _) = raw_with_body(
        addr,
        &format!(
            "POST /v2/publish/http://127.0.0.1:9/x HTTP/1.1\r\nHost: evil.example:{port}\r\n{auth}\r\n\
             Content-Length: 1"
        ),
        "x",
    )
    .await;
    assert_eq!(st, 421);
    assert_eq!(server.handle().stats().publish_requests, 0);
    // A rebinding name that merely starts like a loopback name, and an absolute target naming another host.
    for head in [
        format!("GET /v2/keys HTTP/1.1\r\nHost: localhost.evil.example:{port}\r\n{auth}"),
        format!("GET /v2/keys HTTP/1.1\r\nHost: 127.0.0.1.nip.io:{port}\r\n{auth}"),
        format!(
            "GET http://evil.example:{port}/v2/keys HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
        ),
    ] {
        assert_eq!(raw(addr, &head).await.0, 421, "{head}");
    }

    // What clients on this machine send: the SDKs and reqwest use the URL's host (http://127.0.0.1:PORT).
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("LOCALHOST:{port}"),
        format!("[::1]:{port}"),
        "localhost".to_owned(),
    ] {
        for path in ["/v2/keys", "/__dev/config"] {
            let (st, v) = raw(
                addr,
                &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}"),
            )
            .await;
            assert_eq!(st, 200, "Host: {host} {path}: {v}");
        }
    }
    // A browser page posting to the right Host still names itself in Origin: refused before anything runs.
    let publishes = || server.handle().stats().publish_requests;
    let before = publishes();
    for origin in ["http://evil.example", "null", "https://127.0.0.1.nip.io"] {
        let (st, v) = raw_with_body(
            addr,
            &format!(
                "POST /v2/publish/http://127.0.0.1:9/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
                 Origin: {origin}\r\n{auth}\r\nContent-Length: 1"
            ),
            "x",
        )
        .await;
        assert_eq!(st, 403, "Origin: {origin}: {v}");
    }
    assert_eq!(
        publishes(),
        before,
        "a refused cross-site publish is not counted"
    );
    // Pages served by this very server (none today) and loopback pages are same-site.
    for origin in [
        format!("http://127.0.0.1:{port}"),
        "http://localhost:3000".to_owned(),
    ] {
        let (st, v) = raw(
            addr,
            &format!(
                "GET /v2/keys HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: {origin}\r\n{auth}"
            ),
        )
        .await;
        assert_eq!(st, 200, "Origin: {origin}: {v}");
    }
    // HTTP/1.0 without a Host header.
    let (st, v) = raw(addr, &format!("GET /v2/keys HTTP/1.0\r\n{auth}")).await;
    assert_eq!(st, 200, "{v}");
    let (st, _) = Api::new(&server).call(Method::GET, "/v2/keys").await;
    assert_eq!(st, 200, "reqwest with server.url()");
    server.shutdown().await;
}

fn refusal(r: Result<DevServer, StartError>) -> String {
    match r {
        Err(StartError::Config(m)) => m,
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(s) => panic!("started on {}", s.addr()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_loopback_bind_needs_a_token_of_ones_own() {
    for bind in ["0.0.0.0", "::", "192.0.2.1"] {
        let cfg = Config {
            bind: bind.parse().unwrap(),
            ..Config::for_tests(0.001)
        };
        assert_eq!(cfg.token, DEV_TOKEN);
        let m = refusal(DevServer::start(cfg).await);
        for needle in [bind, "default dev token", "--token", "QSTASH_DEV_TOKEN"] {
            assert!(m.contains(needle), "{bind}: {needle:?} missing from {m:?}");
        }
    }

    // Loopback (all of 127.0.0.0/8) keeps the default token.
    for bind in ["127.0.0.1", "127.0.0.2"] {
        let s = server(0.001, |c| c.bind = bind.parse().unwrap()).await;
        s.shutdown().await;
    }
    // ::1 passes the check (the host may have no IPv6, so binding itself may fail).
    let r = DevServer::start(Config {
        bind: "::1".parse().unwrap(),
        ..Config::for_tests(0.001)
    })
    .await;
    match r {
        Ok(s) => s.shutdown().await,
        Err(StartError::Bind { .. }) => {}
        Err(e) => panic!("::1 refused: {e}"),
    }

    // An explicit token: it starts, answers to its own address and to loopback names, not to other hosts.
    let s = server(0.001, |c| {
        c.bind = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        c.token = "a-secret-of-my-own".into();
    })
    .await;
    let port = s.addr().port();
    let auth = "Authorization: Bearer a-secret-of-my-own";
    for host in [format!("0.0.0.0:{port}"), format!("127.0.0.1:{port}")] {
        let (st, v) = raw(
            loopback(&s),
            &format!("GET /__dev/stats HTTP/1.1\r\nHost: {host}\r\n{auth}"),
        )
        .await;
        assert_eq!(st, 200, "Host: {host}: {v}");
    }
    let (st, _) = raw(
        loopback(&s),
        &format!("GET /__dev/stats HTTP/1.1\r\nHost: evil.example:{port}\r\n{auth}"),
    )
    .await;
    assert_eq!(st, 421);
    // Reached on a non-loopback address of this machine (if it has one): that address is the Host.
    if let Some(ip) = outward_ip() {
        let (st, v) = raw(
            SocketAddr::new(ip, port),
            &format!("GET /__dev/stats HTTP/1.1\r\nHost: {ip}:{port}\r\n{auth}"),
        )
        .await;
        assert_eq!(st, 200, "Host: {ip}:{port}: {v}");
    }
    s.shutdown().await;
}

/// This machine's address on its default route, if any (no packet is sent).
fn outward_ip() -> Option<IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    Some(s.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_refuses_a_non_loopback_bind_without_a_token() {
    let bin = env!("CARGO_BIN_EXE_qstash-dev");
    let cmd = |args: &[&str]| {
        let mut c = tokio::process::Command::new(bin);
        c.args(args)
            .env_remove("QSTASH_DEV_TOKEN")
            .env_remove("QSTASH_DEV_BIND")
            .env_remove("QSTASH_DEV_PORT")
            .env("RUST_LOG", "warn") // logs go to stdout too
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        c
    };
    let out = tokio::time::timeout(WAIT, cmd(&["--bind", "0.0.0.0", "--port", "0"]).output())
        .await
        .expect("exits instead of listening")
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["0.0.0.0", "--token", "QSTASH_DEV_TOKEN", "--bind 127.0.0.1"] {
        assert!(err.contains(needle), "{needle:?} missing from {err}");
    }

    // With a token it listens (and says where).
    let mut child = cmd(&["--bind", "0.0.0.0", "--port", "0", "--token", "mine"])
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("starts")
        .unwrap()
        .unwrap_or_default();
    assert!(
        first.starts_with("qstash-dev listening on http://0.0.0.0:"),
        "{first}"
    );
    child.kill().await.unwrap();
}
