//! A local AWS Secrets Manager (moto_server) for the secrets tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, repo_root};

/// A local AWS Secrets Manager (moto_server), killed on drop.
pub struct Moto {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts moto_server from ./.venv (installed by scripts/test-deps) or PATH.
pub fn start_moto() -> Moto {
    let venv = repo_root().join(".venv/bin/moto_server");
    let exe = if venv.exists() {
        venv
    } else {
        PathBuf::from("moto_server")
    };
    let port = free_port();
    let child = Command::new(&exe)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {} ({e}); run scripts/test-deps to install the test tools",
                exe.display()
            )
        });
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "moto_server did not listen on port {port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Moto {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
    }
}
