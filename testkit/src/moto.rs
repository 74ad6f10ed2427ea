//! A local AWS Secrets Manager (moto_server) for the secrets tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::ports::wait_listening_blocking;
use crate::repo::repo_root;

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

/// Starts moto_server from ./.venv (installed by scripts/test-deps) or PATH, on a port it binds itself (0: the
/// kernel picks one; read back from `/proc`, [`crate::ports`]).
pub fn start_moto() -> Moto {
    let venv = repo_root().join(".venv/bin/moto_server");
    let exe = if venv.exists() {
        venv
    } else {
        PathBuf::from("moto_server")
    };
    let mut child = Command::new(&exe)
        .args(["-H", "127.0.0.1", "-p", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {} ({e}); run scripts/test-deps to install the test tools",
                exe.display()
            )
        });
    let pid = child.id();
    let port = wait_listening_blocking("moto_server", pid, Duration::from_secs(30), || {
        child.try_wait().ok().flatten().map(|s| s.to_string())
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    Moto {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
    }
}
