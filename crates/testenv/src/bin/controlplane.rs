//! Starts the test control plane for a person and prints how to use it. Ctrl-C stops it.

fn main() -> anyhow::Result<()> {
    let cp = testenv::ControlPlane::start()?;
    println!("kube-apiserver is ready at {}", cp.server);
    println!("logs, certificates and kubeconfig: {}", cp.dir().display());
    println!();
    println!("  export KUBECONFIG={}", cp.kubeconfig_path().display());
    println!("  kubectl get --raw /version");
    println!();
    println!("Press Ctrl-C to stop it.");
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc_wait(tx);
    let _ = rx.recv();
    drop(cp);
    Ok(())
}

/// Blocks SIGINT/SIGTERM and waits for one on a thread, so that the control plane is dropped
/// (and its processes stopped) on the way out.
fn ctrlc_wait(tx: std::sync::mpsc::Sender<()>) {
    // SAFETY: plain signal-mask manipulation on this thread before any other thread exists
    // that cares about these signals; sigwait then receives them synchronously.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        std::thread::spawn(move || {
            let mut sig = 0;
            libc::sigwait(&set, &mut sig);
            let _ = tx.send(());
        });
    }
}
