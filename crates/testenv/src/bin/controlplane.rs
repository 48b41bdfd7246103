//! Starts the test control plane for a person and prints how to use it. Ctrl-C stops it.

fn main() -> anyhow::Result<()> {
    let ctrl_c = testenv::procs::CtrlC::block();
    let cp = testenv::ControlPlane::start()?;
    println!("kube-apiserver is ready at {}", cp.server);
    println!("logs, certificates and kubeconfig: {}", cp.dir().display());
    println!();
    println!("  export KUBECONFIG={}", cp.kubeconfig_path().display());
    println!("  kubectl get --raw /version");
    println!();
    println!("Press Ctrl-C to stop it.");
    ctrl_c.wait();
    drop(cp);
    Ok(())
}
