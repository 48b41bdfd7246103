//! A TCP proxy on 127.0.0.1 in front of the apiserver, to partition one client from it while
//! others still reach it: TLS passes through untouched (the apiserver's certificate is valid
//! for 127.0.0.1 on any port). `cut` stops every byte both ways on open connections and holds
//! new ones unanswered, as a network partition does; `heal` lets them flow again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; it stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    open: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `target` (host:port).
    pub async fn start(target: SocketAddr) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (open, rx) = watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let rx = rx.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        pipe(client, server, rx).await;
                    }
                });
            }
        });
        Ok(Proxy { addr, open, task })
    }

    /// `https://127.0.0.1:<port>`: the server URL a client uses to go through the proxy.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Partitions: no byte passes either way until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    /// Ends the partition.
    pub fn heal(&self) {
        self.open.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies both ways while `open` is true; a closed side ends the connection (what was held back
/// for it is dropped, not delivered).
async fn pipe(client: TcpStream, server: TcpStream, open: watch::Receiver<bool>) {
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let a = tokio::spawn(copy(cr, sw, open.clone()));
    let b = tokio::spawn(copy(sr, cw, open));
    let _ = tokio::join!(a, b);
}

async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut open: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Read nothing while cut: the sender's bytes wait in its socket buffers, as in a
        // partition.
        if open.wait_for(|o| *o).await.is_err() {
            return;
        }
        let n = tokio::select! {
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            // Cut while waiting: stop reading.
            _ = open.wait_for(|o| !*o) => continue,
        };
        // Cut after reading: hold these bytes until healed.
        while !*open.borrow() {
            if tokio::time::timeout(Duration::from_secs(3600), open.changed())
                .await
                .is_err()
            {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A shared handle, for tests that hand the proxy around.
pub type SharedProxy = Arc<Proxy>;
