//! The dev server is safe on a developer's machine: `/__dev/*` needs the API token.

mod common;

use common::*;
use qstash_dev::Faults;
use reqwest::Method;

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
