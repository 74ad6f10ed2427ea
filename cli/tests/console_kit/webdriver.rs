//! Just enough of the W3C WebDriver protocol (JSON over HTTP) to drive a headless Chromium through
//! `chromedriver`: open a page, find elements, read their text and attributes, click, type, take screenshots.
//! Debian's `chromium` and `chromium-driver` packages (`scripts/test-deps` installs them).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// The element reference key of the W3C protocol.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// `chromedriver` and `chromium` from `PATH` (or `/usr/bin`), if both are installed.
pub fn find_tools() -> Option<(PathBuf, PathBuf)> {
    let find = |name: &str| -> Option<PathBuf> {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .chain([
                PathBuf::from("/usr/bin"),
                PathBuf::from("/usr/lib/chromium"),
            ])
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    };
    Some((find("chromedriver")?, find("chromium")?))
}

/// A `chromedriver` process and one browser session in it; both end on drop.
pub struct Browser {
    driver: Child,
    base: String,
    http: reqwest::Client,
    session: String,
}

/// An element of the current page.
#[derive(Debug, Clone)]
pub struct Element(String);

impl Browser {
    /// Starts `chromedriver` on a port it binds itself (0: the kernel picks one, read back from `/proc`,
    /// `outbox_testkit::ports`) and a headless Chromium session (1280×900).
    pub async fn start(driver: &std::path::Path, chromium: &std::path::Path) -> Browser {
        outbox::install_crypto_provider();
        let mut child = Command::new(driver)
            .arg("--port=0")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromedriver");
        let pid = child.id();
        let port = outbox_testkit::ports::wait_listening(
            "chromedriver",
            pid,
            Duration::from_secs(30),
            || child.try_wait().ok().flatten().map(|s| s.to_string()),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        for _ in 0..100 {
            let ready = http.get(format!("{base}/status")).send().await;
            if let Ok(r) = ready
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == json!(true)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut b = Browser {
            driver: child,
            base,
            http,
            session: String::new(),
        };
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,900", "--hide-scrollbars", "--lang=en-US"],
            },
        }}});
        let v = b.call("POST", "/session", caps).await;
        b.session = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_owned();
        b
    }

    async fn call(&self, method: &str, path: &str, body: Value) -> Value {
        match self.try_call(method, path, body).await {
            Ok(v) => v,
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
    }

    /// [`Browser::call`] that returns WebDriver's error (`{"error": …}`) instead of panicking.
    async fn try_call(&self, method: &str, path: &str, body: Value) -> Result<Value, Value> {
        let url = if path == "/session" {
            format!("{}{path}", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let req = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body),
        };
        let r = req.send().await.expect("chromedriver request");
        let v: Value = r.json().await.expect("chromedriver answer");
        if v["value"].get("error").is_some() {
            return Err(v["value"].clone());
        }
        Ok(v["value"].clone())
    }

    /// Opens `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        self.call("POST", "/url", json!({"url": url})).await;
    }

    /// The current page's title.
    pub async fn title(&self) -> String {
        self.call("GET", "/title", json!({}))
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The current URL.
    pub async fn url(&self) -> String {
        self.call("GET", "/url", json!({}))
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The page's DOM as HTML, as the browser built it.
    pub async fn source(&self) -> String {
        self.call("GET", "/source", json!({}))
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Every element matching a CSS selector.
    pub async fn all(&self, css: &str) -> Vec<Element> {
        let v = self
            .call(
                "POST",
                "/elements",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| e[ELEMENT].as_str().map(|s| Element(s.to_owned())))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The first element matching a CSS selector (panics when there is none).
    /// Waits up to 10 s for it: a click that submits a form can return before the next page has loaded.
    pub async fn one(&self, css: &str) -> Element {
        for _ in 0..100 {
            if let Some(e) = self.all(css).await.into_iter().next() {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        match self.all(css).await.into_iter().next() {
            Some(e) => e,
            None => panic!(
                "no element {css:?} on the page {} ({:?}):\n{}",
                self.url().await,
                self.title().await,
                self.source().await
            ),
        }
    }

    /// An element's rendered text.
    pub async fn text(&self, e: &Element) -> String {
        let v = self
            .call("GET", &format!("/element/{}/text", e.0), json!({}))
            .await;
        v.as_str().unwrap_or_default().to_owned()
    }

    /// The text of the first element matching `css` once it reads `want`, waiting up to 10 s; else the last text
    /// read. For an element the page had before a click that loads another page with the same element (a
    /// filtered list): reading right after the click can find the old page's element, whose text is the old one
    /// or gone ("stale element reference") by the time it is read.
    pub async fn text_of(&self, css: &str, want: &str) -> String {
        let mut last = String::new();
        for _ in 0..100 {
            let e = self.one(css).await;
            if let Ok(v) = self
                .try_call("GET", &format!("/element/{}/text", e.0), json!({}))
                .await
            {
                last = v.as_str().unwrap_or_default().to_owned();
                if last == want {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last
    }

    /// An element's attribute.
    pub async fn attr(&self, e: &Element, name: &str) -> Option<String> {
        let v = self
            .call(
                "GET",
                &format!("/element/{}/attribute/{name}", e.0),
                json!({}),
            )
            .await;
        v.as_str().map(str::to_owned)
    }

    /// An element's DOM property (`scrollHeight`), as JSON.
    pub async fn property(&self, e: &Element, name: &str) -> Value {
        self.call(
            "GET",
            &format!("/element/{}/property/{name}", e.0),
            json!({}),
        )
        .await
    }

    /// Clicks an element (a link, a button) and waits for the navigation it starts.
    pub async fn click(&self, e: &Element) {
        self.call("POST", &format!("/element/{}/click", e.0), json!({}))
            .await;
    }

    /// Types into an element.
    pub async fn type_into(&self, e: &Element, text: &str) {
        self.call(
            "POST",
            &format!("/element/{}/value", e.0),
            json!({"text": text}),
        )
        .await;
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine;
        let v = self.call("GET", "/screenshot", json!({})).await;
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_default())
            .expect("a base64 screenshot")
    }

    /// Resizes the window (for a full-page screenshot).
    pub async fn resize(&self, width: u32, height: u32) {
        self.call(
            "POST",
            "/window/rect",
            json!({"width": width, "height": height}),
        )
        .await;
    }

    /// Ends the session and the driver.
    pub async fn quit(mut self) {
        let _ = self
            .http
            .delete(format!("{}/session/{}", self.base, self.session))
            .send()
            .await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
